"""The CUDA path: pinned host memory, side-stream device→host copies, results identical to the
CPU path. Skipped without a GPU; `just gpu-check` runs these on a GPU machine."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from typing import NamedTuple

import numpy as np
import pytest
import torch

from cachekit import slots_of, small_cache
from omni_pcache import CachePolicy, InvalidInputError, NewRequest, StepBatch, StepEvents
from omni_pcache.copy_engine import CopyEngine, CopyHandle, StepCopy, empty_host
from omni_pcache.deferred import DeferredRecord

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


def test_cuda_staging_is_pinned_and_the_pool_only_with_pin_pool() -> None:
    # Device→host copies land in the staging pages (pinned: asynchronous); nothing copies
    # between the pool and a device, so it is pageable unless asked for.
    _, stats, cache = run("cuda")
    assert all(t.is_pinned() for t in cache._pages._pages.values())
    assert not any(t.is_pinned() for t in cache._pool._rows.values())
    assert set(stats.pool_bytes) == {"hidden", "codes"}
    with small_cache(pin_pool=True) as pinned:
        pinned.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        sid = pinned.save(torch.ones(4, 8, device="cuda"), {}, StepBatch(["a"], [4], np.arange(4)))
        assert torch.equal(pinned.materialize(sid, ["a"]).hidden["a"], torch.ones(4, 8))
        assert all(t.is_pinned() for t in pinned._pool._rows.values())


SLEEP_CYCLES = 50_000_000  # ~25 ms of the compute stream: the save's copies wait behind it
BIG_ROWS, BIG_WIDTH = 16, 1 << 18  # 16 MiB of fp32: its copy takes a while


def warm_up(cache, block: int, width: int = BIG_WIDTH, mm_rows: dict[str, torch.Tensor] | None = None) -> None:
    """One save of the test's keys (fp32 ``hidden`` of ``width``, plus ``mm_rows``' keys) for a
    request of its own on ``block``, consumed and written: the pinned staging pages are
    allocated before the test's sleep. A page-locked allocation inside the measured save would
    synchronize the device, ordering the copy after the forward even without the side stream's
    wait, so an ordering test could not fail."""
    cache.begin_step(StepEvents(new=[NewRequest("warm-up", [block])]))
    mm = {name: torch.zeros((BS, *t.shape[1:]), dtype=t.dtype, device="cuda") for name, t in (mm_rows or {}).items()}
    batch = StepBatch(["warm-up"], [BS], slots_of([block], 0, BS, BS))
    sid = cache.save(torch.zeros(BS, width, device="cuda"), mm, batch)
    cache.begin_step(StepEvents(finished=["warm-up"]))
    cache.discard(sid)
    cache.flush()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fence", ["begin_step", "fence"])
def test_the_fence_keeps_the_next_forward_off_rows_still_being_copied(fence: str) -> None:
    # (`fence` alone: a dummy forward, which no step begins, replaying the same CUDA graph)
    expected = torch.randn(BIG_ROWS, BIG_WIDTH)
    with small_cache() as cache:
        warm_up(cache, block=8)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2, 3])]))
        hidden = expected.to("cuda")
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward still runs when save returns
        sid = cache.save(hidden, {}, StepBatch(["a"], [BIG_ROWS], slots_of([0, 1, 2, 3], 0, BIG_ROWS, BS)))
        if fence == "fence":
            cache.fence()
        else:
            cache.begin_step(StepEvents())  # the fence
        hidden.fill_(-1)  # the next forward writes the same buffer: after the save's copy, on the device
        out = cache.materialize(sid, ["a"])
    assert torch.equal(out.hidden["a"], expected)


def test_a_dropped_output_is_not_reused_before_its_copy_read_it() -> None:
    expected = torch.randn(BIG_ROWS, BIG_WIDTH)
    with small_cache() as cache:
        warm_up(cache, block=8)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2, 3])]))
        hidden = expected.to("cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        sid = cache.save(hidden, {}, StepBatch(["a"], [BIG_ROWS], slots_of([0, 1, 2, 3], 0, BIG_ROWS, BS)))
        del hidden  # the caller drops its output: the caching allocator may hand its block on...
        other = torch.empty((BIG_ROWS, BIG_WIDTH), device="cuda")
        other.fill_(-1)  # ...only once the side stream has read it (record_stream)
        out = cache.materialize(sid, ["a"])
    assert torch.equal(out.hidden["a"], expected)


def test_a_copy_that_raises_leaves_no_copy_of_the_step_running_or_pending() -> None:
    # save releases the page of a step whose copies raised: the copies launched before the
    # failure must have landed, and the CPU copies handed over must not run at a later fence.
    engine = CopyEngine()
    copy = engine.start()
    big = torch.randn(1 << 22, device="cuda")
    want = big.cpu()
    landed = empty_host((1 << 22,), torch.float32).zero_()
    cpu_src, cpu_dst = torch.randn(1 << 17), torch.zeros(1 << 17)  # 512 KiB: handed to a HostCopy
    copy.copy(landed, big)
    copy.copy(cpu_dst, cpu_src)
    copy.copy(empty_host((3,), torch.float32), torch.ones(5, device="cuda"))  # shapes differ: raises
    torch.cuda._sleep(SLEEP_CYCLES)  # the first copy waits behind the compute stream
    with pytest.raises(RuntimeError):
        copy.finish()
    assert torch.equal(landed, want), "the launched copy landed before finish raised"
    assert torch.equal(cpu_dst, cpu_src), "the CPU copy ran: none is left for the next fence"


def test_a_cuda_call_that_raises_before_the_copies_leaves_no_cpu_copy_for_the_next_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a CUDA error in the side stream's set-up: save then releases the step's page, so the CPU
    # copies handed over must run now, not at the next fence into a page a later step holds)
    engine = CopyEngine()

    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine, "side_stream", broken)
    copy = engine.start()
    cpu_src, cpu_dst = torch.randn(1 << 17), torch.zeros(1 << 17)  # 512 KiB: handed to a HostCopy
    copy.copy(cpu_dst, cpu_src)
    copy.copy(empty_host((4,), torch.float32), torch.ones(4, device="cuda"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copy.finish()
    assert torch.equal(cpu_dst, cpu_src), "the CPU copy ran before finish raised"
    cpu_dst.zero_()
    engine.fence()
    assert not cpu_dst.any(), "the fence ran the refused step's CPU copy again"


def test_the_save_copy_waits_for_rows_the_forward_is_still_writing() -> None:
    # The forward's last write to its output is still queued on the compute stream when save
    # is called: the side stream's copy must wait for it (else it copies the zeros before it).
    want = torch.randn(BIG_ROWS, BIG_WIDTH)
    src = want.to("cuda")
    hidden = torch.zeros_like(src)
    with small_cache() as cache:
        warm_up(cache, block=8)  # (synchronizes: src and hidden are written)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2, 3])]))
        torch.cuda._sleep(SLEEP_CYCLES)
        hidden.copy_(src)  # (device to device, queued behind the sleep: nothing syncs before save)
        sid = cache.save(hidden, {}, StepBatch(["a"], [BIG_ROWS], slots_of([0, 1, 2, 3], 0, BIG_ROWS, BS)))
        cache.begin_step(StepEvents())  # the fence
        out = cache.materialize(sid, ["a"])
    assert torch.equal(out.hidden["a"], want)


def test_deferred_rows_are_read_only_once_the_forward_wrote_them() -> None:
    # A deferred key's clone is made on the compute stream behind the forward's last write;
    # materialize in place reads it at once on the clone-read stream, which must wait for it.
    policy = CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})
    want = torch.arange(64 * 1024, dtype=torch.int64).reshape(-1, 4)
    src = want.to("cuda")
    codes = torch.zeros_like(src)
    n = want.shape[0]
    blocks = list(range(n // BS))
    # (CPU rows: a CUDA hidden's copy would make materialize wait for an event recorded behind
    # the clone, so the test could not fail if the clone's read stopped waiting for the forward)
    hidden = torch.ones(n, 2)
    with small_cache(policy=policy, num_blocks=len(blocks) + 2, staging_capacity_tokens=n) as cache:
        warm_up(
            cache, block=len(blocks) + 1, width=2, mm_rows={"codes": src}
        )  # (synchronizes: src and codes are written)
        spare = torch.empty_like(src)  # (a block for the clone in the allocator's cache: no cudaMalloc in save either)
        del spare
        cache.begin_step(StepEvents(new=[NewRequest("a", blocks)]))
        torch.cuda._sleep(SLEEP_CYCLES)
        codes.copy_(src)  # (device to device, queued behind the sleep: nothing syncs before save)
        sid = cache.save(hidden, {"codes": codes}, StepBatch(["a"], [n], np.arange(n)))
        out = cache.materialize(sid, ["a"])  # (the saving thread, before the next begin_step)
        assert torch.equal(out.mm["codes"]["a"], want)
        # b hits a's blocks but the last while a is live: its rows come from a's device clone
        cache.begin_step(StepEvents(new=[NewRequest("b", [*blocks[:-1], len(blocks)], n - BS)]))
        batch = StepBatch(["b"], [BS], slots_of([*blocks[:-1], len(blocks)], n - BS, BS, BS))
        sid = cache.save(torch.ones(BS, 2, device="cuda"), {"codes": src[-BS:].clone()}, batch)
        assert torch.equal(cache.materialize(sid, ["b"]).mm["codes"]["b"], want)


def test_deferred_rows_are_written_chunk_by_chunk_without_a_device_copy_of_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A record over three steps' clones: its host copy is made chunk by chunk (a concatenation
    # on the device would hold a second copy of the record outside the budget).
    policy = CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})
    # (pieces of one 32-byte row each: the record's copy loops over every row of every chunk)
    with small_cache(policy=policy, copy_chunk_bytes=40) as cache:
        expected = []
        for step in range(3):
            cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]) if step == 0 else StepEvents())
            codes = torch.arange(step * 40, step * 40 + 16).reshape(4, 4)
            expected.append(codes)
            batch = StepBatch(["a"], [4], slots_of([0, 1, 2], 4 * step, 4, BS))
            cache.materialize(cache.save(torch.ones(4, 2, device="cuda"), {"codes": codes.to("cuda")}, batch), ["a"])
        gc.collect()  # (an earlier test's cache freed by a collection meanwhile would lower the peak's base)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        prepare, hosts = DeferredRecord.prepare, []

        def watched(record) -> None:
            prepare(record)
            hosts.extend(record.host.values())

        monkeypatch.setattr(DeferredRecord, "prepare", watched)
        cache.begin_step(StepEvents(finished=["a"]))  # flushes the record
        cache.flush()
        assert torch.cuda.max_memory_allocated() == start, "writing the record allocated device memory"
        # (its host copy is pageable: pinned, it would stay page-locked in torch's host cache)
        assert [h.shape for h in hosts] == [(12, 4)] and not hosts[0].is_pinned()
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 2, 3], 12)]))  # hits the 12 rows
        codes = torch.full((1, 4), -5)
        batch = StepBatch(["b"], [1], slots_of([0, 1, 2, 3], 12, 1, BS))
        out = cache.materialize(cache.save(torch.ones(1, 2, device="cuda"), {"codes": codes.to("cuda")}, batch), ["b"])
    assert torch.equal(out.mm["codes"]["b"], torch.cat([*expected, codes]))


@pytest.mark.parametrize("devices", [("cpu", "cuda", "cpu"), ("cuda", "cpu", "cuda")], ids=["cpu-first", "cuda-first"])
def test_a_deferred_record_over_steps_on_the_cpu_and_a_gpu_writes_every_row(devices: tuple[str, ...]) -> None:
    # One request's deferred key saved from the CPU and from a GPU in turn (an engine that
    # computes some steps' codes on the host): its record holds clones on both; a hit while it
    # is live reads each chunk from its own device, and so does its write (cpu-first: the
    # write's concatenation over mixed devices raised and failed the cache, sticky).
    policy = CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})
    with small_cache(policy=policy, copy_chunk_bytes=40) as cache:
        expected = []
        for step, device in enumerate(devices):
            cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]) if step == 0 else StepEvents())
            codes = torch.arange(step * 40, step * 40 + 16).reshape(4, 4)
            expected.append(codes)
            batch = StepBatch(["a"], [4], slots_of([0, 1, 2], 4 * step, 4, BS))
            sid = cache.save(torch.ones(4, 2, device=device), {"codes": codes.to(device)}, batch)
            assert torch.equal(cache.materialize(sid, ["a"]).mm["codes"]["a"], codes)
        cache.begin_step(StepEvents(new=[NewRequest("l", [0, 1, 2, 3], 12)]))  # hits a's open record
        batch = StepBatch(["l"], [1], slots_of([0, 1, 2, 3], 12, 1, BS))
        live = torch.full((1, 4), -7)
        out = cache.materialize(cache.save(torch.ones(1, 2, device="cuda"), {"codes": live.to("cuda")}, batch), ["l"])
        assert torch.equal(out.mm["codes"]["l"], torch.cat([*expected, live]))
        cache.begin_step(StepEvents(finished=["a", "l"]))  # flushes the records
        cache.flush()
        stats = cache.stats()
        assert (stats.tasks_live, stats.device_bytes) == (0, 0), stats
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 2, 3], 12)]))  # hits the 12 rows
        codes = torch.full((1, 4), -5)
        batch = StepBatch(["b"], [1], slots_of([0, 1, 2, 3], 12, 1, BS))
        out = cache.materialize(cache.save(torch.ones(1, 2, device="cuda"), {"codes": codes.to("cuda")}, batch), ["b"])
    assert torch.equal(out.mm["codes"]["b"], torch.cat([*expected, codes]))


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


def test_cuda_leftovers_come_back_on_the_host_even_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU hidden with CUDA leftovers, materialized on the saving thread before the next
    # begin_step: the step's rows are read in place, but the leftovers' device→host copies
    # must still be waited; a namedtuple's tensors are snapshotted to the host as well.
    # (inline_write_bytes=0: a step save writes itself is read from its own copies instead)
    waits: list[str] = []
    wait, wait_device = CopyHandle.wait, CopyHandle.wait_device
    me = threading.get_ident()  # (the committer waits the step too, when it writes it: not counted)

    def recorded(name, method):
        return lambda self: (waits.append(name) if threading.get_ident() == me else None, method(self))[1]

    monkeypatch.setattr(CopyHandle, "wait", recorded("wait", wait))
    monkeypatch.setattr(CopyHandle, "wait_device", recorded("wait_device", wait_device))
    with small_cache(inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        speaker = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MiB
        prosody = Prosody(torch.full((3,), 2.0, device="cuda"), "calm")
        want = torch.arange(1 << 22, dtype=torch.float32)  # (built before: nothing slow after save)
        torch.cuda._sleep(SLEEP_CYCLES)  # the copies wait behind it: still in flight at materialize
        sid = cache.save(
            torch.ones(4, 2), {"speaker": speaker, "prosody": prosody}, StepBatch(["a"], [4], np.arange(4))
        )
        waits.clear()  # (the committer's waits before this: it may write the step meanwhile)
        out = cache.materialize(sid, ["a"])
        assert waits[:1] == ["wait_device"], "read in place: only the leftovers' device copies waited"
        got = out.mm["speaker"]["a"]
        assert got.device.type == "cpu" and torch.equal(got, want)
        kept = out.mm["prosody"]["a"]
        assert isinstance(kept, Prosody) and kept.label == "calm"
        assert kept.pitch.device.type == "cpu" and torch.equal(kept.pitch, torch.full((3,), 2.0))


TWO_GPU_SCRIPT = """
import threading

