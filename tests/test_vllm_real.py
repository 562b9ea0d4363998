"""The vLLM adapter against vLLM 0.33's REAL types (skipped where vLLM cannot be imported).

Run with `just test-vllm`: it builds a separate, cached environment (.venv-vllm, see
scripts/setup-vllm.sh) holding vLLM 0.33.0 and the few packages its scheduler, KV-cache and
config modules import (installed with --no-deps, torch borrowed from .venv), then runs this file.
The default suite (.venv, no vLLM) skips it; tests/test_vllm_adapter.py covers the same
behaviour with stand-ins.

Here the recorded scheduler sequence of tests/vllm_replay.py (and two recordings from the
embedded engine's scheduler, V1 and V2 style) is built from vLLM's own ``SchedulerOutput``,
``NewRequestData`` and ``CachedRequestData``, the stage's configs from vLLM's ``CacheConfig``,
``SchedulerConfig``, ``ParallelConfig``, ``KVCacheConfig`` and ``FullAttentionSpec``, and
replayed through the mixin with a real cache; the gate is checked against real configs.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest

from vllm_replay import import_vllm_or_skip

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import_vllm_or_skip()
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

from omni_pcache import ConfigError
from omni_pcache.host_memory import host_memory_limit
from omni_pcache.vllm import BlockTracker, cache_config_from_vllm, step_events
from vllm_replay import RECORDED, Step, record_engine_run, replay, scheduler_output

REAL = SimpleNamespace(
    SchedulerOutput=SchedulerOutput,
    NewRequestData=NewRequestData,
    CachedRequestData=CachedRequestData,
    CacheConfig=CacheConfig,
    # vLLM validates max_num_seqs <= max_num_batched_tokens; the replayed stage is tiny.
    SchedulerConfig=functools.partial(SchedulerConfig, max_num_seqs=8, max_model_len=4096, is_encoder_decoder=False),
    ParallelConfig=ParallelConfig,
    KVCacheConfig=KVCacheConfig,
    KVCacheGroupSpec=KVCacheGroupSpec,
    FullAttentionSpec=FullAttentionSpec,
)


def spec(cls=FullAttentionSpec, block_size: int = 16, **kw):
    return cls(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16, **kw)


def configs(**changes):
    kw = {
        "cache_config": CacheConfig(block_size=16, enable_prefix_caching=True),
        "kv_cache_config": KVCacheConfig(
            num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec())]
        ),
        "kv_transfer_config": None,
        "scheduler_config": REAL.SchedulerConfig(max_num_batched_tokens=512),
        "model_config": None,
        "speculative_config": None,
        "parallel_config": ParallelConfig(),
        "is_pooling": False,
    }
    kw.update(changes)
    return kw


@pytest.mark.parametrize("output", ["inline", "late", "thread"])
def test_recorded_sequence_with_real_scheduler_outputs(output: str) -> None:
    runner = replay(REAL, order="shuffled", output=output)
    assert runner.pcache_stats().hits == 3


@pytest.mark.parametrize("runner_kind", ["v1", "v2"])
def test_engine_recording_with_real_scheduler_outputs(runner_kind: str) -> None:
    scenario, counters = record_engine_run(0, v2=runner_kind == "v2")
    assert counters["preemptions"] and counters["hits"]
    replay(REAL, order="shuffled", output="late", scenario=scenario)


def test_real_scheduler_outputs_translate_to_the_expected_events() -> None:
    tracker = BlockTracker()
    so = scheduler_output(REAL, RECORDED[0])
    assert isinstance(so, SchedulerOutput) and isinstance(so.scheduled_new_reqs[0], NewRequestData)
    for step in RECORDED[:4]:
        so = scheduler_output(REAL, step)
        tracker.update(so)
        events = step_events(so, tracker)
    assert [(r.req_id, list(r.block_ids), r.num_computed_tokens) for r in events.resumed] == [("B", [1, 2, 9], 8)]
    assert tracker.blocks("A") == [1, 2, 3, 13]


def real_so(new=(), cached=(), counts=None, preempted=()):
    """A real SchedulerOutput: ``new`` (req_id, prompt, blocks, computed), ``cached`` (req_id,
    new blocks or None, computed)."""
    counts = counts or {}
    c = CachedRequestData(
        req_ids=[x[0] for x in cached],
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None if x[1] is None else (x[1],) for x in cached],
        num_computed_tokens=[x[2] for x in cached],
        num_output_tokens=[0 for _ in cached],
    )
    n = [
        NewRequestData(
            req_id=r, prompt_token_ids=p, mm_features=[], sampling_params=None, pooling_params=None,
            block_ids=(b,), num_computed_tokens=nc, lora_request=None,
        )
        for r, p, b, nc in new
    ]  # fmt: skip
    return SchedulerOutput(
        scheduled_new_reqs=n, scheduled_cached_reqs=c, num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
    )  # fmt: skip


def test_a_real_streaming_sessions_next_chunk_reports_the_rewind_as_dropped() -> None:
    # vLLM 0.33 with async scheduling: turn 1 ends on a stop token while position 6 is decoded;
    # the scheduler rewinds R to 6 and sends the next chunk as a new request with the same id.
    tracker = BlockTracker()
    prompt = [1, 2, 3, 4, 5, 6]
    for so in (
        real_so(new=[("R", prompt, [1, 2], 0)], counts={"R": 6}),
        real_so(cached=[("R", None, 6)], counts={"R": 1}),
    ):
        tracker.update(so)
        assert step_events(so, tracker).dropped == {}
    so = real_so(new=[("R", [*prompt, 50, 51, 52], [1, 2, 3], 6)], counts={"R": 3})
    tracker.update(so)
    assert step_events(so, tracker).dropped == {"R": 6}
    # A preempted request sent again as new (the V2 runner's resume) is not a continuation.
    tracker.update(real_so(preempted={"R"}))
    so = real_so(new=[("R", [*prompt, 50, 51, 52], [1, 2, 3], 8)], counts={"R": 1})
    tracker.update(so)
    assert step_events(so, tracker).dropped == {}


def test_real_block_copies_are_refused() -> None:
    tracker = BlockTracker()
    so = scheduler_output(REAL, Step())
    so.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=3, dst_block_id=4)]
    with pytest.raises(ConfigError, match="kv_cache_block_copies"):
        tracker.update(so)


def test_gate_with_real_configs() -> None:
    config = cache_config_from_vllm(**configs())
    assert (config.num_blocks, config.block_size, config.staging_capacity_tokens) == (1000, 16, 512)
    mla = KVCacheConfig(
        num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec(MLAAttentionSpec))]
    )
    assert cache_config_from_vllm(**configs(kv_cache_config=mla)).block_size == 16
    assert (
        cache_config_from_vllm(**configs(cache_config=CacheConfig(block_size=16, enable_prefix_caching=False))) is None
    )
    sync = REAL.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False)
    for name in ("NixlConnector", "NixlPullConnector"):  # (one class: vLLM's alias)
        producer = KVTransferConfig(kv_connector=name, kv_role="kv_producer")
        assert cache_config_from_vllm(**configs(kv_transfer_config=producer, scheduler_config=sync)) is not None
    # Kernel blocks split each KV block in the backend's own block table only.
    assert cache_config_from_vllm(**configs(), kernel_block_sizes=[8]) == cache_config_from_vllm(**configs())
    # Non-causal layers: vLLM's engine core turns prefix caching off (multiprocess workers still read it on).
    non_causal = KVCacheConfig(
        num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec(non_causal=True))]
    )
    assert cache_config_from_vllm(**configs(kv_cache_config=non_causal)) is None
    # Four data-parallel replicas on this node: each cache's budget is a quarter of the host.
    dp = ParallelConfig(data_parallel_size=4, data_parallel_size_local=4)
    assert cache_config_from_vllm(**configs(parallel_config=dp)).host_budget_bytes == host_memory_limit() // 4
    assert cache_config_from_vllm(**configs()).host_budget_bytes is None


def transfer(connector: str, role: str):
    """The configs' change to a KV transfer config with this connector and role."""
    return lambda: {"kv_transfer_config": KVTransferConfig(kv_connector=connector, kv_role=role)}


