"""Tests of `omni_pcache.vllm`, the vLLM runner adapter, WITHOUT vLLM installed.

Every vLLM object here is a stand-in (tests/vllm_standins.py): dataclasses with vLLM 0.33's class
names and field lists (``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``,
``KVCacheBlockCopy``, the KV-cache specs and the config fields the gate reads), not vLLM's own
classes. tests/test_vllm_real.py replays the same recorded sequence with vLLM's real types when
they can be imported (`just test-vllm`).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm_standins as v
from omni_pcache import (
    CacheClosedError,
    CacheConfig,
    CachePolicy,
    ConfigError,
    InvalidInputError,
    NewRequest,
    PrefixCache,
    StepBatch,
    StepEvents,
    StepIdError,
    WriteFailedError,
)
from omni_pcache.host_memory import host_memory_limit
from omni_pcache.vllm import (
    BlockTracker,
    NoOpCache,
    PrefixCacheRunnerMixin,
    build_cache,
    cache_config_from_vllm,
    is_output_rank,
    slot_mapping,
    step_batch,
    step_events,
)
from vllm_replay import (
    BLOCK_SIZE,
    RECORDED,
    New,
    Runner,
    Scenario,
    Step,
    full_rows,
    record_engine_run,
    replay,
    scheduler_output,
    stage_configs,
    standin_types,
)

T = standin_types()


# ---- the recorded sequence through the mixin and a real cache ----------------------------------


@pytest.mark.parametrize("output", ["inline", "late", "thread"])
@pytest.mark.parametrize("order", ["scheduler", "shuffled"])
def test_recorded_sequence_returns_every_full_sequence_row(order: str, output: str) -> None:
    runner = replay(T, order=order, output=output)
    stats = runner.pcache_stats()
    assert stats.hits == 3  # B on A's prefix, D on C's same-step block, F on aborted E's block
    assert stats.misses == 3  # A, C, E
    assert stats.rows_from_pool + stats.rows_in_flight + stats.rows_preserved > 0


def test_step_events_of_the_recorded_sequence() -> None:
    tracker = BlockTracker()
    events = []
    for step in RECORDED:
        so = scheduler_output(T, step)
        tracker.update(so)
        events.append(step_events(so, tracker))
    assert [(r.req_id, list(r.block_ids), r.num_computed_tokens) for r in events[1].new] == [
        ("B", [1, 2, 4], 8),
        ("C", [5, 6, 7], 0),
        ("D", [5, 8], 4),
    ]
    assert events[2].finished == ["E"]
    assert [(r.req_id, list(r.block_ids), r.num_computed_tokens) for r in events[3].resumed] == [("B", [1, 2, 9], 8)]
    assert [(r.req_id, list(r.block_ids), r.num_computed_tokens) for r in events[5].new] == [("D", [5, 8, 16], 8)]
    assert events[6].finished == ["A", "B", "F"]
    assert set(tracker) == set()  # everything finished


# ---- import without vLLM -------------------------------------------------------------------------


def test_import_does_not_need_vllm() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import omni_pcache.vllm\n"
        "from omni_pcache.vllm import PrefixCacheRunnerMixin, cache_config_from_vllm\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- the gate ------------------------------------------------------------------------------------


def configs(**changes):
    """Stand-in configs of a servable stage (block size 16, 1000 blocks), with ``changes``."""
    spec = changes.pop("spec", v.FullAttentionSpec(block_size=16))
    kw = {
        "cache_config": v.CacheConfig(block_size=16),
        "kv_cache_config": v.KVCacheConfig(1000, [], [v.KVCacheGroupSpec(["l0", "l1"], spec)]),
        "kv_transfer_config": None,
        "scheduler_config": v.SchedulerConfig(max_num_batched_tokens=512),
        "model_config": v.ModelConfig(),
        "speculative_config": None,
        "parallel_config": v.ParallelConfig(),
        "is_pooling": False,
    }
    kw.update(changes)
    return kw


def test_gate_sizes_the_cache_from_vllm() -> None:
    config = cache_config_from_vllm(**configs())
    assert config == CacheConfig(num_blocks=1000, block_size=16, staging_capacity_tokens=512)
    tuned = cache_config_from_vllm(**configs(), staging_depth=6, threaded=False)
    assert tuned.staging_depth == 6 and not tuned.threaded
    assert cache_config_from_vllm(**configs(), staging_capacity_tokens=2048).staging_capacity_tokens == 2048
    # Every step vLLM runs ahead holds a page until its output is built: a deep batch queue
    # (four pipeline stages and async scheduling: five steps) gets one more page than that.
    deep = configs(parallel_config=v.ParallelConfig(pipeline_parallel_size=4))
    assert cache_config_from_vllm(**deep).staging_depth == 6
    assert cache_config_from_vllm(**deep, staging_depth=3).staging_depth == 3  # (as asked)


def test_data_parallel_replicas_on_a_node_share_its_memory() -> None:
    """Each data-parallel replica builds a cache of the same size: by default each gets an even
    share of the host's memory as its budget (one replica, or data parallelism launched from
    outside, ``data_parallel_size_local=0``: the cache's own default, the whole host); a budget
    given is kept."""
    limit = host_memory_limit()
    for local, budget in ((1, None), (0, None), (8, limit // 8)):
        dp = configs(parallel_config=v.ParallelConfig(data_parallel_size_local=local))
        assert cache_config_from_vllm(**dp).host_budget_bytes == budget, local
    eight = configs(parallel_config=v.ParallelConfig(data_parallel_size_local=8))
    assert cache_config_from_vllm(**eight, host_budget_bytes=5 << 30).host_budget_bytes == 5 << 30
    # (a share the keys do not fit is refused at the first save, naming the budget)
    config = dataclasses.replace(cache_config_from_vllm(**eight), num_blocks=2**20, block_size=16)
    with PrefixCache(config) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        rows = torch.zeros(4, (limit // 8) // (2**24 * 2) + 1, dtype=torch.bfloat16)  # (past the share, not the host)
        with pytest.raises(ConfigError, match=r"past CacheConfig\.host_budget_bytes"):
            cache.save(rows, None, StepBatch(["a"], [4], np.arange(4)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_blocks": 10}, r"cache options \['num_blocks'\] are set from vLLM's KV cache config"),
        ({"block_size": 32, "num_blocks": 5}, r"\['block_size', 'num_blocks'\] are set from vLLM's"),
        (
            {"staging_capacity_tokens": 256},
            "must hold a whole step: at least scheduler_config.max_num_batched_tokens=512",
        ),
        # a misspelled option (was a raw TypeError from CacheConfig)
        ({"staging_dept": 8}, r"unknown cache options \['staging_dept'\]; the cache takes \[.*'staging_depth'"),
    ],
)
def test_gate_refuses_cache_options_that_contradict_vllm(options, message) -> None:
    # (these used to reach CacheConfig twice: "got multiple values for keyword argument")
    with pytest.raises(ConfigError, match=message):
        cache_config_from_vllm(**configs(), **options)


@pytest.mark.parametrize(
    "changes",
    [
        {"cache_config": v.CacheConfig(block_size=16, enable_prefix_caching=False)},
        {"is_pooling": True},
        {"model_config": v.ModelConfig(runner_type="pooling")},
    ],
    ids=["prefix-caching-off", "is-pooling", "pooling-runner"],
)
def test_gate_returns_none_when_no_cache_is_needed(changes) -> None:
    assert cache_config_from_vllm(**configs(**changes)) is None


@pytest.mark.parametrize(
    "spec",
    [
        v.FullAttentionSpec(block_size=16),
        v.FullAttentionSpec(block_size=16, sliding_window=64),  # hybrid manager off: kept as full
        v.MLAAttentionSpec(block_size=16),
        v.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": v.FullAttentionSpec(block_size=16)}),
    ],
    ids=["full", "full-with-window", "mla-subclass", "uniform-full"],
)
def test_gate_accepts_full_attention_and_its_subclasses(spec) -> None:
    assert cache_config_from_vllm(**configs(spec=spec)).block_size == 16


@pytest.mark.parametrize("connector", ["NixlConnector", "MooncakeConnector"])
def test_gate_accepts_a_sending_only_kv_producer_with_one_step_in_flight(connector) -> None:
    producer = v.KVTransferConfig(kv_connector=connector, kv_role="kv_producer")
    sync = v.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False)
    assert cache_config_from_vllm(**configs(kv_transfer_config=producer, scheduler_config=sync)) is not None


def uniform_group(*layer_specs) -> v.UniformTypeKVCacheSpecs:
    """One KV-cache group whose layers have these specs (layer names "l0", "l1", ...)."""
    return v.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={f"l{i}": s for i, s in enumerate(layer_specs)})


REFUSED = {
    "kv-consumer": ({"kv_transfer_config": v.KVTransferConfig("NixlConnector", "kv_consumer")}, "kv_role"),
    "kv-both": ({"kv_transfer_config": v.KVTransferConfig("LMCacheConnectorV1", "kv_both")}, "kv_role"),
    # a connector that may load KV whatever its role (an offloading tier)
    "kv-loading-connector": (
        {"kv_transfer_config": v.KVTransferConfig("OffloadingConnector", "kv_producer")},
        "kv_transfer_config.kv_connector",
    ),
    # a producer with steps in flight: vLLM drops a preempted request's in-flight output
    "kv-producer-async-by-default": (
        {"kv_transfer_config": v.KVTransferConfig("NixlConnector", "kv_producer")},
        "async_scheduling=False",
    ),
    "kv-producer-pipeline-parallel": (
        {
            "kv_transfer_config": v.KVTransferConfig("NixlConnector", "kv_producer"),
            "scheduler_config": v.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False),
            "parallel_config": v.ParallelConfig(pipeline_parallel_size=2),
        },
        "pipeline_parallel_size=1",
    ),
    "diffusion-lm": ({"model_config": v.ModelConfig(is_diffusion=True)}, "model_config.is_diffusion"),
    "speculative": ({"speculative_config": v.SpeculativeConfig()}, "speculative_config"),
    "two-groups": (
        {
            "kv_cache_config": v.KVCacheConfig(
                1000,
                [],
                [
                    v.KVCacheGroupSpec(["l0"], v.FullAttentionSpec(block_size=16)),
                    v.KVCacheGroupSpec(["l1"], v.SlidingWindowSpec(block_size=16)),
                ],
            )
        },
        "disable_hybrid_kv_cache_manager",
    ),
    "sliding-window-group": ({"spec": v.SlidingWindowSpec(block_size=16)}, "kv_cache_groups[0] is SlidingWindowSpec"),
    "mamba-group": ({"spec": v.MambaSpec(block_size=16)}, "kv_cache_groups[0] is MambaSpec"),
    "kv-producer-bidirectional": (
        {
            "kv_transfer_config": v.KVTransferConfig(
                "NixlPullConnector", "kv_producer", {"bidirectional_kv_xfer": True}
            ),
            "scheduler_config": v.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False),
        },
        "drop bidirectional_kv_xfer",
    ),
    "kv-offloading": (
        {"cache_config": v.CacheConfig(block_size=16, kv_offloading_size=4.0)},
        "unset cache_config.kv_offloading_size",
    ),
    "decode-context-parallel": (
        {"parallel_config": v.ParallelConfig(decode_context_parallel_size=2)},
        "decode_context_parallel_size",
    ),
    "prefill-context-parallel": (
        {"parallel_config": v.ParallelConfig(prefill_context_parallel_size=2)},
        "parallel_config.prefill_context_parallel_size=2",
    ),
    "uniform-with-a-window": (
        {"spec": uniform_group(v.FullAttentionSpec(block_size=16), v.SlidingWindowSpec(block_size=16))},
        "kv_cache_groups[0] is SlidingWindowSpec)",
    ),
    "kv-sharing-fast-prefill": (
        {"cache_config": v.CacheConfig(block_size=16, kv_sharing_fast_prefill=True)},
        "kv_sharing_fast_prefill=False",
    ),
    "mixed-block-sizes": (
        {"spec": uniform_group(v.FullAttentionSpec(block_size=16), v.FullAttentionSpec(block_size=32))},
        "different block sizes in one KV-cache group ([16, 32])",
    ),
    # a transfer config without vLLM's is_kv_consumer property (older vLLM): its kv_role decides
    "kv-consumer-by-role": ({"kv_transfer_config": SimpleNamespace(kv_role="kv_consumer")}, "kv_role"),
    "sub-block-prefix-match": (
        {"cache_config": v.CacheConfig(block_size=16, prefix_match_unit=4)},
        "prefix_match_unit",
    ),
    "sub-block-hash-size": (
        {
            "kv_cache_config": v.KVCacheConfig(
                1000, [], [v.KVCacheGroupSpec(["l0"], v.FullAttentionSpec(block_size=16))], 8
            )
        },
        "prefix_match_unit",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_gate_refuses_with_the_option_to_change(case: str) -> None:
    changes, option = REFUSED[case]
    with pytest.raises(ConfigError, match="cannot serve") as info:
        cache_config_from_vllm(**configs(**changes))
    assert option in str(info.value), str(info.value)
    assert "enable_prefix_caching=False" in str(info.value)


HYBRID = "disable_hybrid_kv_cache_manager"


@pytest.mark.parametrize(
    ("specs", "hybrid_helps"),
    [
        ([v.FullAttentionSpec(block_size=16), v.SlidingWindowSpec(block_size=16)], True),
        ([v.FullAttentionSpec(block_size=16), v.ChunkedLocalAttentionSpec(block_size=16)], True),
        ([uniform_group(v.FullAttentionSpec(block_size=16), v.SlidingWindowSpec(block_size=16))], True),
        ([v.SlidingWindowSpec(block_size=16)], False),  # (a model of sliding-window layers only)
        ([v.ChunkedLocalAttentionSpec(block_size=16)], False),
        ([v.MambaSpec(block_size=16)], False),
        ([v.FullAttentionSpec(block_size=16), v.MambaSpec(block_size=16)], False),  # (the Mamba group stays)
    ],
    ids=["full+window", "full+chunked", "one-group-full+window", "window-only", "chunked-only", "mamba", "full+mamba"],
)
def test_a_group_refusal_advises_the_hybrid_manager_off_only_where_vllm_then_makes_one_full_group(
    specs, hybrid_helps: bool
) -> None:
    # vLLM keeps sliding-window and chunked-local layers as full attention with the hybrid
    # manager off only when full-attention layers are there too; nothing else changes a group.
    groups = [v.KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    with pytest.raises(ConfigError, match="cannot serve") as info:
        cache_config_from_vllm(**configs(kv_cache_config=v.KVCacheConfig(1000, [], groups)))
    assert (HYBRID in str(info.value)) == hybrid_helps, str(info.value)
    assert "enable_prefix_caching=False" in str(info.value)


def test_kernel_block_sizes_do_not_change_the_cache() -> None:
    # A backend's kernel blocks split each KV block in its own block table only: the cache
    # addresses rows by the scheduler's blocks (earlier versions refused a smaller kernel block).
    want = cache_config_from_vllm(**configs())
    assert cache_config_from_vllm(**configs(), kernel_block_sizes=[8]) == want
    assert cache_config_from_vllm(**configs(), kernel_block_sizes=[16, 4]) == want


def test_non_causal_layers_need_no_cache() -> None:
    # vLLM's engine core turns prefix caching off for them in its own process; a multiprocess
    # worker still reads it as on, and would otherwise copy every row for hits that never come.
    spec = v.FullAttentionSpec(block_size=16, non_causal=True)
    assert cache_config_from_vllm(**configs(spec=spec)) is None
    assert cache_config_from_vllm(**configs(spec=uniform_group(v.FullAttentionSpec(block_size=16), spec))) is None


def test_both_names_of_nixls_pull_connector_are_accepted_as_a_producer() -> None:
    sync = v.SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False)
    for name in ("NixlConnector", "NixlPullConnector"):
        producer = v.KVTransferConfig(name, "kv_producer", {"bidirectional_kv_xfer": False})
        assert cache_config_from_vllm(**configs(kv_transfer_config=producer, scheduler_config=sync)) is not None


def test_a_consumer_role_without_a_connector_is_not_a_consumer() -> None:
    # vLLM's is_kv_consumer needs a connector: nothing is loaded, nothing to refuse.
    assert cache_config_from_vllm(**configs(kv_transfer_config=v.KVTransferConfig(None, "kv_consumer"))) is not None
    older = SimpleNamespace(kv_role="kv_producer")  # (no is_kv_consumer property: its role decides)
    assert cache_config_from_vllm(**configs(kv_transfer_config=older)) is not None


def test_gate_needs_the_schedulers_batch_size() -> None:
    with pytest.raises(ConfigError, match=r"scheduler_config\.max_num_batched_tokens is not set"):
        cache_config_from_vllm(**configs(scheduler_config=SimpleNamespace(max_num_batched_tokens=None)))


# ---- the block tracker ---------------------------------------------------------------------------


def so_of(**fields):
    """A stand-in SchedulerOutput with empty defaults."""
    cached = fields.pop("cached", v.CachedRequestData.make_empty())
    new = fields.pop("new", [])
    counts = fields.pop("counts", {})
    return v.SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=fields.pop("finished", set()),
        free_encoder_mm_hashes=[],
        **fields,
    )


def new_req(req_id: str, blocks: list[int], computed: int = 0) -> v.NewRequestData:
    return v.NewRequestData(req_id, [1, 2, 3], [], None, None, (blocks,), computed, None)


def cached(entries: list[tuple[str, list[int] | None, int]], resumed: set[str] = frozenset()) -> v.CachedRequestData:
    return v.CachedRequestData(
        req_ids=[r for r, _, _ in entries],
        resumed_req_ids=set(resumed),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None if b is None else (b,) for _, b, _ in entries],
        num_computed_tokens=[n for _, _, n in entries],
        num_output_tokens=[0 for _ in entries],
    )


def test_tracker_appends_replaces_and_forgets() -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1, 2]), new_req("b", [3])], counts={"a": 8, "b": 2}))
    t.update(so_of(cached=cached([("a", [4], 8), ("b", None, 2)]), counts={"a": 1, "b": 1}))
    assert t.blocks("a") == [1, 2, 4] and t.blocks("b") == [3]
    t.update(so_of(preempted_req_ids={"b"}, cached=cached([("a", None, 9)]), counts={"a": 1}))
    assert "b" in t
    with pytest.raises(InvalidInputError, match="preempted"):
        t.blocks("b")
    t.update(so_of(cached=cached([("b", [7, 8], 4)], resumed={"b"}), counts={"b": 2}))  # V1 resume
    assert t.blocks("b") == [7, 8]
    t.update(so_of(new=[new_req("a", [9, 10], 4)], counts={"a": 2}))  # V2 resume: sent as new
    assert t.blocks("a") == [9, 10]
    t.update(so_of(finished={"a", "b", "never-seen"}))
    assert len(t) == 0


def test_tracker_replaces_a_resumed_requests_blocks_even_when_it_holds_none() -> None:
    # A resumed request's new_block_ids replace its list, None (vLLM's "no blocks") included:
    # its blocks from before the preemption (unreported here, as by a vLLM without
    # preempted_req_ids) were freed, and must never give its slots again.
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1, 2])], counts={"a": 8}))
    t.update(so_of(cached=cached([("a", None, 0)], resumed={"a"})))
    assert t.blocks("a") == []


def test_tracker_undo_restores_every_kind_of_change() -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req(r, [b]) for r, b in zip("abcdfg", [1, 2, 3, 4, 11, 12], strict=True)]))
    t.update(so_of(preempted_req_ids={"d"}, new=[new_req("f", [11])]))  # f: a streaming session's next chunk
    before = {r: None if b is None else list(b) for r, b in t._blocks.items()}
    assert t.continued == {"f"}
    undo = t.update(
        so_of(
            finished={"a", "gone"},  # a: finished and resubmitted with its id in the same output
            new=[new_req("a", [5, 6]), new_req("e", [7]), new_req("g", [12])],
            preempted_req_ids={"b"},
            cached=cached([("c", [8, 9], 4), ("d", [10], 0)], resumed={"d"}),
        )
    )
    assert t.blocks("a") == [5, 6] and t.blocks("c") == [3, 8, 9] and t.blocks("d") == [10] and "e" in t
    assert t.continued == {"g"}
    undo()
    assert t._blocks == before and t.continued == {"f"}


def test_tracker_reads_an_older_vllms_per_entry_resume_flags() -> None:
    # vLLM before 0.11 has no resumed_req_ids: each cached entry says resumed_from_preemption.
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1, 2]), new_req("b", [3])], counts={"a": 8, "b": 4}))
    t.update(so_of(preempted_req_ids={"b"}, cached=cached([("a", None, 8)]), counts={"a": 1}))
    old = SimpleNamespace(
        req_ids=["a", "b"],
        resumed_from_preemption=[False, True],
        new_block_ids=[([4],), ([7, 8],)],
        num_computed_tokens=[9, 4],
    )
    t.update(so_of(cached=old, counts={"a": 1, "b": 2}))
    assert t.blocks("a") == [1, 2, 4] and t.blocks("b") == [7, 8]  # a appended, b replaced


def test_tracker_refuses_block_copies_and_changes_nothing() -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    so = so_of(
        finished={"a"}, new=[new_req("b", [2])], counts={"b": 4}, kv_cache_block_copies=[v.KVCacheBlockCopy(1, 2)]
    )
    with pytest.raises(ConfigError, match=r"kv_cache_block_copies.*prefix_match_unit"):
        t.update(so)
    assert list(t) == ["a"] and t.blocks("a") == [1]
    t.update(so_of(kv_cache_block_copies=[]))  # empty list: nothing to mirror


def nixl_metadata(**blocks_by_req: tuple[list[int], ...]) -> SimpleNamespace:
    """A stand-in NIXL connector metadata whose ``reqs_to_recv`` pulls into these local blocks."""
    return SimpleNamespace(reqs_to_recv={r: SimpleNamespace(local_block_ids=b) for r, b in blocks_by_req.items()})


def test_tracker_refuses_kv_a_connector_loads_and_changes_nothing() -> None:
    # A NIXL producer pulls KV for a request whose kv_transfer_params ask for a remote prefill
    # (routed to the wrong node): vLLM counts it as computed, and the cache holds those blocks'
    # earlier rows. Refused at the step that starts the load, before anything is registered.
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    so = so_of(finished={"a"}, kv_connector_metadata=nixl_metadata(b=([5, 6],), c=([],)))
    with pytest.raises(ConfigError, match=r"reqs_to_recv: 'b' \(2 blocks\).*do_remote_decode") as info:
        t.update(so)
    assert "'c'" not in str(info.value) and "enable_prefix_caching=False" in str(info.value)
    assert list(t) == ["a"] and t.blocks("a") == [1]
    # An entry without local blocks only tells the remote to free its own: nothing is loaded.
    t.update(so_of(finished={"a"}, kv_connector_metadata=nixl_metadata(c=([], []))))
    assert list(t) == []
    with pytest.raises(ConfigError, match=r"'flat' \(2 blocks\)"):  # (block ids not grouped: counted too)
        t.update(so_of(kv_connector_metadata=nixl_metadata(flat=[7, 8])))
    many = nixl_metadata(**{f"r{i}": ([i],) for i in range(6)})
    with pytest.raises(ConfigError, match=r"'r3' \(1 block\) and 2 more\)"):
        t.update(so_of(kv_connector_metadata=many))


def test_tracker_refuses_draft_tokens_and_changes_nothing() -> None:
    # (speculative decoding is refused at the gate; a diffusion canvas travels the same way)
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    so = so_of(finished={"a"}, new=[new_req("b", [2])], counts={"b": 4})
    so.scheduled_spec_decode_tokens = {"b": [7, 8]}
    with pytest.raises(ConfigError, match=r"scheduled_spec_decode_tokens holds draft tokens for 1 requests"):
        t.update(so)
    assert list(t) == ["a"] and t.blocks("a") == [1]


@pytest.mark.parametrize("not_an_output", [None, object()], ids=["None", "object"])
def test_tracker_refuses_what_is_not_a_scheduler_output_and_changes_nothing(not_an_output) -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    fields = "scheduled_new_reqs, scheduled_cached_reqs, finished_req_ids"
    with pytest.raises(InvalidInputError, match=f"update takes vLLM's SchedulerOutput, got .* without {fields}"):
        t.update(not_an_output)
    one_short = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached([]))
    with pytest.raises(InvalidInputError, match=r"got SimpleNamespace without finished_req_ids$"):
        t.update(one_short)
    assert list(t) == ["a"] and t.blocks("a") == [1]


def test_tracker_rejects_a_running_request_it_does_not_know() -> None:
    t = BlockTracker()
    with pytest.raises(InvalidInputError, match="unknown to the tracker"):
        t.update(so_of(cached=cached([("x", [1], 4)]), counts={"x": 1}))
    t.update(so_of(new=[new_req("p", [1])], counts={"p": 4}))
    t.update(so_of(preempted_req_ids={"p"}))
    with pytest.raises(InvalidInputError, match="preempted to the tracker"):
        t.update(so_of(new=[new_req("q", [2])], cached=cached([("p", [3], 4)]), counts={"p": 1, "q": 4}))
    assert "q" not in t  # nothing applied
    # (one the same output preempts is named preempted, known to the tracker or not)
    with pytest.raises(InvalidInputError, match="'y', which is preempted to the tracker"):
        t.update(so_of(preempted_req_ids={"y"}, cached=cached([("y", [4], 4)]), counts={"y": 1}))


def test_tracker_refuses_several_kv_groups() -> None:
    req = v.NewRequestData("a", [1], [], None, None, ([1], [2]), 0, None)
    t = BlockTracker()
    with pytest.raises(ConfigError, match="2 KV-cache groups"):
        t.update(so_of(new=[req], counts={"a": 1}))
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    two = cached([("a", [2], 4)])
    two.new_block_ids[0] = ([2], [3])
    with pytest.raises(ConfigError, match="2 KV-cache groups"):
        t.update(so_of(cached=two, counts={"a": 1}))
    assert t.blocks("a") == [1]


def test_tracker_refuses_a_malformed_scheduler_output_and_changes_nothing() -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    short = cached([("a", [2], 4)])
    short.new_block_ids.append(([3],))  # one list more than req_ids (was a raw ValueError)
    with pytest.raises(InvalidInputError, match="1 req_ids, 2 new_block_ids and 1 num_computed_tokens"):
        t.update(so_of(cached=short, counts={"a": 1}))
    flat = v.NewRequestData("b", [1], [], None, None, [7], 0, None)  # not one list per group (a raw TypeError)
    with pytest.raises(InvalidInputError, match=r"'b': block ids must be one list of ids per KV-cache group"):
        t.update(so_of(new=[flat], counts={"b": 1}))
    assert list(t) == ["a"] and t.blocks("a") == [1]


# ---- slot mapping --------------------------------------------------------------------------------


def test_slot_mapping_matches_the_per_token_formula() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        bs = int(rng.choice([1, 2, 4, 16]))
        lists, starts, counts, want = [], [], [], []
        for _ in range(int(rng.integers(0, 6))):
            start, count = int(rng.integers(0, 40)), int(rng.integers(0, 12))
            blocks = rng.permutation(1000)[: -(-(start + count) // bs) + int(rng.integers(0, 3))].tolist()
            lists.append(blocks)
            starts.append(start)
            counts.append(count)
            want += [blocks[p // bs] * bs + p % bs for p in range(start, start + count)]
        got = slot_mapping(lists, np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64), bs)
        assert got.dtype == np.int64 and got.tolist() == want


def test_slot_mapping_of_a_zero_count_row_needs_no_block() -> None:
    # Row 0 schedules nothing from position 6 with one block of 4: it touches no block, so it
    # neither reads past its list nor shifts row 1's slots.
    got = slot_mapping([[7], [3]], np.array([6, 0]), np.array([0, 2]), 4)
    assert got.tolist() == [12, 13]
    # (as many rows as requests without one token each: not the one-token-per-request case)
    assert slot_mapping([[1], [2], [3]], np.array([0, 0, 0]), np.array([0, 2, 1]), 4).tolist() == [8, 9, 12]


def test_slot_mapping_refuses_a_short_block_list() -> None:
    with pytest.raises(InvalidInputError, match="need 3 blocks of 4 but the request has 2"):
        slot_mapping([[5, 6]], np.array([6]), np.array([4]), 4)


@pytest.mark.parametrize("counts", [[1, 1], [1, 2]], ids=["decode", "prefill"])
def test_slot_mapping_refuses_a_negative_position_and_a_block_id_that_is_not_an_int(counts) -> None:
    # (a negative position would index the block list from its end: another request's slot)
    with pytest.raises(InvalidInputError, match="row 1: its first position is -4; positions start at 0"):
        slot_mapping([[5, 6], [7, 8]], np.array([0, -4]), np.array(counts), 4)
    with pytest.raises(InvalidInputError, match="block lists must hold int block ids"):
        slot_mapping([[5, 6], ["x", 8]], np.array([0, 0]), np.array(counts), 4)


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True])
def test_slot_mapping_refuses_a_block_size_under_one_or_not_an_int(block_size) -> None:
    # (block size 0 gave slot 0 for every position, with only numpy's division warning)
    with pytest.raises(InvalidInputError, match=r"block_size must be an int >= 1"):
        slot_mapping([[1, 2]], np.array([0]), np.array([1]), block_size)


def test_slot_mapping_refuses_a_negative_count() -> None:
    with pytest.raises(InvalidInputError, match=r"^row 1: -3 tokens scheduled; counts are >= 0$"):
        slot_mapping([[1, 2], [3]], np.array([0, 0]), np.array([1, -3]), 4)


def test_slot_mapping_takes_lists_refuses_unequal_lengths_and_names_the_first_short_row() -> None:
    assert slot_mapping([[5, 6]], [6], [2], 4).tolist() == [26, 27]  # (starts and counts as lists)
    # (a block list too many was ignored: its request got no slots and no error)
    with pytest.raises(InvalidInputError, match="2 block lists for 1 starts and 1 counts"):
        slot_mapping([[5, 6], [7]], [0], [2], 4)
    with pytest.raises(InvalidInputError, match="1 block lists for 1 starts and 2 counts"):
        slot_mapping([[5, 6]], [0], [2, 1], 4)
    # row 0 schedules nothing past its list and row 1 has exactly the blocks it needs: row 2 is short
    short = r"^row 2: positions \[6, 10\) need 3 blocks of 4 but the request has 2$"
    with pytest.raises(InvalidInputError, match=short):
        slot_mapping([[7], [5], [5, 6]], [6, 0, 6], [0, 4, 4], 4)


def test_step_batch_checks_the_rows_against_the_scheduler_output() -> None:
    t = BlockTracker()
    so = so_of(new=[new_req("a", [3, 4]), new_req("b", [5], 0)], counts={"a": 6, "b": 2})
    t.update(so)
    batch = step_batch(so, t, ["b", "a"], 4, num_tokens_padded=16)
    assert batch.req_ids == ["b", "a"] and list(batch.num_scheduled_tokens) == [2, 6]
    assert batch.slot_mapping.tolist() == [20, 21, 12, 13, 14, 15, 16, 17] and batch.num_tokens_padded == 16
    with pytest.raises(InvalidInputError, match="not scheduled"):
        step_batch(so, t, ["a", "z"], 4)
    with pytest.raises(InvalidInputError, match=r"\['b'\] are missing"):
        step_batch(so, t, ["a"], 4)
    again = step_batch(so, t, iter(["b", "a"]), 4)  # (row order from any iterable, read once)
    assert again.req_ids == ["b", "a"] and again.slot_mapping.tolist() == batch.slot_mapping.tolist()
    t.update(so_of(preempted_req_ids={"a"}, cached=cached([("b", None, 2)]), counts={"b": 1}))
    with pytest.raises(InvalidInputError, match="request 'a' is preempted to the block tracker"):
        step_batch(so, t, ["b", "a"], 4)  # (an output the tracker has moved past)


def test_step_batch_refuses_a_token_scheduled_in_vllms_null_block() -> None:
    # Block 0 stands in a block list only where a block was freed (RSWA writes it over a running
    # request's gap blocks behind its window); no scheduled token is ever there, so one that is
    # means the tracker's lists are out of step, and its rows would land in a block lists share.
    t = BlockTracker()
    so = so_of(new=[new_req("a", [3]), new_req("s", [0, 0, 6], 9)], counts={"a": 2, "s": 2})
    t.update(so)
    batch = step_batch(so, t, ["a", "s"], 4)  # (s's nulls lie below its first scheduled position)
    assert batch.slot_mapping.tolist() == [12, 13, 25, 26]
    so = so_of(new=[new_req("b", [5, 0])], counts={"b": 6})
    t.update(so)
    null = r"^request 'b': position 4 is scheduled in block 0, vLLM's null block \(a freed block's stand-in\)"
    with pytest.raises(InvalidInputError, match=null):
        step_batch(so, t, ["b"], 4)
    so = so_of(new=[new_req("c", [-1, 0])], counts={"c": 6})  # (a negative id first: the null block is named)
    t.update(so)
    with pytest.raises(InvalidInputError, match=r"^request 'c': position 4 is scheduled in block 0"):
        step_batch(so, t, ["c"], 4)
    # The second request's token, mid-block: d's slots 4 and 5 (slot 4 is block 1's first), then
    # e's positions 5 and 6 in block 0 (slots 1 and 2).
    so = so_of(new=[new_req("d", [1]), new_req("e", [5, 0], 5)], counts={"d": 2, "e": 2})
    t.update(so)
    with pytest.raises(InvalidInputError, match=r"^request 'e': position 5 is scheduled in block 0"):
        step_batch(so, t, ["d", "e"], 4)


def test_step_batch_of_a_step_without_rows_is_empty() -> None:
    batch = step_batch(so_of(), BlockTracker(), [], 4)
    assert batch.req_ids == [] and batch.slot_mapping.size == 0


# ---- ranks and the mixin off the happy path ------------------------------------------------------


def test_only_the_output_rank_gets_a_cache() -> None:
    config = CacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=16)
    real = build_cache(config, is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        assert isinstance(real, PrefixCache)
    finally:
        real.close()
    policy = CachePolicy(cache_hidden=False)
    for last, tp in [(False, 0), (True, 1), (False, 3)]:
        with build_cache(config, policy, is_last_pipeline_stage=last, tensor_parallel_rank=tp) as noop:
            assert isinstance(noop, NoOpCache) and noop.config is config and noop.policy is policy


def test_the_output_ranks_cache_keeps_its_policy_and_the_rank_check_is_a_bool() -> None:
    config = CacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=16)
    policy = CachePolicy(cache_hidden=False, token_keys=frozenset({"codes"}))
    with build_cache(config, policy, is_last_pipeline_stage=True, tensor_parallel_rank=0) as cache:
        assert isinstance(cache, PrefixCache) and cache.config is config and cache.policy is policy
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        codes = torch.arange(3)
        out = cache.materialize(
            cache.save(torch.ones(3, 2), {"codes": codes}, StepBatch(["a"], [3], np.arange(3))), ["a"]
        )
        assert out.hidden is None and torch.equal(out.mm["codes"]["a"], codes)  # (no hidden states: cache_hidden=False)
    # (a bool, whatever the stage flag was given as)
    assert is_output_rank(is_last_pipeline_stage=0, tensor_parallel_rank=0) is False
    assert is_output_rank(is_last_pipeline_stage=1, tensor_parallel_rank=0) is True


@pytest.mark.parametrize(
    "rank",
    [
        {"is_last_pipeline_stage": False, "tensor_parallel_rank": 0},
        {"is_last_pipeline_stage": True, "tensor_parallel_rank": 1},
    ],
)
def test_the_mixin_is_a_no_op_on_other_ranks(rank) -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), **rank)
    so = scheduler_output(T, RECORDED[0])
    runner.pcache_begin_step(so)
    assert isinstance(runner.pcache, NoOpCache)
    first = runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"])
    second = runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"])
    assert first != second
    out = runner.pcache_materialize(first, ["A", "E"])
    assert out.hidden is None and out.mm == {}
    assert runner.pcache.awaited(second) is False  # (nothing is ever awaited off the output rank)
    runner.pcache_discard(second)
    runner.pcache_fence()
    assert not any(dataclasses.astuple(runner.pcache_stats())), "zero counters, nothing listed"
    assert len(runner._pcache_state.tracker) == 0  # no tracking off the output rank
    runner.pcache_shutdown()


def test_the_mixin_warns_at_init_when_the_hidden_pool_alone_passes_the_budget(caplog) -> None:
    """The hidden states' pool (a row of the model's hidden size per KV slot) is known at KV-cache
    init: past the host budget, the output rank warns then, before any request, naming its size
    and what to change. Within it, off the output rank, or with a dtype not yet resolved, it
    says nothing."""
    budget = 1 << 30
    slots = T.KVCacheConfig(
        num_blocks=1 << 18, kv_cache_tensors=[], kv_cache_groups=stage_configs(T)["kv_cache_config"].kv_cache_groups
    )
    cases = [  # (hidden size, dtype, output rank, warned): 1M slots (blocks of 4) x 1,024 bf16 = 2 GiB
        (1024, torch.bfloat16, True, True),
        (256, torch.bfloat16, True, False),
        (1024, torch.bfloat16, False, False),
        (1024, "auto", True, False),
    ]
    for hidden_size, dtype, output, warned in cases:
        caplog.clear()
        runner = Runner("scheduler", "inline")
        configs = stage_configs(T) | {
            "kv_cache_config": slots,
            "model_config": v.ModelConfig(hidden_size=hidden_size, dtype=dtype),
        }
        with caplog.at_level("WARNING", logger="omni_pcache"):
            assert runner.pcache_init(
                **configs,
                is_last_pipeline_stage=True,
                tensor_parallel_rank=0 if output else 1,
                host_budget_bytes=budget,
            )
        messages = [r.getMessage() for r in caplog.records]
        if warned:
            assert len(messages) == 1 and "hidden states' host pool alone would take 2.0 GiB" in messages[0]
            assert "hidden size 1024, bfloat16" in messages[0] and "past the host budget of 1.0 GiB" in messages[0]
        else:
            assert messages == [], (hidden_size, dtype, output)
        runner.pcache_shutdown()


def test_the_mixin_does_nothing_without_a_cache() -> None:
    class R(PrefixCacheRunnerMixin):
        pass

    runner = R()
    runner.pcache_fence()  # (before pcache_init: a dummy run at warm-up)
    off = stage_configs(T) | {"cache_config": v.CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)}
    assert not runner.pcache_init(**off, is_last_pipeline_stage=True, tensor_parallel_rank=0)
    runner.pcache_fence()
    so = scheduler_output(T, RECORDED[0])
    runner.pcache_begin_step(so)
    assert runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"]) is None
    assert runner.pcache_materialize(None, ["A", "E"]) is None
    runner.pcache_discard(None)
    assert runner.pcache is None and runner.pcache_stats() is None
    runner.pcache_shutdown()


@pytest.mark.parametrize("output", ["inline", "late"])
def test_warm_ups_before_and_between_steps_leave_the_cache_and_tracker_untouched(output: str) -> None:
    # V2's kernel warm-up runs execute_model on hand-built SchedulerOutputs at start and again
    # at an elastic-EP rescale; inside pcache_warmup they neither build the cache, nor reach the
    # tracker (their request ids are the real steps' own here: tracked, step 1 would be refused or
    # A continued), nor leave step ids unconsumed, and every row still comes out right.
    runner = replay(T, output=output, warm_up_before=frozenset({1, 3, 5}))
    stats = runner.pcache_stats()
    assert (stats.hits, stats.misses, stats.steps_outstanding, stats.requests_live) == (3, 3, [], 0)
    assert runner._pcache_warmups == 0


@pytest.mark.parametrize("dummy", ["pcache_fence", "warm-up"])
def test_a_dummy_runs_fence_makes_the_saved_outputs_the_runners_again(monkeypatch, dummy: str) -> None:
    # An idle data-parallel rank's dummy forward (no pcache_begin_step) or a warm-up's
    # (pcache_begin_step inside pcache_warmup) reuses the output buffer the last save's copy
    # reads: the fence first makes that copy land before the buffer is overwritten. (CPU
    # stand-in: the copy goes to the committer, held back until after the dummy run; in the
    # warm-up variant the warm-up's flush waits for it, and the fence's epoch is what keeps
    # materialize from reading the overwritten buffer in place.)
    from omni_pcache import copy_engine

    monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 0)
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    runner.pcache_fence()  # (before the first step: no cache yet, nothing to wait for)
    state = runner._pcache_state
    state.config = dataclasses.replace(state.config, inline_write_bytes=0)  # (no step written inside save)
    try:
        so = scheduler_output(T, RECORDED[0])
        runner.pcache_begin_step(so)
        gate = threading.Event()
        write = runner.pcache._writer.write_batch
        runner.pcache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        expected = torch.randn(18, 4)
        buffer = expected.clone()
        step_id = runner.pcache_save(buffer, {}, so, ["A", "E"])
        if dummy == "pcache_fence":
            runner.pcache_fence()  # the dummy run
        else:
            threading.Timer(0.2, gate.set).start()  # (entering the warm-up flushes: the write must land)
            with runner.pcache_warmup():
                runner.pcache_begin_step(scheduler_output(T, RECORDED[1]))  # (not tracked: would be refused)
        buffer.fill_(-1.0)  # its forward overwrites the output buffer
        gate.set()
        out = runner.pcache_materialize(step_id, ["A", "E"])
        assert torch.equal(torch.cat([out.hidden["A"], out.hidden["E"]]), expected)
    finally:
        runner.pcache_shutdown()


def test_entering_a_warm_up_flushes_the_cache_before_its_graphs_are_captured() -> None:
    # compile_or_warm_up_model captures CUDA graphs again at an elastic-EP rescale, in CUDA's
    # global capture mode, which a device call of the committer during the capture would
    # invalidate: pcache_warmup lets its body run only once every queued write has landed.
    # (CPU stand-in: the committer's write is held back until 0.3 s after the warm-up is entered.)
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    state = runner._pcache_state
    state.config = dataclasses.replace(state.config, inline_write_bytes=0)  # (no step written inside save)
    try:
        with runner.pcache_warmup():  # (before the first step: no cache yet, nothing to flush)
            pass
        so = scheduler_output(T, RECORDED[0])
        runner.pcache_begin_step(so)
        gate = threading.Event()
        write = runner.pcache._writer.write_batch
        runner.pcache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        step_id = runner.pcache_save(torch.randn(18, 4), {}, so, ["A", "E"])
        assert runner.pcache_stats().tasks_live > 0
        threading.Timer(0.3, gate.set).start()
        with runner.pcache_warmup():
            with runner.pcache_warmup():  # (nested: the outer one flushed)
                assert runner.pcache_stats().tasks_live == 0, "a write still queued when the warm-up's body ran"
        runner.pcache_discard(step_id)
    finally:
        gate.set()
        runner.pcache_shutdown()


def test_a_warm_up_after_a_failed_write_runs_and_the_next_step_raises_the_failure() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    state = runner._pcache_state
    state.config = dataclasses.replace(state.config, inline_write_bytes=0)  # (the committer writes)
    try:
        so = scheduler_output(T, RECORDED[0])
        runner.pcache_begin_step(so)

        def broken(groups) -> None:
            raise OSError("disk on fire")

        runner.pcache._writer.write_batch = broken
        runner.pcache_save(torch.randn(18, 4), {}, so, ["A", "E"])
        with runner.pcache_warmup():  # (its flush meets the failure: left to the next step's call)
            pass
        with pytest.raises(WriteFailedError, match="disk on fire"):
            runner.pcache_begin_step(scheduler_output(T, RECORDED[1]))
    finally:
        runner.pcache_shutdown()


def test_a_step_id_kept_across_a_kv_cache_re_init_is_refused_before_and_after_the_first_step() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        so = scheduler_output(T, RECORDED[0])
        runner.pcache_begin_step(so)
        kept = runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"])
        assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
        # (before, the hooks returned None and did nothing until the new cache was built)
        for hook in (lambda: runner.pcache_materialize(kept, ["A", "E"]), lambda: runner.pcache_discard(kept)):
            with pytest.raises(
                StepIdError, match=rf"step#{kept} was never issued: this stage has no cache running"
            ) as err:
                hook()
            assert (err.value.step_id, err.value.outstanding) == (kept, []), "the attributes the cache's own has"
        runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
        with pytest.raises(StepIdError, match=rf"step#{kept} was never issued"):
            runner.pcache_materialize(kept, ["A", "E"])
    finally:
        runner.pcache_shutdown()


def test_the_mixin_discards_and_fixes_the_policy_at_the_first_step() -> None:
    runner = Runner("scheduler", "inline")
    runner.pcache_load_policy(CachePolicy(token_keys=frozenset()))
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        so = scheduler_output(T, RECORDED[0])
        runner.pcache_begin_step(so)
        with pytest.raises(ConfigError, match="fixed once the first step"):
            runner.pcache_load_policy(CachePolicy())
        step_id = runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"], num_tokens_padded=18)
        runner.pcache_discard(step_id)
        assert runner.pcache_stats().steps_outstanding == []
        assert runner.pcache.policy.token_keys == frozenset()
    finally:
        runner.pcache_shutdown()
        runner.pcache_shutdown()  # idempotent


def test_a_policy_loaded_after_init_is_the_caches_and_a_bad_one_is_refused() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        with pytest.raises(ConfigError, match="pcache_load_policy takes a CachePolicy, got dict"):
            runner.pcache_load_policy({"token_keys": []})
        runner.pcache_load_policy(CachePolicy(token_keys=frozenset({"codes"})))  # (KV init ran first)
        runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
        assert runner.pcache.policy.token_keys == frozenset({"codes"})
    finally:
        runner.pcache_shutdown()


def _rows(tokens: list[int], start: int, count: int) -> torch.Tensor:
    """(position, token) per row, as a causal model's rows would identify them."""
    return torch.tensor([[float(p), float(tokens[p])] for p in range(start, start + count)], dtype=torch.float64)


