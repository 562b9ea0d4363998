"""A failed copy or pool write: sticky, loud, and nothing hangs or stays held."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cachekit import describe, fail_first_pool_allocation, rows, slots_of, small_cache, start_thread
from omni_pcache import (
    CacheClosedError,
    CachePolicy,
    InvalidInputError,
    NewRequest,
    StepBatch,
    StepEvents,
    WriteFailedError,
    WriteTimeoutError,
)


def save_one(cache, first_slot=0, n=2):
    return cache.save(torch.ones(n, 2), {}, StepBatch(["a"], [n], np.arange(first_slot, first_slot + n)))


@pytest.mark.parametrize(
    ("threaded", "inline_write_bytes", "where"),
    [
        (True, 0, "pool_write"),
        (True, 0, "copy_wait"),
        (False, 0, "pool_write"),
        (False, 0, "copy_wait"),
        # a small step written by save itself: no queue, no copy wait; its one native call fails
        (True, 1 << 20, "native_write_in_save"),
    ],
    ids=["committer-pool_write", "committer-copy_wait", "inline-mode-pool_write", "inline-mode-copy_wait", "in-save"],
)
def test_a_failed_write_is_sticky_and_releases_everything(
    monkeypatch, threaded: bool, inline_write_bytes: int, where: str
) -> None:
    cache = small_cache(inline_write_bytes=inline_write_bytes, threaded=threaded, staging_depth=2, claim_timeout_s=5.0)
    boom = RuntimeError("injected: disk on fire")

    def fail(*args, **kwargs):
        raise boom

    if where == "pool_write":
        cache._writer.write_step = fail
    elif where == "copy_wait":
        cache._writer.write_batch = fail
    else:
        monkeypatch.setattr("omni_pcache.writes.write_step_now", fail)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    first = save_one(cache)
    with pytest.raises(
        WriteFailedError, match=rf"write task#0 \(request 'a', step {first}\) failed.*disk on fire"
    ) as err:
        cache.flush()
    assert err.value.task_id == 0
    assert err.value.__cause__ is boom

    def enter() -> None:
        with cache:
            pass

    calls = (
        lambda: cache.begin_step(StepEvents()),
        lambda: save_one(cache, first_slot=2),
        lambda: cache.materialize(first, ["a"]),
        lambda: cache.discard(first),
        cache.flush,
    )
    for call in calls:
        with pytest.raises(WriteFailedError, match="task#0"):
            call()
    stats = cache.stats()  # still readable for diagnostics
    assert stats.staging_holders == [[], []], "every staging page released"
    assert stats.tasks_live == 1
    cache.close()
    for call in (*calls, enter):  # (closed since: still the failure, which the caller must see)
        with pytest.raises(WriteFailedError, match="task#0"):
            call()


def test_a_save_waiting_for_a_page_wakes_when_a_write_fails() -> None:
    cache = small_cache(inline_write_bytes=0, staging_depth=1, claim_timeout_s=30.0)
    gate = threading.Event()
    write = cache._writer.write_batch

    def slow_then_fail(record):
        gate.wait(10)
        raise OSError("injected")

    cache._writer.write_batch = slow_then_fail
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    save_one(cache)
    waiter, errors = start_thread(save_one, cache, 2)
    time.sleep(0.1)  # (the save is waiting for the page the failing write holds)
    assert waiter.is_alive() and not errors, "the second save must be waiting for the only page"
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive(), "the waiting save hung"
    assert len(errors) == 1 and isinstance(errors[0], WriteFailedError), errors
    assert "failed: OSError('injected')" in str(errors[0])
    cache._writer.write_batch = write
    cache.close()


def test_a_materialize_waiting_on_a_write_wakes_when_it_fails() -> None:
    cache = small_cache(inline_write_bytes=0, claim_timeout_s=30.0)
    gate = threading.Event()
    entered = threading.Event()

    def slow_then_fail(record):
        entered.set()
        gate.wait(10)
        raise OSError("injected")

    cache._writer.write_batch = slow_then_fail
    # b hits block 0 while a computes it in the same step: materialize must wait for a's write.
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [0, 2], 4)]))
    sid = cache.save(torch.ones(6, 2), {}, StepBatch(["a", "b"], [5, 1], np.array([0, 1, 2, 3, 4, 8])))
    assert entered.wait(10)
    t, errors = start_thread(cache.materialize, sid, ["b"])
    gate.set()
    t.join(10)
    assert not t.is_alive(), "materialize hung on a failed write"
    assert len(errors) == 1 and isinstance(errors[0], WriteFailedError), errors
    cache.close()


def test_a_broken_committer_thread_fails_loudly_instead_of_hanging() -> None:
    with small_cache(inline_write_bytes=0, claim_timeout_s=5.0) as cache:
        tasks = cache._committer._tasks

        class Broken:
            def __getattr__(self, name):
                return getattr(tasks, name)

            def pop_many(self, max_tasks):
                raise RuntimeError("queue corrupted")

        cache._committer._tasks = Broken()
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4)))
        with pytest.raises(WriteFailedError, match=r"the committer thread failed: RuntimeError\('queue corrupted'\)"):
            cache.flush()
        with pytest.raises(WriteFailedError):
            cache.materialize(sid, ["a"])
        assert cache.stats().staging_holders == [[], [], []]


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["queued", "written-in-save"])
def test_a_failure_while_save_is_between_its_claims_and_its_queueing_raises_the_sticky_error(
    inline_write_bytes: int,
) -> None:
    # The committer fails (and fails every live task) right after save claimed its rows: save
    # reports that failure, not the refused queueing (or write) of its now-FAILED tasks.
    with small_cache(inline_write_bytes=inline_write_bytes) as cache:
        claim_rows = cache._claims.claim

        def claims_then_the_committer_fails(*args, **kwargs):
            out = claim_rows(*args, **kwargs)
            cache._on_write_failure(-1, RuntimeError("pool write failed"))  # what the committer runs
            return out

        cache._claims.claim = claims_then_the_committer_fails
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        with pytest.raises(WriteFailedError, match=r"the committer thread failed: RuntimeError\('pool write failed'\)"):
            save_one(cache)
        assert cache.stats().staging_holders == [[], [], []]


def test_a_save_that_cannot_make_room_for_a_new_key_raises_and_the_next_save_tries_again() -> None:
    # Pool storage for a key is made at the first save that shows it; if that fails, the save
    # raises having held nothing, and the next save makes the room (it is not remembered as made).
    with small_cache() as cache:
        calls = fail_first_pool_allocation(cache)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        refused = r"'hidden' rows \(2,\) float32: its host pool cannot be allocated"
        with pytest.raises(InvalidInputError, match=refused) as err:
            save_one(cache)
        assert isinstance(err.value.__cause__, MemoryError)
        assert cache.stats().steps_outstanding == [] and cache.stats().tasks_live == 0
        out = cache.materialize(save_one(cache), ["a"])
        assert torch.equal(out.hidden["a"], torch.ones(2, 2))
        assert calls == ["hidden", "hidden"]
        cache.materialize(save_one(cache, first_slot=2), ["a"])
        assert calls == ["hidden", "hidden"], "room made once the key set is known"


@pytest.mark.parametrize("inline_write_bytes", [0, None], ids=["committer", "written-in-save"])
def test_a_save_whose_claims_find_the_cache_closed_leaves_no_step_outstanding(inline_write_bytes) -> None:
    """The staging registry closes between a save's step id and its claims (close() on another
    thread, or a committer failure releasing everything): the native claim refuses, save raises
    CacheClosedError, and its step id is not left outstanding in the stats."""
    overrides = {} if inline_write_bytes is None else {"inline_write_bytes": inline_write_bytes}
    with small_cache(**overrides) as cache:
        claim = cache._claims.claim

        def closed_meanwhile(*args):
            cache._staging.close()  # (what close() and the failure path do to the registry)
            return claim(*args)

        cache._claims.claim = closed_meanwhile
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        with pytest.raises(CacheClosedError, match="the cache was closed during save"):
            save_one(cache)
        assert cache.stats().steps_outstanding == [] and cache.stats().tasks_live == 0


def test_a_write_by_save_refused_in_its_native_call_is_sticky_and_releases_everything() -> None:
    # Two requests, the step written by save itself under one task for both: the task is
    # failed just before the native call, which refuses to start it. The failure is sticky and
    # names the step and its requests; every page is released and the task ends FAILED.
    with small_cache(staging_depth=2, claim_timeout_s=5.0) as cache:
        write = cache._writer.write_step_now

        def task_failed_first(page, keys, task_ids, offsets, arrays):
            assert task_ids == [0] and offsets == [0], "one task for the whole step"
            cache._tasks.fail(task_ids[0])
            write(page, keys, task_ids, offsets, arrays)

        cache._writer.write_step_now = task_failed_first
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        sid = cache.save(torch.ones(4, 2), {}, StepBatch(["a", "b"], [2, 2], np.array([0, 1, 16, 17])))
        with pytest.raises(
            WriteFailedError, match=rf"write task#0 \(requests 'a' to 'b' \(2\), step {sid}\) failed: TaskStateError"
        ):
            cache.materialize(sid, ["a", "b"])
        stats = cache.stats()
        assert stats.staging_holders == [[], []], "every staging page released"
        assert (stats.steps_outstanding, stats.reads_pending) == ([], 0), "its step holds nothing"
        assert sorted(cache._tasks.states()) == [(0, "FAILED")]


def test_a_save_that_fails_after_handing_its_copy_over_leaves_no_copy_into_the_page(monkeypatch) -> None:
    # A save refused after its CPU copy went to the committer (here: the deferred keys' clone
    # fails) frees its staging page; a retried save may take that page before the next
    # begin_step. The refused copy must have landed first, not at that fence, over the new rows.
    from omni_pcache import copy_engine

    # (every step through the page: a small step save writes itself is read from its own copies)
    with small_cache(staging_depth=1, inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        # A first step registers the key, so the refused save copies into the page every later
        # step uses (a key's first save that is refused frees the storage it allocated).
        first = cache.save(torch.full((4, 2), 3.0), {}, StepBatch(["a"], [4], np.arange(4)))
        cache.materialize(first, ["a"])
        cache.begin_step(StepEvents())
        clone_step = cache._deferred.clone_step

        def refuse(*args, **kwargs):
            raise RuntimeError("injected: no device memory for the clone")

        monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 0)  # the copy goes to the committer
        cache._deferred.clone_step = refuse
        with pytest.raises(RuntimeError, match="injected"):
            cache.save(torch.full((4, 2), 7.0), {}, StepBatch(["a"], [4], np.arange(4, 8)))
        monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 1 << 20)  # the retry copies in save
        cache._deferred.clone_step = clone_step
        sid = cache.save(torch.full((4, 2), 1.0), {}, StepBatch(["a"], [4], np.arange(4, 8)))
        cache.begin_step(StepEvents())  # the fence: the step's rows are read from its page now
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.full((4, 2), 1.0))
        cache.flush()
        cache.begin_step(StepEvents(new=[NewRequest("h", [0, 1, 2], 8)]))
        hit = cache.materialize(cache.save(torch.zeros(1, 2), {}, StepBatch(["h"], [1], np.array([8]))), ["h"])
        assert torch.equal(hit.hidden["h"][:8], torch.cat([torch.full((4, 2), 3.0), torch.full((4, 2), 1.0)]))
        cache.flush()  # (the committer writes the hit step's own task, which holds the page until then)
        assert cache.stats().staging_holders == [[]]


class _PausingTasks:
    """The cache's `WriteTasks`, with a hook run right after (or before) one of its methods."""

    def __init__(self, tasks, method: str, hook, before: bool = False) -> None:
        self._tasks, self._method, self._hook, self._before = tasks, method, hook, before

    def __getattr__(self, name: str):
        call = getattr(self._tasks, name)
        if name != self._method:
            return call

        def hooked(*args):
            if self._before:
                self._hook()
            out = call(*args)
            if not self._before:
                self._hook()
            return out

        return hooked

    def __len__(self) -> int:
        return len(self._tasks)


