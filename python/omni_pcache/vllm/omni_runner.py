"""`VllmOmniPrefixCacheMixin`: omni_pcache behind vLLM-Omni's own prefix-cache hooks.

vLLM-Omni 0.30's autoregressive runner (``vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner``)
already calls a prefix cache at every place one is needed, through its
``PrefixCacheRunnerMixin``: ``_prefix_cache_step_begin(scheduler_output)`` at the start of
``execute_model``, ``_prefix_cache_save_step(hidden, mm, num_tokens_unpadded=...,
num_tokens_padded=...)`` after the forward, ``_prefix_cache_materialize(step_id, req_ids)`` in the
output builder (possibly a step late), and ``omni_prefix_cache.discard_step(step_id)`` /
``omni_prefix_cache.shutdown()`` on the object it keeps in ``omni_prefix_cache``. This mixin,
listed before the runner class, serves those same hooks with an omni_pcache `PrefixCache`
(through `PrefixCacheRunnerMixin`), so a vLLM-Omni stage changes its cache without a line of
its runner changed:

- the cache is gated at KV-cache init (``initialize_metadata_builders``, where vLLM-Omni stages
  its own config), on every rank: a configuration omni_pcache refuses raises `ConfigError` at
  start, not at the first request. A stage vLLM-Omni gives no cache (prefix caching off, a
  pooling stage) gets none here either;
- the model's cache policy (vLLM-Omni's ``ModelCachePolicy``, snapshotted at load) becomes a
  `CachePolicy`: hidden states cached unless the model opts out, its deferred keys deferred,
  the other per-token mm keys found as vLLM-Omni finds them, afresh each step
  (`CachePolicy.reclassify_each_step`: 2+ dims with a row per token; a new key only in a step
  where some request has more than one row, so a tensor with a row per request is never one).
  Set ``pcache_policy`` on the class to name them instead;
- ``omni_prefix_cache`` holds a `VllmOmniCacheHandle` on every tensor-parallel rank of the last
  pipeline stage, as vLLM-Omni's own cache does: each rank's model postprocess reads the merged
  rows into state its next forward uses, so the ranks must see the same rows. Earlier
  pipeline stages get ``None`` (``pcache_every_tensor_parallel_rank = False``: only the output
  rank, tensor-parallel rank 0, holds one);
- a model postprocess is not run for a request whose merged rows are empty in a step (a resumed
  request's chunk that recomputes only rows its consumer already has: each row is returned
  once), since vLLM-Omni runs every request's postprocess in one ``try``: one reading the last
  row of nothing would lose the whole batch's updates;
- ``_dummy_run`` fences the last save's copies first (`PrefixCacheRunnerMixin.pcache_fence`), and
  ``capture_model`` runs inside `PrefixCacheRunnerMixin.pcache_warmup` (a running cache flushed
  first, as at an elastic-EP rescale's capture).

`install_vllm_omni` makes vLLM-Omni's AR worker build its runner with this mixin; the vLLM plugin
`vllm_plugin` calls it in every vLLM process when ``OMNI_PCACHE_VLLM_OMNI=1``. Nothing here
imports vLLM or vLLM-Omni at module level.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from omni_pcache.config import HIDDEN, CachePolicy
from omni_pcache.errors import ConfigError, InvalidInputError
from omni_pcache.host_budget import budget_limit
from omni_pcache.host_memory import size_text
from omni_pcache.stats import CacheStats
from omni_pcache.vllm.mixin import PrefixCacheRunnerMixin

logger = logging.getLogger("vllm.omni_pcache")

# vLLM-Omni's name for the hidden states among a policy's keys (its `interface.HIDDEN_KEY`).
OMNI_HIDDEN_KEY = "__hidden_states__"
# The environment variable under which the vLLM plugin installs the mixin.
ENABLE_ENV = "OMNI_PCACHE_VLLM_OMNI"


def policy_from_omni(omni_policy: Any) -> CachePolicy:
    """The `CachePolicy` of a vLLM-Omni ``ModelCachePolicy`` (read by attribute; ``None``: its
    defaults): hidden states cached when ``needs_full_hidden_states``, ``deferred_keys``
    deferred (its hidden-states key named ``"hidden"``), and the other per-token keys found as
    vLLM-Omni finds them, afresh each step (`CachePolicy.reclassify_each_step`)."""
    cache_hidden = bool(getattr(omni_policy, "needs_full_hidden_states", True))
    deferred = frozenset(getattr(omni_policy, "deferred_keys", ()) or ())
    deferred = frozenset(HIDDEN if key == OMNI_HIDDEN_KEY else key for key in deferred)
    return CachePolicy(cache_hidden=cache_hidden, deferred_keys=deferred, reclassify_each_step=True)


def flat_mm(mm: Mapping[str, Any] | None) -> dict[str, Any]:
    """A step's mm outputs as vLLM-Omni's cache keys them: nested payloads flattened to dotted
    names (``{"codes": {"audio": t}}`` → ``{"codes.audio": t}``) by vLLM-Omni's own
    ``flatten_payload``, so materialize hands back the names its output builder reads. Without
    vLLM-Omni (a stand-in runner) the entries are taken as they are."""
    if not mm:
        return {}
    try:
        from vllm_omni.data_entry_keys import flatten_payload
    except ImportError:
        return dict(mm)
    return flatten_payload(mm)


class VllmOmniCacheHandle:
    """What a vLLM-Omni runner finds in ``omni_prefix_cache`` on the output rank: the two calls
    it makes on that object itself (``discard_step``, ``shutdown``), passed to the runner's
    `PrefixCacheRunnerMixin` hooks, and ``stats``."""

    __slots__ = ("_runner",)

    def __init__(self, runner: PrefixCacheRunnerMixin) -> None:
        self._runner = runner

    def discard_step(self, step_id: int) -> None:
        """Consumes a step id nobody materializes (any thread): `PrefixCacheRunnerMixin.pcache_discard`."""
        self._runner.pcache_discard(step_id)

    def shutdown(self) -> None:
        """Closes the cache (writes what is queued, stops its thread); idempotent."""
        self._runner.pcache_shutdown()

    def stats(self) -> CacheStats | None:
        """The cache's counters (`PrefixCache.stats`)."""
        return self._runner.pcache_stats()


