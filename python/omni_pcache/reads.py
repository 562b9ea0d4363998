"""Hit reads: a request's cached prefix rows, planned at save and served at materialize.

A hit is planned in the ledger at save, after this step's claims, so a request that hits
blocks another request computes in the same step sees that request's task as the source (or
the pool, when save wrote its small step itself before planning: `PrefixCache.save`).
Serving follows a seqlock: wait for in-flight source tasks, read the pool rows, then ask the
ledger which slots moved since the plan; moved rows come from the copy-on-write store. Rows a
prefetch gathered before the plan (`omni_pcache.prefetch`) stand in for the pool's where the
version they were vouched for is the one the plan captured; the rest are read from the pool. A
row that was never written, or moved with no preserved copy, raises `UnservableHitError`:
never zeros, stale rows or a short tensor.

Threads: plans are made on the engine thread under the ledger lock; `serve` runs on
whichever thread materializes, taking the ledger lock only to look up moved rows among the
preserved copies (validation itself takes only the native ledger's own mutex).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_pcache._native import SOURCE_ABSENT, SOURCE_POOL, Ledger, ReadPlan
from omni_pcache.errors import UnservableHitError
from omni_pcache.keys import KeySpec
from omni_pcache.pool import HostPool
from omni_pcache.prefetch import Prefetched, PrefetchEntry
from omni_pcache.preserve import PreservedRows


@dataclass(slots=True)
class KeyRead:
    """One key's planned read of a hit span."""

    spec: KeySpec
    slots: np.ndarray
    # The ledger's plan: read_id, num_absent, num_from_pool, tasks (in-transit sources, each
    # once), and `sources` per slot, built when asked (only where some row is not in the pool).
    plan: ReadPlan


@dataclass(slots=True)
class HitRead:
    """A request's pool read, planned for every cached key: ``num_rows`` rows from where its
    consumer's rows end (position 0 for a new request's hit; a resumed request's first row
    not yet delivered) to its resume point. Offsets into it run over ``[0, num_rows)``."""

    req_id: str
    num_rows: int
    keys: list[KeyRead]
    released: bool = False
    prefetched: PrefetchEntry | None = None  # the same slots' rows gathered since begin_step


@dataclass(slots=True)
class ServedRows:
    """Rows of one hit per key, and where they came from (for stats)."""

    rows: dict[str, torch.Tensor]
    from_pool: int
    in_flight: int
    preserved: int
    prefetched: int = 0  # rows a prefetch had gathered (of any source but preserved copies)


