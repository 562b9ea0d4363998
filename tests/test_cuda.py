"""The CUDA path: pinned host memory, side-stream device→host copies, results identical to the
CPU path. Skipped without a GPU; `just gpu-check` runs these on a GPU machine."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from cachekit import slots_of, small_cache
from omni_pcache import CachePolicy, NewRequest, StepBatch, StepEvents
from omni_pcache.copy_engine import StepCopy

pytestmark = pytest.mark.cuda
BS = 4


def run(device: str, policy=None):
    outs = []
    with small_cache(policy=policy) as cache:
        for step, (new, req, blocks, start, count) in enumerate(
            [
                (NewRequest("a", [0, 1, 2]), "a", [0, 1, 2], 0, 10),
                (NewRequest("b", [0, 1, 3], 8), "b", [0, 1, 3], 8, 3),
            ]
        ):
            cache.begin_step(StepEvents(new=[new]))
            gen = torch.Generator().manual_seed(step)
            hidden = torch.randn(count + 2, 16, generator=gen).to(torch.bfloat16).to(device)  # padded by 2
            mm = {
                "codes": torch.randint(0, 1000, (count, 4), generator=gen).to(device),
                "ref": torch.randn(3, generator=gen).to(device),
            }
            batch = StepBatch([req], [count], slots_of(blocks, start, count, BS), count + 2)
            sid = cache.save(hidden, mm, batch)
            cache.begin_step(StepEvents(finished=[req]))  # the fence; flushes deferred rows
            hidden.zero_()  # the engine reuses its buffers after the fence: the cache holds its copy
            mm["ref"].zero_()
            outs.append(cache.materialize(sid, [req]))
            cache.flush()
        stats = cache.stats()
    return outs, stats, cache


def test_cuda_results_equal_the_cpu_path() -> None:
    cuda_outs, _, _ = run("cuda")
    cpu_outs, _, _ = run("cpu")
    for got, want in zip(cuda_outs, cpu_outs, strict=True):
        for req, rows in want.hidden.items():
            assert got.hidden[req].device.type == "cpu"
            assert torch.equal(got.hidden[req], rows)
        for key, per_req in want.mm.items():
            for req, value in per_req.items():
                assert torch.equal(got.mm[key][req], value)


def test_cuda_deferred_keys_equal_the_cpu_path() -> None:
    policy = CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})
    cuda_outs, stats, _ = run("cuda", policy)
    cpu_outs, _, _ = run("cpu", policy)
    for got, want in zip(cuda_outs, cpu_outs, strict=True):
        for req, value in want.mm["codes"].items():
            assert torch.equal(got.mm["codes"][req], value)
    assert stats.device_bytes == 0 and stats.bytes_written["codes"] > 0


def test_cuda_pool_and_staging_are_pinned() -> None:
    _, stats, cache = run("cuda")
    assert all(t.is_pinned() for t in cache._pool._rows.values())
    assert all(t.is_pinned() for t in cache._pages._pages.values())
    assert set(stats.pool_bytes) == {"hidden", "codes"}


def test_one_device_to_host_copy_per_key_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    copy = StepCopy.copy

    def counting(self, dst, src):
        calls.append(src.device)
        copy(self, dst, src)

    monkeypatch.setattr(StepCopy, "copy", counting)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3])]))
        hidden = torch.ones(8, 8, device="cuda")
        mm = {"codes": torch.ones(8, 2, device="cuda")}
        sid = cache.save(hidden, mm, StepBatch(["a", "b"], [4, 4], np.arange(16)[np.r_[0:4, 8:12]]))
        assert len(calls) == 2, "one copy per key for the whole step, not per request"
        out = cache.materialize(sid, ["a", "b"])
        assert torch.equal(out.hidden["b"], torch.ones(4, 8))


class Prosody(NamedTuple):
    pitch: torch.Tensor
    label: str


def test_cuda_leftovers_come_back_on_the_host_even_read_in_place() -> None:
    # A CPU hidden with CUDA leftovers, materialized on the saving thread before the next
    # begin_step: the step's rows are read in place, but the leftovers' device→host copies
    # must still be waited; a namedtuple's tensors are snapshotted to the host as well.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        speaker = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MiB: copy takes a while
        prosody = Prosody(torch.full((3,), 2.0, device="cuda"), "calm")
        sid = cache.save(
            torch.ones(4, 2), {"speaker": speaker, "prosody": prosody}, StepBatch(["a"], [4], np.arange(4))
        )
        out = cache.materialize(sid, ["a"])
        got = out.mm["speaker"]["a"]
        assert got.device.type == "cpu" and torch.equal(got, torch.arange(1 << 22, dtype=torch.float32))
        kept = out.mm["prosody"]["a"]
        assert isinstance(kept, Prosody) and kept.label == "calm"
        assert kept.pitch.device.type == "cpu" and torch.equal(kept.pitch, torch.full((3,), 2.0))