def _step(runner: Runner, so: v.SchedulerOutput, hidden: torch.Tensor) -> torch.Tensor:
    """One step of request R through the mixin (begin, save, materialize): R's rows."""
    runner.pcache_begin_step(so)
    return runner.pcache_materialize(runner.pcache_save(hidden, {}, so, ["R"]), ["R"]).hidden["R"]


def test_a_streaming_sessions_next_chunk_gets_the_row_vllm_dropped_under_async_scheduling() -> None:
    # vLLM 0.33, async scheduling: the decode of position 6 is in flight when step 1's stop token
    # ends the session's turn; the scheduler rewinds the request to 6, drops that step's output,
    # and sends the next chunk (3 tokens) as a new request with the same id and 6 computed.
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)

    turn1, turn2 = [1, 2, 3, 4, 5, 6, 99], [1, 2, 3, 4, 5, 6, 50, 51, 52]
    try:
        s1 = so_of(new=[new_req("R", [1, 2])], counts={"R": 6})
        got = [_step(runner, s1, _rows(turn1, 0, 6))]
        s2 = so_of(cached=cached([("R", None, 6)]), counts={"R": 1})
        _step(runner, s2, _rows(turn1, 6, 1))  # dropped by vLLM
        s3 = so_of(new=[new_req("R", [1, 2, 3], 6)], counts={"R": 3})
        got.append(_step(runner, s3, _rows(turn2, 6, 3)))
        assert torch.equal(torch.cat(got), _rows(turn2, 0, 9)), "every position once, 6 included"
        # A preempted request sent again as new (V2) is no continuation: its rows past the
        # resume point were delivered, and are not returned twice.
        runner.pcache_begin_step(so_of(preempted_req_ids={"R"}))
        s5 = so_of(new=[new_req("R", [1, 2, 3], 8)], counts={"R": 2})
        out = _step(runner, s5, _rows([*turn2, 53], 8, 2))
        assert torch.equal(out, _rows([*turn2, 53], 9, 1)), "position 8 was delivered before"
    finally:
        runner.pcache_shutdown()