class VllmOmniPrefixCacheMixin(PrefixCacheRunnerMixin):
    """vLLM-Omni's prefix-cache hooks served by omni_pcache (see the module doc). List it before
    the runner class: ``class Runner(VllmOmniPrefixCacheMixin, GPUARModelRunner)``.

    Class attributes a subclass may set: ``pcache_options`` (`CacheConfig` fields, e.g.
    ``{"host_budget_bytes": 64 << 30}``), ``pcache_policy`` (a `CachePolicy` used instead of the
    model's vLLM-Omni policy), ``pcache_log_stats_interval_s`` (`pcache_init`'s) and
    ``pcache_every_tensor_parallel_rank`` (``False``: only tensor-parallel rank 0 holds a cache,
    the others' outputs being dropped by vLLM; only for a model whose postprocess reads no
    merged rows, which every rank's next forward would otherwise see differently)."""

    pcache_options: Mapping[str, Any] = MappingProxyType({})
    pcache_policy: CachePolicy | None = None
    pcache_log_stats_interval_s: float | None = 10.0
    pcache_every_tensor_parallel_rank: bool = True
    # (vLLM-Omni's runner sets these two in its __init__; the defaults cover a runner that does not)
    omni_prefix_cache: VllmOmniCacheHandle | None = None
    _omni_prefix_cache_cfg: Any = None
    _pcache_scheduler_output: Any = None  # (the step's SchedulerOutput, from begin to save)
    _pcache_profiling: bool = False  # (inside vLLM's profiling KV-cache init)

    # ---- KV-cache init -------------------------------------------------------------------

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's KV-cache init; notes whether it is the profiling one (``is_profiling``: a
        minimal KV cache for CUDA-graph profiling, initialized again after), whose cache is
        gated as any other but not announced in the log."""
        self._pcache_profiling = bool(kwargs.get("is_profiling", args[1] if len(args) > 1 else False))
        try:
            return super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._pcache_profiling = False

    def initialize_metadata_builders(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's KV-cache init step where vLLM-Omni stages its cache config: the stage's cache
        is gated here (`_pcache_adopt`), on every rank, once the runner's own init is done."""
        result = super().initialize_metadata_builders(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        self._pcache_adopt(kv_cache_config)
        return result

    def _pcache_adopt(self, kv_cache_config: Any = None) -> None:
        """Takes the config vLLM-Omni staged for its own cache (``_omni_prefix_cache_cfg``, so
        vLLM-Omni's never builds) and gates omni_pcache's instead (`pcache_init`, raising
        `ConfigError` for a refused configuration). Nothing staged: the stage has no cache, or
        this KV-cache init was adopted already."""
        if self._omni_prefix_cache_cfg is None:
            return
        self._omni_prefix_cache_cfg = None
        self.omni_prefix_cache = None
        self._pcache_scheduler_output = None
        self.pcache_shutdown()  # (a KV cache initialized again: the running cache, if any, first)
        self._pcache_state = None
        omni_policy = getattr(self, "_omni_cache_policy", None)
        policy = self.pcache_policy if self.pcache_policy is not None else policy_from_omni(omni_policy)
        if not policy.cache_hidden and bool(getattr(omni_policy, "needs_full_hidden_states", True)):
            raise ConfigError(
                "pcache_policy caches no hidden states, but the model needs its full-sequence hidden states "
                "(vLLM-Omni's ModelCachePolicy.needs_full_hidden_states): its outputs would lose them"
            )
        self.pcache_load_policy(policy)
        is_last_stage, rank = self._pcache_parallel_ranks()
        # (the counters' line from rank 0 alone: one line per replica of the stage)
        log_interval_s = self.pcache_log_stats_interval_s if rank == 0 else None
        # (each rank of the last stage serves its own, identical, rows)
        tp_rank = 0 if self.pcache_every_tensor_parallel_rank else rank
        vllm_config = getattr(self, "vllm_config", None)
        has_cache = self.pcache_init(
            cache_config=self.cache_config,
            kv_cache_config=kv_cache_config if kv_cache_config is not None else self.kv_cache_config,
            kv_transfer_config=getattr(vllm_config, "kv_transfer_config", None),
            scheduler_config=self.scheduler_config,
            model_config=self.model_config,
            speculative_config=getattr(self, "speculative_config", None),
            parallel_config=getattr(self, "parallel_config", None) or getattr(vllm_config, "parallel_config", None),
            is_pooling=bool(getattr(self, "is_pooling_model", False)),
            is_last_pipeline_stage=is_last_stage,
            tensor_parallel_rank=tp_rank,
            log_stats_interval_s=log_interval_s,
            **dict(self.pcache_options),
        )
        state = self._pcache_state
        if has_cache and state is not None and state.output_rank:
            self.omni_prefix_cache = VllmOmniCacheHandle(self)
            if rank == 0 and not self._pcache_profiling:
                config, policy = state.config, state.policy or CachePolicy()
                budget, source = budget_limit(config)
                if policy.token_keys is not None:
                    keys = "named"
                else:
                    keys = "found each step" if policy.reclassify_each_step else "found once"
                logger.info(
                    "omni_pcache: this stage caches its outputs through omni_pcache (%d KV blocks of %d tokens, "
                    "host budget %s from %s, mm keys %s)",
                    config.num_blocks,
                    config.block_size,
                    "unknown" if budget is None else size_text(budget),
                    source,
                    keys,
                )

    def _pcache_parallel_ranks(self) -> tuple[bool, int]:
        """Whether this rank is the last pipeline stage, and its tensor-parallel rank (vLLM's
        parallel state, set up before the KV cache is)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_pp_group().is_last_rank, get_tp_group().rank_in_group

    def _ensure_omni_prefix_cache(self) -> None:
        """vLLM-Omni's one-shot build of its own cache: omni_pcache's is gated instead."""
        self._pcache_adopt()

    # ---- vLLM-Omni's per-step hooks ----------------------------------------------------------

    def _prefix_cache_step_begin(self, scheduler_output: Any) -> None:
        """Start of ``execute_model``, once per SchedulerOutput, before ``_update_states``
        (`pcache_begin_step`); a config staged but not yet gated is gated first."""
        self._pcache_adopt()
        self._pcache_scheduler_output = scheduler_output
        self.pcache_begin_step(scheduler_output)

    def _prefix_cache_save_step(
        self,
        hidden_states: Any,
        multimodal_outputs: dict | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> int | None:
        """After the forward: saves the step's rows, in ``input_batch.req_ids`` order (the
        forward's), with its mm outputs flattened as vLLM-Omni keys them (`flat_mm`), and
        returns the step id its output path consumes once; ``None`` on a rank or stage without
        a cache. Raises `InvalidInputError` when ``num_tokens_unpadded`` is not the step's
        scheduled token count."""
        if self.omni_prefix_cache is None or getattr(self, "is_pooling_model", False):
            return None
        so = self._pcache_scheduler_output
        if so is None:
            raise ConfigError("_prefix_cache_save_step before _prefix_cache_step_begin: every step must begin first")
        scheduled = int(getattr(so, "total_num_scheduled_tokens", num_tokens_unpadded))
        if int(num_tokens_unpadded) != scheduled:
            raise InvalidInputError(
                f"num_tokens_unpadded={num_tokens_unpadded} but the SchedulerOutput schedules {scheduled} tokens"
            )
        req_ids = list(self.input_batch.req_ids)  # (a copy: the runner's list changes next step)
        return self.pcache_save(hidden_states, flat_mm(multimodal_outputs), so, req_ids, num_tokens_padded)

    def _prefix_cache_materialize(
        self, step_id: int | None, req_ids: Sequence[str]
    ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
        """The output builder (any thread, possibly a step late): ``(hidden, mm)`` of a saved
        step, as vLLM-Omni's cache returns them: ``hidden[req_id]`` (cached prefix rows, then
        the step's; ``None`` when the model opts out of hidden states) and ``mm[key][req_id]``
        (``None`` when the step had no mm). ``(None, None)`` for no step id or no cache."""
        if step_id is None or self.omni_prefix_cache is None:
            return None, None
        outputs = self.pcache_materialize(step_id, list(req_ids))
        if outputs is None:
            return None, None
        return outputs.hidden, (outputs.mm or None)

    def _process_additional_information_updates(
        self,
        hidden_states: Any,
        multimodal_outputs: Any,
        num_scheduled_tokens_np: Any,
        scheduler_output: Any,
        combined_hidden_states: dict[str, Any] | None = None,
        combined_multimodal_outputs: dict[str, Any] | None = None,
        req_ids_filter: set[str] | None = None,
        req_ids: list[str] | None = None,
        query_start_loc_cpu: Any = None,
    ) -> None:
        """vLLM-Omni's per-request model postprocess over a step's outputs, leaving out the
        requests whose merged hidden rows are empty this step (see the module doc)."""
        if combined_hidden_states:
            empty = {req for req, rows in combined_hidden_states.items() if rows.shape[0] == 0}
            if empty:
                order = req_ids if req_ids is not None else self.input_batch.req_ids
                req_ids_filter = set(order if req_ids_filter is None else req_ids_filter) - empty
        return super()._process_additional_information_updates(  # type: ignore[misc]
            hidden_states,
            multimodal_outputs,
            num_scheduled_tokens_np,
            scheduler_output,
            combined_hidden_states,
            combined_multimodal_outputs,
            req_ids_filter=req_ids_filter,
            req_ids=req_ids,
            query_start_loc_cpu=query_start_loc_cpu,
        )

    def capture_model(self, *args: Any, **kwargs: Any) -> Any:
        """CUDA-graph capture (at start, and again at an elastic-EP rescale while serving) runs
        inside `pcache_warmup`, which flushes a running cache first: a device call of its
        committer during a capture in CUDA's global mode would invalidate the capture."""
        with self.pcache_warmup():
            return super().capture_model(*args, **kwargs)  # type: ignore[misc]

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        """A forward with no step begun (an idle data-parallel rank, a warm-up): the last save's
        device→host copies are fenced first (`pcache_fence`)."""
        self.pcache_fence()
        return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]


