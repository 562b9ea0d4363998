"""`VllmOmniPrefixCacheMixin`: omni_pcache behind vLLM-Omni's own prefix-cache hooks.

A stand-in of vLLM-Omni's ``GPUARModelRunner`` (its config attributes, ``input_batch``, the
staging of its cache config at ``initialize_metadata_builders``, ``_dummy_run``) with the mixin in
front, driven by stand-in SchedulerOutputs (tests/vllm_standins.py): where the cache is gated,
which rank gets one, the policy taken from the model's, the rows a hit returns, the step-id
contract through ``omni_prefix_cache.discard_step``, and `install_vllm_omni` / the vLLM plugin
against a stand-in of vLLM-Omni's worker module. tests/test_vllm_omni_scheduler.py runs the
hooks under vLLM's real scheduler; the last tests here check the hooks' signatures against
vLLM-Omni 0.30 itself where it is installed (`.venv-bench`), and are skipped elsewhere.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

import vllm_standins as v
from omni_pcache import CacheClosedError, CachePolicy, ConfigError, InvalidInputError, StepEvents, StepIdError
from omni_pcache.vllm import VllmOmniCacheHandle, VllmOmniPrefixCacheMixin, install_vllm_omni
from omni_pcache.vllm.omni_runner import ENABLE_ENV, flat_mm, policy_from_omni, vllm_plugin
from test_vllm_adapter import new_req, so_of
from vllm_replay import stage_configs, standin_types

ROOT = Path(__file__).resolve().parent.parent
BS = 4  # the stand-in stage's block size (vllm_replay's scenario)


class OmniRunnerBase:
    """vLLM-Omni's runner as the mixin sees it: configs as attributes, ``input_batch.req_ids``,
    the model's ``ModelCachePolicy`` snapshot, its cache config staged at KV-cache init
    (``None`` when vLLM-Omni gives the stage no cache), and a ``_dummy_run`` of its own."""

    def __init__(self, *, stage_cache: bool = True, ranks: tuple[bool, int] = (True, 0), **overrides) -> None:
        configs = stage_configs(standin_types()) | overrides
        self.cache_config = configs["cache_config"]
        self.scheduler_config = configs["scheduler_config"]
        self.model_config = configs["model_config"]
        self.speculative_config = configs["speculative_config"]
        self.parallel_config = configs["parallel_config"]
        self.vllm_config = SimpleNamespace(kv_transfer_config=configs["kv_transfer_config"])
        self.kv_cache_config = configs["kv_cache_config"]
        self.is_pooling_model = False
        self.input_batch = SimpleNamespace(req_ids=[])
        self._omni_cache_policy = SimpleNamespace(needs_full_hidden_states=True, deferred_keys=frozenset())
        self.omni_prefix_cache = None
        self._omni_prefix_cache_cfg = None
        self.stage_cache = stage_cache
        self.ranks = ranks
        self.dummy_runs = 0
        self.postprocessed: list[set[str] | None] = []

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False) -> None:
        """vLLM's: the KV cache, then its metadata builders."""
        self.initialize_metadata_builders(kv_cache_config, [BS])

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        if self.stage_cache:
            self._omni_prefix_cache_cfg = ("vLLM-Omni's PrefixCacheConfig", kv_cache_config.num_blocks)

    def _dummy_run(self, num_tokens: int) -> str:
        self.dummy_runs += 1
        return f"dummy run of {num_tokens}"

    def _process_additional_information_updates(
        self,
        hidden_states,
        multimodal_outputs,
        num_scheduled_tokens_np,
        scheduler_output,
        combined_hidden_states=None,
        combined_multimodal_outputs=None,
        req_ids_filter=None,
        req_ids=None,
        query_start_loc_cpu=None,
    ) -> None:
        """Records which requests' postprocess would run (``None``: every request's)."""
        self.postprocessed.append(req_ids_filter)

    def capture_model(self) -> int:
        """Records what the cache had left to write when the capture began."""
        self.unwritten_at_capture = self.omni_prefix_cache.stats().tasks_live
        return 7  # (vLLM's: the memory the graphs took)


