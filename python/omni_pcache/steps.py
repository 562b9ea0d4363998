"""Step ids and their staging pages, from `PrefixCache.save` to the one consumption.

A save issues a step id and claims a staging page for it (``("step", id)`` holds the page
until the id is consumed); `take` consumes the id exactly once (materialize or discard, any
thread) and `finish` releases the step's hit reads, its page, and the preserved rows no step
can need any more. A step whose id is consumed but whose reads are still being served (a
materialize under way) still bounds that drop, as an outstanding one does.

Threads: `issue` and `abandon` on the engine thread; `take` and `finish` on any thread. The
step records, the set of steps being materialized and the page releases are guarded by the
cache's ledger lock (shared ``cond``), as the failure path that releases every page is.
"""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Callable, Sequence

from omni_pcache._native import StagingSlots, StepIds
from omni_pcache.config import CacheConfig
from omni_pcache.errors import CacheClosedError, InvalidInputError, PrefixCacheError, StagingTimeoutError, StepIdError
from omni_pcache.outputs import StepRecord
from omni_pcache.preserve import PreservedRows
from omni_pcache.reads import HitReader
from omni_pcache.validation import check_step_id

_STEP_ID_BASES = itertools.count()
"""Each cache issues step ids from its own 2**40-wide range: an id kept across a rebuild (a
vLLM runner re-initializing its KV cache) is refused by the new cache as never issued instead
of naming one of its steps."""


def _same_objects(req_ids: Sequence[object], saved: dict[str, object]) -> bool:
    """Whether ``req_ids`` are the step's own id objects, all of them, in batch order."""
    return len(req_ids) == len(saved) and all(map(operator.is_, req_ids, saved))


