"""Deferred keys: per-token rows kept on the device across a request's steps, written to the
pool in one go when the request finishes or aborts, or earlier when the device budget needs
room (oldest first).

At save, each deferred key's rows of the whole step are cloned once on the device (`Clone`);
every request of the step holds a view of that clone, so it is charged to the `DeviceBudget`
once and uncharged when its last holder has written. Each live request has at most one open
`DeferredRecord` (a write task that stays PENDING while it collects chunks); a flush queues it,
and the committer copies its rows to the host in ``copy_chunk_bytes`` pieces (one series of
copies per key) and scatters them like any write. Until then, reads of those rows are served
from the clone.

Threads: records are opened, extended and flushed on the engine thread; the committer writes
them and releases their clones; readers read clones (immutable once made) from any thread.
Host reads of a CUDA clone wait its ``ready`` event, then copy on the reading thread's own
clone-read stream (`reading`), not the compute stream: they neither queue behind the forward
in flight nor hold up the next one, nor behind another thread's reads (the engine thread's
keep-aside copies in save do not wait for the committer's record copies).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_pcache.copy_engine import host_waited_event
from omni_pcache.errors import CacheClosedError, InvalidInputError, StagingTimeoutError
from omni_pcache.keys import KeySpec

_read_streams = threading.local()  # .by_device: this thread's clone-read stream per device


def reading(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a host read of a clone runs in (any thread): for a CUDA clone, the calling
    thread's clone-read stream for its device (made on first use, gone with the thread), so
    the copy waits only for itself; for a CPU clone, nothing. The copies made in it are
    synchronous (the host reads their result at once), so the clone needs no
    ``record_stream``. The clone's device is made the thread's current one for the context
    (`_on_device`): the committer and output threads never set one, and leaving a stream
    context entered from another device would set device 0 again, creating a CUDA context
    there (hundreds of MiB) in a worker that owns another GPU."""
    if not tensor.is_cuda:
        return contextlib.nullcontext()
    streams = getattr(_read_streams, "by_device", None)
    if streams is None:
        streams = _read_streams.by_device = {}
    stream = streams.get(tensor.device)
    if stream is None:
        # (from the high-priority pool: torch hands out pooled streams round-robin, so a
        # low-priority one would in time be some cache's side stream, and a synchronous
        # clone read would wait behind that stream's copies, which wait for the forward)
        stream = streams[tensor.device] = torch.cuda.Stream(device=tensor.device, priority=-1)
    return _on_device(stream)


