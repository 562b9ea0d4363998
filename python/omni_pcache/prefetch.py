"""Hit prefetch: a new hit's committed prefix rows gathered off the engine thread, during the
forward between `PrefixCache.begin_step` and the save that plans the hit's read.

`begin_step` learns each hit's slots (the reads `Deliveries.begin` planned) and hands the
committer one `PrefetchJob` for the step. Per cached key, the job gathers the rows the pool
holds now for every request into one new tensor, each request's rows followed by room for
this step's (``room``: what the request's block table holds past the hit, at most a step's
rows), in one native call without the GIL (`_native.prefetch_rows`). A row is *vouched for*
when the ledger shows its slot committed at the same version before and after the gather
(`pcache_core::prefetch`); it carries that version, the others 0, which no claim gives.

At save the hit's read is planned as without a prefetch (`HitReader.plan`) and the request's
`PrefetchEntry` rides along on its `HitRead` (an entry always holds its request's latest
planned read: `HitPrefetcher.start`). At materialize,
`HitReader.serve` keeps each prefetched row whose version is the one the plan captured (the
bytes the pool held at that version) and gathers the others from the pool, then runs the same
in-flight, clone, seqlock and copy-on-write steps: rows are served exactly as without a
prefetch. A request whose prefetched tensors hold all the rows it returns, with less than a
block to spare, is handed those tensors (`OutputBuilder`): its prefix rows are not copied
again.

Threads: `HitPrefetcher` on the engine thread (`start` in begin_step, `attach` in save);
`PrefetchJob.run` on the committer, under the pool writer's lock (its native gather borrows
the pool's rows, which no write may overlap) and mostly without the GIL;
`PrefetchEntry.result` on the materializing thread, which cancels a job the committer has
not started (materialize then gathers as without it) and waits for one it is running.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_pcache._native import Ledger, prefetch_rows
from omni_pcache.keys import KeySpec
from omni_pcache.pool import HostPool, row_bytes_view

logger = logging.getLogger("omni_pcache")

_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)

Planned = tuple[str, np.ndarray, int]
"""A read `Deliveries.begin` planned: ``(req_id, slots, room)``."""


@dataclass(slots=True)
class Prefetched:
    """One request's prefetched rows. Per key: a tensor of ``num_rows + room`` rows whose first
    ``num_rows`` (one per slot read) are the pool's rows where ``versions`` is not 0 (the
    version each was vouched for at), and the ledger key id they were read under."""

    rows: dict[str, torch.Tensor]
    versions: dict[str, np.ndarray]
    key_ids: dict[str, int]
    num_rows: int
    max_spare: int  # a request returning fewer than ``rows - max_spare`` rows gets a chunk instead


class PrefetchJob:
    """One begin_step's prefetches: run once by the committer, or cancelled by the first
    consumer that finds it not started."""

    def __init__(
        self, planned: Sequence[Planned], specs: Sequence[KeySpec], ledger: Ledger, pool: HostPool, block_size: int
    ) -> None:
        self._planned = planned
        self._block_size = block_size
        self._specs = specs
        self._ledger = ledger
        self._pool = pool
        self._lock = threading.Lock()
        # Held until run ends (a plain lock: lighter to make on the engine thread than an Event).
        self._running = threading.Lock()
        self._running.acquire()
        self._state = _PENDING
        self._results: list[Prefetched | None] = []

    def run(self) -> None:
        """Gathers every planned read (the committer, holding the pool writer's lock: no write
        runs meanwhile, and the native gather borrows the pool's rows). A job already cancelled
        does nothing; a gather that raises leaves the job without results (consumers gather
        for themselves)."""
        with self._lock:
            if self._state != _PENDING:
                return
            self._state = _RUNNING
        results: list[Prefetched | None] = []
        try:
            results = self._gather()
        except Exception:  # (a key dropped meanwhile, memory: the reads are planned at save anyway)
            logger.debug("omni_pcache: a hit prefetch failed; materialize gathers those rows", exc_info=True)
            results = []
        finally:
            with self._lock:
                self._results = results
                self._state = _DONE
            self._running.release()

    def cancel(self) -> None:
        """Cancels the job unless it is running or done (any thread; the committer stopping)."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _CANCELLED

    def result(self, index: int, timeout_s: float) -> Prefetched | None:
        """The ``index``-th planned read's rows (the materializing thread): ``None`` when the
        job had not started (it is cancelled), failed, found nothing committed, or is still
        running after ``timeout_s``."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _CANCELLED
            state = self._state
        if state == _CANCELLED or (state == _RUNNING and not self.wait(timeout_s)):
            return None
        results = self._results
        return results[index] if index < len(results) else None

    def wait(self, timeout_s: float) -> bool:
        """Whether the job ran to its end within ``timeout_s`` (any thread; false for a job
        cancelled before it started)."""
        if self._state == _DONE:
            return True
        if self._state == _CANCELLED or not self._running.acquire(timeout=timeout_s):
            return False
        self._running.release()
        return True

    def _gather(self) -> list[Prefetched | None]:
        """Per planned read, its rows gathered into one new tensor per key for the whole job
        (request ``i`` at rows ``[start_i, start_i + num_rows_i + room_i)``: its read, then its
        room), by one native call per key (`_native.prefetch_rows`, without the GIL)."""
        planned = self._planned
        sizes = [int(slots.size) for _req_id, slots, _room in planned]
        starts = np.cumsum([0, *(n + room for n, (_r, _s, room) in zip(sizes, planned, strict=True))]).tolist()
        slots = np.concatenate([slots for _req_id, slots, _room in planned])
        dest = np.concatenate([np.arange(start, start + n) for start, n in zip(starts[:-1], sizes, strict=True)])
        gathered: dict[str, tuple[torch.Tensor, np.ndarray, int]] = {}
        for spec in self._specs:
            pool = self._pool.rows_of(spec.name)
            if pool is None or not spec.row_bytes:
                continue
            if pool.dtype != spec.dtype or tuple(pool.shape[1:]) != spec.row_shape:
                continue
            out = torch.empty((starts[-1], *spec.row_shape), dtype=spec.dtype)
            pool_bytes = self._pool.byte_rows(spec.name)
            versions = prefetch_rows(self._ledger, spec.key_id, pool_bytes, slots, row_bytes_view(out), dest)
            if versions.any():
                gathered[spec.name] = (out, versions, spec.key_id)
        if not gathered:
            return []
        key_ids = {name: key_id for name, (_out, _versions, key_id) in gathered.items()}
        results: list[Prefetched | None] = []
        at = 0
        for i, n in enumerate(sizes):
            rows = {name: out[starts[i] : starts[i + 1]] for name, (out, _v, _k) in gathered.items()}
            versions = {name: v[at : at + n] for name, (_out, v, _k) in gathered.items()}
            results.append(Prefetched(rows, versions, key_ids, n, self._block_size))
            at += n
        return results


@dataclass(slots=True)
class PrefetchEntry:
    """A request's part of a `PrefetchJob`: the ``index``-th read it planned, of ``slots``."""

    job: PrefetchJob
    index: int
    slots: np.ndarray

    def result(self, slots: np.ndarray, timeout_s: float) -> Prefetched | None:
        """`PrefetchJob.result` for the save's read of ``slots``: the slots this entry read,
        since an entry is dropped whenever its request's read is planned again
        (`HitPrefetcher.start`) and every save drops the ones it does not take (`attach`);
        as a guard, ``None`` for a read of another length."""
        if self.slots.size != slots.size:
            return None
        return self.job.result(self.index, timeout_s)


class HitPrefetcher:
    """Starts a step's prefetch at begin_step and hands each request's part to its hit read at
    save (engine thread). ``submit`` queues a job for the committer (false: not queued)."""

    def __init__(
        self,
        ledger: Ledger,
        pool: HostPool,
        submit: Callable[[PrefetchJob], bool],
        block_size: int,
        max_room: int,
        enabled: bool | None,
    ) -> None:
        # ``enabled``: `CacheConfig.prefetch_hits`; None decides at the first save with cached
        # rows (`saw_rows`): on for rows on a CUDA device.
        self.enabled = bool(enabled)
        self.undecided = enabled is None
        self._ledger = ledger
        self._pool = pool
        self._submit = submit
        self._block_size = block_size
        self._max_room = max_room
        self._entries: dict[str, PrefetchEntry] = {}
        # The keys of the last save: a step's hits are read under its keys, nearly always the same.
        self.specs: tuple[KeySpec, ...] = ()

    @property
    def pending(self) -> bool:
        """Whether a begin_step started prefetches no save has taken yet."""
        return bool(self._entries)

    def saw_rows(self, on_device: bool) -> None:
        """The first save with cached rows (undecided only): prefetch from now on when they are
        on a CUDA device, whose forward leaves the host's cores to the committer."""
        self.enabled = on_device
        self.undecided = False

    def start(self, planned: list[Planned]) -> None:
        """Queues a gather of the ``planned`` reads (begin_step, after the events registered).
        Nothing while disabled, or before the first save (no key known yet)."""
        entries = self._entries
        for req_id, _slots, _room in planned:  # (a read planned again: its old prefetch is not its)
            entries.pop(req_id, None)
        if not self.enabled or not self.specs:
            return
        planned = [(req_id, slots, min(room, self._max_room)) for req_id, slots, room in planned]
        job = PrefetchJob(planned, self.specs, self._ledger, self._pool, self._block_size)
        if not self._submit(job):
            return
        for i, (req_id, slots, _room) in enumerate(planned):
            self._entries[req_id] = PrefetchEntry(job, i, slots)

    def attach(self, hits: dict) -> None:
        """Hands each planned hit read of this save its request's prefetch (save, after
        planning; `PrefetchEntry.result` checks the slots are the same, off the engine thread),
        then forgets the rest: a prefetch serves only the save after it."""
        entries, self._entries = self._entries, {}
        for req_id, hit in hits.items():
            hit.prefetched = entries.get(req_id)

    def clear(self) -> None:
        """Forgets the started prefetches (a save that plans no reads: closed or failed)."""
        self._entries = {}


__all__ = ["HitPrefetcher", "PrefetchEntry", "PrefetchJob", "Prefetched"]
