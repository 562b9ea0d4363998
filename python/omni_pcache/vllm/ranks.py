"""Which rank gets a real cache: only the one that produces the stage's outputs.

Under tensor parallelism every rank holds the same hidden states and under pipeline parallelism
only the last stage has them; outputs leave from the last pipeline stage's tensor-parallel
rank 0. `build_cache` gives that rank a `PrefixCache` and every other rank a `NoOpCache`, which
has the same methods and costs nothing: ``begin_step`` does nothing, ``save`` returns a fresh
dummy step id, ``materialize`` returns empty `StepOutputs` (``hidden=None``, ``mm={}``),
``discard``/``flush``/``close`` do nothing and ``stats`` returns zero counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from omni_pcache.cache import PrefixCache
from omni_pcache.config import CacheConfig, CachePolicy
from omni_pcache.events import StepBatch, StepEvents, StepOutputs
from omni_pcache.stats import CacheStats
from omni_pcache.validation import as_int


def is_output_rank(*, is_last_pipeline_stage: bool, tensor_parallel_rank: int) -> bool:
    """Whether this rank produces outputs: the last pipeline stage's tensor-parallel rank 0
    (vLLM: ``get_pp_group().is_last_rank`` and ``get_tp_group().rank_in_group == 0``). Raises
    `InvalidInputError` for a rank that is not an int >= 0."""
    return bool(is_last_pipeline_stage) and as_int(tensor_parallel_rank, "tensor_parallel_rank") == 0


class NoOpCache:
    """A stand-in for `PrefixCache` on ranks that produce no outputs (see the module doc)."""

    def __init__(self, config: CacheConfig | None = None, policy: CachePolicy | None = None) -> None:
        self._config = config
        self._policy = policy
        self._ids = itertools.count()

    @property
    def config(self) -> CacheConfig | None:
        return self._config

    @property
    def policy(self) -> CachePolicy | None:
        return self._policy

    def begin_step(self, events: StepEvents) -> None:
        pass

    def fence(self) -> None:
        pass

    def save(self, hidden: Any, mm: dict[str, Any] | None, batch: StepBatch) -> int:
        return next(self._ids)

    def materialize(self, step_id: int, req_ids: Sequence[str]) -> StepOutputs:
        return StepOutputs(None, {})

    def discard(self, step_id: int) -> None:
        pass

    def awaited(self, step_id: int) -> bool:
        """Always False: no step is ever outstanding here."""
        return False

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def stats(self) -> CacheStats:
        return CacheStats()

    def close(self) -> None:
        pass

    def __enter__(self) -> NoOpCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_cache(
    config: CacheConfig,
    policy: CachePolicy | None = None,
    *,
    is_last_pipeline_stage: bool,
    tensor_parallel_rank: int,
) -> PrefixCache | NoOpCache:
    """A `PrefixCache` on the output rank (see `is_output_rank`), a `NoOpCache` elsewhere."""
    if is_output_rank(is_last_pipeline_stage=is_last_pipeline_stage, tensor_parallel_rank=tensor_parallel_rank):
        return PrefixCache(config, policy)
    return NoOpCache(config, policy)