class OmniRunner(VllmOmniPrefixCacheMixin, OmniRunnerBase):
    fences = 0

    def _pcache_parallel_ranks(self) -> tuple[bool, int]:
        return self.ranks

    def pcache_fence(self) -> None:
        self.fences += 1
        super().pcache_fence()

    def step(self, so, order: list[str], hidden: torch.Tensor, mm: dict | None = None) -> int | None:
        """``execute_model``'s calls into the cache: begin, the forward (rows in ``order``), save."""
        self._prefix_cache_step_begin(so)
        self.input_batch.req_ids = list(order)
        return self._prefix_cache_save_step(
            hidden, mm, num_tokens_unpadded=so.total_num_scheduled_tokens, num_tokens_padded=hidden.shape[0]
        )


def started(runner: OmniRunner) -> OmniRunner:
    runner.initialize_metadata_builders(runner.kv_cache_config, [BS])
    return runner


def slots_of(blocks: list[int], count: int) -> np.ndarray:
    return np.array([blocks[p // BS] * BS + p % BS for p in range(count)])


def test_the_cache_is_gated_at_kv_init_and_the_output_rank_gets_the_handle(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        runner = started(OmniRunner())
    # (one line per stage replica, at start, on vLLM's logger: the stage's cache is this one)
    assert "omni_pcache: this stage caches its outputs through omni_pcache (32 KV blocks of 4 tokens" in caplog.text
    assert "from this host's memory" in caplog.text and "mm keys found each step)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        started(OmniRunner(ranks=(True, 1)))  # (rank 1: no line)
        profiled = OmniRunner()
        profiled.initialize_kv_cache(profiled.kv_cache_config, is_profiling=True)  # (vLLM's minimal one: no line)
    assert caplog.text == ""
    assert isinstance(profiled.omni_prefix_cache, VllmOmniCacheHandle)  # (gated all the same)

    class Named(OmniRunner):
        pcache_policy = CachePolicy(token_keys=frozenset({"codes"}))
        pcache_options: ClassVar[dict[str, int]] = {"host_budget_bytes": 1 << 30}

    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        Named().initialize_kv_cache(runner.kv_cache_config)
    assert "host budget 1.0 GiB from CacheConfig.host_budget_bytes, mm keys named)" in caplog.text
    assert runner._omni_prefix_cache_cfg is None  # (taken: vLLM-Omni never builds its own)
    assert isinstance(runner.omni_prefix_cache, VllmOmniCacheHandle)
    config = runner._pcache_state.config
    assert (config.num_blocks, config.block_size) == (runner.kv_cache_config.num_blocks, BS)
    assert runner.pcache is None  # (built at the first step, as vLLM-Omni builds its own)
    runner._prefix_cache_step_begin(so_of())
    assert runner.pcache is not None
    runner.omni_prefix_cache.shutdown()


def test_a_hit_returns_the_cached_prefix_then_the_steps_rows() -> None:
    runner = started(OmniRunner())
    handle = runner.omni_prefix_cache
    hidden_a = torch.randn(6, 8)
    codes_a = torch.arange(12).reshape(6, 2)  # (per-token: 2 dims, a row per token)
    step = runner.step(so_of(new=[new_req("a", [3, 5])], counts={"a": 6}), ["a"], hidden_a, {"codes": codes_a})
    hidden, mm = runner._prefix_cache_materialize(step, ["a"])
    assert torch.equal(hidden["a"], hidden_a) and torch.equal(mm["codes"]["a"], codes_a)
    # "b" hits a's first block (4 tokens) and computes 3; "c" misses, with padding rows after.
    so = so_of(new=[new_req("b", [3, 7], computed=4), new_req("c", [9])], counts={"b": 3, "c": 2}, finished={"a"})
    hidden_bc = torch.randn(7, 8)  # (5 scheduled rows, 2 of CUDA-graph padding)
    codes_bc = torch.arange(100, 114).reshape(7, 2)
    ids_bc = torch.arange(7)  # (1-D: vLLM-Omni's cache never caches it, nor does this one here)
    mm_bc = {"codes": codes_bc, "ids": ids_bc, "scale": torch.tensor(0.5)}
    step = runner.step(so, ["c", "b"], hidden_bc, mm_bc)
    hidden, mm = runner._prefix_cache_materialize(step, ["c", "b"])
    assert torch.equal(hidden["c"], hidden_bc[:2])
    assert torch.equal(hidden["b"], torch.cat([hidden_a[:4], hidden_bc[2:5]]))
    assert torch.equal(mm["codes"]["b"], torch.cat([codes_a[:4], codes_bc[2:5]]))
    assert mm["ids"]["b"].tolist() == [2, 3, 4]  # (a leftover with a row per token: the step's, sliced)
    assert mm["scale"]["b"].item() == 0.5  # (a leftover, passed to each request whole)
    stats = handle.stats()
    assert (stats.hits, stats.misses, stats.reads_pending) == (1, 2, 0)
    assert stats.pool_bytes.keys() == {"hidden", "codes"}
    handle.shutdown()
    with pytest.raises(CacheClosedError):  # (shut down: a step id left is refused, typed)
        runner._prefix_cache_materialize(runner.step(so_of(), [], torch.zeros(0, 8)), [])
    handle.shutdown()  # (idempotent, as vLLM-Omni's shutdown may run twice)


def test_an_entry_with_a_row_per_request_is_per_token_only_where_it_looks_it_and_never_an_error() -> None:
    # (vLLM-Omni's rule, each step: a [requests, d] tensor in a step of one-token requests has a
    # row per token; in the next step, of 5 tokens, it is a leftover passed whole)
    runner = started(OmniRunner())
    so = so_of(new=[new_req("a", [3]), new_req("b", [4])], counts={"a": 1, "b": 1})
    spk = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    step = runner.step(so, ["a", "b"], torch.randn(2, 4), {"spk": spk})
    assert runner._prefix_cache_materialize(step, ["a", "b"])[1]["spk"]["b"].tolist() == [[2.0, 2.0]]
    so = so_of(new=[new_req("c", [5, 6])], counts={"c": 5})
    step = runner.step(so, ["c"], torch.randn(5, 4), {"spk": spk})
    assert torch.equal(runner._prefix_cache_materialize(step, ["c"])[1]["spk"]["c"], spk)
    runner.omni_prefix_cache.shutdown()


def test_a_hit_in_a_step_of_one_token_requests_is_served_beside_a_row_per_request_entry() -> None:
    # (the first review's case: "spk", a row per request, looks per-token in b's step of one
    # token; found as a key there, b's hit would read it over a's prompt, which has no rows of it)
    runner = started(OmniRunner())
    hidden_a = torch.randn(5, 4)
    spk = torch.ones(1, 2)
    step = runner.step(so_of(new=[new_req("a", [3, 5])], counts={"a": 5}), ["a"], hidden_a, {"spk": spk})
    runner.omni_prefix_cache.discard_step(step)
    hidden_b = torch.randn(1, 4)
    so = so_of(new=[new_req("b", [3, 7], computed=4)], counts={"b": 1})
    step = runner.step(so, ["b"], hidden_b, {"spk": spk})
    hidden, mm = runner._prefix_cache_materialize(step, ["b"])
    assert torch.equal(hidden["b"], torch.cat([hidden_a[:4], hidden_b])) and torch.equal(mm["spk"]["b"], spk)
    assert runner.omni_prefix_cache.stats().pool_bytes.keys() == {"hidden"}
    runner.omni_prefix_cache.shutdown()


def test_a_request_with_no_new_rows_gets_no_postprocess_and_the_others_do() -> None:
    # vLLM-Omni's runner postprocesses every request of a step in one try: a request whose
    # merged rows are empty (a resumed chunk recomputing rows already delivered) is left out.
    runner = started(OmniRunner())
    merged = {"a": torch.zeros(0, 4), "b": torch.ones(2, 4), "c": torch.ones(1, 4)}
    runner._process_additional_information_updates(None, None, None, None, merged, None, req_ids=["a", "b", "c"])
    assert runner.postprocessed == [{"b", "c"}]
    runner._process_additional_information_updates(None, None, None, None, merged, None, req_ids_filter={"a", "b"})
    assert runner.postprocessed[-1] == {"b"}
    runner.input_batch.req_ids = ["a", "c"]  # (no req_ids: the batch's)
    runner._process_additional_information_updates(None, None, None, None, merged, None)
    assert runner.postprocessed[-1] == {"c"}
    runner._process_additional_information_updates(None, None, None, None, {"b": torch.ones(1, 4)}, None)
    assert runner.postprocessed[-1] is None  # (nothing empty: the filter as given)


def test_discard_step_consumes_the_id_exactly_once() -> None:
    runner = started(OmniRunner())
    step = runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4))
    runner.omni_prefix_cache.discard_step(step)
    with pytest.raises(StepIdError, match=f"step#{step}"):
        runner.omni_prefix_cache.discard_step(step)
    with pytest.raises(StepIdError):
        runner._prefix_cache_materialize(step, ["a"])
    runner.omni_prefix_cache.shutdown()


def test_a_step_without_mm_materializes_mm_as_none() -> None:
    runner = started(OmniRunner())
    step = runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4), None)
    hidden, mm = runner._prefix_cache_materialize(step, ["a"])
    assert hidden["a"].shape == (2, 4) and mm is None
    assert runner._prefix_cache_materialize(None, ["a"]) == (None, None)
    runner.omni_prefix_cache.shutdown()


