"""omni_pcache.vllm: plugging the cache into a vLLM v1 GPU model runner (V1 or V2).

One module per concept, none importing vLLM (everything reads vLLM's objects by attribute):

- `gate`: `cache_config_from_vllm` — no cache, a refused configuration (`ConfigError`), or the
  `CacheConfig` sized from vLLM's configs;
- `tracker`: `BlockTracker` — each request's block ids from SchedulerOutputs alone, and the
  outputs vLLM dropped after a reset (given `steps_in_flight`);
- `translate`: `step_events` / `step_batch` — SchedulerOutput and the runner's row order into
  `StepEvents` / `StepBatch` with the CPU slot mapping;
- `ranks`: `build_cache` — a real cache on the output rank, a `NoOpCache` elsewhere;
- `mixin`: `PrefixCacheRunnerMixin` — the hooks a runner calls each step;
- `omni_runner`: `VllmOmniPrefixCacheMixin` — the same cache behind vLLM-Omni's own runner hooks,
  and `install_vllm_omni` (also a vLLM plugin, on with ``OMNI_PCACHE_VLLM_OMNI=1``).
"""

from __future__ import annotations

from omni_pcache.vllm.gate import REFUSALS, cache_config_from_vllm, steps_in_flight
from omni_pcache.vllm.mixin import PcacheState, PrefixCacheRunnerMixin
from omni_pcache.vllm.omni_runner import VllmOmniCacheHandle, VllmOmniPrefixCacheMixin, install_vllm_omni
from omni_pcache.vllm.ranks import NoOpCache, build_cache, is_output_rank
from omni_pcache.vllm.tracker import BlockTracker
from omni_pcache.vllm.translate import computed_tokens, slot_mapping, step_batch, step_events

__all__ = [
    "REFUSALS",
    "BlockTracker",
    "NoOpCache",
    "PcacheState",
    "PrefixCacheRunnerMixin",
    "VllmOmniCacheHandle",
    "VllmOmniPrefixCacheMixin",
    "build_cache",
    "cache_config_from_vllm",
    "computed_tokens",
    "install_vllm_omni",
    "is_output_rank",
    "slot_mapping",
    "step_batch",
    "step_events",
    "steps_in_flight",
]