def test_a_save_before_any_begin_step_is_refused() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    so = scheduler_output(T, RECORDED[0])
    with pytest.raises(ConfigError, match="pcache_save before pcache_begin_step"):
        runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"])
    runner.pcache_shutdown()


def test_shutdown_and_a_kv_cache_re_init_close_the_running_cache() -> None:
    runner = Runner("scheduler", "inline")
    for end in ("re-init", "shutdown"):
        assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
        runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
        cache = runner.pcache
        if end == "re-init":
            assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
        else:
            runner.pcache_shutdown()
        with pytest.raises(CacheClosedError):  # (its committer thread has ended)
            cache.begin_step(StepEvents())
    runner.pcache_shutdown()


def test_the_recorded_sequence_is_refused_with_block_copies_mid_run() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
        so = scheduler_output(T, Step(finished={"A", "E"}))
        so.kv_cache_block_copies = [v.KVCacheBlockCopy(src_block_id=1, dst_block_id=2)]
        with pytest.raises(ConfigError, match="kv_cache_block_copies"):
            runner.pcache_begin_step(so)
    finally:
        runner.pcache_shutdown()


def test_a_step_the_cache_refuses_leaves_the_block_tracker_as_it_was() -> None:
    """Step 4 of the recorded sequence first comes with a block id past the cache's blocks in
    B's resumed list: the cache refuses it, and the tracker must not keep A's appended block
    or B's new list (before, the tracker applied the output before the cache checked it: A's
    list then held block 13 twice, and every later slot of A was wrong)."""
    step4 = RECORDED[3]
    bad = dataclasses.replace(
        step4,
        cached=[dataclasses.replace(c, new_blocks=[1, 2, 99]) if c.req_id == "B" else c for c in step4.cached],
    )
    replay(T, refused_before={4: (bad, InvalidInputError, r"'B': block id 99 at position 2 is out of range")})