@contextlib.contextmanager
def _on_device(stream: torch.cuda.Stream) -> Iterator[None]:
    """``stream`` current on its device, that device current for the thread, and both as they
    were after (`torch.cuda.device` restores the previous device without creating a context
    on it; the stream context, entered on the stream's own device, switches none)."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


class DeviceBudget:
    """Bytes of deferred clones alive on the device, against ``device_budget_bytes``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.closed = False
        self._cond = threading.Condition()

    def charge(self, nbytes: int) -> None:
        with self._cond:
            self.used += nbytes

    def uncharge(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()

    def drop_holder(self, clone: Clone) -> None:
        """One of ``clone``'s holders is done (any thread); the last one uncharges its bytes.
        The count is changed under this budget's lock, so two threads releasing holders of one
        clone (the committer after a write, another thread at a failure) cannot lose an update."""
        with self._cond:
            clone.holders -= 1
            if clone.holders == 0:
                self.used -= clone.nbytes
                self._cond.notify_all()

    def wait_for_room(self, nbytes: int, deadline: float) -> bool:
        """Waits until ``nbytes`` more fit (any thread but the committer). False on timeout;
        `CacheClosedError` once the cache closes."""
        with self._cond:
            while self.used + nbytes > self.limit:
                if self.closed:
                    raise CacheClosedError("the cache was closed while save waited for device budget")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Wakes every waiter with `CacheClosedError` (close)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()


@dataclass(slots=True, eq=False)
class Clone:
    """One step's rows of one deferred key, on the device; shared by the step's requests."""

    tensor: torch.Tensor
    holders: int
    budget: DeviceBudget
    # The write tasks of the DeferredRecords holding a view (their ids, not the records: a record
    # refers to its clones, and a cycle would keep an open record's clones on the device after
    # a cache is dropped, until the next cyclic collection).
    owners: list[int] = field(default_factory=list)
    ready: torch.cuda.Event | None = None  # recorded after the clone on the compute stream

    @classmethod
    def of(cls, rows: torch.Tensor, holders: int, budget: DeviceBudget) -> Clone:
        """Clones ``rows`` on their device (the compute stream, after the forward). Other threads
        read it on other streams, so a CUDA clone records an event they wait before reading. The
        clone is row-major whatever the rows' strides (a permuted dense tensor's `clone` keeps
        them): the host copies of its row ranges then need no contiguous temporary on the
        device, outside the budget."""
        tensor = rows.detach().clone(memory_format=torch.contiguous_format)
        ready = None
        if tensor.is_cuda:
            ready = host_waited_event()
            ready.record(torch.cuda.current_stream(tensor.device))
        return cls(tensor, holders, budget, ready=ready)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """A view of rows ``[start, stop)``, safe to read from any thread and stream (the ready
        event is waited with the clone's device current: see `copy_engine.CopyHandle`)."""
        if self.ready is not None:
            with torch.cuda.device(self.tensor.device):
                self.ready.synchronize()
        return self.tensor[start:stop]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """One holder is done (any thread); the last one uncharges the budget."""
        self.budget.drop_holder(self)


@dataclass(slots=True, eq=False)
class DeferredRecord:
    """One request's deferred rows since its last flush: a write task of the deferred keys."""

    task_id: int
    req_id: str
    step_id: int  # the step that opened it (flush order: oldest first)
    keys: tuple[KeySpec, ...]
    copy_chunk_bytes: int
    chunks: dict[str, list[tuple[Clone, int, int]]] = field(default_factory=dict)
    slots: list[np.ndarray] = field(default_factory=list)
    num_rows: int = 0
    flushed: bool = False
    closed: bool = False  # rows committed in the pool (ledger lock)
    done: bool = False  # and its staging page or clones released: nothing left to wait for
    obligations: list = field(default_factory=list)
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    released: bool = False
    deferred = True

    def append(self, clones: dict[str, Clone], start: int, count: int, slots: np.ndarray) -> None:
        """Adds one step's rows ``[start, start + count)`` of each key's clone (engine thread)."""
        for spec in self.keys:
            self.chunks.setdefault(spec.name, []).append((clones[spec.name], start, count))
        self.slots.append(slots)
        self.num_rows += count

    def prepare(self) -> None:
        """Copies every key's rows to the host (committer): chunk by chunk, in a key with any
        device chunk each chunk in ``copy_chunk_bytes`` pieces, straight from the clones (no
        device-side concatenation: that would hold a second device copy of the record, outside
        the budget). Each run of chunks on one device is read there: a key's steps may come from
        the CPU and a GPU in turn."""
        for spec in self.keys:
            chunks = self.chunks.get(spec.name, [])
            if not chunks:
                self.host[spec.name] = torch.empty((0, *spec.row_shape), dtype=spec.dtype)
                continue
            if not any(clone.tensor.is_cuda for clone, _, _ in chunks):
                self.host[spec.name] = torch.cat([clone.rows(start, start + count) for clone, start, count in chunks])
                continue
            # (pageable, as the pool is by default: the copies into it are synchronous anyway,
            # and a long request's record pinned would stay page-locked in torch's host cache,
            # rounded up to a power of two, for the life of the process)
            host = torch.empty((self.num_rows, *spec.row_shape), dtype=spec.dtype)
            per_piece = max(1, self.copy_chunk_bytes // max(spec.row_bytes, 1))
            at = 0
            for _, same_device in itertools.groupby(chunks, key=lambda chunk: chunk[0].tensor.device):
                run = list(same_device)
                with reading(run[0][0].tensor):  # (their device and its clone-read stream; none on the CPU)
                    for clone, start, count in run:
                        rows = clone.rows(start, start + count)
                        for offset in range(0, count, per_piece):
                            piece = min(per_piece, count - offset)
                            host[at + offset : at + offset + piece].copy_(rows[offset : offset + piece])
                        at += count
            self.host[spec.name] = host

    def rows(self, spec: KeySpec, positions: torch.Tensor) -> torch.Tensor:
        """Rows at ``positions`` (an int64 CPU tensor, in the record's row order), as a new host
        tensor (any thread): from the host copy once `prepare` made it, else gathered from each
        chunk's clone (only the rows asked for leave the device)."""
        chunks = self.chunks.get(spec.name, [])  # (read before `host`: `release` drops the chunks once host is filled)
        source = self.host.get(spec.name)
        if source is not None:
            return source.index_select(0, positions)
        wanted = positions.numpy()
        out: torch.Tensor | None = None
        at = 0
        for clone, start, count in chunks:
            picked = np.flatnonzero((wanted >= at) & (wanted < at + count))
            if picked.size:
                rows = clone.rows(start, start + count)
                if out is None:
                    out = torch.empty((wanted.size, *rows.shape[1:]), dtype=rows.dtype)
                index = torch.from_numpy(wanted[picked] - at)
                with reading(rows):
                    out[torch.from_numpy(picked)] = rows.index_select(0, index.to(rows.device)).cpu()
            at += count
        if out is None:  # (no positions asked for)
            return torch.empty((0, *spec.row_shape), dtype=spec.dtype)
        return out

    def position_of(self, slots: list[int]) -> torch.Tensor:
        """Positions of ``slots`` (the newest, if a slot was claimed twice)."""
        row_of = {int(s): i for i, s in enumerate(np.concatenate(self.slots).tolist())}
        return torch.tensor([row_of[s] for s in slots], dtype=torch.int64)

    def is_done(self, task_id: int) -> bool:
        """Whether the record's task is written and its clones released (ledger lock)."""
        return self.done

    def req_of(self, task_id: int) -> str:
        return self.req_id

    def slot_rows(self, task_id: int, spec: KeySpec, slots: list[int]) -> torch.Tensor:
        """The record's host rows of ``slots``."""
        return self.rows(spec, self.position_of(slots))

    def finish_tasks(self, task_ids: list[int]) -> None:
        """The task is written and its clones released (ledger lock)."""
        self.done = True

    def release(self) -> None:
        """Drops the record's holds on its clones (after its write, or on failure); idempotent.
        Once `prepare` has copied every key to the host, the record also drops its references to
        the clones, so their device memory goes when the budget says it has (a clone lives on
        only while its step's own record is unmaterialized); otherwise (a failure before the
        copy) the views stay readable for a reader that already holds this record."""
        if self.released:
            return
        self.released = True
        for spec in self.keys:
            for clone, _, _ in self.chunks.get(spec.name, []):
                clone.release()
        if all(spec.name in self.host for spec in self.keys):
            self.chunks = {}  # (a new dict: a reader that took the old one still reads it whole)


class DeferredWrites:
    """The open deferred records of live requests and the device budget they share.

    Engine thread (the committer releases clones through `Clone.release`), except `drop_all`
    and `drop_open` (a failure or close, on any thread). Opening and extending records happens
    in the cache's claims, under its ledger lock; flushing them here takes that ``lock`` too,
    so a close or failure on another thread, which forgets every open record under it, never
    meets one half flushed: once `failed` is set, a flush raises `CacheClosedError`.
    """

    def __init__(self, config, tasks, notify, waited, failure, lock) -> None:
        self._config = config
        self._tasks = tasks
        self._lock = lock  # the cache's ledger lock (a Condition)
        self._notify = notify  # wakes the committer for one queued task
        self._waited = waited  # records a blocking wait in the stats
        self._failure = failure  # the sticky write failure, if any
        self.budget = DeviceBudget(config.device_budget_bytes)
        self.open: dict[str, DeferredRecord] = {}  # live request -> its open record
        self.failed = False  # set by `drop_all` (ledger lock): no record is opened or extended after it

    def check_fits(self, step_bytes: dict[str, int]) -> None:
        """Refuses (before anything changes) a step whose rows of the deferred keys, which are
        cloned together, exceed the budget: no amount of flushing could make room for them."""
        total = sum(step_bytes.values())
        if total > self.budget.limit:
            keys = ", ".join(f"{name!r} {nbytes} bytes" for name, nbytes in sorted(step_bytes.items()))
            raise InvalidInputError(
                f"this step's rows of the deferred keys ({keys}; {total} bytes in all) "
                f"exceed device_budget_bytes={self.budget.limit}"
            )

    def open_record(self, req_id: str, step_id: int, keys: tuple[KeySpec, ...]) -> DeferredRecord:
        """A new open record (a PENDING write task) for a live request."""
        record = DeferredRecord(self._tasks.create(), req_id, step_id, keys, self._config.copy_chunk_bytes)
        self.open[req_id] = record
        return record

    def clone_step(self, deferred: list[KeySpec], cached, shape) -> dict[str, Clone]:
        """One device clone per deferred key of this step's rows, charged once to the budget;
        flushes the oldest open records first when it would overflow."""
        if not deferred:
            return {}
        holders = sum(1 for _, count in shape.rows.values() if count)
        need = sum(spec.row_bytes * shape.n for spec in deferred)
        if self.budget.used + need > self.budget.limit:
            self._make_room(need)
        clones = {spec.name: Clone.of(cached[spec.name][1][: shape.n], holders, self.budget) for spec in deferred}
        if holders:  # charged once every clone exists: a failed clone leaves the budget as it was
            self.budget.charge(sum(clone.nbytes for clone in clones.values()))
        return clones

    def _check_open(self) -> None:
        """Raises `CacheClosedError` once a failure or close forgot the open records (`failed`:
        their tasks are failed or gone); ledger lock held."""
        if self.failed:
            raise CacheClosedError("the cache failed or closed: its open deferred rows are not written")

    def _flush(self, record: DeferredRecord) -> None:
        """Queues an open record for writing (ledger lock held; `_check_open` done)."""
        self.open.pop(record.req_id, None)
        record.flushed = True
        self._tasks.enqueue(record.task_id)

    def close_open(self, req_id: str) -> int:
        """A live request comes back (resumed, or continued as new) and may recompute positions
        it saved before, reclaiming their slots: its open record is queued now, so those claims
        belong to a new record and a read that captured the old rows gets them preserved (a
        record reclaiming its own slot would not). Returns how many tasks were queued (0 or 1)."""
        with self._lock:
            self._check_open()
            record = self.open.get(req_id)
            if record is None:
                return 0
            self._flush(record)
        return 1

    def close_other_keys(self, req_ids: list[str], keys: tuple[KeySpec, ...]) -> int:
        """Queues the open records of ``req_ids`` that hold another set of deferred keys than
        this step's ``keys`` (a step that gives a deferred key more or fewer than the request's
        earlier steps), so the step's rows open a new record with its own keys: a record
        extends every key it holds with each step's rows. Returns how many tasks were queued."""
        flushed = 0
        with self._lock:
            self._check_open()
            for req_id in req_ids:
                record = self.open.get(req_id)
                if record is not None and record.keys != keys and set(record.keys) != set(keys):
                    self._flush(record)
                    flushed += 1
        return flushed

    def finish(self, req_id: str) -> int:
        """The request finished or aborted: its open record goes to the front of the queue.
        Returns how many tasks were queued (0 or 1)."""
        with self._lock:
            self._check_open()
            record = self.open.get(req_id)
            if record is None:
                return 0
            self._tasks.escalate(record.task_id)  # PENDING: flagged, queued at the front
            self._flush(record)
        return 1

    def drop_all(self) -> None:
        """After a failure (the failing thread, often the committer; ledger lock held): forget
        open records (their clones are released by the cache), and refuse new ones and flushes
        (`failed`: a save racing the failure must not open a record nobody will write or
        release)."""
        self.failed = True
        self.open.clear()
        self.budget.wake()

    def drop_open(self) -> list[int]:
        """At close, after the committer stopped (ledger lock held): releases the open records'
        holds on their clones (uncharging the budget) and forgets them, as `drop_all` does; no
        record is opened or extended after it. Returns their write tasks (still PENDING: the
        cache fails and forgets them, since nothing will write them)."""
        task_ids = [record.task_id for record in self.open.values()]
        for record in self.open.values():
            record.release()
        self.drop_all()
        return task_ids

    def discard_clones(self, clones: dict[str, Clone]) -> None:
        """A save refused after `clone_step`, before any record took a view of its clones:
        uncharges what `clone_step` charged (engine thread)."""
        charged = sum(clone.nbytes for clone in clones.values() if clone.holders)
        if charged:
            self.budget.uncharge(charged)

    def _make_room(self, need: int) -> None:
        """Flushes open records, oldest first, until their writes free enough of the budget,
        then waits for those writes (up to claim_timeout_s)."""
        overflow = self.budget.used + need - self.budget.limit
        freed = 0
        counted: set[int] = set()
        with self._lock:
            oldest_first = sorted(self.open.values(), key=lambda r: (r.step_id, r.task_id))
        for record in oldest_first:
            if freed >= overflow:
                break
            with self._lock:  # (close or a failure clears `open` under it: never mid-iteration)
                self._check_open()
                self._flush(record)
                still_open = {r.task_id for r in self.open.values()}  # (a record leaves `open` only flushed or failed)
            self._notify()
            for chunks in record.chunks.values():
                for clone, _, _ in chunks:
                    if id(clone) not in counted and still_open.isdisjoint(clone.owners):
                        counted.add(id(clone))
                        freed += clone.nbytes
        start = time.monotonic()
        fits = self.budget.wait_for_room(need, start + self._config.claim_timeout_s)
        self._waited(time.monotonic() - start)
        if not fits:
            failure = self._failure()
            if failure is not None:
                raise failure
            err = StagingTimeoutError(
                f"save waited {self._config.claim_timeout_s:g} s for {need} bytes of device budget "
                f"(used {self.budget.used} of {self.budget.limit}); open deferred requests: {sorted(self.open)}"
            )
            err.holders = []
            err.unconsumed = []
            raise err