REFUSED = {
    "kv-consumer": (transfer("NixlConnector", "kv_consumer"), "kv_role"),
    "kv-both": (transfer("NixlConnector", "kv_both"), "kv_role"),
    "kv-loading-connector": (transfer("OffloadingConnector", "kv_producer"), "kv_transfer_config.kv_connector"),
    "kv-producer-async-by-default": (transfer("NixlConnector", "kv_producer"), "async_scheduling=False"),
    "speculative": (
        lambda: {
            "speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
        },
        "speculative_config",
    ),
    "two-groups": (
        lambda: {
            "kv_cache_config": KVCacheConfig(
                num_blocks=10,
                kv_cache_tensors=[],
                kv_cache_groups=[
                    KVCacheGroupSpec(["l0"], spec()),
                    KVCacheGroupSpec(["l1"], spec(SlidingWindowSpec, sliding_window=64)),
                ],
            )
        },
        "disable_hybrid_kv_cache_manager",
    ),
    "sliding-window": (
        lambda: {
            "kv_cache_config": KVCacheConfig(
                num_blocks=10,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["l0"], spec(SlidingWindowSpec, sliding_window=64))],
            )
        },
        "SlidingWindowSpec",
    ),
    "decode-context-parallel": (
        lambda: {"parallel_config": ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)},
        "decode_context_parallel_size",
    ),
    "prefix-match-unit": (
        lambda: {"cache_config": CacheConfig(block_size=16, prefix_match_unit=4)},
        "prefix_match_unit",
    ),
    "kv-producer-bidirectional": (
        lambda: {
            "kv_transfer_config": KVTransferConfig(
                kv_connector="NixlConnector",
                kv_role="kv_producer",
                kv_connector_extra_config={"bidirectional_kv_xfer": True},
            ),
            "scheduler_config": REAL.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False),
        },
        "bidirectional_kv_xfer",
    ),
    "kv-offloading": (
        lambda: {"cache_config": CacheConfig(block_size=16, enable_prefix_caching=True, kv_offloading_size=2.0)},
        "cache_config.kv_offloading_size",
    ),
    "kv-sharing-fast-prefill": (
        lambda: {"cache_config": CacheConfig(block_size=16, kv_sharing_fast_prefill=True)},
        "kv_sharing_fast_prefill=False",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_gate_refuses_real_configs(case: str) -> None:
    changes, option = REFUSED[case]
    with pytest.raises(ConfigError, match="cannot serve") as info:
        cache_config_from_vllm(**configs(**changes()))
    assert option in str(info.value)