def test_a_save_that_queues_its_rows_while_close_runs_still_has_them_written() -> None:
    # close() lands between a save's claims and its queueing: the committer has stopped, so
    # the save's notify writes the rows itself (close writes what is queued; before, they
    # stayed QUEUED and a flush waited out claim_timeout_s).
    cache = small_cache(inline_write_bytes=0, claim_timeout_s=30.0)
    inside, go = threading.Event(), threading.Event()
    cache._tasks = _PausingTasks(cache._tasks, "enqueue_many", lambda: (inside.set(), go.wait(10)), before=True)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    saved: list[int] = []
    saver, errors = start_thread(
        lambda: saved.append(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
    )
    assert inside.wait(10)
    cache.close()
    go.set()
    saver.join(10)
    assert saved and not saver.is_alive() and not errors
    done = threading.Event()
    flusher, errors = start_thread(lambda: (cache.flush(), done.set()))
    flusher.join(10)
    assert done.is_set() and not errors, f"flush waited for rows nobody would write: {errors}"
    assert cache.stats().bytes_written == {"hidden": 4 * 2 * 4}


def test_a_committer_failure_while_begin_step_flushes_a_finished_requests_deferred_rows_is_the_sticky_error() -> None:
    # The failure drops every open deferred record (on the committer thread) after begin_step
    # registered a finished request and before it queues that request's record: begin_step
    # raises the failure (before: a raw KeyError from the record already dropped). The failure
    # cannot land between the record's escalation and its queueing: both hold the ledger lock.
    cache = small_cache(inline_write_bytes=0, policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))
    failing, failed = threading.Event(), threading.Event()

    def fail_write(groups) -> None:
        failing.wait(10)
        raise RuntimeError("injected: pool write failed")

    cache._writer.write_batch = fail_write
    release = cache._release_after_failure
    cache._release_after_failure = lambda: (release(), failed.set())
    finish = cache._deferred.finish
    cache._deferred.finish = lambda req_id: (failing.set(), failed.wait(10), finish(req_id))[-1]
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.save(torch.ones(8, 2), {"codes": torch.ones(8, 3)}, StepBatch(["a"], [8], np.arange(8)))
    with pytest.raises(WriteFailedError, match="injected: pool write failed"):
        cache.begin_step(StepEvents(finished=["a"]))
    assert failed.is_set()
    with pytest.raises(WriteFailedError):
        cache.flush()
    cache.close()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open) == (0, 0), stats


