"""A step's write tasks' journey from host rows to pool, run by the committer.

A `StepWrite` holds the immediate write tasks of one step, one task per request with rows in
it: each task's rows are a range of the step's staging page, claimed in the ledger for every
immediate key (a `omni_pcache.deferred.DeferredRecord` holds one request's deferred rows across
steps instead). The step's tasks share one object, so a decode step of hundreds of requests
costs a few lists, not an object per request. `PoolWriter.write_batch` waits the rows' copy,
scatters the rows each task still owns into the pool (rows stolen by a newer tenant are
skipped; a step's run of tasks in one native call), commits them, fills the copy-on-write
obligations that were registered on the tasks while they were in transit, and releases the
tasks' staging holds (the usual batch: commit and release in one native call).

Both kinds of record answer for the tasks they hold (`is_done`, `req_of`, `slot_rows`,
`finish_tasks`), so the cache keeps one ``task id -> record`` map for both.

Threads: `write_batch` runs under the committer's write lock (the pool's single writer: the
committer thread, or the engine thread in inline mode). The ledger lock is held for the
commit and for closing the tasks, never across the copy wait or the scatter. `write_step_now`
runs on the engine thread under the same write lock (`Committer.hold_writer`) and holds the
ledger lock throughout, small copy included: its step is under `CacheConfig.inline_write_bytes`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import chain, groupby
from operator import itemgetter

import numpy as np
import torch

from omni_pcache._native import Ledger, StagingSlots, WriteTasks, close_step_writes, write_step_now, write_step_rows
from omni_pcache.copy_engine import CopyHandle
from omni_pcache.keys import KeySpec
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool
from omni_pcache.preserve import PreservedRows

# (key spec, slots, versions) to keep aside when a task is written: reads captured them in transit.
Obligation = tuple[KeySpec, list[int], list[int]]


@dataclass(slots=True, eq=False)
class StepWrite:
    """The immediate write tasks of step ``step_id``: task ``task_ids[i]`` writes request
    ``req_ids[i]``'s ``counts[i]`` rows at ``starts[i]`` of staging page ``page`` (rows whose
    slots are ``step_slots[starts[i] : starts[i] + counts[i]]``), for every key in ``keys``.

    ``open`` (tasks not written yet) and ``obligations`` change under the ledger lock."""

    step_id: int
    page: int
    keys: tuple[KeySpec, ...]
    handle: CopyHandle
    step_slots: np.ndarray  # the step's slot mapping (int64)
    pages: StagingPages
    task_ids: list[int]
    req_ids: list[str]
    starts: list[int]
    counts: list[int]
    open: set[int]
    obligations: dict[int, list[Obligation]] | None = None  # by task (None until the first)
    _index: dict[int, int] | None = None  # task id -> i (built when first needed)
    _task_of: dict[str, int] | None = None  # request -> task id (built when first needed)
    deferred = False

    @classmethod
    def of(cls, step_id, page, keys, handle, step_slots, pages, task_ids, req_ids, starts, counts) -> StepWrite:
        return cls(step_id, page, keys, handle, step_slots, pages, task_ids, req_ids, starts, counts, set(task_ids))

    def _at(self, task_id: int) -> int:
        if self._index is None:
            self._index = dict(zip(self.task_ids, range(len(self.task_ids)), strict=True))
        return self._index[task_id]

    def task_of(self, req_id: str) -> int | None:
        """The task writing ``req_id``'s rows of this step, if it had rows in it."""
        if self._task_of is None:
            self._task_of = dict(zip(self.req_ids, self.task_ids, strict=True))
        return self._task_of.get(req_id)

    def is_done(self, task_id: int) -> bool:
        """Whether the task is written and its staging hold released (ledger lock)."""
        return task_id not in self.open

    def req_of(self, task_id: int) -> str:
        return self.req_ids[self._at(task_id)]

    def offsets(self, task_ids: list[int]) -> list[int]:
        """Each task's first row in the staging page."""
        if task_ids == self.task_ids:  # (the whole step, in order: the usual batch)
            return self.starts
        return [self.starts[self._at(t)] for t in task_ids]

    def prepare(self) -> None:
        """Waits until the rows are on the host (the step's device→host copy)."""
        self.handle.wait()

    def slot_rows(self, task_id: int, spec: KeySpec, slots: list[int]) -> torch.Tensor:
        """The task's host rows of ``slots`` (its own; the newest if one was claimed twice)."""
        i = self._at(task_id)
        start = self.starts[i]
        own = self.step_slots[start : start + self.counts[i]]
        row_of = {int(s): r for r, s in enumerate(own.tolist())}
        positions = torch.tensor([row_of[s] for s in slots], dtype=torch.int64)
        return self.pages.page(spec.name, self.page).index_select(0, positions + start)

    def finish_tasks(self, task_ids: list[int]) -> None:
        """The tasks are written and released (ledger lock)."""
        self.open.difference_update(task_ids)