def test_a_save_whose_token_count_is_not_the_steps_is_refused_and_the_id_not_issued() -> None:
    runner = started(OmniRunner())
    so = so_of(new=[new_req("a", [3])], counts={"a": 2})
    runner._prefix_cache_step_begin(so)
    runner.input_batch.req_ids = ["a"]
    with pytest.raises(InvalidInputError, match=r"num_tokens_unpadded=3 but the SchedulerOutput schedules 2 tokens"):
        runner._prefix_cache_save_step(torch.randn(3, 4), None, num_tokens_unpadded=3, num_tokens_padded=3)
    assert runner.omni_prefix_cache.stats().steps_outstanding == []
    step = runner._prefix_cache_save_step(torch.randn(3, 4), None, num_tokens_unpadded=2, num_tokens_padded=3)
    assert runner._prefix_cache_materialize(step, ["a"])[0]["a"].shape == (2, 4)  # (the corrected save is served)
    runner.omni_prefix_cache.shutdown()


def test_every_tensor_parallel_rank_of_the_last_stage_serves_the_same_rows() -> None:
    so = so_of(new=[new_req("a", [3])], counts={"a": 2})
    hidden = torch.randn(2, 4)
    for runner in (started(OmniRunner(ranks=(True, 0))), started(OmniRunner(ranks=(True, 1)))):
        assert isinstance(runner.omni_prefix_cache, VllmOmniCacheHandle)
        # (the counters' line is logged by rank 0 alone: one line per stage)
        assert runner._pcache_state.log_interval_s == (10.0 if runner.ranks[1] == 0 else None)
        step = runner.step(so, ["a"], hidden)
        assert torch.equal(runner._prefix_cache_materialize(step, ["a"])[0]["a"], hidden)
        runner.omni_prefix_cache.shutdown()