@pytest.mark.parametrize("runner_kind", ["v1", "v2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_recorded_runs_return_every_full_sequence_row(seed: int, runner_kind: str) -> None:
    """Longer recordings from the embedded engine's scheduler (vLLM's prefix-caching and
    scheduling rules), with many preemptions, evictions and aborts, sent as vLLM 0.33 sends
    them to a V1 runner (resumed_req_ids) or to a V2 runner (resumed requests as new)."""
    scenario, counters = record_engine_run(seed, v2=runner_kind == "v2")
    assert counters["hits"] and counters["preemptions"] and counters["aborted"]
    replay(T, order="shuffled", output="late", scenario=scenario)


def test_an_aborted_request_resubmitted_with_its_id_gets_its_full_sequence_again() -> None:
    """vLLM may report an id finished and schedule it as new in the same SchedulerOutput (aborted,
    then resubmitted with the same id): the adapter must finish the old one first."""
    tokens = {"X": [5, 6, 7, 8, 9, 10, 11, 12, 13]}
    scenario = Scenario([], tokens, {"X": tokens["X"][:8]}, {})
    runner = Runner("scheduler", "inline", tokens)
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    try:
        first = scheduler_output(T, Step(new=[New("X", [1, 2], 0, 8)]), scenario)
        runner.execute_model(first, 1, {"X": 0})
        again = scheduler_output(T, Step(finished={"X"}, new=[New("X", [1, 3], 4, 4)]), scenario)
        runner.execute_model(again, 2, {"X": 4})
    finally:
        runner.pcache_shutdown()
    want_hidden, want_codes = full_rows(tokens["X"], 8)
    assert len(runner.received["X"]) == 2
    for hidden, codes in runner.received["X"]:
        assert torch.equal(hidden, want_hidden) and torch.equal(codes, want_codes)


# ---- refusals and copies a mutation audit found untested ----------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # (a vLLM without KVTransferConfig.is_kv_consumer: the role alone decides)
        ({"kv_transfer_config": SimpleNamespace(kv_role="kv_both")}, "kv_role='kv_both'"),
        ({"kv_cache_config": v.KVCacheConfig(1000, [], [])}, "0 KV-cache groups"),  # (was a raw IndexError)
        ({"cache_config": v.CacheConfig(block_size=16, prefix_match_unit=24)}, "prefix_match_unit=24"),
    ],
    ids=["kv-both-role", "no-kv-group", "unit-not-whole-blocks"],
)
def test_gate_refuses_what_it_cannot_mirror(changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        cache_config_from_vllm(**configs(**changes))


def test_gate_accepts_matching_units_of_whole_blocks_and_refuses_a_capacity_that_is_not_an_int() -> None:
    kv = v.KVCacheConfig(1000, [], [v.KVCacheGroupSpec(["l0"], v.FullAttentionSpec(block_size=16))], 16)
    assert cache_config_from_vllm(**configs(kv_cache_config=kv)) is not None  # hash_block_size == block_size
    assert cache_config_from_vllm(**configs(cache_config=v.CacheConfig(block_size=16, prefix_match_unit=32)))
    with pytest.raises(ConfigError, match="staging_capacity_tokens='4096' must hold a whole step"):
        cache_config_from_vllm(**configs(), staging_capacity_tokens="4096")


@pytest.mark.parametrize("gone", [{"finished": {"a"}}, {"preempted_req_ids": {"a"}}], ids=["finished", "preempted"])
def test_tracker_refuses_a_running_request_that_the_same_output_ends(gone) -> None:
    t = BlockTracker()
    t.update(so_of(new=[new_req("a", [1])], counts={"a": 4}))
    with pytest.raises(InvalidInputError, match="to the tracker"):
        t.update(so_of(cached=cached([("a", [2], 4)]), counts={"a": 1}, **gone))
    assert t.blocks("a") == [1]


def test_tracker_keeps_block_lists_of_its_own() -> None:
    # (vLLM's V1 runner extends the very lists a SchedulerOutput carries, in its request state)
    t = BlockTracker()
    req = new_req("a", [1, 2])
    t.update(so_of(new=[req], counts={"a": 8}))
    req.block_ids[0].append(99)
    assert t.blocks("a") == [1, 2]
    t.update(so_of(preempted_req_ids={"a"}))
    resumed = cached([("a", [5, 6], 4)], resumed={"a"})
    t.update(so_of(cached=resumed, counts={"a": 1}))
    resumed.new_block_ids[0][0].append(77)
    assert t.blocks("a") == [5, 6]


def test_step_batch_refuses_a_request_named_twice() -> None:
    t = BlockTracker()
    so = so_of(new=[new_req("a", [3, 4])], counts={"a": 2})
    t.update(so)
    with pytest.raises(InvalidInputError, match=r"req_ids has duplicates: \['a'\] \(each request once per step\)"):
        step_batch(so, t, ["a", "a"], 4)


def test_a_re_init_without_prefix_caching_closes_and_drops_the_cache() -> None:
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
    cache = runner.pcache
    off = stage_configs(T) | {"cache_config": v.CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)}
    assert not runner.pcache_init(**off, is_last_pipeline_stage=True, tensor_parallel_rank=0)
    assert runner.pcache is None and runner.pcache_stats() is None
    with pytest.raises(CacheClosedError):
        cache.begin_step(StepEvents())
    so = scheduler_output(T, RECORDED[0])
    runner.pcache_begin_step(so)
    assert runner.pcache_save(torch.zeros(18, 4), {}, so, ["A", "E"]) is None
    runner.pcache_shutdown()


