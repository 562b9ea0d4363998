"""The records of live write tasks: which record holds each task from its claim until the
engine thread forgets it, and the waits for tasks still in transit.

A queued step's immediate tasks share one `omni_pcache.writes.StepWrite`; a request's deferred
rows are one `omni_pcache.deferred.DeferredRecord`. Both answer for the tasks they hold
(`is_done`, `req_of`, ...), so one ``task id -> record`` map serves both. `StepClaims` adds
records at save; the pool's writer looks a batch's records up (`groups`); `reap` (engine
thread, at begin_step) forgets the tasks the native table published as written; readers and
`flush` wait for tasks not in the pool yet (`wait`).

Locks: the maps change under the cache's ledger lock (``cond``: claims, `reap`, the failure
path), and other threads read them under it, except the writer's lookup of a batch it was
handed: those tasks are queued, so nothing forgets them meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from omni_pcache._native import WriteTasks
from omni_pcache.deferred import DeferredRecord
from omni_pcache.errors import WriteFailedError, WriteTimeoutError
from omni_pcache.writes import StepWrite, batch_groups


class WriteRecords:
    """Every task not yet forgotten -> the record holding it (see the module doc)."""

    def __init__(
        self,
        tasks: WriteTasks,
        cond: threading.Condition,
        failure: Callable[[], WriteFailedError | None],
        waited: Callable[[float], None],
    ) -> None:
        self._tasks = tasks
        self._cond = cond
        self._failure = failure  # the sticky write failure, if any
        self._waited = waited  # records a blocking wait in the stats
        # Every task not yet forgotten (`reap`) -> the record holding it; a step's immediate
        # tasks share one `StepWrite`.
        self.by_task: dict[int, StepWrite | DeferredRecord] = {}
        # Step writes with tasks not written yet, oldest first, where a finished request's writes
        # are looked up to be escalated (pruned at `reap`; at most ~staging_depth).
        self.open_writes: dict[int, StepWrite] = {}

    def groups(self, task_ids: list[int]) -> list[tuple]:
        """A batch of queued tasks as runs of one record and its tasks (the pool's writer)."""
        first = self.by_task[task_ids[0]]
        if not first.deferred and task_ids == first.task_ids:  # a whole step, in order: the usual batch
            return [(first, task_ids)]
        return batch_groups(task_ids, [self.by_task[t] for t in task_ids])

    def escalate_unwritten(self, req_id: str) -> None:
        """Moves a finished request's queued immediate writes to the front of the copy queue
        (engine thread). Raises `TaskStateError` when the cache failed meanwhile."""
        for write in self.open_writes.values():
            task_id = write.task_of(req_id)
            # Not forgotten yet (`reap` drops it from the native table; the committer may have
            # published it but not yet closed it in ``write.open``).
            if task_id is not None and task_id in self.by_task:
                self._tasks.escalate(task_id)

    def unwritten(self) -> set[int]:
        """The tasks queued or in transit (caller holds the ledger lock): not the open deferred
        records', which are queued only when their requests finish."""
        return {t for t, r in self.by_task.items() if not r.is_done(t) and not (r.deferred and not r.flushed)}

    def open_deferred(self, task_id: int) -> DeferredRecord | None:
        """The deferred record of ``task_id`` if its rows are not in the pool yet (any thread)."""
        record = self.by_task.get(task_id)
        return record if record is not None and record.deferred and not record.closed else None

    def wait(self, task_ids: set[int], deadline: float) -> None:
        """Waits until each task has written the pool (any thread but the writer's). Raises the
        sticky `WriteFailedError`, or `WriteTimeoutError` (with each open task's state) at
        ``deadline`` (monotonic seconds)."""
        start = time.monotonic()
        with self._cond:
            while True:
                if (failure := self._failure()) is not None:
                    raise failure
                open_ids = [t for t in task_ids if (r := self.by_task.get(t)) is not None and not r.is_done(t)]
                if not open_ids:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    states = {t: self._tasks.state(t) for t in open_ids}
                    err = WriteTimeoutError(
                        f"write tasks not in the pool after {time.monotonic() - start:.3g} s (task id: state): {states}"
                    )
                    err.states = states
                    raise err
                self._cond.wait(remaining)
        self._waited(time.monotonic() - start)

    def reap(self) -> None:
        """Forgets written tasks (engine thread), under the ledger lock (the native reap too: a
        waiter's timeout report asks the table for the states). Nothing to do when no task is
        recorded: only recorded tasks are published as complete (a step save wrote itself is
        forgotten unpublished), and each stays recorded until reaped here."""
        if not self.by_task and not self.open_writes:
            return
        forget = self.by_task.pop
        with self._cond:
            for task_id in self._tasks.reap_completions():
                forget(task_id, None)
            # (checked even when nothing completed now: a step's tasks may have been published
            # before the committer closed them in ``open``, and reaped at the previous call)
            written = [step_id for step_id, write in self.open_writes.items() if not write.open]
            for step_id in written:
                del self.open_writes[step_id]


__all__ = ["WriteRecords"]
