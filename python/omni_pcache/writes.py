"""One write task's journey from host rows to pool, run by the committer.

A `WriteRecord` is one request's rows in one step: a row range of the step's staging page,
claimed in the ledger for every immediate key (a `omni_pcache.deferred.DeferredRecord` holds
a request's deferred rows across steps instead). `PoolWriter.write` waits the rows' copy,
scatters the rows the task still owns into the pool (rows stolen by a newer tenant are
skipped), commits them, fills the copy-on-write obligations that were registered on the task
while it was in transit, and releases its staging page.

Threads: `write_batch` runs under the committer's write lock (the pool's single writer: the
committer thread, or the engine thread writing a small step in `Committer.write_now`). The
ledger lock is held for the commit and for closing the record, never across the copy wait or
the scatter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from omni_pcache._native import Ledger, WriteTasks
from omni_pcache.copy_engine import CopyHandle
from omni_pcache.keys import KeySpec
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool
from omni_pcache.preserve import PreservedRows


@dataclass(slots=True, eq=False)
class WriteRecord:
    """An immediate write task: ``num_rows`` rows of request ``req_id`` at ``start`` in the
    staging page ``page`` of step ``step_id``."""

    task_id: int
    step_id: int
    req_id: str
    page: int
    start: int
    num_rows: int
    keys: tuple[KeySpec, ...]
    handle: CopyHandle
    step_slots: np.ndarray  # the step's slot mapping (int64); this task's are [start, start + num_rows)
    pages: StagingPages
    # (key spec, slots, versions) to keep aside when written: reads captured them in transit
    # (None until the first; ledger lock).
    obligations: list[tuple[KeySpec, list[int], list[int]]] | None = None
    closed: bool = False  # rows committed in the pool (ledger lock)
    done: bool = False  # and its staging page or clones released: nothing left to wait for
    deferred = False

    def prepare(self) -> None:
        """Waits until the rows are on the host (the step's device→host copy)."""
        self.handle.wait()

    def rows(self, spec: KeySpec, positions: torch.Tensor) -> torch.Tensor:
        """The task's rows at ``positions`` (in its row order), on the host."""
        return self.pages.page(spec.name, self.page).index_select(0, positions + self.start)

    def position_of(self, slots: list[int]) -> torch.Tensor:
        own = self.step_slots[self.start : self.start + self.num_rows]
        row_of = {int(s): i for i, s in enumerate(own.tolist())}
        return torch.tensor([row_of[s] for s in slots], dtype=torch.int64)


class PoolWriter:
    """Writes tasks into the pool. Shares the cache's ledger lock/condition."""

    def __init__(
        self,
        tasks: WriteTasks,
        ledger: Ledger,
        pool: HostPool,
        preserved: PreservedRows,
        cond: threading.Condition,
    ) -> None:
        self._tasks = tasks
        self._ledger = ledger
        self._pool = pool
        self._preserved = preserved
        self._cond = cond
        self.bytes_written: dict[str, int] = {}

    def write_batch(self, records: list) -> None:
        """Copies the owned rows of ``records`` into the pool and commits them (the writer).

        Records are `WriteRecord`s or `DeferredRecord`s, each COPYING on entry and WRITTEN on
        return. Immediate records of one step share a staging page, so their rows move with one
        gather and one scatter per key. Raises on any failure, leaving the tasks for the caller
        to fail.
        """
        task_ids = [record.task_id for record in records]
        groups: dict[tuple, list] = {}
        for record in records:
            key = ("page", record.step_id) if not record.deferred else ("deferred", record.task_id)
            group = groups.get(key)
            if group is None:  # one wait per group: a step's records share its copy handle
                record.prepare()
                group = groups[key] = []
            group.append(record)
        self._tasks.copy_done_many(task_ids)
        for group in groups.values():
            for spec in group[0].keys:
                self._scatter(spec, group)
        self._tasks.written_many(task_ids)
        obligations = []
        with self._cond:
            self._ledger.commit_many(task_ids)
            for record in records:
                if record.obligations:
                    obligations.append((record, record.obligations))
                    record.obligations = None
                record.closed = True
            self._cond.notify_all()
        for record, owed in obligations:
            self.fill_obligations(record, owed)

    def _scatter(self, spec: KeySpec, group: list) -> None:
        """One gather from the group's host rows and one scatter into the pool for ``spec``
        (the ledger says which rows are still owned, and whether they form one range)."""
        offsets = [0 if record.deferred else record.start for record in group]
        at, slot_ids, first = self._ledger.owned_many([record.task_id for record in group], spec.key_id, offsets)
        if slot_ids.size == 0:
            return
        if group[0].deferred:
            rows = group[0].rows(spec, torch.from_numpy(at))
        elif first >= 0:  # every row still owned, in page order: no gather
            rows = group[0].pages.page(spec.name, group[0].page)[first : first + at.size]
        else:
            rows = group[0].pages.page(spec.name, group[0].page).index_select(0, torch.from_numpy(at))
        self._pool.write(spec.name, slot_ids, rows)
        self.bytes_written[spec.name] = self.bytes_written.get(spec.name, 0) + slot_ids.size * spec.row_bytes

    def fill_obligations(self, record, obligations: list) -> None:
        """Keeps aside the task's rows of slots a newer tenant took while a read held them."""
        for spec, slots, versions in obligations:
            self._preserved.fill(spec.name, slots, versions, record.rows(spec, record.position_of(slots)))