def test_step_batch_refuses_an_output_whose_requests_and_scheduled_counts_disagree() -> None:
    # "b" is among the output's new requests but has no scheduled token count: the rows match
    # what is scheduled, yet the output itself is inconsistent, and is refused, naming both sets.
    t = BlockTracker()
    so = so_of(new=[new_req("a", [3, 4]), new_req("b", [5])], counts={"a": 2})
    t.update(so)
    with pytest.raises(InvalidInputError, match=r"schedules \['a'\] but its requests are \['a', 'b'\]: inconsistent"):
        step_batch(so, t, ["a"], 4)


def test_the_gate_reads_fields_an_older_vllms_cache_config_lacks_as_off() -> None:
    # The gate reads configs by attribute: a CacheConfig without ``enable_prefix_caching`` means
    # no prefix caching (no cache); one without ``kv_sharing_fast_prefill`` (an older vLLM) is
    # not fast prefill, and gets a cache.
    from types import SimpleNamespace

    from omni_pcache.vllm import cache_config_from_vllm
    from vllm_replay import stage_configs, standin_types

    configs = stage_configs(standin_types())
    bs = configs["cache_config"].block_size
    no_flag = configs | {"cache_config": SimpleNamespace(block_size=bs)}
    assert cache_config_from_vllm(**no_flag) is None
    older = configs | {"cache_config": SimpleNamespace(block_size=bs, enable_prefix_caching=True)}
    config = cache_config_from_vllm(**older)
    assert config is not None and config.block_size == bs