@pytest.mark.parametrize(
    ("ranks", "every_rank"),
    [((False, 0), True), ((True, 1), False)],
    ids=["earlier-pipeline-stage", "tensor-parallel-rank-1-output-rank-only"],
)
def test_ranks_without_a_cache_get_no_handle_and_save_nothing(ranks: tuple[bool, int], every_rank: bool) -> None:
    class Runner(OmniRunner):
        pcache_every_tensor_parallel_rank = every_rank

    runner = started(Runner(ranks=ranks))
    assert runner.omni_prefix_cache is None  # (vLLM-Omni's runner then builds payloads of the step's rows)
    assert runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4)) is None
    assert runner._prefix_cache_materialize(None, ["a"]) == (None, None)


def test_a_stage_vllm_omni_gives_no_cache_gets_none_and_a_pooling_stage_saves_nothing() -> None:
    runner = started(OmniRunner(stage_cache=False))
    assert runner.omni_prefix_cache is None and runner._pcache_state is None
    assert runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4)) is None
    pooling = started(OmniRunner())
    pooling.is_pooling_model = True  # (vLLM-Omni stages no config for one; its save hook returns None too)
    assert pooling.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4)) is None
    pooling.omni_prefix_cache.shutdown()


def test_a_refused_configuration_raises_at_kv_init() -> None:
    runner = OmniRunner(speculative_config=v.SpeculativeConfig())
    with pytest.raises(ConfigError, match="speculative_config"):
        started(runner)