def _deferred_cache_with_an_open_record():
    """A cache whose live request "a" holds an open deferred record of 8 rows of "codes"."""
    cache = small_cache(inline_write_bytes=0, policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(8, 2), {"codes": torch.ones(8, 3)}, StepBatch(["a"], [8], np.arange(8))))
    cache.flush()
    stats = cache.stats()
    assert (stats.deferred_open, stats.device_bytes, stats.tasks_live) == (1, 8 * 3 * 4, 1), stats
    return cache


def test_close_on_another_thread_before_begin_step_flushes_a_finished_requests_record() -> None:
    # close() forgets the open record (failing its task) after begin_step registered "a" as
    # finished and before it queues a's record: begin_step raises CacheClosedError (before: it
    # went on as if the record had been queued; in other interleavings close raised a raw
    # RuntimeError from the open records changing under it, leaving the rest charged, or
    # begin_step an InvalidInputError for the task close had removed).
    cache = _deferred_cache_with_an_open_record()
    at_finish, closed = threading.Event(), threading.Event()
    finish = cache._deferred.finish
    cache._deferred.finish = lambda req_id: (at_finish.set(), closed.wait(10), finish(req_id))[-1]
    engine, errors = start_thread(cache.begin_step, StepEvents(finished=["a"]))
    assert at_finish.wait(10)
    cache.close()
    closed.set()
    engine.join(10)
    assert len(errors) == 1 and isinstance(errors[0], CacheClosedError), errors
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats


