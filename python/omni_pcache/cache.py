"""`PrefixCache`: the facade a model runner calls each step.

Per step, on the engine thread: `begin_step` (before the forward) registers new requests'
hit spans, escalates the writes of finished ones and fences last step's copies; `save`
(after the forward) launches the copy of the step's per-token rows into a staging page (one
copy per key, see `omni_pcache.copy_engine`), claims their slots in the ledger under one
write task per request (`omni_pcache.claims`), plans this step's hit reads, snapshots
leftover mm and returns a step id. The committer thread writes the pool, except a small
all-CPU step that save writes itself while the committer is idle (from copies of its own, not
the page: `omni_pcache.inline_writes`). `materialize` (any thread, possibly a step late) returns per request the cached
prefix rows followed by this step's rows (assembled by `omni_pcache.outputs`); `discard`
consumes a step id nobody needs.

Locks: one *ledger lock* makes ledger calls atomic with the Python bookkeeping around them
(claims with copy-on-write obligations, commits with closing a write record, validation with
the preserved-row lookup). It is never held across a wait, or a copy or scatter larger than
`CacheConfig.inline_write_bytes` (the one save writes itself); waits use its condition
variable.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from omni_pcache._native import Deliveries, Ledger, StagingSlots, WriteTasks
from omni_pcache.call_wrappers import outside_inference_mode, weakly
from omni_pcache.claims import StepClaims
from omni_pcache.committer import Committer
from omni_pcache.config import CacheConfig, CachePolicy
from omni_pcache.copy_engine import CopyEngine, CopyHandle
from omni_pcache.deferred import DeferredWrites
from omni_pcache.errors import (
    CacheClosedError,
    ConfigError,
    InvalidInputError,
    PrefixCacheError,
    TaskStateError,
    WriteFailedError,
)
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents, StepOutputs
from omni_pcache.failure import release_everything, write_failed_error
from omni_pcache.host_budget import HostBudget
from omni_pcache.inline_writes import InlineWrites
from omni_pcache.key_storage import KeyStorage
from omni_pcache.keys import KeyRegistry, row_bytes
from omni_pcache.outputs import OutputBuilder, StepRecord
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool
from omni_pcache.prefetch import HitPrefetcher
from omni_pcache.preserve import PreservedRows
from omni_pcache.reads import HitRead, HitReader
from omni_pcache.row_arrays import own_copies
from omni_pcache.snapshot import snapshot
from omni_pcache.stats import CacheStats, Counters
from omni_pcache.steps import StepPages
from omni_pcache.validation import as_id_map, as_list, check_batch, check_step_id, check_timeout
from omni_pcache.write_records import WriteRecords
from omni_pcache.writes import PoolWriter


class PrefixCache:
    """A full-sequence prefix cache for one engine's per-token outputs. See the module doc."""

    def __init__(self, config: CacheConfig, policy: CachePolicy | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config must be a CacheConfig, got {type(config).__name__}")
        policy = CachePolicy() if policy is None else policy
        if not isinstance(policy, CachePolicy):
            raise ConfigError(f"policy must be a CachePolicy, got {type(policy).__name__}")
        self._config = config
        self._policy = policy
        self._cond = threading.Condition(threading.Lock())
        self._ledger = Ledger(config.num_slots, config.block_size)
        self._tasks = WriteTasks()
        self._staging = StagingSlots(config.staging_depth)
        self._pool = HostPool(config.num_slots, pinned=config.pin_pool)
        self._pages = StagingPages(config.staging_depth, config.staging_capacity_tokens)
        self._preserved = PreservedRows(config.max_preserved_rows, self._cond)
        self._copies = CopyEngine()
        self._writer = PoolWriter(
            self._tasks, self._ledger, self._staging, self._pool, self._preserved, self._cond, self._pages
        )
        self._budget = HostBudget(config, policy.deferred_keys, self._pool, self._pages, self._ledger)
        self._keys = KeyRegistry(policy, self._ledger.add_key, self._budget.check)
        self._storage = KeyStorage(self._pool, self._pages, self._writer.bytes_written)
        self._inline = InlineWrites(config, self._writer, weakly(self._on_write_failure), weakly(self._failure_or_none))
        self._counters = Counters()
        failure_or_none = weakly(self._failure_or_none)
        self._records = WriteRecords(self._tasks, self._cond, failure_or_none, self._counters.waited)
        self._reader = HitReader(
            self._ledger,
            self._pool,
            self._preserved,
            self._cond,
            self._records.wait,
            failure_or_none,
            self._records.open_deferred,
        )
        self._steps = StepPages(
            config,
            self._staging,
            self._reader,
            self._preserved,
            self._cond,
            self._counters.waited,
            weakly(self._closed_error),
            failure_or_none,
        )
        self._outputs = OutputBuilder(self._reader, self._copies, self._counters, config.claim_timeout_s)
        self._deferred = DeferredWrites(
            config,
            self._tasks,
            weakly(self._notify_one),
            self._counters.waited,
            failure_or_none,
            self._cond,
        )
        self._claims = StepClaims(
            self._tasks,
            self._ledger,
            self._staging,
            self._pages,
            self._pool,
            self._preserved,
            self._deferred,
            self._cond,
            self._records.by_task,
            self._records.open_writes,
        )
        # What each live request's consumer has been given (native: `pcache_core::delivery`).
        self._delivery = Deliveries(config.block_size)
        self._requests_live = 0
        self._failure: WriteFailedError | None = None
        self._closed = False
        self._close_lock = threading.RLock()  # (a close nested on the closing thread returns at once)
        # The committer reaches the cache only weakly, so a cache dropped without close() is
        # collected, and collecting it stops the committer (the finalizer; else at exit).
        self._committer = Committer(
            self._tasks, weakly(self._write_tasks), weakly(self._on_write_failure), config.threaded
        )
        self._finalizer = weakref.finalize(self, self._committer.stop, config.claim_timeout_s)
        self._prefetch = HitPrefetcher(
            self._ledger,
            self._pool,
            self._committer.submit,
            config.block_size,
            config.staging_capacity_tokens,
            config.prefetch_hits,
        )

    # ---- context manager and lifecycle -------------------------------------------------

    def __enter__(self) -> PrefixCache:
        """The cache itself; `CacheClosedError` (or the failure) for one already closed."""
        self._check_usable()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every queued write has reached the pool (any thread but the committer).
        Deferred rows of live requests stay on the device until those requests finish.
        Raises `WriteFailedError` if a write failed, `WriteTimeoutError` on timeout, and
        `InvalidInputError` for a ``timeout_s`` that is not a finite number >= 0."""
        check_timeout(timeout_s, "flush timeout_s")
        timeout = self._config.claim_timeout_s if timeout_s is None else timeout_s
        with self._cond:
            open_ids = self._records.unwritten()
        if open_ids:
            self._records.wait(open_ids, time.monotonic() + timeout)
        elif self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Writes what is queued, stops the committer and wakes every waiter. Idempotent: a
        call racing another returns once that one has closed the cache.
        Deferred rows of live requests are not queued (they would be at their requests' finish,
        which the cache will not see now): their device clones are released and their write
        tasks failed and forgotten, so the device budget and ``tasks_live`` are back to zero
        (but for the task of a write failure: failed tasks stay counted).
        Steps not consumed yet cannot be after it; their staging pages are released."""
        with self._close_lock:  # (a second caller returns once the first has closed the cache)
            if self._closed:
                return
            self._closed = True
            self._deferred.budget.close()  # a save waiting for device budget raises CacheClosedError
            self._finalizer()  # stops the committer once
            self._budget.release()  # (the other caches stop counting it: its storage goes once it is dropped)
            self._staging.close()
            with self._cond:
                # (their records stay in the write records: a read under way still serves their rows
                # from the clones, which stay readable for it, instead of the pool's unwritten slots)
                for task_id in self._deferred.drop_open():
                    self._tasks.fail(task_id)
                    self._tasks.remove(task_id)
                self._steps.release_at_close()
                self._cond.notify_all()

    def _notify_one(self) -> None:
        """One task was queued (a deferred record flushed to make device budget room)."""
        self._committer.notify(1)

    def _failure_or_none(self) -> WriteFailedError | None:
        return self._failure

    def _closed_error(self, message: str) -> PrefixCacheError:
        """What a call cut short by a failure or close raises: the sticky failure, if any."""
        return self._failure or CacheClosedError(message)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CacheClosedError("the cache is closed")

    # ---- engine thread: begin_step and save --------------------------------------------

    def begin_step(self, events: StepEvents) -> None:
        """Registers this step's events (engine thread, once per step, before the forward).

        A new request with ``num_computed_tokens > 0`` registers a hit span, read at its first
        save. A resumed request, or a live one continued as new, gets exactly the rows its
        consumer has not received (the native `Deliveries`, which checks and registers the
        events in one call); its open deferred rows are queued for writing, since it may
        recompute them. Writes of finished or aborted requests go to the front of the copy queue.
        """
        self._check_usable()
        if not isinstance(events, StepEvents):
            raise InvalidInputError(f"begin_step takes StepEvents, got {type(events).__name__}")
        self._copies.fence()  # (before the events register: a fence that raises leaves them unseen)
        self._records.reap()
        # (each read once into a list: a one-shot iterator of finished ids is read twice below)
        finished = as_list(events.finished, "StepEvents.finished")
        new = as_list(events.new, "StepEvents.new")
        resumed = as_list(events.resumed, "StepEvents.resumed")
        dropped = as_id_map(events.dropped, "StepEvents.dropped")
        dropped_saves = as_id_map(events.dropped_saves, "StepEvents.dropped_saves", "numbers of saves")
        hits, misses, reentered, planned = self._delivery.begin(
            finished,
            new,
            resumed,
            NewRequest,
            ResumedRequest,
            self._config.num_blocks,
            dropped,
            dropped_saves,
            self._prefetch.enabled,  # (the planned reads' slots, only for a prefetch to gather)
        )
        if planned:  # (off the engine thread, during the forward: `omni_pcache.prefetch`)
            self._prefetch.start(planned)
        self._requests_live = len(self._delivery)  # (for `stats` on any thread: `Deliveries` is the engine thread's)
        flushed = 0
        try:
            if self._records.open_writes or self._deferred.open:
                for req_id in finished:
                    self._records.escalate_unwritten(req_id)
                    flushed += self._deferred.finish(req_id)
            for req_id in reentered:
                flushed += self._deferred.close_open(req_id)
        except (TaskStateError, CacheClosedError):  # a failure or close (another thread) meanwhile
            if flushed:  # (records queued before it are written, as close writes what is queued)
                self._committer.notify(flushed)
            raise self._closed_error("the cache is closed") from None
        if flushed:
            self._committer.notify(flushed)
        if hits or misses:
            self._counters.requests(hits, misses)

    def fence(self) -> None:
        """Makes the next forward wait for the last save's copies (engine thread; on CUDA the host
        does not block), as `begin_step` does first: call it before a forward no `begin_step`
        precedes, such as vLLM's dummy run on an idle data-parallel rank, whose CUDA-graph replay
        would otherwise overwrite the graph's output buffer while the last step's rows are
        still being copied from it. The saved tensors are the caller's again after it."""
        self._copies.fence()

    @outside_inference_mode
    def save(self, hidden: torch.Tensor | None, mm: dict[str, Any] | None, batch: StepBatch) -> int:
        """Saves one step's outputs and returns its step id (engine thread, after the forward).

        Never waits for the copy it launches (a side CUDA stream, or the committer for CPU
        tensors of `copy_engine.INLINE_COPY_BYTES` or more; smaller ones are copied here). A
        small all-CPU step is also written to the pool here while the committer is idle
        (`CacheConfig.inline_write_bytes`).
        ``hidden`` and ``mm`` must stay unchanged until the next `begin_step`, which
        fences the copy; the caller may overwrite them after it. Waits only for a free staging
        page when ``staging_depth`` step ids are unconsumed, up to ``claim_timeout_s``, and, in
        one rare case, for a small device→host copy of an earlier step's rows: when this step
        takes slots whose rows a pending hit still needs and only a deferred key's device clone
        holds them (`StepClaims.keep_aside`; never for this step's forward). The returned id
        must be consumed exactly once by `materialize` or `discard`.
        """
        self._check_usable()
        shape = check_batch(batch, self._config)
        one_row_each = shape.n == len(shape.claim_req_ids)
        rows, leftover = self._keys.classify(
            hidden, {} if mm is None else mm, shape.n, shape.n_padded, one_row_each=one_row_each
        )
        deferred_names = self._policy.deferred_keys
        if deferred_names:
            self._deferred.check_fits({name: row_bytes(rows[name]) * shape.n for name in deferred_names & rows.keys()})
        step_id, page = self._steps.issue()
        handle: CopyHandle | None = None
        now = False  # (save writes the step to the pool itself, holding the writer's lock)
        arrays: dict[str, Any] | None = None
        added: tuple[str, ...] = ()  # (keys and leftover names this step registered)
        try:
            copy = self._copies.start()
            # Leftovers first: one that cannot be copied refuses the step before its keys are
            # registered, so a corrected retry is classified afresh (`KeyRegistry.register`).
            kept_leftover = {name: snapshot(value, copy, name) for name, value in leftover.items()}
            cached, added = self._keys.register(rows, leftover, shape.n)
            keys = self._keys.step_keys(cached, self._storage.make_room)  # (the same key set every step: one lookup)
            specs, immediate, deferred = keys.specs, keys.immediate, keys.deferred
            sources: dict[str, torch.Tensor] = {}  # the caller's CPU rows, per immediate key
            staged: dict[str, torch.Tensor] = {}  # the step's rows, per immediate key: page views or own copies
            for spec in immediate:
                src = cached[spec.name][1]
                if src.shape[0] != shape.n:  # (padded past the scheduled rows; else no view to make)
                    src = src[: shape.n]
                if not src.is_cuda:
                    sources[spec.name] = src
                staged[spec.name] = src
            small = self._inline.eligible(shape.n, keys, sources)
            if small and self._inline.owns_rows(shape.n, keys) and (now := self._committer.hold_writer()):
                arrays = own_copies(keys.immediate, staged)
                if arrays is None:  # (rows numpy cannot show as they are: the page path below decides)
                    self._committer.release_writer()
                    now = False
            if arrays is None:
                for name, src in staged.items():
                    staged[name] = dst = self._pages.page(name, page)[: shape.n]
                    copy.copy(dst, src)
            else:  # materialize reads the step's own copies, never the caller's tensors
                sources = {}
            handle = copy.finish()
            clones = self._deferred.clone_step(deferred, cached, shape)  # charges only if it returns
        except BaseException as exc:  # a leftover that cannot be copied, no device budget in time, ...
            if now:
                self._committer.release_writer()
            self._abandon_save(step_id, page, handle)
            self._keys.forget(added)  # (nothing is claimed on them yet; their copies have landed)
            self._storage.free(added)
            self._budget.refresh()  # (the others need not count keys admitted for this step now)
            if self._failure is not None or isinstance(exc, CacheClosedError):  # every call raises the failure
                raise self._closed_error("the cache was closed during save") from None
            raise
        if deferred and self._deferred.open:  # (a request's open record holds one key set)
            try:
                flushed = self._deferred.close_other_keys(shape.claim_req_ids, deferred)
            except (TaskStateError, CacheClosedError):  # a failure or close (another thread) meanwhile
                self._deferred.discard_clones(clones)
                self._abandon_save(step_id, page, handle)
                raise self._closed_error("the cache was closed during save") from None
            if flushed:
                self._committer.notify(flushed)
        # A small all-CPU step is written here, before its hits are planned, while the committer
        # is idle: its tasks are never queued and no record of them is kept (`omni_pcache.inline_writes`).
        own_write_failed = False
        try:
            if not now:  # (rows in the page: written here once their copies are done)
                now = small and handle.done() and self._committer.hold_writer()
            try:
                task_ids, from_pool, from_deferred = self._claims.claim(
                    step_id, page, shape, immediate, deferred, handle, clones, not now, keys.omitted
                )
            except CacheClosedError:  # (claims fail only when the cache failed or closed meanwhile)
                self._deferred.discard_clones(clones)  # (a refused claim holds nothing: nor does the step)
                self._abandon_save(step_id, page, handle)
                raise self._closed_error("the cache was closed during save") from None
            try:
                self._claims.keep_aside(from_pool, from_deferred)  # (before this step's rows overwrite them)
            except BaseException as exc:
                # The rows pending reads are owed are lost and the claims cannot be undone: the
                # cache fails (sticky), releasing the step's tasks, reads and page; save raises
                # that failure below, as for a failure since the claims. It holds the writer's
                # lock, as every other failure does (the committer's batch lands first).
                with contextlib.nullcontext() if now else self._committer.writer_held():
                    self._on_write_failure(-1, exc, f"the copy of rows kept aside for pending reads (step {step_id})")
            else:
                own_write_failed = (
                    now and bool(task_ids) and self._inline.write(step_id, page, shape, immediate, task_ids, arrays)
                )
        finally:
            if now:
                self._committer.release_writer()
        with self._cond:
            # (a failure since the claims released every step's reads and pages: this step must
            # not plan reads or hold its id; save raises it, unless it is this save's own write's,
            # raised by the next call)
            failure = self._failure
            if failure is None and self._closed:  # (no step id is consumed after close: none is recorded)
                self._prefetch.clear()
                self._delivery.take_step(shape.rows)
                self._steps.discard_at_close(step_id)
            elif failure is None:
                rows, reads = self._delivery.take_step(shape.rows)
                hits: dict[str, HitRead] = {req: self._reader.plan(req, read, specs) for req, read in reads.items()}
                if self._prefetch.pending:
                    self._prefetch.attach(hits)
                self._prefetch.specs = specs  # (the keys the next step's hits are prefetched under)
                if self._prefetch.undecided and cached:
                    self._prefetch.saw_rows(any(value.is_cuda for _spec, value in cached.values()))
                self._steps.records[step_id] = StepRecord(
                    step_id, page, handle, shape.n, shape.n_padded, rows, list(cached), hits, kept_leftover, clones,
                    sources, staged, threading.get_ident(), self._copies.epoch, keys.max_row_bytes, arrays is not None,
                )  # fmt: skip
        if failure is not None:
            self._abandon_save(step_id, page, handle)
            if own_write_failed:
                return step_id
            raise failure
        if now:
            return step_id
        try:
            self._tasks.enqueue_many(task_ids)
        except TaskStateError:  # the committer failed meanwhile and failed these tasks with the rest
            raise self._closed_error("the cache was closed during save") from None
        self._committer.notify(len(task_ids))
        return step_id

    def _abandon_save(self, step_id: int, page: int, handle: CopyHandle | None) -> None:
        """Undoes a save refused before its claims: its copies into the page land first (a CPU
        copy handed to the committer would otherwise run at the next fence, into a page a later
        step may hold by then), then its step id is consumed and its page released."""
        if handle is not None:
            with contextlib.suppress(Exception):  # (a copy that fails leaves the page as undefined)
                handle.wait()
        self._steps.abandon(step_id, page)

    # ---- committer thread --------------------------------------------------------------

    def _write_tasks(self, task_ids: list[int]) -> None:
        """Writes a batch of queued tasks (the pool's writer: the committer, or the engine thread
        in inline mode); `PoolWriter.write_batch` commits and releases them."""
        if self._failure is not None:
            raise self._failure
        self._writer.write_batch(self._records.groups(task_ids))

    def _on_write_failure(self, task_id: int, exc: BaseException, what: str | None = None) -> None:
        """Makes the failure sticky and releases every page and waiter (the writing thread, or
        the engine thread for a copy in save: always holding the pool writer's lock).
        ``task_id`` is -1 for a failure outside a write: ``what`` says what failed (default:
        the committer itself); for a task, ``what`` names its request and step when no record
        of it is kept."""
        with self._cond:
            if self._failure is None:
                record = self._records.by_task.get(task_id)
                if what is None and task_id >= 0:
                    what = f"request {record.req_of(task_id)!r}, step {record.step_id}" if record else "unknown"
                self._failure = write_failed_error(task_id, exc, what)
            self._cond.notify_all()
        self._release_after_failure()

    def _release_after_failure(self) -> None:
        """Releases everything the failed cache holds and wakes every waiter (`failure`)."""
        with self._cond:
            release_everything(
                self._tasks,
                self._ledger,
                self._steps.records,
                self._reader,
                self._records.by_task,
                self._deferred,
                self._staging,
            )
            self._cond.notify_all()

    # ---- any thread: materialize, discard ----------------------------------------------

    @outside_inference_mode
    def materialize(self, step_id: int, req_ids: Sequence[str]) -> StepOutputs:
        """Per-request outputs of step ``step_id`` (any thread, exactly once per step id).

        A request with a hit gets its cached prefix rows followed by this step's rows; a miss
        gets this step's rows. The requests' tensors of a key are slices of one new host tensor
        (one per chunk of `outputs.OUTPUT_CHUNK_BYTES`); every returned tensor is the caller's
        to keep or write (a leftover passed whole is one snapshot shared by the step's
        requests). Raises
        `UnservableHitError` for rows that cannot be served, `StepIdError` for a consumed or
        unknown id, `InvalidInputError` for a request that was not in the step, or for
        ``req_ids`` that is not a sequence of ids (a single str, ``None``), holds an unhashable
        id or names a request twice (the step id is then not consumed).
        """
        self._check_usable()
        req_ids = as_list(req_ids, "req_ids")  # (an iterator would be spent by the check below)
        record = self._steps.take(step_id, req_ids)
        try:
            return self._outputs.build(record, req_ids)
        finally:
            self._steps.finish(record)

    def discard(self, step_id: int) -> None:
        """Consumes a step id whose outputs nobody needs (any thread). Writes still land."""
        self._check_usable()
        self._steps.finish(self._steps.take(step_id, None))

    def awaited(self, step_id: int) -> bool:
        """Whether step ``step_id`` is saved and neither `materialize` nor `discard` has taken it
        yet, nor `close` (any thread; a snapshot, no lock: one dict lookup). The vLLM adapter reads it to
        tell an output still in flight at a reset from one the scheduler already has. Raises
        `InvalidInputError` for an id that is not an int."""
        if type(step_id) is not int:  # (the usual id needs no more look)
            check_step_id(step_id)
        return step_id in self._steps.records

    # ---- stats -------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A snapshot of the counters (any thread; works after a failure or close)."""
        c = self._counters
        return CacheStats(
            hits=c.hits,
            misses=c.misses,
            rows_from_pool=c.rows_from_pool,
            rows_in_flight=c.rows_in_flight,
            rows_preserved=c.rows_preserved,
            rows_prefetched=c.rows_prefetched,
            bytes_written=dict(self._writer.bytes_written),
            num_waits=c.num_waits,
            wait_time_s=c.wait_time_s,
            staging_holders=self._staging.holders(),
            pool_bytes=self._pool.nbytes(),
            staging_bytes=self._pages.nbytes(),
            steps_outstanding=self._steps.ids.outstanding(),
            tasks_live=sum(1 for _, state in self._tasks.states() if state != "WRITTEN"),
            preserved_entries=len(self._preserved),
            device_bytes=self._deferred.budget.used,
            deferred_open=len(self._deferred.open),
            requests_live=self._requests_live,
            reads_pending=self._ledger.num_pending_reads,
            host_budget_bytes=self._budget.limit,
            host_reserved_bytes=self._budget.reserved,
        )


__all__ = ["PrefixCache", "PrefixCacheError"]