def test_step_batch_names_a_row_request_the_output_has_but_does_not_schedule() -> None:
    # "b" is one of the output's requests (so the tracker holds its blocks) but has no
    # scheduled tokens: naming it among the forward's rows is refused as not scheduled.
    t = BlockTracker()
    so = so_of(new=[new_req("a", [3, 4]), new_req("b", [5])], counts={"a": 2})
    t.update(so)
    with pytest.raises(InvalidInputError, match=r"req_ids \['b'\] are not scheduled by this SchedulerOutput"):
        step_batch(so, t, ["a", "b"], 4)


def _resumed(req_id: str, tokens: list[int], runner_kind: str) -> v.SchedulerOutput:
    """``req_id`` resumed from position 0 with ``tokens`` after a reset preempted it: V1 sends
    it in ``resumed_req_ids`` with its tokens in ``all_token_ids``, V2 again as new with them in
    ``prefill_token_ids``."""
    if runner_kind == "v1":
        entries = cached([(req_id, [5, 6], 0)], resumed={req_id})
        entries.all_token_ids[req_id] = list(tokens)
        return so_of(preempted_req_ids={req_id}, cached=entries, counts={req_id: len(tokens)})
    new = dataclasses.replace(new_req(req_id, [5, 6]), prefill_token_ids=list(tokens))
    return so_of(preempted_req_ids={req_id}, new=[new], counts={req_id: len(tokens)})