def batch_groups(task_ids: list[int], records: list) -> list[tuple]:
    """``task_ids`` (``records[i]`` holds ``task_ids[i]``) as runs of one record and its tasks."""
    runs = groupby(zip(records, task_ids, strict=True), key=itemgetter(0))
    return [(record, [t for _, t in run]) for record, run in runs]


class PoolWriter:
    """Writes tasks into the pool. Shares the cache's ledger lock/condition."""

    def __init__(
        self,
        tasks: WriteTasks,
        ledger: Ledger,
        staging: StagingSlots,
        pool: HostPool,
        preserved: PreservedRows,
        cond: threading.Condition,
        pages: StagingPages,
    ) -> None:
        self._tasks = tasks
        self._ledger = ledger
        self._staging = staging
        self._pool = pool
        self._pages = pages
        self._preserved = preserved
        self._cond = cond
        self.bytes_written: dict[str, int] = {}
        # `_targets` per (key set, page): the key sets are `StepKeys` tuples kept for the cache's
        # life, and each entry holds its tuple, so an id here is never reused for another.
        self._targets_of: dict[tuple[int, int], tuple[tuple, list[KeySpec], list[tuple]]] = {}

    def write_batch(self, groups: list[tuple]) -> None:
        """Copies the owned rows of a batch of tasks into the pool, commits them, fills what
        readers are owed, and releases the tasks' staging pages or clones (the writer).

        ``groups`` are ``(record, task ids)`` runs (see `batch_groups`): a `StepWrite` or a
        `DeferredRecord` and tasks of it; every task is COPYING on entry, and WRITTEN, published
        as complete and done (`is_done`) on return.
        A step's tasks are queued together, so they usually come as one run, written in one
        native call (`write_step`); an escalated task, or a
        batch cut at `Committer.max_batch`, splits a step into several runs, each written on its
        own. Raises on any failure, leaving the tasks for the caller to fail.
        """
        prepared: set[int] = set()
        for record, _ in groups:
            if id(record) not in prepared:  # one wait per record: a step's tasks share its copy handle
                prepared.add(id(record))
                record.prepare()
        for record, ids in groups:
            if record.deferred:
                self._tasks.copy_done_many(ids)
                for spec in record.keys:
                    self._scatter_deferred(spec, record, ids)
                self._tasks.written_many(ids)
                continue
            self.write_step(record, ids)
        with self._cond:
            if len(groups) == 1 and not groups[0][0].deferred and not groups[0][0].obligations:
                # The usual batch: one step's run with nothing owed to readers. Committed, its
                # page holds dropped and completions published in one native call, under the
                # one lock section that also marks the tasks done.
                record, ids = groups[0]
                close_step_writes(self._tasks, self._ledger, self._staging, record.page, ids)
                record.finish_tasks(ids)
                self._cond.notify_all()
                return
            task_ids = list(chain.from_iterable(ids for _, ids in groups))
            self._ledger.commit_many(task_ids)
            owed = self._take_obligations(groups)
            self._cond.notify_all()
        for record, task_id, (spec, slots, versions) in owed:  # (the staging rows are still held)
            self._preserved.fill(spec.name, slots, versions, record.slot_rows(task_id, spec, slots))
        for record, ids in groups:
            if record.deferred:
                record.release()
            else:
                self._staging.release_many(record.page, "task", ids)
        self._tasks.complete_many(task_ids)
        with self._cond:
            for record, ids in groups:
                record.finish_tasks(ids)
            self._cond.notify_all()

    @staticmethod
    def _take_obligations(groups: list[tuple]) -> list:
        """The copy-on-write obligations registered on the batch's tasks while they were in
        transit, popped (ledger lock held, atomic with the commit: a claim after it finds the
        rows committed and preserves them from the pool instead)."""
        owed = []
        for record, ids in groups:
            if record.deferred:
                if record.obligations:
                    owed.extend((record, record.task_id, o) for o in record.obligations)
                    record.obligations = []
                record.closed = True
            elif record.obligations:
                for t in ids:
                    owed.extend((record, t, o) for o in record.obligations.pop(t, ()))
        return owed

    def write_step(self, record: StepWrite, task_ids: list[int]) -> None:
        """A run of one step's tasks (COPYING) written into the pool (WRITTEN, not committed),
        in one native call: their transitions, the rows they still own and one page → pool copy
        per run of slots, without the GIL (`_native.write_step_rows`)."""
        keys, targets = self._targets(record.keys, record.page)
        written = write_step_rows(self._tasks, self._ledger, task_ids, record.offsets(task_ids), targets)
        self._count_written(keys, written)

    def write_step_now(
        self,
        page: int,
        keys: tuple[KeySpec, ...],
        task_ids: list[int],
        offsets: list[int],
        arrays: dict[str, np.ndarray] | None = None,
    ) -> None:
        """A small step's new (PENDING) tasks written whole by the thread that saved it, which
        holds the writer's lock (`Committer.hold_writer`): queued and popped at once, their rows
        copied from staging page ``page``, or from ``arrays`` when given (per key with bytes, the
        step's own copies of its rows as `row_arrays.numpy_rows` shows them; task ``i``'s from row
        ``offsets[i]``), committed,
        released and forgotten, in one native call (`_native.write_step_now`), under the ledger
        lock (atomic with the commit, as `write_batch`'s closing is; the copy is small). No
        record of them is kept: nothing waits on them, and no read was planned on them yet."""
        keys, targets = self._targets(keys, page)
        if arrays is not None:
            targets = [(key_id, arrays[spec.name], pool) for spec, (key_id, _, pool) in zip(keys, targets, strict=True)]
        with self._cond:
            written = write_step_now(self._tasks, self._ledger, self._staging, page, task_ids, offsets, targets)
        self._count_written(keys, written)

    def _targets(self, keys: tuple[KeySpec, ...], page: int) -> tuple[list[KeySpec], list[tuple]]:
        """The keys with bytes (rows of none move nothing) and, per key, ``(key id, staging page
        bytes, pool bytes)``: what the native step writes take (made once per key set and page;
        the writing thread)."""
        made = self._targets_of.get((id(keys), page))
        if made is not None and made[0] is keys:
            return made[1], made[2]
        with_bytes = [spec for spec in keys if spec.row_bytes]
        pages, pool = self._pages, self._pool
        targets = [(spec.key_id, pages.page_bytes(spec.name, page), pool.byte_rows(spec.name)) for spec in with_bytes]
        if type(keys) is tuple:  # (the cache's key sets; a list a caller builds per call is not kept)
            self._targets_of[(id(keys), page)] = (keys, with_bytes, targets)
        return with_bytes, targets

    def _count_written(self, keys: list[KeySpec], rows_per_key: list[int]) -> None:
        for spec, rows in zip(keys, rows_per_key, strict=True):
            self.bytes_written[spec.name] = self.bytes_written.get(spec.name, 0) + rows * spec.row_bytes

    def _scatter_deferred(self, spec: KeySpec, record, task_ids: list[int]) -> None:
        """A deferred record's owned rows of ``spec`` (the ledger says which) gathered from its
        device clone and scattered into the pool."""
        at, slot_ids, _ = self._ledger.owned_many(task_ids, spec.key_id, [0])
        if slot_ids.size == 0:
            return
        self._pool.write(spec.name, slot_ids, record.rows(spec, torch.from_numpy(at)))
        self._count_written([spec], [slot_ids.size])