def test_close_on_another_thread_while_begin_step_queues_a_finished_requests_record() -> None:
    # close() comes while begin_step holds the ledger lock to escalate and queue a's record:
    # close waits for it, so the record is queued whole, and written by begin_step itself (the
    # committer has stopped); close then finds no open record. Nothing is left held.
    cache = _deferred_cache_with_an_open_record()
    closing = threading.Event()
    close_budget = cache._deferred.budget.close
    cache._deferred.budget.close = lambda: (close_budget(), closing.set())  # (close's first step)
    closer: list[threading.Thread] = []

    def close_meanwhile() -> None:
        closer.append(start_thread(cache.close)[0])
        assert closing.wait(10)
        time.sleep(0.05)  # (lets close reach the ledger lock, held here; the test passes either way)

    cache._deferred._tasks = _PausingTasks(cache._deferred._tasks, "escalate", close_meanwhile)
    cache.begin_step(StepEvents(finished=["a"]))
    closer[0].join(10)
    assert not closer[0].is_alive()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats
    assert stats.bytes_written["codes"] == 8 * 3 * 4, "a's rows written when queued"


def test_a_write_not_in_the_pool_in_time_is_a_timeout_naming_each_stuck_task() -> None:
    with small_cache(inline_write_bytes=0, claim_timeout_s=0.2) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.materialize(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))), ["a"])
        with pytest.raises(WriteTimeoutError, match=r"write tasks not in the pool after 0\.1\d* s") as flushed:
            cache.flush(0.1)
        # b hits a's block while a's write is still held: its materialize waits claim_timeout_s
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))
        sid = cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8])))
        with pytest.raises(WriteTimeoutError) as served:
            cache.materialize(sid, ["b"])
        for err in (flushed.value, served.value):
            assert len(err.states) == 1 and set(err.states.values()) <= {"QUEUED", "COPYING", "HOST_READY"}
            assert str(next(iter(err.states))) in str(err)
        gate.set()
        cache.flush()  # (the held write lands; nothing failed)
        assert cache.stats().tasks_live == 0