@pytest.mark.parametrize("runner_kind", ["v1", "v2"])
@pytest.mark.parametrize("dropped", [True, False], ids=["reset-dropped-it", "its-output-arrived"])
def test_a_resume_returns_the_rows_of_a_step_in_flight_that_vllm_dropped(runner_kind: str, dropped: bool) -> None:
    # vLLM 0.33, async scheduling: R's prompt (6 tokens) samples token 7 in step 1; step 2
    # decodes position 6 and is in flight when reset_prefix_cache(reset_running_requests=True)
    # preempts R with drop_stale_output: step 2's output never reaches the consumer and its
    # token is not R's. Step 3 resumes R from position 0 with its 7 tokens: the consumer gets
    # position 6 there. When step 2's output did arrive (a pause drained it first), R resumes
    # with 8 tokens and gets position 7 only.
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    seq = [1, 2, 3, 4, 5, 6, 70, 80]
    try:
        s1 = so_of(new=[new_req("R", [1, 2])], counts={"R": 6})
        got = [_step(runner, s1, _rows(seq, 0, 6))]
        s2 = so_of(cached=cached([("R", None, 6)]), counts={"R": 1})
        out = _step(runner, s2, _rows(seq, 6, 1))
        if not dropped:
            got.append(out)
        kept = seq[:7] if dropped else seq
        got.append(_step(runner, _resumed("R", kept, runner_kind), _rows(seq, 0, len(kept))))
        assert runner._pcache_state.tracker.dropped_saves == ({"R": 1} if dropped else {})
        assert torch.equal(torch.cat(got), _rows(seq, 0, len(kept))), "every position once, none missing"
        assert runner.pcache.stats().requests_live == 1
    finally:
        runner.pcache_shutdown()


def test_a_dropped_prompt_step_is_returned_from_its_first_position() -> None:
    # R's whole prompt (positions 0..5, sampling token 7) is the step in flight at the reset:
    # its consumer never got any row, so all six come with the resume.
    t = BlockTracker(steps_in_flight=2)
    t.update(so_of(new=[new_req("R", [1, 2])], counts={"R": 6}))
    entries = cached([("R", [5, 6], 0)], resumed={"R"})
    entries.all_token_ids["R"] = [1, 2, 3, 4, 5, 6]
    t.update(so_of(preempted_req_ids={"R"}, cached=entries, counts={"R": 6}))
    assert t.dropped_saves == {"R": 1}