class StepPages:
    """The outstanding step ids, their records and their staging pages (see the module doc)."""

    def __init__(
        self,
        config: CacheConfig,
        staging: StagingSlots,
        reader: HitReader,
        preserved: PreservedRows,
        cond: threading.Condition,
        waited: Callable[[float], None],
        closed_error: Callable[[str], PrefixCacheError],
        failure: Callable[[], PrefixCacheError | None],
    ) -> None:
        self._config = config
        self._staging = staging
        self._reader = reader
        self._preserved = preserved
        self._cond = cond
        self._waited = waited  # records a blocking wait in the stats
        self._closed_error = closed_error  # the sticky failure, else CacheClosedError(message)
        self._failure = failure  # the sticky failure, if any
        self.ids = StepIds(next(_STEP_ID_BASES) << 40)
        self.records: dict[int, StepRecord] = {}  # saved, not yet consumed (ledger lock)
        self._building: set[int] = set()  # consumed, materialize under way (ledger lock)

    def issue(self) -> tuple[int, int]:
        """A new step id and its staging page (engine thread). Waits for a free page up to
        ``claim_timeout_s``; on failure the id is consumed again and nothing is held."""
        step_id = self.ids.issue()
        holder = ("step", step_id)
        try:
            page = self._staging.try_claim(holder)
            if page is not None:
                return step_id, page
        except CacheClosedError:
            self.ids.consume(step_id)
            raise self._closed_error("the cache is closed") from None
        start = time.monotonic()
        try:
            return step_id, self._staging.claim(holder, self._config.claim_timeout_s)
        except StagingTimeoutError as exc:
            self.ids.consume(step_id)
            unconsumed = self.ids.outstanding()
            err = StagingTimeoutError(
                f"save waited {self._config.claim_timeout_s:g} s for a free staging page; "
                f"{len(unconsumed)} step ids are unconsumed: {unconsumed} (each must be materialized "
                f"or discarded; staging_depth={self._config.staging_depth}); page holders: {exc.holders}"
            )
            err.holders = exc.holders
            err.unconsumed = unconsumed
            raise err from None
        except CacheClosedError:
            self.ids.consume(step_id)
            raise self._closed_error("the cache is closed") from None
        finally:
            self._waited(time.monotonic() - start)

    def abandon(self, step_id: int, page: int) -> None:
        """Undoes a save that raised before claiming any rows (engine thread): its step id is
        consumed and its staging page released, so a refused save holds nothing. The caller
        has waited for the copies it launched into the page (`PrefixCache.save`): a CPU copy
        handed to the committer would otherwise land at the next fence, over the rows of a
        later step that took the page."""
        self.ids.consume(step_id)
        self._release_page(page, step_id)

    def take(self, step_id: int, req_ids: Sequence[str] | None) -> StepRecord:
        """Consumes ``step_id`` (any thread) and returns its record. Raises `InvalidInputError`
        for a request that was not in the step (the id is then not consumed), `StepIdError` for
        a consumed or unknown id, or for an id whose save has not returned yet (issued, no
        record: another thread's save under way; not consumed, so that save's step stays
        whole), and the failure or `CacheClosedError` once the cache failed or closed (a step
        taken before still serves its rows)."""
        check_step_id(step_id)
        if not 0 <= step_id < 2**64:  # (no step id is out of u64 range: never issued)
            raise StepIdError(f"step#{step_id} was never issued; outstanding step ids: {self.ids.outstanding()}")
        record = self.records.get(step_id)
        # The usual call names the step's own request ids (the very objects saved), every one in
        # batch order, and needs none of the checks. Identity, not equality: an object that only
        # compares equal to an id (a one-element numpy array of it) must meet the checks.
        if record is not None and req_ids is not None:
            _check_req_ids(step_id, record, req_ids)
        with self._cond:  # (atomic with `finish`'s bound on the preserved rows, and with save's record)
            # A failure since the caller checked the cache released this outstanding step's hit
            # reads (`failure.release_everything`, under this lock): raise it, as every call it
            # cuts short does. A step taken before it keeps its reads (it is no longer listed).
            if (failure := self._failure()) is not None:
                raise failure
            if self._staging.closed:  # (close released the outstanding steps' reads: `release_at_close`)
                raise self._closed_error("the cache was closed before this step was taken")
            now = self.records.get(step_id)
            if now is None and step_id in self.ids.outstanding():
                err = StepIdError(f"step#{step_id} is not saved yet (its save has not returned); nothing was consumed")
                err.step_id, err.outstanding = step_id, self.ids.outstanding()
                raise err
            if now is not None and record is None and req_ids is not None:  # (saved since the look above)
                _check_req_ids(step_id, now, req_ids)
            self.ids.consume(step_id)  # raises StepIdError for a second or unknown consumption
            self._building.add(step_id)
            return self.records.pop(step_id)

    def finish(self, record: StepRecord) -> None:
        """Releases a consumed step's reads, and the preserved rows no step can need any more:
        those created up to the oldest step still outstanding or still being materialized on
        some thread (its id is consumed, but its reads are not served yet); then its page."""
        with self._cond:
            for hit in record.hits.values():
                self._reader.release(hit)
            self._building.discard(record.step_id)
            if self._preserved.steps_held:
                live = self.ids.outstanding()[:1] + list(self._building)
                self._preserved.drop_through(min(live) if live else None)
            self._release_page_locked(record.page, record.step_id)

    def _release_page(self, page: int, step_id: int) -> None:
        with self._cond:
            self._release_page_locked(page, step_id)

    def _release_page_locked(self, page: int, step_id: int) -> None:
        """Drops the step's hold on its staging page, unless a failure or close already released
        every step's (caller holds the ledger lock, as both do, so they cannot interleave)."""
        if not self._staging.closed:
            self._staging.release(page, ("step", step_id))

    def release_at_close(self) -> None:
        """At close, after the staging registry closed (ledger lock held): the steps not
        consumed yet never can be, so their ids are consumed here (`stats().steps_outstanding`
        is empty, `awaited` False), their hit reads released and the rows kept aside for them
        dropped; every step's hold on its page is dropped. A materialize under way still reads
        its page, its own reads and the rows kept aside for it (its record is no longer
        listed; nothing writes a page once the registry is closed). A save racing close records
        no step (`discard_at_close`). The write tasks' holds stay: a task queued by a save
        racing close is still written, and its writer releases its own."""
        for step_id, record in self.records.items():
            for hit in record.hits.values():
                self._reader.release(hit)
            self.ids.consume(step_id)
        self.records.clear()
        if self._preserved.steps_held:
            self._preserved.drop_through(min(self._building) if self._building else None)
        release_page_holders(self._staging, "step")

    def discard_at_close(self, step_id: int) -> None:
        """Consumes the id of a step whose save finished after close (ledger lock held): it is
        not recorded, as nothing can take it (`release_at_close` released its page)."""
        self.ids.consume(step_id)


def release_page_holders(staging: StagingSlots, kind: str | None = None) -> None:
    """Drops every holder of every staging page (``kind``: only holders of that kind, "step"
    or "task"); the caller holds the ledger lock (a failure or close, after closing the
    registry)."""
    for page, holders in enumerate(staging.holders()):
        for holder in holders:
            if kind is None or holder[0] == kind:
                staging.release(page, holder)


def _check_req_ids(step_id: int, record: StepRecord, req_ids: Sequence[str]) -> None:
    """Raises `InvalidInputError` unless ``req_ids`` names requests of the step, each once;
    nothing is skipped for the usual call, the step's own id objects in batch order."""
    if _same_objects(req_ids, record.rows):
        return
    try:
        wanted = set(req_ids)
    except TypeError:  # an unhashable id (a list, a dict, a tuple holding one, ...)
        unhashable = [r for r in req_ids if not _hashable(r)]
        raise InvalidInputError(
            f"req_ids holds request ids (str), got {(unhashable or [req_ids])[0]!r}; nothing was consumed"
        ) from None
    if len(wanted) != len(req_ids):  # (each request's rows are returned once, under its id)
        twice = sorted({r for r in req_ids if req_ids.count(r) > 1}, key=repr)
        raise InvalidInputError(f"req_ids has duplicates: {twice}; nothing was consumed")
    unknown = wanted - record.rows.keys()
    if unknown:
        missing = [r for r in req_ids if r in unknown]  # (in the caller's order)
        raise InvalidInputError(f"requests {missing} were not in step {step_id}; its requests: {list(record.rows)}")


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


__all__ = ["StepPages", "release_page_holders"]