def test_a_flush_timeout_names_every_stuck_task_not_only_the_first() -> None:
    with small_cache(inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("c", [1])]))  # one task each
        cache.discard(cache.save(torch.ones(8, 2), {}, StepBatch(["a", "c"], [4, 4], np.arange(8))))
        try:
            with pytest.raises(WriteTimeoutError) as flushed:
                cache.flush(0.05)
        finally:
            gate.set()
        assert len(flushed.value.states) == 2 and all(str(t) in str(flushed.value) for t in flushed.value.states)
        cache.flush()
        assert cache.stats().tasks_live == 0


def test_a_save_refused_while_it_holds_the_pool_writer_lets_it_go(monkeypatch) -> None:
    # A small CPU step save writes itself takes the pool writer's lock first; a refusal after
    # that must release it, or the committer (and every later write) waits for it forever.
    from omni_pcache import cache as cache_module

    own_copies = cache_module.own_copies

    def refuse_once(*args):
        monkeypatch.setattr(cache_module, "own_copies", own_copies)
        raise RuntimeError("injected: no memory for the step's own copies")

    monkeypatch.setattr(cache_module, "own_copies", refuse_once)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        with pytest.raises(RuntimeError, match="injected"):
            cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4)))
        # (were the lock still held, this step would be queued for a committer that never gets it)
        cache.discard(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
        cache.flush(timeout_s=5)
        assert cache.stats().tasks_live == 0


def test_a_write_failure_releases_the_hit_reads_of_outstanding_steps() -> None:
    cache = small_cache(inline_write_bytes=0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8))))
    cache.flush()
    gate = threading.Event()

    def fail(*args, **kwargs):
        gate.wait(5)
        raise RuntimeError("injected")

    cache._writer.write_batch = fail
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
    cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8])))  # (never consumed: its read stays planned)
    assert cache.stats().reads_pending == 1
    gate.set()
    with pytest.raises(WriteFailedError, match="injected"):
        cache.flush()
    assert cache.stats().reads_pending == 0
    cache.close()


def test_a_failure_between_a_saves_claims_and_its_queueing_leaves_no_step_or_read_held() -> None:
    # The committer fails after save claimed its rows and before it plans its hit and records
    # its step: save raises the failure, and the step id it never returned is not outstanding,
    # nor is the hit read it would have planned (before: steps_outstanding [its id], reads_pending 1).
    with small_cache(inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8))))
        cache.flush()
        claim = cache._claims.claim

        def claim_then_the_committer_fails(*args):
            out = claim(*args)
            cache._on_write_failure(out[0][0], RuntimeError("injected: pool write failed"))
            return out

        cache._claims.claim = claim_then_the_committer_fails
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
        with pytest.raises(WriteFailedError, match="injected: pool write failed"):
            cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8])))
        stats = cache.stats()
        assert (stats.steps_outstanding, stats.reads_pending) == ([], 0), stats


@pytest.mark.parametrize("when", ["before-take", "after-take-deferred"])
def test_a_failure_while_materialize_is_under_way_raises_the_failure(when: str) -> None:
    # b hits a's block; a write failure (another thread) lands while b's materialize runs:
    # - before-take: after materialize found the cache usable and before it took its step. The
    #   failure released the still-outstanding step's hit reads, so the ledger no longer knows
    #   them (before: the ledger's InvalidInputError "unknown read#N", in about 1 run in 100 of
    #   the close-or-failure harness with deferred keys).
    # - after-take-deferred: a is live, so b's "codes" rows are in a's deferred record; after
    #   the take and before the hit is served. The failure drops the failed tasks' claims, so
    #   those slots look overwritten (before: UnservableHitError "overwritten by a newer tenant").
    # Either way materialize raises the failure, as every call it cuts short does.
    deferred = when == "after-take-deferred"
    cache = small_cache(policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}) if deferred else None)
    codes = (lambda n: {"codes": torch.ones(n, 3)}) if deferred else (lambda n: {})
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(6, 2), codes(6), StepBatch(["a"], [6], np.arange(6))))
    cache.flush()  # (a's hidden rows reach the pool: b's hit waits on no write)
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
    sid = cache.save(torch.zeros(1, 2), codes(1), StepBatch(["b"], [1], np.array([8])))
    paused, failed = threading.Event(), threading.Event()
    take = cache._steps.take
    if deferred:
        cache._steps.take = lambda *args: (take(*args), paused.set(), failed.wait(10))[0]
    else:
        cache._steps.take = lambda *args: (paused.set(), failed.wait(10), take(*args))[2]
    reader, errors = start_thread(cache.materialize, sid, ["b"])
    assert paused.wait(10)
    cache._on_write_failure(0, RuntimeError("injected: pool write failed"))
    failed.set()
    reader.join(10)
    assert len(errors) == 1 and isinstance(errors[0], WriteFailedError), errors
    assert "injected: pool write failed" in str(errors[0])
    assert cache.stats().reads_pending == 0
    cache.close()