def install_vllm_omni(**cache_options: Any) -> type:
    """Makes vLLM-Omni's AR worker (``vllm_omni.worker.gpu_ar_worker.GPUARWorker``) build its
    runner with `VllmOmniPrefixCacheMixin` in front (``cache_options``: `CacheConfig` fields for
    every cache it builds) and returns that runner class. Call it in the worker process before
    the worker starts (the vLLM plugin `vllm_plugin` does); idempotent. Raises `ConfigError`
    when vLLM-Omni cannot be imported."""
    try:
        from vllm_omni.worker import gpu_ar_worker
    except ImportError as exc:
        raise ConfigError(f"vLLM-Omni's AR worker cannot be imported ({exc})") from exc
    worker = gpu_ar_worker.GPUARWorker
    base = worker.model_runner_cls
    if issubclass(base, VllmOmniPrefixCacheMixin):
        if cache_options:
            base.pcache_options = dict(cache_options)
        return base
    name = f"OmniPcache{base.__name__}"
    runner = type(
        name, (VllmOmniPrefixCacheMixin, base), {"pcache_options": dict(cache_options), "__module__": __name__}
    )
    globals()[name] = runner  # (found by its qualified name, as pickle looks a class up)
    worker.model_runner_cls = runner
    return runner


def vllm_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (loaded in every vLLM process): installs the
    mixin (`install_vllm_omni`) when ``OMNI_PCACHE_VLLM_OMNI=1``; otherwise does nothing. With the variable
    set, a process without vLLM-Omni logs a warning and keeps vLLM-Omni's runner."""
    value = os.environ.get(ENABLE_ENV, "").strip()
    if value in ("", "0"):
        return
    if value != "1":
        logger.warning("omni_pcache: %s=%r is not 0 or 1; vLLM-Omni's own prefix cache stays", ENABLE_ENV, value)
        return
    try:
        runner = install_vllm_omni()
    except Exception as exc:  # (a plugin that raises stops vLLM's start: this one only warns)
        logger.warning("omni_pcache: not installed in vLLM-Omni's AR worker (%s); its own prefix cache stays", exc)
        return
    logger.info("omni_pcache: vLLM-Omni's AR stages cache through omni_pcache (%s)", runner.__name__)