import numpy as np
import torch

from omni_pcache import CacheConfig, CachePolicy, NewRequest, PrefixCache, StepBatch, StepEvents

if SET_DEVICE:
    torch.cuda.set_device(1)
policy = CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})
with PrefixCache(CacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=16), policy) as cache:
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    codes = torch.arange(16, device="cuda:1").reshape(8, 2)
    sid = cache.save(torch.ones(8, 2, device="cuda:1"), {"codes": codes}, StepBatch(["a"], [8], np.arange(8)))
    got = {}
    reader = threading.Thread(target=lambda: got.update(out=cache.materialize(sid, ["a"])))
    reader.start()
    reader.join()
    assert torch.equal(got["out"].mm["codes"]["a"], codes.cpu())
    cache.begin_step(StepEvents(finished=["a"]))  # the committer copies a's record to the host
    cache.flush()
print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0))
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("set_device", [True, False], ids=["engine-thread-on-gpu-1", "no-device-set"])
def test_reading_clones_on_gpu_1_from_other_threads_creates_no_context_on_gpu_0(set_device: bool) -> None:
    # A worker owning GPU 1 (a later pipeline stage, all GPUs visible): the materializing
    # thread and the committer, which never set a device, read its deferred clones; that must
    # not create a CUDA context on GPU 0 (hundreds of MiB of another worker's memory). A fresh
    # process: this one has a context on GPU 0 already. Without ``set_device`` the saving
    # thread's current device stays 0 too: save's side-stream copy must not set it on leaving.
    script = f"SET_DEVICE = {set_device}\n{TWO_GPU_SCRIPT}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "context on GPU 0: False" in result.stdout, result.stdout


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_cuda_leftover_is_refused_and_the_save_holds_nothing(layout: str) -> None:
    dense = torch.eye(3, device="cuda")
    leftover = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match=rf"leftover mm 'x' holds a {layout} CUDA tensor.*\.to_dense"):
            cache.save(torch.ones(4, 2, device="cuda"), {"x": [leftover]}, batch)
        assert cache.stats().steps_outstanding == [] and cache.stats().staging_holders == [[], [], []]
        sid = cache.save(torch.ones(4, 2, device="cuda"), {"x": [dense]}, batch)  # the corrected retry
        assert torch.equal(cache.materialize(sid, ["a"]).mm["x"]["a"][0], dense.cpu())


