"""Claiming a step's rows at `PrefixCache.save`: the write tasks that own them, and the
copy-on-write obligations their claims create.

A claim takes a slot's newest version in the native ledger for a write task. A pending hit
read may have captured the slot's older version; the ledger reports those slots, and the rows
they held are kept aside for the read (`omni_pcache.preserve`): read from the pool now when
they are there, from a deferred record's device clone, or, when the older tenant is a write
still in transit, registered on that write as an obligation its writer fills
(`omni_pcache.writes.PoolWriter`).

Threads: the engine thread, under the cache's ledger lock (``cond``) for the claims and the
obligations registered with them; the preserved rows owed from the pool or a clone are
returned, for `StepClaims.keep_aside` to copy once the caller has released the lock.
"""

from __future__ import annotations

import threading

import torch

from omni_pcache._native import Ledger, StagingSlots, WriteTasks, claim_step
from omni_pcache.copy_engine import CopyHandle
from omni_pcache.deferred import Clone, DeferredRecord, DeferredWrites
from omni_pcache.errors import CacheClosedError
from omni_pcache.keys import KeySpec
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool
from omni_pcache.preserve import PreservedRows
from omni_pcache.validation import BatchShape
from omni_pcache.writes import StepWrite

# What a claim owes readers now: (key spec, slots, versions) to read from the pool, and
# (deferred record, key spec, slots, versions) to read from a record's device clone.
FromPool = tuple[KeySpec, list[int], list[int]]
FromDeferred = tuple[DeferredRecord, KeySpec, list[int], list[int]]