def test_a_save_whose_own_write_succeeds_after_the_cache_failed_raises_the_failure() -> None:
    # The committer fails (another thread) while save writes its small step itself: save's own
    # write lands, but the cache has failed meanwhile, so save raises the sticky failure (it is
    # not its own write's failure, which save would return the step id for) and holds nothing.
    cache = small_cache(inline_write_bytes=1 << 20)
    write_step_now = cache._writer.write_step_now
    calls = []

    def failed_meanwhile(*args):
        calls.append(args)
        write_step_now(*args)
        cache._on_write_failure(-1, RuntimeError("injected: committer broke"))

    cache._writer.write_step_now = failed_meanwhile
    cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
    with pytest.raises(WriteFailedError, match=r"the committer thread failed.*committer broke"):
        cache.save(torch.ones(2, 2), {}, StepBatch(["a"], [2], np.arange(2)))
    assert len(calls) == 1, "the step was written by save itself"
    stats = cache.stats()
    assert stats.steps_outstanding == [] and stats.staging_holders == [[], [], []], stats
    cache.close()


def test_finishing_a_request_whose_task_was_reaped_while_its_step_is_still_open() -> None:
    cache = small_cache(inline_write_bytes=0)
    cache._committer.max_batch = 1  # one task per batch: a's task lands before b's
    write, calls = cache._writer.write_batch, []
    entered, gate = threading.Event(), threading.Event()

    def gated(groups):
        calls.append(groups)
        if len(calls) > 1:  # b's task: held until the test lets it go
            entered.set()
            gate.wait(10)
        write(groups)

    cache._writer.write_batch = gated
    try:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        hidden = torch.cat([rows(1, 0, 4), rows(2, 0, 4)])
        slots = np.concatenate([slots_of([0], 0, 4, 4), slots_of([1], 0, 4, 4)])
        step = cache.save(hidden, {}, StepBatch(["a", "b"], [4, 4], slots))
        assert entered.wait(10), "b's task never reached the writer"
        cache.begin_step(StepEvents())  # reaps a's written task; the step stays open for b's
        cache.begin_step(StepEvents(finished=["a"]))  # a's task is forgotten: nothing to escalate
    finally:
        gate.set()
    out = cache.materialize(step, ["a", "b"])
    assert describe(out.hidden["a"]) == describe(rows(1, 0, 4))
    assert describe(out.hidden["b"]) == describe(rows(2, 0, 4))
    cache.flush()
    cache.begin_step(StepEvents(finished=["b"]))
    stats = cache.stats()
    assert (stats.tasks_live, stats.steps_outstanding, stats.requests_live) == (0, [], 0)
    cache.close()


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["committer-writes", "save-writes"])
def test_a_failed_keep_aside_copy_fails_the_cache_instead_of_leaving_the_step_half_saved(inline_write_bytes) -> None:
    # b's step plans a read of a's block 0; c's step reuses block 0 before b's is materialized,
    # so its claim owes b a preserved copy of a's rows, taken from the pool inside save. When
    # that copy fails (a device clone's read running out of memory, here a CPU stand-in), the
    # owed rows are gone and the claims cannot be undone: the cache must fail (sticky, loud)
    # rather than leave c's tasks claimed and never queued, its page held and its step id
    # outstanding (b's read then waiting claim_timeout_s for rows no one will keep).
    cache = small_cache(inline_write_bytes=inline_write_bytes, claim_timeout_s=30.0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.materialize(cache.save(rows(1, 0, 8), {}, StepBatch(["a"], [8], slots_of([0, 1], 0, 8, 4))), ["a"])
    cache.flush()  # (a's rows in the pool: the copy owed is read from there)
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))
    hit_step = cache.save(rows(2, 4, 3), {}, StepBatch(["b"], [3], slots_of([0, 2], 4, 3, 4)))
    cache.flush()  # (b's own rows written: only c's task is left for the failure to fail)
    cache.begin_step(StepEvents(new=[NewRequest("c", [0, 3])], finished=["b"]))
    boom = MemoryError("injected: no memory for the preserved copy")

    def fail(*args, **kwargs):
        raise boom

    cache._preserved.fill = fail
    t0 = time.monotonic()
    what = r"the copy of rows kept aside for pending reads \(step \d+\) failed.*no memory"
    with pytest.raises(WriteFailedError, match=what) as err:
        cache.save(rows(3, 0, 5), {}, StepBatch(["c"], [5], slots_of([0, 3], 0, 5, 4)))
    assert err.value.__cause__ is boom
    for call in (
        lambda: cache.materialize(hit_step, ["b"]),  # (never served a's rows half kept, nor waits for them)
        lambda: cache.begin_step(StepEvents()),
        cache.flush,
    ):
        with pytest.raises(WriteFailedError, match="rows kept aside"):
            call()
    assert time.monotonic() - t0 < 10, "a call waited for the rows the failed copy never kept"
    stats = cache.stats()
    assert stats.staging_holders == [[], [], []], "every staging page released"
    assert stats.reads_pending == 0
    assert stats.steps_outstanding == [hit_step], "c's step id is consumed; b's is not, and raises the failure"
    assert [state for _, state in cache._tasks.states() if state != "WRITTEN"] == ["FAILED"], "c's task failed"
    cache.close()


