"""`PrefixCacheRunnerMixin`: the hooks a vLLM GPU model runner calls, in the order it calls them.

A runner class lists the mixin as a base and calls (see the README, "Using it in a vLLM runner"):

1. ``pcache_init(...)`` at KV-cache init, on every rank: runs the gate
   (`cache_config_from_vllm`; raises `ConfigError` for refused configurations) and remembers
   whether this rank produces outputs. Returns whether the stage has a cache.
2. ``pcache_load_policy(policy)`` at model load: the model's `CachePolicy` (what it caches).
   Allowed until the first step; the cache is built lazily at the first ``pcache_begin_step``.
3. ``pcache_begin_step(scheduler_output)`` at the start of ``execute_model``, for every
   SchedulerOutput (zero-token steps included), before ``_update_states`` drops finished
   requests and before any KV transfer: updates the block tracker and calls ``begin_step``.
4. ``pcache_save(hidden, mm, scheduler_output, req_ids, num_tokens_padded)`` after the forward
   (only steps that ran one) → a step id to carry with the step's state.
   ``pcache_fence()`` before every forward that has no ``pcache_begin_step`` (dummy runs), and
   ``with pcache_warmup():`` around the worker's ``compile_or_warm_up_model``, whose warm-ups
   call ``execute_model`` on hand-built SchedulerOutputs (the V2 runner's, some models' on V1)
   and which captures the CUDA graphs again at an elastic-EP rescale.
5. ``pcache_materialize(step_id, req_ids)`` in the output builder (any thread, possibly a step
   late) → `StepOutputs`, or ``pcache_discard(step_id)`` when nothing downstream needs them.
   Each step id must be consumed exactly once, before its output can reach the scheduler
   (a step not yet consumed at a reset is read as an output the scheduler has not had).
6. ``pcache_shutdown()`` before CUDA teardown (idempotent).

On a stage without a cache (prefix caching off, pooling) every hook is a no-op, ``pcache_save``
returns ``None`` and ``pcache_materialize(None, ...)`` returns ``None`` (as inside
``pcache_warmup``). On ranks that produce no outputs the hooks run a `NoOpCache` and skip the
block tracking. The mixin defines no ``__init__``: its state lives in ``_pcache_state``, set by
``pcache_init``, and ``_pcache_warmups``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_pcache.cache import PrefixCache
from omni_pcache.config import CacheConfig, CachePolicy
from omni_pcache.errors import ConfigError, StepIdError, WriteFailedError
from omni_pcache.events import StepOutputs
from omni_pcache.host_budget import budget_limit
from omni_pcache.host_memory import size_text
from omni_pcache.stats import CacheStats
from omni_pcache.stats_log import StatsLog, check_interval
from omni_pcache.vllm.gate import cache_config_from_vllm, hidden_pool_bytes, steps_in_flight
from omni_pcache.vllm.ranks import NoOpCache, is_output_rank
from omni_pcache.vllm.tracker import BlockTracker
from omni_pcache.vllm.translate import step_batch, step_events

logger = logging.getLogger("omni_pcache")
# (vLLM sets up its own "vllm" logger, INFO by default, and no other: a child of it shows the
# counters' line wherever vLLM's own lines show, at vLLM's level)
stats_logger = logging.getLogger("vllm.omni_pcache")


@dataclass
class PcacheState:
    """What the mixin keeps between hooks: the gated config, whether this rank produces outputs,
    the model's policy, the cache once built, the block tracker and the stats log."""

    config: CacheConfig
    output_rank: bool
    policy: CachePolicy | None = None
    cache: PrefixCache | NoOpCache | None = None
    tracker: BlockTracker = field(default_factory=BlockTracker)
    log_interval_s: float | None = None  # (a `StatsLog` line every so often; None: none)
    stats_log: StatsLog | None = None  # (made with the cache, on the output rank)


def _warn_if_hidden_past_budget(config: CacheConfig, model_config: Any) -> None:
    """Warns at KV-cache init, before any request, when the hidden states' pool alone would
    pass the host budget (`hidden_pool_bytes`): the first save will then raise `ConfigError`.
    A warning, not a refusal: a runner may save hidden states of another width."""
    pool = hidden_pool_bytes(config, model_config)
    budget, _ = budget_limit(config)
    if pool is not None and budget is not None and pool > budget:
        logger.warning(
            "omni_pcache: the hidden states' host pool alone would take %s (%d KV slots x hidden size %d, %s), "
            "past the host budget of %s: the first save will raise ConfigError; cap vLLM's blocks "
            "(num_gpu_blocks_override) or set host_budget_bytes",
            size_text(pool),
            config.num_slots,
            model_config.get_hidden_size(),
            str(model_config.dtype).removeprefix("torch."),
            size_text(budget),
        )


