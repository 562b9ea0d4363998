"""Save's own write of a small all-CPU step, on the engine thread.

A step whose rows all come from CPU tensors, without deferred keys, under
`CacheConfig.inline_write_bytes`, is written to the pool by `PrefixCache.save` itself while the
committer is idle (the caller holds the pool writer's lock: `Committer.hold_writer`): one
native call, no queueing, no wake-up, and no GIL contention with the committer. Its one write
task is never queued and no record of it is kept, since nothing else can name it before
save's hits are planned (after it, so they read its rows from the pool).

Threads: the engine thread only, inside `save`, holding the pool writer's lock.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_pcache import copy_engine
from omni_pcache.config import CacheConfig
from omni_pcache.errors import WriteFailedError
from omni_pcache.keys import StepKeys
from omni_pcache.validation import BatchShape
from omni_pcache.writes import PoolWriter


class InlineWrites:
    """Whether save writes a step itself, and that write (see the module doc)."""

    def __init__(
        self,
        config: CacheConfig,
        writer: PoolWriter,
        on_failure: Callable[[int, BaseException, str], None],
        failure: Callable[[], WriteFailedError | None],
    ) -> None:
        self._config = config
        self._writer = writer
        self._on_failure = on_failure  # makes a failure sticky and releases everything (`PrefixCache`)
        self._failure = failure  # the sticky failure, if any

    def eligible(self, n: int, keys: StepKeys, sources: dict) -> bool:
        """Whether save may write its step to the pool itself: a step whose rows all come from
        CPU tensors (``sources``), without deferred keys, under `CacheConfig.inline_write_bytes`."""
        return (
            not keys.deferred
            and len(sources) == len(keys.immediate)
            and n * keys.immediate_row_bytes < self._config.inline_write_bytes
        )

    @staticmethod
    def owns_rows(n: int, keys: StepKeys) -> bool:
        """Whether save copies an eligible step's rows into tensors of its own (not the staging
        page) and writes the pool from them: each key's rows under
        `copy_engine.INLINE_COPY_BYTES` (as for any copy save makes itself), of dtypes the native
        write reads as they are (`row_arrays.numpy_rows`). Materialize then hands those copies
        out as they are, for a step without hits returned whole, instead of copying the page
        once more."""
        return n * keys.max_row_bytes < copy_engine.INLINE_COPY_BYTES and keys.immediate_numpy_readable

    def write(
        self, step_id: int, page: int, shape: BatchShape, immediate: list, task_ids: list[int], arrays: dict | None
    ) -> bool:
        """Writes the step's one new task (all its rows) to the pool (one native call:
        `PoolWriter.write_step_now`), from the step's own copies' ``arrays`` (else from the
        staging page). Its own failure is made sticky, as the committer's are, and raised by the
        next call: returns True then (save returns the step id, which holds nothing); a write
        refused because the cache failed meanwhile returns False (save raises that failure)."""
        try:
            self._writer.write_step_now(page, immediate, task_ids, [0], arrays)  # (one task: its rows from row 0)
        except BaseException as exc:
            failed_before = self._failure() is not None
            reqs = shape.claim_req_ids  # (the one task holds every request's rows)
            what = f"request {reqs[0]!r}" if len(reqs) == 1 else f"requests {reqs[0]!r} to {reqs[-1]!r} ({len(reqs)})"
            self._on_failure(task_ids[0], exc, f"{what}, step {step_id}")
            return not failed_before
        return False


__all__ = ["InlineWrites"]