class _Proxy:
    """``real`` with some attributes replaced (native objects take no new attributes)."""

    def __init__(self, real, **replaced) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_a_keep_aside_failure_waits_for_the_committers_batch_before_releasing_everything() -> None:
    # save fails its keep-aside copy (engine thread) while the committer writes a's batch. The
    # failure lists the live tasks and fails each; had the committer written a's task in between,
    # that fail was refused (TaskStateError from save, the cleanup cut short: staging left open,
    # b's task PENDING and a page holder kept after close). The failure holds the writer's lock,
    # as every other one does, so a's batch lands first and the release sees it written.
    cache = small_cache(inline_write_bytes=0, claim_timeout_s=30.0)
    in_batch, go, listed, written = (threading.Event() for _ in range(4))
    write_batch, write_step, tasks = cache._writer.write_batch, cache._writer.write_step, cache._tasks
    cache._writer.write_batch = lambda groups: (in_batch.set(), go.wait(10), write_batch(groups))[2]
    cache._writer.write_step = lambda *args: (listed.wait(0.5), write_step(*args), written.set())[1]
    # (the failure's listing of the tasks lets the committer write before it fails them)
    cache._tasks = _Proxy(tasks, states=lambda: (tasks.states(), listed.set(), written.wait(2))[0])
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    sid = cache.save(rows(1, 0, 8), {}, StepBatch(["a"], [8], slots_of([0, 1], 0, 8, 4)))  # (its write held)
    cache.begin_step(StepEvents(new=[NewRequest("b", [2])]))

    def failing_keep_aside(*args) -> None:
        assert in_batch.wait(10)  # (the committer holds the writer's lock for a's batch)
        go.set()  # a's batch goes on: the failure races it
        raise MemoryError("injected: keep-aside copy failed")

    cache._claims.keep_aside = failing_keep_aside
    with pytest.raises(WriteFailedError, match=r"kept aside for pending reads.*injected: keep-aside copy failed"):
        cache.save(rows(2, 0, 4), {}, StepBatch(["b"], [4], slots_of([2], 0, 4, 4)))
    cache._tasks = tasks
    assert sorted(state for _, state in tasks.states()) == ["FAILED", "WRITTEN"], "a's written, b's failed"
    with pytest.raises(WriteFailedError):
        cache.materialize(sid, ["a"])
    cache.close()
    stats = cache.stats()
    assert stats.staging_holders == [[], [], []] and stats.reads_pending == 0, stats