class PrefixCacheRunnerMixin:
    """Hooks that plug an omni_pcache `PrefixCache` into a vLLM model runner (see the module doc)."""

    _pcache_state: PcacheState | None = None
    _pcache_policy: CachePolicy | None = None
    _pcache_warmups: int = 0  # (how many `pcache_warmup` contexts are open)

    # ---- KV-cache init and model load ----------------------------------------------------

    def pcache_init(
        self,
        *,
        cache_config: Any,
        kv_cache_config: Any,
        kv_transfer_config: Any,
        scheduler_config: Any,
        model_config: Any,
        speculative_config: Any,
        parallel_config: Any,
        is_pooling: bool,
        is_last_pipeline_stage: bool,
        tensor_parallel_rank: int,
        kernel_block_sizes: Sequence[int] | None = None,
        log_stats_interval_s: float | None = 10.0,
        **cache_options: Any,
    ) -> bool:
        """Gates the configuration at KV-cache init (every rank). Returns whether this stage
        has a cache; raises `ConfigError` for a refused configuration. A second call (KV cache
        re-initialized) closes the previous cache first. ``kernel_block_sizes`` is accepted
        for runners written for earlier versions and not needed (`cache_config_from_vllm`).
        The output rank logs the cache's counters (`CacheStats.summary`) at INFO on the
        ``vllm.omni_pcache`` logger (so vLLM's handler and level show it) every
        ``log_stats_interval_s`` seconds while steps run (10, as vLLM logs its own; ``None``:
        never, 0: every step); ``cache_options`` are `CacheConfig` fields."""
        log_interval_s = check_interval(log_stats_interval_s, "log_stats_interval_s")
        self.pcache_shutdown()
        config = cache_config_from_vllm(
            cache_config=cache_config,
            kv_cache_config=kv_cache_config,
            kv_transfer_config=kv_transfer_config,
            scheduler_config=scheduler_config,
            model_config=model_config,
            speculative_config=speculative_config,
            parallel_config=parallel_config,
            is_pooling=is_pooling,
            kernel_block_sizes=kernel_block_sizes,
            **cache_options,
        )
        if config is None:
            self._pcache_state = None
            return False
        output = is_output_rank(
            is_last_pipeline_stage=is_last_pipeline_stage, tensor_parallel_rank=tensor_parallel_rank
        )
        tracker = BlockTracker(steps_in_flight(scheduler_config, parallel_config))
        self._pcache_state = PcacheState(
            config, output, self._pcache_policy, tracker=tracker, log_interval_s=log_interval_s
        )
        if output and (self._pcache_policy or CachePolicy()).cache_hidden:
            _warn_if_hidden_past_budget(config, model_config)
        return True

    def pcache_load_policy(self, policy: CachePolicy | None) -> None:
        """Snapshots the model's `CachePolicy` (``None``: the default) at model load."""
        if policy is not None and not isinstance(policy, CachePolicy):
            raise ConfigError(f"pcache_load_policy takes a CachePolicy, got {type(policy).__name__}")
        state = self._pcache_state
        if state is not None and state.cache is not None:
            raise ConfigError("the cache policy is fixed once the first step has run; load it at model load")
        self._pcache_policy = policy
        if state is not None:
            state.policy = policy

    # ---- per step ------------------------------------------------------------------------

    @property
    def pcache(self) -> PrefixCache | NoOpCache | None:
        """The cache (a `NoOpCache` off the output rank); ``None`` before the first step or
        when the stage has no cache."""
        state = self._pcache_state
        return None if state is None else state.cache

    @contextlib.contextmanager
    def pcache_warmup(self) -> Iterator[None]:
        """Keeps the cache out of forwards run on hand-built SchedulerOutputs whose outputs nobody
        consumes: the warm-ups in ``Worker.compile_or_warm_up_model`` (at start and again at an
        elastic-EP rescale) call ``execute_model`` with ``dummy_run=False`` on the V2 runner (the
        JIT kernel warm-up, FlashInfer's mixed-batch attention warm-up, some models' own), and
        some models' on V1 too. Inside it ``pcache_begin_step`` only fences (`pcache_fence`: the
        warm-up forward waits for the last real save's copies) and neither builds the cache nor
        tracks the requests, and ``pcache_save`` returns ``None`` (nothing to consume). Engine
        thread; nests.

        Entering it (the outermost) first flushes a running cache: the CUDA graphs that
        ``compile_or_warm_up_model`` captures again at a rescale are captured in CUDA's global
        mode, which a device call of the committer during the capture would invalidate. A
        failed cache is left to raise at the next step's call; `WriteTimeoutError` is raised."""
        state = self._pcache_state
        if not self._pcache_warmups and state is not None and isinstance(state.cache, PrefixCache):
            with contextlib.suppress(WriteFailedError):  # (every later call of the cache raises it)
                state.cache.flush()
        self._pcache_warmups += 1
        try:
            yield
        finally:
            self._pcache_warmups -= 1

    def pcache_begin_step(self, scheduler_output: Any) -> None:
        """Tells the cache about one SchedulerOutput (start of ``execute_model``, before the
        runner drops finished requests). Builds the cache at the first call."""
        state = self._pcache_state
        if state is None:
            return
        if self._pcache_warmups:
            self.pcache_fence()
            return
        if state.cache is None:
            make = PrefixCache if state.output_rank else NoOpCache
            state.cache = make(state.config, state.policy)
            if state.output_rank and state.log_interval_s is not None:
                state.stats_log = StatsLog(state.log_interval_s, log=stats_logger)
        if not state.output_rank:
            return
        undo = state.tracker.update(scheduler_output, state.cache.awaited)
        try:
            state.cache.begin_step(step_events(scheduler_output, state.tracker))
        except BaseException:  # (a refused step leaves the tracker as it was, as it leaves the cache)
            undo()
            raise
        if state.stats_log is not None:
            state.stats_log.tick(state.cache)

    def pcache_fence(self) -> None:
        """Before a forward that has no ``pcache_begin_step`` (vLLM's dummy runs: an idle
        data-parallel rank's ``execute_dummy_batch``, V2's ``execute_model(dummy_run=True)``):
        makes it wait for the last save's device-to-host copies, which may still be reading a
        CUDA-graph output buffer the dummy forward overwrites (`PrefixCache.fence`). A no-op
        before the first step and without a cache."""
        state = self._pcache_state
        if state is not None and state.cache is not None:
            state.cache.fence()

    def pcache_save(
        self,
        hidden: Any,
        mm: dict[str, Any] | None,
        scheduler_output: Any,
        req_ids: Sequence[str],
        num_tokens_padded: int | None = None,
    ) -> int | None:
        """Saves the forward's outputs (rows in ``req_ids`` order, ``num_tokens_padded`` rows
        when CUDA graphs pad) and returns the step id, ``None`` without a cache."""
        state = self._pcache_state
        if state is None or self._pcache_warmups:
            return None
        if state.cache is None:
            raise ConfigError("pcache_save before pcache_begin_step: every step must begin first")
        if not state.output_rank:
            return state.cache.save(hidden, mm, None)  # type: ignore[arg-type]
        batch = step_batch(scheduler_output, state.tracker, req_ids, state.config.block_size, num_tokens_padded)
        step_id = state.cache.save(hidden, mm, batch)
        state.tracker.saved(scheduler_output, step_id)  # (whether its output is awaited at a reset)
        return step_id

    def pcache_materialize(self, step_id: int | None, req_ids: Sequence[str]) -> StepOutputs | None:
        """Per-request full-sequence outputs of a saved step (any thread); ``None`` for ``None``.
        Raises `StepIdError` for an id no present cache issued (one kept across a re-init)."""
        if step_id is None:
            return None
        return self._pcache_issuer(step_id).materialize(step_id, req_ids)

    def pcache_discard(self, step_id: int | None) -> None:
        """Consumes a step id whose outputs nobody needs (any thread); as `pcache_materialize`."""
        if step_id is not None:
            self._pcache_issuer(step_id).discard(step_id)

    def _pcache_issuer(self, step_id: int) -> PrefixCache | NoOpCache:
        """The cache that may have issued ``step_id``: none before the first step after a
        (re-)init, or for a stage without a cache, so an id kept from an earlier cache is
        refused there as the new cache would refuse it, never passed over silently."""
        state = self._pcache_state
        if state is None or state.cache is None:
            err = StepIdError(f"step#{step_id} was never issued: this stage has no cache running yet (or at all)")
            err.step_id, err.outstanding = step_id, []
            raise err
        return state.cache

    def pcache_stats(self) -> CacheStats | None:
        """The cache's counters, ``None`` when there is no cache."""
        cache = self.pcache
        return None if cache is None else cache.stats()

    def pcache_shutdown(self) -> None:
        """Closes the cache (writes what is queued, stops its thread). Idempotent."""
        state = self._pcache_state
        if state is not None and state.cache is not None:
            state.cache.close()