def test_a_config_staged_but_not_gated_is_gated_at_the_first_step() -> None:
    # (a runner that stages it elsewhere than initialize_metadata_builders: vLLM-Omni's NPU one)
    runner = OmniRunner()
    runner._omni_prefix_cache_cfg = "staged"
    step = runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4))
    assert isinstance(runner.omni_prefix_cache, VllmOmniCacheHandle) and step is not None
    runner._ensure_omni_prefix_cache()  # (nothing staged any more: the running cache stays)
    assert runner._prefix_cache_materialize(step, ["a"])[0]["a"].shape == (2, 4)
    runner.omni_prefix_cache.shutdown()


def test_the_models_policy_becomes_the_caches() -> None:
    opted_out = SimpleNamespace(needs_full_hidden_states=False, deferred_keys=frozenset({"codes"}))
    expected = CachePolicy(cache_hidden=False, deferred_keys=frozenset({"codes"}), reclassify_each_step=True)
    assert policy_from_omni(opted_out) == expected
    deferred_hidden = SimpleNamespace(needs_full_hidden_states=True, deferred_keys=frozenset({"__hidden_states__"}))
    assert policy_from_omni(deferred_hidden).deferred_keys == frozenset({"hidden"})
    assert policy_from_omni(None) == CachePolicy(reclassify_each_step=True)
    runner = OmniRunner()
    runner._omni_cache_policy = opted_out
    started(runner)
    step = runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4))
    hidden, _ = runner._prefix_cache_materialize(step, ["a"])
    assert hidden is None  # (the model opted out of hidden states: vLLM-Omni's runner uses the step's rows)
    runner.omni_prefix_cache.shutdown()


def test_a_policy_set_on_the_class_wins_over_the_models() -> None:
    class Named(OmniRunner):
        pcache_policy = CachePolicy(token_keys=frozenset({"codes"}))

    runner = started(Named())
    assert runner._pcache_state.policy == CachePolicy(token_keys=frozenset({"codes"}))
    runner.omni_prefix_cache.shutdown()


def test_a_class_policy_without_hidden_states_for_a_model_that_needs_them_is_refused_at_kv_init() -> None:
    class NoHidden(OmniRunner):
        pcache_policy = CachePolicy(cache_hidden=False)

    with pytest.raises(ConfigError, match="caches no hidden states, but the model needs its full-sequence"):
        started(NoHidden())
    runner = NoHidden()
    runner._omni_cache_policy = SimpleNamespace(needs_full_hidden_states=False, deferred_keys=frozenset())
    assert isinstance(started(runner).omni_prefix_cache, VllmOmniCacheHandle)  # (the model opts out too)


def test_a_kv_cache_initialized_again_replaces_the_running_cache() -> None:
    runner = started(OmniRunner())
    step = runner.step(so_of(new=[new_req("a", [3])], counts={"a": 2}), ["a"], torch.randn(2, 4))
    old = runner.pcache
    started(runner)  # (vLLM-Omni stages its config again)
    assert runner.pcache is None  # (the new cache is built at the next step)
    with pytest.raises(CacheClosedError):  # (the old one is closed)
        old.begin_step(StepEvents())
    with pytest.raises(StepIdError):  # (an id of the old cache is refused, never served another step's rows)
        runner._prefix_cache_materialize(step, ["a"])
    step = runner.step(so_of(new=[new_req("b", [4])], counts={"b": 1}), ["b"], torch.randn(1, 4))
    assert runner._prefix_cache_materialize(step, ["b"])[0]["b"].shape == (1, 4)
    runner.omni_prefix_cache.shutdown()