class StepClaims:
    """Claims steps' rows for their write tasks (engine thread, ledger lock; see the module doc).

    ``records`` (task id -> the record holding it) and ``open_writes`` (step id -> its
    `StepWrite` while tasks of it are unwritten) are the cache's `WriteRecords` maps, shared: a
    claim adds to them, `WriteRecords.reap` forgets written tasks from them."""

    def __init__(
        self,
        tasks: WriteTasks,
        ledger: Ledger,
        staging: StagingSlots,
        pages: StagingPages,
        pool: HostPool,
        preserved: PreservedRows,
        deferred: DeferredWrites,
        cond: threading.Condition,
        records: dict[int, StepWrite | DeferredRecord],
        open_writes: dict[int, StepWrite],
    ) -> None:
        self._tasks = tasks
        self._ledger = ledger
        self._staging = staging
        self._pages = pages
        self._pool = pool
        self._preserved = preserved
        self._deferred = deferred
        self._cond = cond
        self._records = records
        self._open_writes = open_writes

    def claim(
        self,
        step_id: int,
        page: int,
        shape: BatchShape,
        immediate: list[KeySpec],
        deferred: list[KeySpec],
        handle: CopyHandle,
        clones: dict[str, Clone],
        queued: bool,
        omitted: tuple[KeySpec, ...] = (),
    ) -> tuple[list[int], list[FromPool], list[FromDeferred]]:
        """Creates the step's immediate write tasks and extends each request's open deferred
        record, claiming their slots and registering copy-on-write obligations atomically with
        the claims (takes the ledger lock). Immediate rows get one task per request with rows,
        in one `StepWrite`, when they will be ``queued`` for the committer; one task for all of
        them, recorded nowhere, when save writes the step itself. Returns the immediate task
        ids and the preserved rows owed from the pool and from deferred clones (to copy after
        the lock is released, before this step's rows overwrite them). Raises
        `CacheClosedError` when the cache failed or closed meanwhile.

        The ``omitted`` keys (cached by earlier steps, not given by this one) have no rows for
        the step's positions: their slots become absent (`Ledger.invalidate`), so a later hit
        over them raises `UnservableHitError` instead of serving the slots' previous tenant's
        rows, and a pending read that captured those rows still gets them (preserved)."""
        task_ids: list[int] = []
        from_pool: list[FromPool] = []
        from_deferred: list[FromDeferred] = []
        if not immediate and not deferred and not omitted:
            return task_ids, from_pool, from_deferred
        # (the slot mapping holds exactly the scheduled rows' slots; zero-count requests add none)
        req_ids, starts, counts = shape.claim_req_ids, shape.claim_starts, shape.claim_counts
        slot_ids = shape.slot_mapping  # the scheduled rows' slots, in batch order (int64)
        with self._cond:
            if immediate:
                # (one native call: the tasks, their claims on every immediate key, their page holds)
                key_ids = [spec.key_id for spec in immediate]
                # A step save writes itself gets one task for all its rows: nothing is queued,
                # escalated or waited on per request, and a task per request cost each its own
                # creation, page hold, five transitions, commit and release inside the one save.
                task_counts = counts if queued or not shape.n else [shape.n]
                task_ids, outcomes = claim_step(
                    self._tasks, self._ledger, self._staging, page, slot_ids, task_counts, key_ids
                )
                if queued and task_ids:
                    keys = tuple(immediate)
                    write = StepWrite.of(
                        step_id, page, keys, handle, slot_ids, self._pages, task_ids, req_ids, starts, counts
                    )
                    self._records.update(zip(task_ids, [write] * len(task_ids), strict=True))
                    self._open_writes[step_id] = write
                for spec, out in zip(immediate, outcomes, strict=True):
                    if out is not None and out.preserve_slots.size:
                        self._register_obligations(spec, out, step_id, from_pool, from_deferred)
            if deferred:
                if self._deferred.failed:  # (checked before any record takes a view of the clones)
                    raise CacheClosedError("the cache failed during save")
                owners = []
                for req_id, start, count in zip(req_ids, starts, counts, strict=True):
                    record = self._deferred.open.get(req_id)
                    if record is None:
                        record = self._deferred.open_record(req_id, step_id, tuple(deferred))
                        self._records[record.task_id] = record
                    record.append(clones, start, count, slot_ids[start : start + count])
                    owners.append(record.task_id)
                    for spec in deferred:
                        clones[spec.name].owners.append(record.task_id)
                for spec in deferred:
                    out = self._ledger.claim_many(slot_ids, counts, spec.key_id, owners)
                    if out.preserve_slots.size:
                        self._register_obligations(spec, out, step_id, from_pool, from_deferred)
            if shape.n:
                for spec in omitted:
                    out = self._ledger.invalidate(slot_ids, spec.key_id)
                    if out.preserve_slots.size:
                        self._register_obligations(spec, out, step_id, from_pool, from_deferred)
        return task_ids, from_pool, from_deferred

    def keep_aside(self, from_pool: list[FromPool], from_deferred: list[FromDeferred]) -> None:
        """Copies the rows a claim owes readers now (what `claim` returned) into the preserved
        store: from the pool, or from a deferred record's device clone (engine thread, without
        the ledger lock, before the step's own rows overwrite the pool's)."""
        for spec, slots, versions in from_pool:
            rows = self._pool.read(spec.name, torch.tensor(slots, dtype=torch.int64))
            self._preserved.fill(spec.name, slots, versions, rows)
        for record, spec, slots, versions in from_deferred:
            self._preserved.fill(spec.name, slots, versions, record.rows(spec, record.position_of(slots)))

    def _register_obligations(
        self, spec: KeySpec, out, step_id: int, from_pool: list[FromPool], from_deferred: list[FromDeferred]
    ) -> None:
        """Copy-on-write for slots a pending read captured (caller holds the ledger lock): what
        the pool or a deferred clone holds is owed now; what a write in transit holds is
        registered on its record, for its writer to fill."""
        slots = out.preserve_slots.tolist()
        versions = out.preserve_versions.tolist()
        owners = out.preserve_from.tolist()
        accepted = self._preserved.register(spec.name, slots, versions, step_id)
        by_owner: dict[int, tuple[list[int], list[int]]] = {}
        for slot, version, owner, ok in zip(slots, versions, owners, accepted, strict=True):
            if ok:
                group = by_owner.setdefault(owner, ([], []))
                group[0].append(slot)
                group[1].append(version)
        for owner, (s, v) in by_owner.items():
            record = self._records.get(owner) if owner >= 0 else None
            if record is None:
                from_pool.append((spec, s, v))
            elif record.deferred:
                from_deferred.append((record, spec, s, v))  # its rows are in a clone already
            else:
                if record.obligations is None:
                    record.obligations = {}
                record.obligations.setdefault(owner, []).append((spec, s, v))


__all__ = ["StepClaims"]
