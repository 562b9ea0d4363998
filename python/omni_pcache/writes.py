"""One write task's journey from staging page to pool, run by the committer.

A `WriteRecord` is one request's rows in one step: a row range of the step's staging page,
claimed in the ledger for every immediate key. `PoolWriter.write` waits the step's copy,
scatters the rows the task still owns into the pool (rows stolen by a newer tenant are
skipped), commits them, fills the copy-on-write obligations that were registered on the task
while it was in transit, and releases its staging page.

Threads: `write` runs on the committer only (the pool's single writer). The ledger lock is
held for the commit and for closing the record, never across the copy wait or the scatter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from omni_pcache._native import Ledger, StagingSlots, WriteTasks
from omni_pcache.copy_engine import CopyHandle
from omni_pcache.keys import KeySpec
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool
from omni_pcache.preserve import PreservedRows


@dataclass(slots=True)
class WriteRecord:
    """One write task: ``num_rows`` rows of request ``req_id`` at ``start`` in ``page``."""

    task_id: int
    step_id: int
    req_id: str
    page: int
    start: int
    num_rows: int
    keys: tuple[KeySpec, ...]
    handle: CopyHandle
    slots: torch.Tensor  # the claimed slots in row order (CPU int64)
    # (key spec, slots, versions) to keep aside when written: reads captured them in transit.
    obligations: list[tuple[KeySpec, list[int], list[int]]] = field(default_factory=list)
    closed: bool = False


class PoolWriter:
    """Writes tasks into the pool. Shares the cache's ledger lock/condition."""

    def __init__(
        self,
        tasks: WriteTasks,
        ledger: Ledger,
        staging: StagingSlots,
        pages: StagingPages,
        pool: HostPool,
        preserved: PreservedRows,
        cond: threading.Condition,
    ) -> None:
        self._tasks = tasks
        self._ledger = ledger
        self._staging = staging
        self._pages = pages
        self._pool = pool
        self._preserved = preserved
        self._cond = cond
        self.bytes_written: dict[str, int] = {}

    def write(self, record: WriteRecord) -> None:
        """Copies ``record``'s owned rows into the pool and commits them (committer thread).
        The task is COPYING on entry and WRITTEN on return; raises on any failure, leaving the
        task for the caller to fail."""
        task_id = record.task_id
        record.handle.wait()
        self._tasks.copy_done(task_id)
        for spec in record.keys:
            positions, slots = self._ledger.owned(task_id, spec.key_id)
            if slots.size == 0:
                continue
            page = self._pages.page(spec.name, record.page)
            rows = page.index_select(0, torch.from_numpy(positions + record.start))
            self._pool.write(spec.name, torch.from_numpy(slots), rows)
            self.bytes_written[spec.name] = self.bytes_written.get(spec.name, 0) + slots.size * spec.row_bytes
        self._tasks.written(task_id)
        with self._cond:
            self._ledger.commit(task_id)
            obligations, record.obligations = record.obligations, []
            record.closed = True
            self._cond.notify_all()
        self.fill_obligations(record, obligations)

    def fill_obligations(self, record: WriteRecord, obligations: list) -> None:
        """Keeps aside the task's rows of slots a newer tenant took while a read held them."""
        if not obligations:
            return
        row_of = {int(s): i for i, s in enumerate(record.slots.tolist())}
        for spec, slots, versions in obligations:
            page = self._pages.page(spec.name, record.page)
            index = torch.tensor([record.start + row_of[s] for s in slots], dtype=torch.int64)
            self._preserved.fill(spec.name, slots, versions, page.index_select(0, index))