def test_cache_options_on_the_class_reach_the_cache_config() -> None:
    class Small(OmniRunner):
        pcache_options: ClassVar[dict[str, int]] = {"staging_depth": 3}

    runner = started(Small())
    assert runner._pcache_state.config.staging_depth == 3


def test_a_dummy_run_fences_the_last_saves_copies_first() -> None:
    runner = started(OmniRunner())
    assert runner._dummy_run(8) == "dummy run of 8"
    assert (runner.fences, runner.dummy_runs) == (1, 1)


def test_a_capture_begins_once_the_caches_queued_writes_have_landed() -> None:
    # (the committer's write is held back until 0.3 s after the capture is called, as
    # tests/test_vllm_adapter.py holds it for pcache_warmup)
    class CommitterWrites(OmniRunner):
        pcache_options: ClassVar[dict[str, int]] = {"inline_write_bytes": 0}

    runner = started(CommitterWrites())
    gate = threading.Event()
    try:
        runner._prefix_cache_step_begin(so_of())  # (the cache is built)
        write = runner.pcache._writer.write_batch
        runner.pcache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        step = runner.step(so_of(new=[new_req("a", [3, 5])], counts={"a": 6}), ["a"], torch.randn(6, 4))
        assert runner.omni_prefix_cache.stats().tasks_live > 0
        threading.Timer(0.3, gate.set).start()
        assert runner.capture_model() == 7
        assert runner.unwritten_at_capture == 0, "a write still queued when the capture began"
        assert runner._pcache_warmups == 0
        runner.omni_prefix_cache.discard_step(step)
    finally:
        gate.set()
        runner.omni_prefix_cache.shutdown()


def test_a_save_keys_nested_mm_as_vllm_omnis_flattening_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ModuleType("vllm_omni.data_entry_keys")  # (a stand-in: "parent.child" per nested entry)
    keys.flatten_payload = lambda mm: {f"{k}.{q}": t for k, d in mm.items() for q, t in d.items()}
    monkeypatch.setitem(sys.modules, "vllm_omni", ModuleType("vllm_omni"))
    monkeypatch.setitem(sys.modules, "vllm_omni.data_entry_keys", keys)
    runner = started(OmniRunner())
    audio = torch.arange(6).reshape(3, 2)
    step = runner.step(
        so_of(new=[new_req("a", [3])], counts={"a": 3}), ["a"], torch.randn(3, 4), {"codes": {"audio": audio}}
    )
    _, mm = runner._prefix_cache_materialize(step, ["a"])
    assert mm.keys() == {"codes.audio"} and torch.equal(mm["codes.audio"]["a"], audio)
    assert runner.omni_prefix_cache.stats().pool_bytes.keys() == {"hidden", "codes.audio"}
    runner.omni_prefix_cache.shutdown()


def test_flat_mm_uses_vllm_omnis_flattening_when_it_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    audio = torch.arange(3)
    assert flat_mm({"codes": {"audio": audio}})["codes"]["audio"] is audio  # (no vLLM-Omni here)
    assert flat_mm(None) == {}
    keys = ModuleType("vllm_omni.data_entry_keys")
    keys.flatten_payload = lambda mm: {f"{k}.{q}": t for k, d in mm.items() for q, t in d.items()}
    monkeypatch.setitem(sys.modules, "vllm_omni", ModuleType("vllm_omni"))
    monkeypatch.setitem(sys.modules, "vllm_omni.data_entry_keys", keys)
    assert flat_mm({"codes": {"audio": audio}}) == {"codes.audio": audio}


# ---- install_vllm_omni and the vLLM plugin -------------------------------------------------------


class StandinARRunner:
    """vLLM-Omni's GPUARModelRunner, as far as installing goes."""