@pytest.mark.parametrize(
    "policy", [None, CachePolicy(deferred_keys=frozenset({"codes"}))], ids=["immediate", "deferred"]
)
def test_cuda_saves_under_inference_mode_hand_out_plain_writable_tensors(policy) -> None:
    # vLLM's execute_model runs under torch.inference_mode(): the pinned pages, the pool and the
    # device clones made there must stay writable by the committer, and the outputs by anyone.
    # The forward's outputs are inference tensors too, a leftover among them.
    with small_cache(policy=policy) as cache:
        with torch.inference_mode():
            hidden = torch.randn(10, 16, device="cuda")
            codes = torch.arange(10, device="cuda")
            ref = torch.full((3,), 7.0, device="cuda")
            assert hidden.is_inference() and codes.is_inference() and ref.is_inference()
            cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
            batch = StepBatch(["a"], [10], slots_of([0, 1, 2], 0, 10, BS))
            sid = cache.save(hidden, {"codes": codes, "ref": ref}, batch)
            cache.begin_step(StepEvents(finished=["a"]))  # (the fence; flushes deferred rows)
        out: dict = {}
        reader = threading.Thread(target=lambda: out.update(got=cache.materialize(sid, ["a"])))
        reader.start()
        reader.join()
        cache.flush()
        got = out["got"]
        assert torch.equal(got.hidden["a"], hidden.cpu()) and torch.equal(got.mm["codes"]["a"], codes.cpu())
        assert got.mm["ref"]["a"].device.type == "cpu" and torch.equal(got.mm["ref"]["a"], torch.full((3,), 7.0))
        for tensor in (got.hidden["a"], got.mm["codes"]["a"]):
            assert not tensor.is_inference()
            tensor.add_(1)
        stats = cache.stats()
        assert (stats.tasks_live, stats.device_bytes, stats.steps_outstanding) == (0, 0, []), stats


def test_hit_prefetch_turns_on_by_itself_for_rows_on_a_cuda_device() -> None:
    # (CacheConfig.prefetch_hits=None, the default: on once a save brings CUDA rows)
    hidden = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        sid = cache.save(hidden[:10].cuda(), None, StepBatch(["a"], [10], slots_of([0, 1, 2], 0, 10, BS)))
        cache.materialize(sid, ["a"])
        cache.flush()
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 3], 8)]))
        jobs = {id(e.job): e.job for e in cache._prefetch._entries.values()}
        assert jobs, "a prefetch was started"
        assert all(job.wait(10) for job in jobs.values())
        own = torch.full((2, 8), -1.0)
        sid = cache.save(own.cuda(), None, StepBatch(["b"], [2], slots_of([0, 1, 3], 8, 2, BS)))
        out = cache.materialize(sid, ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([hidden[:8], own]))
        assert cache.stats().rows_prefetched == 8