def test_close_between_begin_steps_flushes_of_two_finished_requests_still_writes_the_first() -> None:
    # a and b finish with open deferred records; close (another thread) stops the committer after
    # begin_step queued a's record and before b's: b's flush raises CacheClosedError. a's record,
    # queued after the committer's last drain, must still be written (close writes what is
    # queued), not left QUEUED with its clone charged.
    cache = small_cache(inline_write_bytes=0, policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))
    cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
    cache.discard(
        cache.save(torch.ones(8, 2), {"codes": torch.ones(8, 3)}, StepBatch(["a", "b"], [4, 4], np.arange(8)))
    )
    cache.flush()
    stopped, a_flushed, closed = threading.Event(), threading.Event(), threading.Event()
    finish, staging = cache._deferred.finish, cache._staging

    def paused_finish(req_id: str) -> int:
        if req_id == "a":  # (after the committer's last drain: close is stopping it)
            stopped.wait(10)
            try:
                return finish(req_id)
            finally:
                a_flushed.set()
        closed.wait(10)  # (b's after close forgot the open records)
        return finish(req_id)

    cache._deferred.finish = paused_finish
    cache._staging = _Proxy(staging, close=lambda: (stopped.set(), a_flushed.wait(10), staging.close())[2])
    engine, errors = start_thread(cache.begin_step, StepEvents(finished=["a", "b"]))
    cache.close()
    closed.set()
    engine.join(10)
    cache._staging = staging
    assert len(errors) == 1 and isinstance(errors[0], CacheClosedError), errors
    stats = cache.stats()
    assert (stats.device_bytes, stats.tasks_live, stats.deferred_open) == (0, 0, 0), stats
    assert stats.bytes_written["codes"] == 4 * 3 * 4, "a's rows were written; b's open record was dropped"


def test_a_materialize_that_close_overtakes_before_it_takes_its_step_raises_cache_closed() -> None:
    # materialize passed its usability check, then close ran to the end on another thread (and
    # released the outstanding steps' hit reads) before the step was taken: CacheClosedError,
    # not the ledger's "unknown read" InvalidInputError.
    cache = small_cache(inline_write_bytes=0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.materialize(cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8))), ["a"])
    cache.flush()
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))  # b hits a's first block
    sid = cache.save(torch.ones(1, 2), {}, StepBatch(["b"], [1], np.array([8])))
    take = cache._steps.take

    def take_after_close(step_id, req_ids):
        closer = threading.Thread(target=cache.close)
        closer.start()
        closer.join()
        return take(step_id, req_ids)

    cache._steps.take = take_after_close
    with pytest.raises(CacheClosedError, match="the cache was closed before this step was taken"):
        cache.materialize(sid, ["b"])
    stats = cache.stats()
    assert (stats.reads_pending, stats.tasks_live) == (0, 0), stats


def test_a_close_racing_another_returns_once_the_cache_is_closed() -> None:
    # The second caller used to return at once, the committer still writing and a page held.
    cache = small_cache(inline_write_bytes=0)
    writing, go_on = threading.Event(), threading.Event()
    write_batch = cache._writer.write_batch

    def gated_write(groups):
        writing.set()
        go_on.wait(10)
        return write_batch(groups)

    cache._writer.write_batch = gated_write
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8))))
    assert writing.wait(10)
    first = threading.Thread(target=cache.close)
    first.start()
    seen: list = []
    second = threading.Thread(target=lambda: (cache.close(), seen.append(cache.stats())))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second close waits for the first"
    go_on.set()
    second.join(10)
    first.join(10)
    (stats,) = seen
    assert (stats.tasks_live, stats.staging_holders) == (0, [[], [], []]), stats


def test_a_close_nested_on_the_closing_thread_returns_at_once() -> None:
    # (a signal handler or finalizer that closes the cache while close runs on that thread:
    # with a plain lock the nested call waited for itself)
    cache = small_cache()
    close_budget = cache._deferred.budget.close
    nested: list[str] = []

    def budget_close():
        cache.close()  # nested: returns at once, the cache being closed by the outer call
        nested.append("returned")
        close_budget()

    cache._deferred.budget.close = budget_close
    closer = threading.Thread(target=cache.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and nested == ["returned"]
    assert cache.stats().tasks_live == 0


def test_a_failed_batch_of_several_tasks_names_its_first_task() -> None:
    # One step of two requests is one batch of two write tasks: the sticky failure names the
    # batch's first task and its request.
    with small_cache(inline_write_bytes=0) as cache:

        def broken(*args, **kwargs):
            raise RuntimeError("injected: disk on fire")

        cache._writer.write_step = broken
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        step = cache.save(torch.zeros(8, 2), None, StepBatch(["a", "b"], [4, 4], np.arange(8)))
        with pytest.raises(WriteFailedError, match=rf"write task#0 \(request 'a', step {step}\)") as err:
            cache.flush()
        assert err.value.task_id == 0