@pytest.fixture
def omni_worker(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in ``vllm_omni.worker.gpu_ar_worker`` whose ``GPUARWorker.model_runner_cls`` is
    `StandinARRunner`, as vLLM-Omni 0.30's is its ``GPUARModelRunner``."""

    class GPUARWorker:
        model_runner_cls = StandinARRunner

    module = ModuleType("vllm_omni.worker.gpu_ar_worker")
    module.GPUARWorker = GPUARWorker
    package = ModuleType("vllm_omni.worker")
    package.gpu_ar_worker = module
    monkeypatch.setitem(sys.modules, "vllm_omni", ModuleType("vllm_omni"))
    monkeypatch.setitem(sys.modules, "vllm_omni.worker", package)
    monkeypatch.setitem(sys.modules, "vllm_omni.worker.gpu_ar_worker", module)
    return GPUARWorker


def test_install_puts_the_mixin_in_front_of_the_workers_runner_once(omni_worker: type) -> None:
    runner = install_vllm_omni(host_budget_bytes=1 << 30)
    assert omni_worker.model_runner_cls is runner
    assert runner.__mro__[1:3] == (VllmOmniPrefixCacheMixin, *VllmOmniPrefixCacheMixin.__bases__)
    assert issubclass(runner, StandinARRunner) and runner.__name__ == "OmniPcacheStandinARRunner"
    assert runner.pcache_options == {"host_budget_bytes": 1 << 30}
    assert install_vllm_omni() is runner and omni_worker.model_runner_cls is runner  # (not wrapped twice)
    assert install_vllm_omni(staging_depth=2).pcache_options == {"staging_depth": 2}


def test_install_without_vllm_omni_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # (an import of it raises ImportError)
    with pytest.raises(ConfigError, match="vLLM-Omni's AR worker cannot be imported"):
        install_vllm_omni()


def test_the_plugin_installs_only_when_asked(
    omni_worker: type, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for value in (None, "", "0"):
        if value is None:
            monkeypatch.delenv(ENABLE_ENV, raising=False)
        else:
            monkeypatch.setenv(ENABLE_ENV, value)
        with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
            vllm_plugin()
        assert omni_worker.model_runner_cls is StandinARRunner
        assert caplog.text == ""  # (off is silent: vLLM loads the plugin in every process)
    monkeypatch.setenv(ENABLE_ENV, "yes")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_pcache"):
        vllm_plugin()
    assert omni_worker.model_runner_cls is StandinARRunner
    assert "OMNI_PCACHE_VLLM_OMNI='yes' is not 0 or 1" in caplog.text
    monkeypatch.setenv(ENABLE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        vllm_plugin()
    assert issubclass(omni_worker.model_runner_cls, VllmOmniPrefixCacheMixin)
    assert "vLLM-Omni's AR stages cache through omni_pcache (OmniPcacheStandinARRunner)" in caplog.text


def test_the_plugin_only_warns_where_vllm_omni_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm_omni", None)
    monkeypatch.setenv(ENABLE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_pcache"):
        vllm_plugin()  # (raises nothing: a plugin that raises stops vLLM's start)
    assert "not installed in vLLM-Omni's AR worker" in caplog.text and "its own prefix cache stays" in caplog.text


def test_the_plugin_is_declared_as_a_vllm_general_plugin() -> None:
    # (pyproject.toml, read as text: tomllib is not in Python 3.10)
    section = (ROOT / "pyproject.toml").read_text().split('[project.entry-points."vllm.general_plugins"]\n')[1]
    target = "omni_pcache.vllm.omni_runner:vllm_plugin"
    assert section.splitlines()[0] == f'omni_pcache_vllm_omni = "{target}"'
    from importlib.metadata import entry_points

    installed = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert installed.get("omni_pcache_vllm_omni") == target  # (the installed package declares it too)


# ---- against vLLM-Omni 0.30 itself (its `.venv-bench`; skipped where it is not installed) ---------


@pytest.fixture
def vllm_omni() -> Path:
    """vLLM-Omni's package directory, read as source (importing its runner needs vLLM and its
    other dependencies, which `.venv-bench` installs none of). Skipped where it is not installed."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM-Omni is not installed (scripts/setup-bench.sh installs it into .venv-bench)")
    return Path(spec.origin).parent


def class_functions(path: Path, class_name: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def parameters(function: ast.FunctionDef) -> list[tuple[str, str]]:
    """A function's parameters as (name, kind), as `inspect` names the kinds."""
    a = function.args
    out = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
    out += [(a.vararg.arg, "VAR_POSITIONAL")] if a.vararg else []
    out += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
    return out + ([(a.kwarg.arg, "VAR_KEYWORD")] if a.kwarg else [])


def test_the_hooks_take_the_arguments_vllm_omnis_runner_passes(vllm_omni: Path) -> None:
    theirs = class_functions(vllm_omni / "core" / "prefix_cache" / "runner_mixin.py", "PrefixCacheRunnerMixin")
    for name in (
        "_prefix_cache_step_begin",
        "_prefix_cache_save_step",
        "_prefix_cache_materialize",
        "_ensure_omni_prefix_cache",
    ):
        ours = inspect.signature(getattr(VllmOmniPrefixCacheMixin, name)).parameters.values()
        assert [(p.name, p.kind.name) for p in ours] == parameters(theirs[name]), name
    runner = class_functions(vllm_omni / "worker" / "gpu_model_runner.py", "OmniGPUModelRunner")
    ours = inspect.signature(VllmOmniPrefixCacheMixin._process_additional_information_updates).parameters.values()
    assert [(p.name, p.kind.name) for p in ours] == parameters(runner["_process_additional_information_updates"])
    interface = (vllm_omni / "core" / "prefix_cache" / "interface.py").read_text()
    assert 'HIDDEN_KEY: TensorName = "__hidden_states__"' in interface  # (`policy_from_omni` names it "hidden")
    tree = ast.parse(interface)  # (StageCacheOutputs: the (hidden, mm) pair materialize returns, in that order)
    (outputs,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StageCacheOutputs"]
    assert [n.target.id for n in outputs.body if isinstance(n, ast.AnnAssign)] == ["hidden_states", "mm_outputs"]
    keys = ast.parse((vllm_omni / "data_entry_keys.py").read_text())
    (flatten,) = [n for n in keys.body if isinstance(n, ast.FunctionDef) and n.name == "flatten_payload"]
    assert parameters(flatten) == [("payload", "POSITIONAL_OR_KEYWORD")]  # (what `flat_mm` calls)


def test_vllm_omnis_worker_and_runner_have_what_install_and_the_mixin_use(vllm_omni: Path) -> None:
    worker = ast.parse((vllm_omni / "worker" / "gpu_ar_worker.py").read_text())
    (cls,) = [n for n in worker.body if isinstance(n, ast.ClassDef) and n.name == "GPUARWorker"]
    assigned = {t.id: a.value for a in cls.body if isinstance(a, ast.Assign) for t in a.targets}
    assert isinstance(assigned.get("model_runner_cls"), ast.Name)
    assert assigned["model_runner_cls"].id == "GPUARModelRunner"
    runner = (vllm_omni / "worker" / "gpu_model_runner.py").read_text()
    assert "def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes)" in runner
    assert "self._omni_prefix_cache_cfg = cfg" in runner
    ar_runner = (vllm_omni / "worker" / "gpu_ar_model_runner.py").read_text()
    # Every call it makes on the cache object itself (``self.omni_prefix_cache.<name>(``, and
    # ``cache.shutdown()`` at its shutdown): the handle has each.
    calls = {
        line.split("omni_prefix_cache.")[1].split("(")[0]
        for line in ar_runner.splitlines()
        if "omni_prefix_cache." in line
    }
    assert (
        calls == {"discard_step"} and "cache = self.omni_prefix_cache" in ar_runner and "cache.shutdown()" in ar_runner
    )
    assert all(hasattr(VllmOmniCacheHandle, name) for name in (*calls, "shutdown"))