class HitReader:
    """Plans and serves hit reads against the pool. Shares the cache's ledger lock."""

    def __init__(
        self,
        ledger: Ledger,
        pool: HostPool,
        preserved: PreservedRows,
        cond: threading.Condition,
        wait_tasks: Callable[[set[int], float], None],
        failure: Callable[[], BaseException | None],
        open_deferred: Callable[[int], Any],
    ) -> None:
        self._ledger = ledger
        self._pool = pool
        self._preserved = preserved
        self._cond = cond
        self._wait_tasks = wait_tasks
        self._failure = failure
        self._open_deferred = open_deferred

    def plan(self, req_id: str, slots: np.ndarray, specs: list[KeySpec]) -> HitRead:
        """Registers the reads of one hit for every key (caller holds the ledger lock)."""
        reads = []
        for spec in specs:
            reads.append(KeyRead(spec, slots, self._ledger.plan_read(slots, spec.key_id)))
        return HitRead(req_id, int(slots.size), reads)

    def release(self, hit: HitRead) -> None:
        """Releases the hit's reads (caller holds the ledger lock). Idempotent."""
        if not hit.released:
            hit.released = True
            for read in hit.keys:
                self._ledger.release(read.plan.read_id)

    def serve(
        self,
        hit: HitRead,
        step_id: int,
        timeout_s: float,
        into: dict[str, torch.Tensor] | None = None,
        prefetched: Prefetched | None = None,
    ) -> ServedRows:
        """The hit's rows per key (materializing thread), written into ``into[key]`` when given
        (the front of the caller's output tensor: one copy instead of two; none where it is the
        front of the ``prefetched`` rows themselves). Raises `UnservableHitError`."""
        deadline = time.monotonic() + timeout_s
        for read in hit.keys:
            if read.plan.num_absent:
                absent = np.flatnonzero(read.plan.sources == SOURCE_ABSENT)
                raise UnservableHitError(
                    f"request {hit.req_id!r} (step {step_id}) hits {hit.num_rows} rows of "
                    f"{read.spec.name!r}, but {absent.size} were never written (first offsets into the span read "
                    f"{absent[:8].tolist()}, slots {read.slots[absent[:8]].tolist()}): the steps that "
                    "computed them did not give this key, or the cache does not mirror the engine's KV "
                    "for these blocks"
                )
        in_flight = {t for read in hit.keys for t in read.plan.tasks}
        # Deferred rows not yet written are served from their device clone, never waited for
        # (their write may not happen before the request finishes).
        clones = {t: record for t in in_flight if (record := self._open_deferred(t)) is not None}
        if in_flight - clones.keys():
            self._wait_tasks(in_flight - clones.keys(), deadline)
        served: dict[str, torch.Tensor] = {}
        preserved = in_flight_rows = from_pool = from_prefetch = 0
        for read in hit.keys:
            dest = None if into is None else into.get(read.spec.name)
            stale = None  # (positions not taken from the prefetch; None: nothing prefetched)
            if prefetched is not None and prefetched.key_ids.get(read.spec.name) == read.spec.key_id:
                rows, stale = self._prefetched_rows(read, prefetched, dest)
            else:
                rows = self._pool.read(read.spec.name, torch.from_numpy(read.slots), out=dest)
            sources = read.plan.sources if clones else None
            for task_id, record in clones.items():
                at = np.flatnonzero(sources == task_id)
                if at.size:
                    positions = record.position_of(read.slots[at].tolist())
                    rows[torch.from_numpy(at)] = record.rows(read.spec, positions)
            kept = None
            # The usual case, nothing moved, needs only the ledger's own lock; moved rows are
            # looked up again under the cache's, atomically with the preserved copies.
            moved = self._ledger.validate(read.plan.read_id)
            if moved.size:
                with self._cond:
                    moved = self._ledger.validate(read.plan.read_id)
                    slots = read.slots[moved].tolist()
                    versions = self._ledger.captured_versions(read.plan.read_id)[moved].tolist()
                    lost = [
                        (s, v)
                        for s, v in zip(slots, versions, strict=True)
                        if not self._preserved.contains(read.spec.name, s, v)
                    ]
                    if lost and (failure := self._failure()) is not None:
                        raise failure  # (a failure drops its tasks' claims: their slots look overwritten)
                    if lost:
                        raise UnservableHitError(
                            f"request {hit.req_id!r} (step {step_id}): {len(lost)} rows of "
                            f"{read.spec.name!r} were overwritten by a newer tenant before this read "
                            f"and no copy was preserved (slot, version): {lost[:8]}; raise "
                            "CacheConfig.max_preserved_rows or materialize sooner"
                        )
                    try:
                        kept = self._preserved.take(read.spec.name, slots, versions, deadline, self._failure)
                    except TimeoutError as exc:
                        raise UnservableHitError(f"request {hit.req_id!r} (step {step_id}): {exc}") from None
            if kept is not None:  # copied outside the lock
                rows[torch.from_numpy(moved)] = torch.stack(kept)
                preserved += int(moved.size)
            if stale is not None:  # (a moved row is served from its preserved copy, not the prefetch's)
                from_prefetch += read.slots.size - (np.union1d(stale, moved).size if moved.size else stale.size)
            if moved.size:
                kept_sources = np.delete(read.plan.sources, moved)
                in_flight_rows += int(np.count_nonzero(kept_sources >= 0))
                from_pool += int(np.count_nonzero(kept_sources == SOURCE_POOL))
            else:
                from_pool += read.plan.num_from_pool
                in_flight_rows += read.slots.size - read.plan.num_from_pool  # (none absent: checked above)
            served[read.spec.name] = rows
        return ServedRows(served, from_pool, in_flight_rows, preserved, from_prefetch)

    def _prefetched_rows(
        self, read: KeyRead, prefetched: Prefetched, dest: torch.Tensor | None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """One key's rows of the read (into ``dest`` when given) from the prefetch: each row
        vouched for at the version the plan captured, the others read from the pool now (after
        the in-flight waits, as without a prefetch). Returns them and the positions read now."""
        n = read.slots.size
        head = prefetched.rows[read.spec.name][:n]
        stale = self._ledger.unvouched(read.plan.read_id, prefetched.versions[read.spec.name])
        if dest is None:
            rows = head.clone()
        elif dest.data_ptr() != head.data_ptr():
            rows = dest.copy_(head)
        else:  # (the output is the prefetch's own tensor: its rows are in place)
            rows = dest
        if stale.size:
            at = torch.from_numpy(stale)
            rows[at] = self._pool.read(read.spec.name, torch.from_numpy(read.slots[stale]))
        return rows, stale


__all__ = ["HitRead", "HitReader", "KeyRead", "ServedRows"]