@pytest.mark.parametrize(
    ("steps", "kept", "dropped"),
    [(1, 7, {}), (2, 8, {"R": 1}), (3, 7, {"R": 2}), (3, 8, {"R": 1}), (3, 9, {}), (4, 7, {"R": 2})],
)
def test_the_tracker_counts_the_dropped_steps_among_those_that_may_be_in_flight(steps, kept, dropped) -> None:
    # R's prompt (0..5) samples token 7 and two decodes follow; the reset comes with
    # ``steps - 1`` SchedulerOutputs possibly in flight (1: none; 2: the last decode; 3 or
    # more, pipeline parallelism: both decodes). The outputs that arrived ended with a sampled
    # token each, so R's ``kept`` tokens tell how many of those in flight were dropped.
    t = BlockTracker(steps_in_flight=steps)
    t.update(so_of(new=[new_req("R", [1, 2])], counts={"R": 6}))
    t.update(so_of(cached=cached([("R", None, 6)]), counts={"R": 1}))
    t.update(so_of(cached=cached([("R", None, 7)]), counts={"R": 1}))
    entries = cached([("R", [5, 6], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(1, kept + 1))
    t.update(so_of(preempted_req_ids={"R"}, cached=entries, counts={"R": kept}))
    assert t.dropped_saves == dropped


def test_the_tracker_counts_a_resume_steps_later_and_forgets_what_finished() -> None:
    t = BlockTracker(steps_in_flight=2)
    first = [new_req("A", [1, 2]), new_req("B", [3, 4]), new_req("C", [7]), new_req("D", [8])]
    t.update(so_of(new=first, counts={"A": 6, "B": 5, "D": 3}))
    t.update(so_of(cached=cached([("A", None, 6), ("B", None, 5), ("D", None, 3)]), counts={"A": 1, "B": 1, "D": 1}))
    # The reset preempts A, B, C and D (C was not in the step before: nothing of it in flight;
    # D is aborted in the same output); none fits yet; B is aborted while waiting.
    gone = so_of(preempted_req_ids={"A", "B", "C", "D"}, finished={"D"})
    undo = t.update(gone)
    assert t.dropped_saves == {} and set(t._spans_in_flight) == {"A", "B"}
    undo()
    assert t._spans_in_flight == {} and len(t._recent) == 1
    t.update(gone)
    t.update(so_of(finished={"B"}))
    assert set(t._spans_in_flight) == {"A"}
    entries = cached([("A", [8, 9], 0), ("C", [10], 0)], resumed={"A", "C"})
    entries.all_token_ids.update(A=[1, 2, 3, 4, 5, 6, 7], C=[1, 2])
    undo = t.update(so_of(cached=entries, counts={"A": 7, "C": 2}))
    assert t.dropped_saves == {"A": 1} and t._spans_in_flight == {}
    undo()
    assert t.dropped_saves == {} and set(t._spans_in_flight) == {"A"}


def test_the_tracker_leaves_a_resume_whose_tokens_vllm_did_not_send() -> None:
    # (an older vLLM, or a V1 resume the scheduler scheduled in the step before: no
    # all_token_ids entry) nothing is known, so nothing is rewound
    t = BlockTracker(steps_in_flight=2)
    t.update(so_of(new=[new_req("R", [1, 2])], counts={"R": 6}))
    t.update(so_of(preempted_req_ids={"R"}, cached=cached([("R", [5, 6], 0)], resumed={"R"}), counts={"R": 6}))
    assert t.dropped_saves == {}


@pytest.mark.parametrize(
    ("async_scheduling", "pp", "steps"),
    [(False, 1, 1), (True, 1, 2), (None, 1, 2), (False, 2, 2), (True, 2, 3), (False, 4, 4)],
)
def test_steps_in_flight_follows_vllms_batch_queue(async_scheduling, pp: int, steps: int) -> None:
    from omni_pcache.vllm import steps_in_flight

    assert steps_in_flight(T.SchedulerConfig(async_scheduling=async_scheduling), T.ParallelConfig(pp)) == steps


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_a_second_reset_does_not_count_the_steps_an_earlier_resume_settled(runner: str) -> None:
    # Three steps in flight (pipeline parallelism). R's prompt step [4, 11) is dropped by a
    # reset; R resumes with its 11 tokens and a prompt chunk [4, 10); a second reset (after a
    # pause: that chunk's output arrived) resumes it again with the same 11 tokens. Only the
    # chunk may have been in flight then: the prompt step, before the first resume, is not
    # counted again. (V2 sends a resume as a new request, V1 as a resumed cached one.)
    t = BlockTracker(steps_in_flight=3)
    prompt = list(range(1, 12))

    def resumed(blocks: list[int], count: int):
        if runner == "v2":
            again = dataclasses.replace(new_req("R", blocks, 4), prefill_token_ids=prompt)
            return so_of(preempted_req_ids={"R"}, new=[again], counts={"R": count})
        entries = cached([("R", blocks, 4)], resumed={"R"})
        entries.all_token_ids["R"] = list(prompt)
        return so_of(preempted_req_ids={"R"}, cached=entries, counts={"R": count})

    t.update(so_of(new=[new_req("R", [1, 2, 3], 4)], counts={"R": 7}))
    t.update(resumed([4, 5, 6], 6))
    assert t.dropped_saves == {"R": 1}
    t.update(resumed([7, 8, 9], 5))
    assert t.dropped_saves == {}


@pytest.mark.parametrize(("awaited", "dropped"), [({7, 8}, {"R": 2}), ({8}, {"R": 1}), (set(), {})])
def test_a_reset_drops_every_chunk_in_flight_from_the_first_not_taken(awaited: set[int], dropped) -> None:
    # Four steps in flight. R's 20-token prompt runs in two chunks that sample nothing, [0, 8)
    # (step 7) and [8, 16) (step 8), when a reset's output (admitting X) preempts it: outputs
    # are taken in order, so every chunk from the first not taken yet was dropped, and its
    # rows come again with R's resume (the tokens cannot tell: nothing was sampled).
    t = BlockTracker(steps_in_flight=4)
    t.update(so_of(new=[new_req("R", [1, 2, 3, 4])], counts={"R": 8}))
    t.saved(t._recent[-1][0], 7)
    t.update(so_of(cached=cached([("R", None, 8)]), counts={"R": 8}), awaited.__contains__)
    t.saved(t._recent[-1][0], 8)
    t.update(so_of(preempted_req_ids={"R"}, new=[new_req("X", [5])], counts={"X": 1}), awaited.__contains__)
    entries = cached([("R", [6, 7], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(20))
    t.update(so_of(cached=entries, counts={"R": 8}))
    assert t.dropped_saves == dropped


def test_an_aborted_requests_id_resubmitted_is_not_in_the_old_requests_drop_mode() -> None:
    # Four steps in flight. A reset preempts R with its chunk's step 7 outstanding (vLLM keeps
    # R in drop mode while it is); R is aborted and its id resubmitted as a new request, which
    # too few blocks then preempt normally while step 7 is still outstanding: the new R's
    # output arrives (it is not the old R), so nothing of it is returned twice.
    t = BlockTracker(steps_in_flight=4)
    outstanding = {7, 9}
    t.update(so_of(new=[new_req("R", [1, 2]), new_req("Q", [3])], counts={"R": 8, "Q": 2}))
    t.saved(t._recent[-1][0], 7)
    back = dataclasses.replace(new_req("R", [4, 5]), prefill_token_ids=list(range(20)))
    t.update(so_of(preempted_req_ids={"R", "Q"}, new=[back], counts={"R": 6}), outstanding.__contains__)
    t.saved(t._recent[-1][0], 8)
    fresh = dataclasses.replace(new_req("R", [9]), prefill_token_ids=[1, 2, 3, 4])
    t.update(so_of(finished={"R"}, new=[fresh, new_req("Q", [3])], counts={"R": 4, "Q": 2}), outstanding.__contains__)
    t.saved(t._recent[-1][0], 9)
    t.update(so_of(preempted_req_ids={"R"}, cached=cached([("Q", None, 2)]), counts={"Q": 1}), outstanding.__contains__)
    entries = cached([("R", [6], 0)], resumed={"R"})
    entries.all_token_ids["R"] = [1, 2, 3, 4, 5]  # (its output arrived: the sampled 5th token is there)
    t.update(so_of(cached=entries, counts={"R": 5}))
    assert t.dropped_saves == {}


def test_a_step_id_noted_for_an_output_whose_update_was_undone_marks_no_other_output() -> None:
    # The cache refused step 2's events (the mixin undid its update); a save noted for step 2's
    # output anyway must not stamp step 1's output with its id: step 1's chunk (step 7, not
    # taken) is still what a reset finds outstanding, so its rows come again with R's resume.
    t = BlockTracker(steps_in_flight=3)
    first = so_of(new=[new_req("R", [1, 2])], counts={"R": 8})
    t.update(first)
    t.saved(first, 7)
    refused = so_of(cached=cached([("R", None, 8)]), counts={"R": 8})
    t.update(refused, {7}.__contains__)()
    t.saved(refused, 9)
    t.update(so_of(preempted_req_ids={"R"}, new=[new_req("X", [5])], counts={"X": 1}), {7}.__contains__)
    entries = cached([("R", [6, 7], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(20))
    t.update(so_of(cached=entries, counts={"R": 8}))
    assert t.dropped_saves == {"R": 1}


def test_a_reset_preempted_requests_taken_steps_are_forgotten() -> None:
    # What the tracker keeps of a request a reset preempted (its steps still outstanding) is
    # gone once those steps are taken: a second reset then finds nothing of it outstanding.
    t = BlockTracker(steps_in_flight=3)
    t.update(so_of(new=[new_req("R", [1])], counts={"R": 4}))
    t.saved(t._recent[-1][0], 7)
    t.update(so_of(preempted_req_ids={"R"}, new=[new_req("X", [2])], counts={"X": 1}), {7}.__contains__)
    assert t._stale_steps == {"R": [7]}
    entries = cached([("R", [3], 0)], resumed={"R"})
    entries.all_token_ids["R"] = [1, 2, 3, 4]
    t.update(so_of(cached=entries, counts={"R": 4}), {7}.__contains__)
    t.update(so_of(preempted_req_ids={"R", "X"}, new=[new_req("Y", [4])], counts={"Y": 1}), lambda s: False)
    assert t._stale_steps == {}


@pytest.mark.parametrize(
    ("awaited", "admitted", "running", "dropped"),
    [
        (True, True, False, {"R": 1}),  # a reset's output, R's chunk not taken yet: dropped
        (False, True, False, {}),  # taken before the reset's output arrived: it may have arrived
        (True, False, True, {}),  # a normal preemption (Q still running, nothing admitted): it arrives
        (True, True, True, {}),  # (a running request scheduled: not a reset's output)
        (True, False, False, {}),  # (nothing admitted: not known to be a reset's)
    ],
)
def test_a_reset_drops_a_chunk_whose_output_was_not_taken(awaited, admitted, running, dropped) -> None:
    # R's prompt is 20 tokens; its first chunk [0, 8) samples nothing, so the tokens cannot tell
    # whether its output arrived. It is preempted with its step's output not yet taken
    # (``awaited``) in an output that looks like a reset's or not; R resumes later.
    t = BlockTracker(steps_in_flight=2)
    t.update(so_of(new=[new_req("R", [1, 2]), new_req("Q", [3])], counts={"R": 8, "Q": 2}))
    t.saved(t._recent[-1][0], 7)
    new = [new_req("X", [4])] if admitted else []
    still = cached([("Q", None, 2)]) if running else cached([])
    t.update(
        so_of(preempted_req_ids={"R"}, new=new, cached=still, counts={"X": 1} if admitted else {}),
        lambda s: awaited and s == 7,
    )
    entries = cached([("R", [5, 6], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(20))
    t.update(so_of(cached=entries, counts={"R": 8}))
    assert t.dropped_saves == dropped


def test_a_mixin_returns_the_rows_of_a_chunk_dropped_before_its_output_was_taken() -> None:
    # Async scheduling: R's first prompt chunk [0, 6) of 8 is in flight when a reset preempts it;
    # the reset's output (admitting X) reaches the runner before the chunk's step is
    # materialized, so that output was dropped: R's resume returns 0..8.
    runner = Runner("scheduler", "inline")
    assert runner.pcache_init(**stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0)
    seq = list(range(1, 10))
    try:
        s1 = so_of(new=[new_req("R", [1, 2])], counts={"R": 6})
        runner.pcache_begin_step(s1)
        late = runner.pcache_save(_rows(seq, 0, 6), {}, s1, ["R"])  # (taken a step late)
        s2 = so_of(preempted_req_ids={"R"}, new=[new_req("X", [3])], counts={"X": 1})
        runner.pcache_begin_step(s2)
        assert runner._pcache_state.tracker._spans_in_flight == {"R": ([(0, 6, late)], 1)}
        runner.pcache_discard(runner.pcache_save(torch.zeros(1, 2, dtype=torch.float64), {}, s2, ["X"]))
        runner.pcache_discard(late)  # (dropped by the scheduler)
        entries = cached([("R", [4, 5], 0)], resumed={"R"})
        entries.all_token_ids["R"] = seq[:8]
        out = _step(runner, so_of(cached=entries, counts={"R": 8}), _rows(seq, 0, 8))
        assert torch.equal(out, _rows(seq, 0, 8)), "every row of R: the dropped chunk's too"
    finally:
        runner.pcache_shutdown()


@pytest.mark.parametrize("still_out", [True, False], ids=["reset-output-outstanding", "reset-output-taken"])
def test_a_normal_preemption_drops_while_a_resets_output_is_outstanding(still_out: bool) -> None:
    # Four steps in flight. A reset preempts R with its chunk [0, 8) (step 7) in flight; R
    # resumes at once and computes the chunk [0, 6) again (step 8); then too few blocks preempt
    # it (Q still running). While step 7 is outstanding, vLLM keeps R in drop mode, so step 8's
    # output (not taken either) is dropped too; once step 7 is taken, the preemption is normal.
    t = BlockTracker(steps_in_flight=4)
    outstanding = {7, 8} if still_out else {8}
    t.update(so_of(new=[new_req("R", [1, 2]), new_req("Q", [3])], counts={"R": 8, "Q": 2}))
    t.saved(t._recent[-1][0], 7)
    back = dataclasses.replace(new_req("R", [4, 5]), prefill_token_ids=list(range(20)))
    t.update(so_of(preempted_req_ids={"R", "Q"}, new=[back], counts={"R": 6}), outstanding.__contains__)
    assert t.dropped_saves == ({"R": 1} if still_out else {})
    t.saved(t._recent[-1][0], 8)
    t.update(so_of(new=[new_req("Q", [3])], counts={"Q": 2}), outstanding.__contains__)
    t.update(so_of(preempted_req_ids={"R"}, cached=cached([("Q", None, 2)]), counts={"Q": 1}), outstanding.__contains__)
    entries = cached([("R", [6, 7], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(20))
    t.update(so_of(cached=entries, counts={"R": 8}))
    assert t.dropped_saves == ({"R": 1} if still_out else {})


@pytest.mark.parametrize("still_out", [True, False], ids=["stopped-turns-output-outstanding", "taken"])
def test_a_preemption_drops_while_a_session_turns_stale_output_is_outstanding(still_out: bool) -> None:
    # Four steps in flight. Session R's turn stops on the token its prompt step (5) sampled,
    # with its decode step 6 in flight; its next chunk comes as new (continued) and computes
    # [6, 12) of a 20-token prompt (step 7: samples nothing); then too few blocks preempt it (Q
    # still running). While step 6 is outstanding vLLM keeps R in drop mode, so step 7's output
    # (not taken either) is dropped and its rows come again with R's resume; once step 6 is
    # taken, the preemption is normal. (Found by a soak of sessions with pipelines.)
    t = BlockTracker(steps_in_flight=4)
    outstanding = {6, 7} if still_out else {7}
    t.update(so_of(new=[new_req("R", [1, 2]), new_req("Q", [3])], counts={"R": 5, "Q": 2}))
    t.saved(t._recent[-1][0], 5)
    t.update(so_of(cached=cached([("R", None, 5), ("Q", None, 2)]), counts={"R": 1, "Q": 1}))
    t.saved(t._recent[-1][0], 6)
    chunk = so_of(new=[new_req("R", [1, 2, 4], 6)], cached=cached([("Q", None, 3)]), counts={"R": 6, "Q": 1})
    undo = t.update(chunk, outstanding.__contains__)
    assert t.continued == {"R"} and t._stale_steps == ({"R": [6]} if still_out else {})
    undo()
    assert t._stale_steps == {} and t.continued == set()
    t.update(chunk, outstanding.__contains__)
    t.saved(t._recent[-1][0], 7)
    t.update(so_of(preempted_req_ids={"R"}, cached=cached([("Q", None, 4)]), counts={"Q": 1}), outstanding.__contains__)
    entries = cached([("R", [6, 7], 0)], resumed={"R"})
    entries.all_token_ids["R"] = list(range(20))
    t.update(so_of(cached=entries, counts={"R": 8}))
    assert t.dropped_saves == ({"R": 1} if still_out else {})


@pytest.mark.parametrize("steps", [0, -1, "2", 2.0, True])
def test_a_tracker_refuses_steps_in_flight_that_is_not_an_int_from_one(steps) -> None:
    with pytest.raises(InvalidInputError, match=r"steps_in_flight must be an int >= 1"):
        BlockTracker(steps)
    assert BlockTracker(np.int64(3)).dropped_saves == {}  # (a numpy int is an int)


@pytest.mark.parametrize("rank", ["0x", "0", -1, 0.0, None])
def test_build_cache_refuses_a_tensor_parallel_rank_that_is_not_an_int_from_zero(rank) -> None:
    config = CacheConfig(num_blocks=16, block_size=BLOCK_SIZE)
    with pytest.raises(InvalidInputError, match=r"tensor_parallel_rank must be an int >= 0"):
        build_cache(config, is_last_pipeline_stage=True, tensor_parallel_rank=rank)
