"""Full sequence in every case: deferred keys under a device budget, finish and abort,
preempted-and-resumed requests, async-chunk continuation, tenant succession."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cachekit import describe, rows, slots_of, small_cache, start_thread
from omni_pcache import (
    CacheClosedError,
    CachePolicy,
    InvalidInputError,
    NewRequest,
    ResumedRequest,
    StagingTimeoutError,
    StepBatch,
    StepEvents,
    WriteFailedError,
)

BS = 4
DEFERRED = CachePolicy(deferred_keys={"codes"}, token_keys={"codes"})


def save(cache, reqs, new=(), resumed=(), finished=(), dropped_saves=None):
    """begin_step + save; ``reqs``: (req_id, block_ids, start position, count, writer)."""
    cache.begin_step(
        StepEvents(new=list(new), resumed=list(resumed), finished=list(finished), dropped_saves=dropped_saves or {})
    )
    hidden = torch.cat([rows(w, s, c) for _, _, s, c, w in reqs])
    codes = torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for _, _, s, c, w in reqs])
    slots = np.concatenate([slots_of(b, s, c, BS) for _, b, s, c, _ in reqs])
    return cache.save(hidden, {"codes": codes}, StepBatch([r for r, *_ in reqs], [c for *_, c, _ in reqs], slots))


def spans(*pieces):
    return torch.cat([rows(w, s, c) for w, s, c in pieces])


def spans_codes(*pieces):
    return torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for w, s, c in pieces])


def check(out, req, *pieces):
    assert describe(out.hidden[req]) == describe(spans(*pieces))
    assert torch.equal(out.hidden[req], spans(*pieces))
    assert torch.equal(out.mm["codes"][req], spans_codes(*pieces))


def test_deferred_rows_are_served_from_the_clone_then_flushed_at_finish() -> None:
    with small_cache(policy=DEFERRED) as cache:
        step = save(
            cache, [("a", [0, 1], 0, 6, 1), ("x", [5], 0, 2, 9)], new=[NewRequest("a", [0, 1]), NewRequest("x", [5])]
        )
        check(cache.materialize(step, ["a"]), "a", (1, 0, 6))
        stats = cache.stats()
        assert stats.device_bytes == 8 * 2 * 8, "one clone of the step's 8 rows, charged once for two requests"
        assert stats.deferred_open == 2
        # b hits a's first block while a is still running: its codes come from a's clone.
        step = save(cache, [("b", [0, 2], 4, 2, 2)], new=[NewRequest("b", [0, 2], 4)])
        check(cache.materialize(step, ["b"]), "b", (1, 0, 4), (2, 4, 2))
        cache.flush()
        assert cache.stats().bytes_written["codes"] == 0, "deferred rows wait for their request (listed at 0)"
        step = save(cache, [("c", [6], 0, 1, 3)], new=[NewRequest("c", [6])], finished=["a", "x", "b"])
        cache.discard(step)
        cache.flush()
        stats = cache.stats()
        assert stats.bytes_written["codes"] == (6 + 2 + 2) * 2 * 8
        assert stats.deferred_open == 1 and stats.device_bytes == 1 * 2 * 8, "only c's clone is left"
        step = save(cache, [("d", [0, 7], 4, 1, 4)], new=[NewRequest("d", [0, 7], 4)], finished=["c"])
        check(cache.materialize(step, ["d"]), "d", (1, 0, 4), (4, 4, 1))
        cache.begin_step(StepEvents(finished=["d"]))
        cache.flush()
        assert cache.stats().device_bytes == 0 and cache.stats().deferred_open == 0


def test_a_deferred_record_over_steps_where_its_request_was_not_last_serves_each_slot_its_own_row() -> None:
    # a comes before x in both steps; b then hits a's two blocks while a is still running: its
    # codes come from a's clones, each slot's row found among a's own rows of both steps.
    with small_cache(policy=DEFERRED) as cache:
        new = [NewRequest("a", [0, 1]), NewRequest("x", [5])]
        cache.discard(save(cache, [("a", [0, 1], 0, 4, 1), ("x", [5], 0, 2, 9)], new=new))
        cache.discard(save(cache, [("a", [0, 1], 4, 4, 1), ("x", [5], 2, 1, 9)]))
        step = save(cache, [("b", [0, 1, 2], 8, 1, 2)], new=[NewRequest("b", [0, 1, 2], 8)])
        check(cache.materialize(step, ["b"]), "b", (1, 0, 8), (2, 8, 1))
        # (and the same rows from the pool once a's record is written at its finish)
        cache.discard(save(cache, [("x", [5], 3, 1, 9)], finished=["a", "b"]))
        cache.flush()
        step = save(cache, [("d", [0, 1, 3], 8, 1, 4)], new=[NewRequest("d", [0, 1, 3], 8)])
        check(cache.materialize(step, ["d"]), "d", (1, 0, 8), (4, 8, 1))


def test_the_budget_flushes_the_oldest_deferred_request_first() -> None:
    step_bytes = 4 * 2 * 8  # 4 rows of int64 (2,)
    # (room for two steps and a half: a third step's rows must not fit, half of them would)
    budget = 2 * step_bytes + step_bytes // 2
    with small_cache(policy=DEFERRED, device_budget_bytes=budget, claim_timeout_s=30) as cache:
        cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))
        cache.discard(save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])]))
        assert cache.stats().device_bytes == 2 * step_bytes
        cache.discard(save(cache, [("c", [2], 0, 4, 3)], new=[NewRequest("c", [2])]))
        stats = cache.stats()
        assert stats.device_bytes == 2 * step_bytes, "a was flushed to make room for c"
        assert stats.bytes_written["codes"] == step_bytes and stats.num_waits == 1
        # (woken when a's clone was released, not at the 30 s timeout: a liveness bound)
        assert stats.wait_time_s < 15, stats
        # a keeps running: its next rows open a new deferred record, and a hit reads both.
        cache.discard(save(cache, [("a", [0, 3], 4, 2, 1)]))
        # e hits block 0, whose deferred rows a flushed to the pool.
        step = save(cache, [("e", [0, 7], 4, 1, 5)], new=[NewRequest("e", [0, 7], 4)])
        check(cache.materialize(step, ["e"]), "e", (1, 0, 4), (5, 4, 1))


def test_room_for_a_step_flushes_every_request_holding_a_shared_clone() -> None:
    step_bytes = 4 * 2 * 8  # 4 rows of int64 (2,)
    # a and b computed in one step share one clone (2 step_bytes): flushing a alone frees
    # nothing, so making room for c flushes b too instead of waiting for a room that never comes.
    budget = 2 * step_bytes + step_bytes // 2
    with small_cache(policy=DEFERRED, device_budget_bytes=budget, claim_timeout_s=1) as cache:
        new = [NewRequest("a", [0]), NewRequest("b", [1])]
        cache.discard(save(cache, [("a", [0], 0, 4, 1), ("b", [1], 0, 4, 2)], new=new))
        cache.discard(save(cache, [("c", [2], 0, 4, 3)], new=[NewRequest("c", [2])]))
        cache.flush()
        stats = cache.stats()
        assert stats.device_bytes == step_bytes and stats.bytes_written["codes"] == 2 * step_bytes, stats


def test_the_budget_at_its_exact_bound_neither_waits_nor_flushes_more_than_it_must() -> None:
    step_bytes = 4 * 2 * 8  # 4 rows of int64 (2,)
    with small_cache(policy=DEFERRED, device_budget_bytes=2 * step_bytes) as cache:
        cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))
        cache.discard(save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])]))  # (fills it to the byte)
        stats = cache.stats()
        assert (stats.device_bytes, stats.deferred_open, stats.num_waits) == (2 * step_bytes, 2, 0), stats
        # c needs one step's bytes: flushing a frees exactly that, so b keeps its rows on the device.
        cache.discard(save(cache, [("c", [2], 0, 4, 3)], new=[NewRequest("c", [2])]))
        cache.flush()
        stats = cache.stats()
        assert (stats.device_bytes, stats.deferred_open) == (2 * step_bytes, 2), stats
        assert stats.bytes_written["codes"] == step_bytes, "only a's rows were written"


def test_deferred_keys_that_fit_the_budget_alone_but_not_together_are_refused_at_once() -> None:
    policy = CachePolicy(token_keys={"codes", "audio"}, deferred_keys={"codes", "audio"})
    step_bytes = 4 * 2 * 8  # 4 rows of int64 (2,) per key: each fits, both do not
    with small_cache(policy=policy, device_budget_bytes=step_bytes + 8, claim_timeout_s=2) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        codes = rows(1, 0, 4, width=2, dtype=torch.int64)
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match=r"'audio' 64 bytes, 'codes' 64 bytes; 128 bytes in all\) exceed"):
            cache.save(rows(1, 0, 4), {"codes": codes, "audio": codes}, batch)
        stats = cache.stats()
        assert stats.steps_outstanding == [] and stats.device_bytes == 0 and stats.num_waits == 0
        step = cache.save(rows(1, 0, 4), {"codes": codes}, batch)  # one key fits
        check(cache.materialize(step, ["a"]), "a", (1, 0, 4))


def test_a_late_read_of_deferred_rows_their_own_request_recomputes_gets_the_captured_rows() -> None:
    # b hits a's block 0 while a's codes are still on the device (a's open deferred record);
    # before b's step is materialized, a is resumed from position 0 and recomputes block 0.
    # b must get the rows its read captured: a's open record is closed when a comes back, so
    # the recompute claims the slots under a new record and the captured rows are preserved.
    with small_cache(policy=DEFERRED) as cache:
        cache.materialize(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]), ["a"])
        hit = save(cache, [("b", [0, 1], 4, 4, 2)], new=[NewRequest("b", [0, 1], 4)])
        again = save(cache, [("a", [0], 0, 4, 3)], resumed=[ResumedRequest("a", [0], 0)])
        check(cache.materialize(hit, ["b"]), "b", (1, 0, 4), (2, 4, 4))
        out = cache.materialize(again, ["a"])  # nothing new for a's consumer: rows 0-3 were delivered
        assert out.hidden["a"].shape[0] == 0 and out.mm["codes"]["a"].shape[0] == 0
        cache.begin_step(StepEvents(finished=["a", "b"]))
        cache.flush()
        late = save(cache, [("c", [0, 2], 4, 1, 4)], new=[NewRequest("c", [0, 2], 4)])
        check(cache.materialize(late, ["c"]), "c", (3, 0, 4), (4, 4, 1))  # the newest tenant's rows


def test_rows_captured_from_a_deferred_record_still_in_transit_are_kept_from_its_clone() -> None:
    # As above, with the committer held: when a's recompute claims block 0, a's codes are in
    # its flushed record (not written: only in the device clone) and its hidden rows in a
    # queued write. b's late read must get both as captured: the codes copied aside from the
    # clone at the claim, the hidden rows owed by the write when it lands.
    with small_cache(policy=DEFERRED, inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda records: (gate.wait(10), write(records))
        filled: list[str] = []
        fill = cache._preserved.fill
        cache._preserved.fill = lambda key, *args: (filled.append(key), fill(key, *args))[1]
        cache.materialize(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]), ["a"])
        hit = save(cache, [("b", [0, 1], 4, 4, 2)], new=[NewRequest("b", [0, 1], 4)])
        again = save(cache, [("a", [0], 0, 4, 3)], resumed=[ResumedRequest("a", [0], 0)])
        assert filled == ["codes"], "a's codes rows are kept from the clone at the claim; hidden waits for its write"
        gate.set()
        check(cache.materialize(hit, ["b"]), "b", (1, 0, 4), (2, 4, 4))
        assert cache.stats().rows_preserved == 8  # 4 hidden rows owed by the write, 4 codes rows
        cache.discard(again)
        cache.begin_step(StepEvents(finished=["a", "b"]))
        cache.flush()
        late = save(cache, [("c", [0, 2], 4, 1, 4)], new=[NewRequest("c", [0, 2], 4)])
        check(cache.materialize(late, ["c"]), "c", (3, 0, 4), (4, 4, 1))


def test_a_request_resumed_without_a_computed_count_recomputes_from_position_0() -> None:
    # (ResumedRequest's num_computed_tokens defaults to 0) a's consumer got positions 0-5; a is
    # resumed on other blocks and recomputes 0-6: only position 6 is new to its consumer.
    with small_cache() as cache:
        first = save(cache, [("a", [0, 1], 0, 6, 1)], new=[NewRequest("a", [0, 1])])
        check(cache.materialize(first, ["a"]), "a", (1, 0, 6))
        again = save(cache, [("a", [2, 3], 0, 7, 3)], resumed=[ResumedRequest("a", [2, 3])])
        check(cache.materialize(again, ["a"]), "a", (3, 6, 1))
        cache.begin_step(StepEvents(finished=["a"]))
        cache.flush()
        stats = cache.stats()
        assert (stats.requests_live, stats.tasks_live, stats.steps_outstanding) == (0, 0, []), stats


def fill_the_budget(cache, write_batch) -> None:
    """Saves a's step, whose rows of "codes" fill a budget of one step, with the committer's
    batch writes replaced by ``write_batch(records, write)`` (``write``: the real one), which
    holds them back or fails them: a's clone stays charged until it lets a's write through."""
    write = cache._writer.write_batch
    cache._writer.write_batch = lambda records: write_batch(records, write)
    cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))


def budget_of_one_step(policy=DEFERRED, **overrides):
    return small_cache(policy=policy, device_budget_bytes=4 * 2 * 8, inline_write_bytes=0, **overrides)


def test_close_wakes_a_save_waiting_for_device_budget() -> None:
    # (a long claim timeout: a save that close failed to wake would wait it out, and be caught)
    with budget_of_one_step(claim_timeout_s=60) as cache:
        gate = threading.Event()  # the committer cannot write a's rows: b's save waits for room
        fill_the_budget(cache, lambda records, write: (gate.wait(60), write(records)))
        raised: list[BaseException] = []
        waiting = threading.Event()
        budget = cache._deferred.budget
        wait_for_room = budget.wait_for_room
        budget.wait_for_room = lambda *args: (waiting.set(), wait_for_room(*args))[1]

        def engine_thread() -> None:
            try:
                save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])])
            except BaseException as exc:  # checked below
                raised.append(exc)
            gate.set()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        assert waiting.wait(10)  # b's save flushed a's record to make room and waits for its write
        time.sleep(0.05)  # (into the wait itself)
        cache.close()  # from another thread
        thread.join(10)
        assert not thread.is_alive(), "close did not wake the save waiting for device budget"
        assert [type(exc) for exc in raised] == [CacheClosedError], raised


def test_rows_the_engine_dropped_are_delivered_again() -> None:
    # a's rows 0..6 are saved, but the engine dropped the output carrying row 6 (vLLM's
    # drop_stale_output): a continued as new at 6 gets 6 again, not only what follows it.
    with small_cache(policy=DEFERRED) as cache:
        first = save(cache, [("a", [0, 1], 0, 6, 1)], new=[NewRequest("a", [0, 1])])
        check(cache.materialize(first, ["a"]), "a", (1, 0, 6))
        cache.discard(save(cache, [("a", [0, 1], 6, 1, 1)]))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2], 6)], dropped={"a": 6}))
        sid = cache.save(rows(2, 6, 3), {"codes": rows(2, 6, 3, width=2, dtype=torch.int64)},
                         StepBatch(["a"], [3], slots_of([0, 1, 2], 6, 3, BS)))  # fmt: skip
        check(cache.materialize(sid, ["a"]), "a", (2, 6, 3))
        # Dropped below the point it resumes from: those rows come from the pool.
        out = cache.materialize(
            save(cache, [("a", [0, 1, 2], 9, 1, 3)], new=[NewRequest("a", [0, 1, 2], 9)]), ["a"]
        )  # (nothing dropped: nothing returned twice)
        check(out, "a", (3, 9, 1))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2], 10)], dropped={"a": 4}))
        sid = cache.save(rows(3, 10, 1), {"codes": rows(3, 10, 1, width=2, dtype=torch.int64)},
                         StepBatch(["a"], [1], slots_of([0, 1, 2], 10, 1, BS)))  # fmt: skip
        check(cache.materialize(sid, ["a"]), "a", (1, 4, 2), (2, 6, 3), (3, 9, 2))


@pytest.mark.parametrize(
    ("dropped", "message"),
    [
        ({"a": -1}, r"StepEvents.dropped\['a'\] must be a position \(an int >= 0\), got -1"),
        ({"a": True}, r"must be a position \(an int >= 0\), got True"),
        ({5: 1}, r"StepEvents.dropped holds request ids \(str, valid UTF-8\), got 5"),
        (["a"], "StepEvents.dropped must map request ids to positions, got list"),
        ({"a": 2}, r"StepEvents.dropped names request 'a', which is not live \(never scheduled, or finished\)"),
        ({"b": 0}, r"StepEvents.dropped names request 'b', which is not live"),
    ],
)
def test_bad_dropped_positions_are_refused_changing_nothing(dropped, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
        with pytest.raises(InvalidInputError, match=message):
            cache.begin_step(StepEvents(new=[NewRequest("b", [1])], finished=["a"], dropped=dropped))
        assert cache.stats().requests_live == 1 and cache.stats().misses == 1  # (b not registered, a not forgotten)


def test_dropped_rows_of_a_request_not_scheduled_again_are_refused_changing_nothing() -> None:
    # Dropped rows are delivered again when the request is scheduled again (new or resumed) in
    # the same events; a running request's would never be: refused, not silently lost.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        first = cache.materialize(cache.save(rows(1, 0, 4), {}, StepBatch(["a"], [4], np.arange(4))), ["a"])
        assert torch.equal(first.hidden["a"], rows(1, 0, 4))
        with pytest.raises(InvalidInputError, match="which these events do not schedule again"):
            cache.begin_step(StepEvents(new=[NewRequest("b", [1])], dropped={"a": 2}))
        assert cache.stats().requests_live == 1  # (b not registered)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1], 4)], dropped={"a": 2}))  # (sent again)
        sid = cache.save(rows(2, 4, 1), {}, StepBatch(["a"], [1], slots_of([0, 1], 4, 1, BS)))
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], spans((1, 2, 2), (2, 4, 1)))


def test_close_releases_the_device_clones_of_live_requests() -> None:
    # A live request's deferred rows wait on the device for its finish, which the cache will not
    # see after close: close releases them (the device budget back to zero, no open record, no
    # write task left pending), and a save after it is refused.
    cache = small_cache(policy=DEFERRED)
    check(cache.materialize(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]), ["a"]), "a", (1, 0, 4))
    check(cache.materialize(save(cache, [("a", [0, 1], 4, 2, 1)]), ["a"]), "a", (1, 4, 2))
    cache.flush()  # (the hidden rows: only the deferred record's task is left)
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (6 * 2 * 8, 1, 1), stats
    cache.close()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats
    with pytest.raises(CacheClosedError):
        save(cache, [("a", [0, 1], 6, 1, 1)])


def test_a_read_of_a_live_requests_deferred_rows_cut_by_close_still_gets_them_from_the_clone() -> None:
    # b hits a's block while a is live: b's "codes" rows come from a's device clone. close()
    # lands after b's materialize took its step and before it serves the hit: the rows still
    # come from the clone (before: close forgot a's record, so the read took the pool's never
    # written slots), and the staging page b's step held is free in the stats afterwards.
    cache = small_cache(policy=DEFERRED)
    check(
        cache.materialize(save(cache, [("a", [0, 1], 0, 6, 1)], new=[NewRequest("a", [0, 1])]), ["a"]), "a", (1, 0, 6)
    )
    sid = save(cache, [("b", [0, 2], 4, 1, 2)], new=[NewRequest("b", [0, 2], 4)])
    took, closed = threading.Event(), threading.Event()
    take = cache._steps.take
    cache._steps.take = lambda *args: (take(*args), took.set(), closed.wait(10))[0]
    out: list = []
    reader, errors = start_thread(lambda: out.append(cache.materialize(sid, ["b"])))
    assert took.wait(10)
    cache.close()
    closed.set()
    reader.join(10)
    assert not errors, errors
    check(out[0], "b", (1, 0, 4), (2, 4, 1))
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats
    assert not any(stats.staging_holders) and stats.steps_outstanding == [], stats


def test_a_save_that_gets_no_device_budget_in_time_is_refused_and_loses_nothing() -> None:
    with budget_of_one_step(claim_timeout_s=0.2) as cache:
        gate = threading.Event()  # the committer cannot write a's rows: b's save finds no room
        fill_the_budget(cache, lambda records, write: (gate.wait(10), write(records)))
        with pytest.raises(
            StagingTimeoutError, match=r"save waited 0.2 s for 64 bytes of device budget \(used 64 of 64\)"
        ):
            save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])])
        gate.set()
        cache.flush()
        assert cache.stats().device_bytes == 0, "b's refused step charged nothing"
        again = save(cache, [("b", [1], 0, 4, 2)])  # b's step, saved again, is whole
        check(cache.materialize(again, ["b"]), "b", (2, 0, 4))
        hit = save(cache, [("c", [0, 2], 4, 1, 3)], new=[NewRequest("c", [0, 2], 4)])
        check(cache.materialize(hit, ["c"]), "c", (1, 0, 4), (3, 4, 1))  # a's rows were flushed and written


def test_a_failure_when_the_device_budget_wait_times_out_is_what_save_raises() -> None:
    # The committer's write of a's rows fails just as b's save, waiting for device budget,
    # reaches its deadline: save raises that failure (every call does), not a timeout that
    # hides it.
    with budget_of_one_step(claim_timeout_s=0.2) as cache:
        gate = threading.Event()

        def gated_then_failing(records, write):
            gate.wait(10)
            raise RuntimeError("injected: the write failed")

        fill_the_budget(cache, gated_then_failing)
        wait = cache._deferred.budget.wait_for_room

        def fails_at_the_deadline(nbytes: int, deadline: float) -> bool:
            fits = wait(nbytes, deadline)  # (a's write is held: no room comes in time)
            gate.set()
            with cache._cond:  # (the committer reports its write's failure)
                assert cache._cond.wait_for(lambda: cache._failure is not None, 10)
            return fits

        cache._deferred.budget.wait_for_room = fails_at_the_deadline
        try:
            with pytest.raises(WriteFailedError, match=r"failed: RuntimeError\('injected: the write failed"):
                save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])])
        finally:
            gate.set()


@pytest.mark.parametrize(
    "policy",
    [DEFERRED, CachePolicy(cache_hidden=False, token_keys={"codes"}, deferred_keys={"codes"})],
    ids=["with-hidden", "deferred-only"],
)
def test_a_committer_failure_wakes_a_save_waiting_for_device_budget_with_the_failure(policy) -> None:
    # The failure releases a's clones, so b's save gets room, clones its rows, and only then
    # finds the cache failed: it raises the failure and holds no device budget, whether its
    # claims start with an immediate key (hidden) or with the deferred one.
    # (a long claim timeout: a save left waiting would wait it out, and be caught)
    with budget_of_one_step(policy, claim_timeout_s=60) as cache:
        gate = threading.Event()

        def failing_write(records, write) -> None:
            gate.wait(10)
            raise RuntimeError("injected: pool write failed")

        fill_the_budget(cache, failing_write)
        budget = cache._deferred.budget
        wait_for_room = budget.wait_for_room
        budget.wait_for_room = lambda *args: (gate.set(), wait_for_room(*args))[1]  # fails a's write once b waits
        started = time.monotonic()
        failed = r"write task#\d+ \(request 'a', step \d+\) failed: RuntimeError\('injected: pool write failed'\)"
        with pytest.raises(WriteFailedError, match=failed):
            save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])])
        assert time.monotonic() - started < 30, "the failure woke the wait"
        assert cache.stats().device_bytes == 0, "a failed cache holds no device budget"


def test_a_write_failure_while_save_flushes_requests_for_device_budget_is_what_save_raises() -> None:
    # c's step needs the room of both a's and b's open records: save flushes a, whose write
    # fails before save flushes b. Save raises that failure (every call does), not the
    # CacheClosedError of the open records the failure forgot, and holds nothing.
    step_bytes = 4 * 2 * 8  # 4 rows of int64 (2,)
    with small_cache(policy=DEFERRED, device_budget_bytes=2 * step_bytes, inline_write_bytes=0) as cache:
        cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))
        cache.discard(save(cache, [("b", [1], 0, 4, 2)], new=[NewRequest("b", [1])]))
        cache.flush()  # (their hidden rows are written; their codes stay on the device)
        assert cache.stats().device_bytes == 2 * step_bytes

        def failing_write(records) -> None:
            raise RuntimeError("injected: the write failed")

        cache._writer.write_batch = failing_write
        notify = cache._deferred._notify

        def notify_then_wait_for_the_failure() -> None:  # (a's write fails before save goes on)
            notify()
            with cache._cond:
                assert cache._cond.wait_for(lambda: cache._failure is not None, 10)

        cache._deferred._notify = notify_then_wait_for_the_failure
        with pytest.raises(WriteFailedError, match=r"request 'a'.*injected: the write failed"):
            save(cache, [("c", [2, 3], 0, 8, 3)], new=[NewRequest("c", [2, 3])])
        stats = cache.stats()
        assert (stats.device_bytes, stats.steps_outstanding, stats.staging_holders) == (0, [], [[], [], []]), stats


def test_an_aborted_request_mid_write_still_lands_and_can_be_hit() -> None:
    with small_cache(inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda record: (gate.wait(10), write(record))
        step = save(cache, [("a", [0, 1], 0, 8, 1)], new=[NewRequest("a", [0, 1])])
        cache.discard(step)
        cache.begin_step(StepEvents(finished=["a"]))  # aborted while its write is queued
        gate.set()
        step = save(cache, [("b", [0, 1, 2], 8, 1, 2)], new=[NewRequest("b", [0, 1, 2], 8)])
        check(cache.materialize(step, ["b"]), "b", (1, 0, 8), (2, 8, 1))


def test_resume_does_not_repeat_delivered_rows() -> None:
    with small_cache() as cache:
        cache.materialize(save(cache, [("a", [0, 1, 2], 0, 10, 1)], new=[NewRequest("a", [0, 1, 2])]), ["a"])
        # Preempted; resumed with a hit on its first block: it recomputes from 4, but [4, 10)
        # was already delivered, so the consumer gets only rows from 10 on.
        step = save(cache, [("a", [0, 5, 6], 4, 7, 2)], resumed=[ResumedRequest("a", [0, 5, 6], 4)])
        check(cache.materialize(step, ["a"]), "a", (2, 10, 1))


def test_a_per_row_leftover_leaves_out_the_rows_a_resumed_request_already_delivered() -> None:
    with small_cache(policy=CachePolicy(token_keys=frozenset())) as cache:  # (every mm entry is leftover)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        first = cache.save(
            rows(1, 0, 10), {"pos": torch.arange(10)}, StepBatch(["a"], [10], slots_of([0, 1, 2], 0, 10, BS))
        )
        assert torch.equal(cache.materialize(first, ["a"]).mm["pos"]["a"], torch.arange(10))
        # Preempted, resumed at 4 beside a new request: [4, 10) was delivered, so a gets rows
        # from 10 on, of its hidden states and of the per-row leftover alike.
        cache.begin_step(StepEvents(new=[NewRequest("m", [7])], resumed=[ResumedRequest("a", [0, 5, 6], 4)]))
        hidden = torch.cat([rows(2, 4, 7), rows(3, 0, 2)])
        pos = torch.cat([torch.arange(4, 11), torch.arange(100, 102)])
        slots = np.concatenate([slots_of([0, 5, 6], 4, 7, BS), slots_of([7], 0, 2, BS)])
        out = cache.materialize(cache.save(hidden, {"pos": pos}, StepBatch(["a", "m"], [7, 2], slots)), ["a", "m"])
        assert torch.equal(out.hidden["a"], rows(2, 10, 1)) and torch.equal(out.mm["pos"]["a"], torch.tensor([10]))
        assert torch.equal(out.hidden["m"], rows(3, 0, 2)) and torch.equal(out.mm["pos"]["m"], torch.tensor([100, 101]))


def test_a_resumed_request_with_nothing_new_gets_empty_rows_not_a_missing_key() -> None:
    with small_cache() as cache:
        cache.materialize(save(cache, [("a", [0, 1, 2], 0, 10, 1)], new=[NewRequest("a", [0, 1, 2])]), ["a"])
        # Preempted and resumed at 4, it recomputes [4, 8): all delivered already.
        step = save(cache, [("a", [0, 5, 6], 4, 4, 2)], resumed=[ResumedRequest("a", [0, 5, 6], 4)])
        out = cache.materialize(step, ["a"])
        assert out.hidden["a"].shape == (0, 3) and out.hidden["a"].dtype == torch.float32
        assert out.mm["codes"]["a"].shape == (0, 2) and out.mm["codes"]["a"].dtype == torch.int64


def test_outputs_keep_the_order_asked_whatever_mix_of_hits_and_misses() -> None:
    with small_cache() as cache:
        cache.materialize(save(cache, [("a", [0, 1], 0, 8, 1)], new=[NewRequest("a", [0, 1])]), ["a"])
        reqs = [("m1", [2], 0, 3, 2), ("h", [0, 3], 4, 2, 3), ("m2", [4], 0, 1, 4)]
        new = [NewRequest("m1", [2]), NewRequest("h", [0, 3], 4), NewRequest("m2", [4])]
        out = cache.materialize(save(cache, reqs, new=new), ["m2", "h", "m1"])
        assert list(out.hidden) == ["m2", "h", "m1"] and list(out.mm["codes"]) == ["m2", "h", "m1"]
        check(out, "h", (1, 0, 4), (3, 4, 2))
        check(out, "m1", (2, 0, 3))
        check(out, "m2", (4, 0, 1))


def test_resume_reads_skipped_but_undelivered_rows_from_the_pool() -> None:
    with small_cache() as cache:
        first = save(cache, [("a", [0, 1, 2], 0, 10, 1)], new=[NewRequest("a", [0, 1, 2])])
        cache.discard(first)  # nobody consumed them; delivered_upto still counts them
        cache.materialize(save(cache, [("z", [9], 0, 1, 9)], new=[NewRequest("z", [9])]), ["z"])
        # A second request that was preempted before delivering anything resumes with a hit.
        cache.materialize(save(cache, [("b", [0, 3], 0, 5, 2)], new=[NewRequest("b", [0, 3])]), ["b"])
        step = save(cache, [("b", [0, 1, 4], 8, 3, 3)], resumed=[ResumedRequest("b", [0, 1, 4], 8)])
        # b had delivered [0, 5); it resumes at 8 (hit on a's blocks 0 and 1): rows [5, 8) come
        # from the pool (written by a), then this step's rows.
        check(cache.materialize(step, ["b"]), "b", (1, 5, 3), (3, 8, 3))


def test_async_chunk_continuation_gets_exactly_its_undelivered_rows() -> None:
    with small_cache() as cache:
        check(
            cache.materialize(save(cache, [("a", [0, 1], 0, 6, 1)], new=[NewRequest("a", [0, 1])]), ["a"]),
            "a",
            (1, 0, 6),
        )
        # The next upstream chunk arrives: "a" re-enters as new with what it computed itself.
        step = save(cache, [("a", [0, 1, 2], 6, 4, 2)], new=[NewRequest("a", [0, 1, 2], 6)])
        out = cache.materialize(step, ["a"])
        check(out, "a", (2, 6, 4))
        assert cache.stats().hits == 0, "a continuation is not a hit"


def test_tenants_finishing_in_reverse_order_newest_wins() -> None:
    with small_cache(policy=DEFERRED) as cache:
        cache.discard(save(cache, [("old", [0], 0, 4, 1)], new=[NewRequest("old", [0])]))
        # Block 0 gets a new tenant while the old one's deferred rows are still on the device.
        cache.discard(save(cache, [("new", [0], 0, 4, 2)], new=[NewRequest("new", [0])]))
        cache.begin_step(StepEvents(finished=["new"]))
        cache.flush()
        cache.begin_step(StepEvents(finished=["old"]))  # the older tenant finishes last
        cache.flush()
        step = save(cache, [("r", [0, 1], 4, 1, 3)], new=[NewRequest("r", [0, 1], 4)])
        check(cache.materialize(step, ["r"]), "r", (2, 0, 4), (3, 4, 1))


def test_a_request_reacquiring_a_lost_block_writes_rows_that_win() -> None:
    with small_cache(policy=DEFERRED) as cache:
        cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))
        cache.discard(save(cache, [("i", [0], 0, 4, 2)], new=[NewRequest("i", [0])]))  # interim tenant
        # a (preempted) resumes, gets block 0 back and recomputes it: fresh rows, newest claim.
        cache.discard(save(cache, [("a", [0], 0, 4, 3)], resumed=[ResumedRequest("a", [0], 0)]))
        cache.begin_step(StepEvents(finished=["a"]))
        cache.flush()
        cache.begin_step(StepEvents(finished=["i"]))
        cache.flush()
        step = save(cache, [("r", [0, 1], 4, 1, 4)], new=[NewRequest("r", [0, 1], 4)])
        check(cache.materialize(step, ["r"]), "r", (3, 0, 4), (4, 4, 1))


def test_a_zero_row_request_in_a_deferred_step_holds_no_device_budget() -> None:
    with small_cache(policy=DEFERRED) as cache:
        step = save(cache, [("a", [0], 0, 4, 1), ("z", [1], 0, 0, 2)], new=[NewRequest("a", [0]), NewRequest("z", [1])])
        check(cache.materialize(step, ["a", "z"]), "a", (1, 0, 4))
        assert cache.stats().deferred_open == 1  # (a's: z has no rows)
        cache.begin_step(StepEvents(finished=["a", "z"]))
        cache.flush()
        cache.begin_step(StepEvents())
        stats = cache.stats()
        assert (stats.device_bytes, stats.deferred_open) == (0, 0), "the clone let go once a's rows were written"


def test_a_late_read_of_rows_a_finished_request_holds_on_the_device_survives_the_blocks_reuse() -> None:
    # a's deferred codes are still only in its device clone (its write held back) when b reuses
    # block 0: the rows c's pending read captured are kept aside from that clone.
    with small_cache(policy=DEFERRED, inline_write_bytes=0, claim_timeout_s=2.0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))
        cache.materialize(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]), ["a"])
        late = save(cache, [("c", [0, 1], 4, 1, 3)], new=[NewRequest("c", [0, 1], 4)], finished=["a"])
        reuse = save(cache, [("b", [0], 0, 4, 2)], new=[NewRequest("b", [0])], finished=["c"])
        gate.set()
        check(cache.materialize(late, ["c"]), "c", (1, 0, 4), (3, 4, 1))
        check(cache.materialize(reuse, ["b"]), "b", (2, 0, 4))


def _deferred_cache():
    return small_cache(inline_write_bytes=0, policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))


def test_a_save_whose_deferred_clones_were_charged_when_close_came_uncharges_them() -> None:
    # close() runs (another thread) after save charged the device budget for its clones and
    # before it checks the request's open record: save raises CacheClosedError and the budget
    # it charged is given back, so the device budget is back to zero after close.
    cache = _deferred_cache()
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
    cache.discard(cache.save(torch.ones(4, 2), {"codes": torch.ones(4, 3)}, StepBatch(["a"], [4], np.arange(4))))
    assert cache.stats().deferred_open == 1
    cache.begin_step(StepEvents())
    close_other_keys = cache._deferred.close_other_keys

    def closed_meanwhile(*args):
        closer, errors = start_thread(cache.close)
        closer.join(10)
        assert not closer.is_alive() and not errors, errors
        return close_other_keys(*args)

    cache._deferred.close_other_keys = closed_meanwhile
    with pytest.raises(CacheClosedError, match="the cache was closed during save"):
        cache.save(torch.ones(4, 2), {"codes": torch.ones(4, 3)}, StepBatch(["a"], [4], np.arange(4, 8)))
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.steps_outstanding) == (0, 0, []), stats


def test_a_step_without_deferred_keys_leaves_the_requests_open_record_on_the_device() -> None:
    # A step that gives no deferred key at all does not close the request's open record (only
    # a step with another set of deferred keys does): its rows stay on the device, open, until
    # the request finishes, and are then written and served as usual.
    cache = small_cache(policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(rows(1, 0, 4), {"codes": rows(7, 0, 4)}, StepBatch(["a"], [4], slots_of([0, 1], 0, 4, 4))))
    before = cache.stats()
    assert before.deferred_open == 1 and before.device_bytes > 0
    cache.begin_step(StepEvents())
    step = cache.save(rows(1, 4, 2), {}, StepBatch(["a"], [2], slots_of([0, 1], 4, 2, 4)))
    assert describe(cache.materialize(step, ["a"]).hidden["a"]) == describe(rows(1, 4, 2))
    cache.flush()
    after = cache.stats()
    assert (after.deferred_open, after.device_bytes) == (1, before.device_bytes), after
    cache.begin_step(StepEvents(finished=["a"], new=[NewRequest("b", [0, 2], 4)]))
    step = cache.save(rows(2, 4, 1), {"codes": rows(8, 4, 1)}, StepBatch(["b"], [1], slots_of([0, 2], 4, 1, 4)))
    out = cache.materialize(step, ["b"])
    assert describe(out.mm["codes"]["b"]) == describe(rows(7, 0, 4)) + describe(rows(8, 4, 1))
    cache.close()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open) == (0, 0), stats


def test_a_record_closed_by_a_step_with_only_deferred_keys_is_written_without_another_wake_up() -> None:
    # No immediate key (cache_hidden=False): the step queues no task of its own, so the wake-up
    # for the record its new key set closed is the only one; without it the record's write
    # would sit in the queue until some later step woke the committer, and flush would time out.
    policy = CachePolicy(token_keys={"codes", "aux"}, deferred_keys={"codes", "aux"}, cache_hidden=False)
    cache = small_cache(policy=policy, claim_timeout_s=5.0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    mm = {"codes": rows(7, 0, 4), "aux": rows(5, 0, 4)}
    cache.discard(cache.save(None, mm, StepBatch(["a"], [4], slots_of([0, 1], 0, 4, 4))))
    cache.begin_step(StepEvents())
    cache.discard(cache.save(None, {"codes": rows(7, 4, 2)}, StepBatch(["a"], [2], slots_of([0, 1], 4, 2, 4))))
    cache.flush()  # the closed record (a's first 4 rows of both keys) is in the pool
    assert cache.stats().bytes_written == {"codes": 4 * 3 * 4, "aux": 4 * 3 * 4}
    cache.begin_step(StepEvents(finished=["a"], new=[NewRequest("b", [0, 2], 4)]))
    step = cache.save(
        None, {"codes": rows(8, 4, 1), "aux": rows(6, 4, 1)}, StepBatch(["b"], [1], slots_of([0, 2], 4, 1, 4))
    )
    out = cache.materialize(step, ["b"])
    assert describe(out.mm["codes"]["b"]) == describe(rows(7, 0, 4)) + describe(rows(8, 4, 1))
    assert describe(out.mm["aux"]["b"]) == describe(rows(5, 0, 4)) + describe(rows(6, 4, 1))
    cache.close()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats


def test_a_deferred_key_of_zero_width_rows_is_written_and_served_like_any_other() -> None:
    # Rows of zero elements move nothing: the finished request's record is written (a no-op
    # for that key) without failing the cache, and a hit on it gets rows of the same shape.
    cache = small_cache(policy=CachePolicy(token_keys={"codes"}, deferred_keys={"codes"}))
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(
        cache.save(rows(1, 0, 4), {"codes": torch.empty(4, 0)}, StepBatch(["a"], [4], slots_of([0, 1], 0, 4, 4)))
    )
    cache.begin_step(StepEvents(finished=["a"], new=[NewRequest("b", [0, 2], 4)]))
    cache.flush()
    step = cache.save(rows(2, 4, 1), {"codes": torch.empty(1, 0)}, StepBatch(["b"], [1], slots_of([0, 2], 4, 1, 4)))
    out = cache.materialize(step, ["b"])
    assert describe(out.hidden["b"]) == describe(rows(1, 0, 4)) + describe(rows(2, 4, 1))
    assert out.mm["codes"]["b"].shape == (5, 0)
    cache.close()
    stats = cache.stats()
    assert (stats.device_bytes, stats.deferred_open, stats.tasks_live) == (0, 0, 0), stats


@pytest.mark.parametrize("policy", [CachePolicy(token_keys={"codes"}), DEFERRED], ids=["pool", "deferred"])
def test_the_rows_of_dropped_saves_are_delivered_again(policy: CachePolicy) -> None:
    # a's prompt (0..6) is delivered; the step decoding 6 is dropped with a preempting reset
    # (vLLM's reset_prefix_cache(reset_running_requests=True) with that step in flight). a
    # resumes recomputing 0..7 and gets 6 again, not 0..6. Then b hits 8 rows, its first step
    # (the hit rows and 8..10) and the next (10) are dropped likewise (two steps in flight),
    # and its resume at 4 gets 0..4 from the pool and everything it recomputes from there.
    with small_cache(policy=policy) as cache:
        first = save(cache, [("a", [0, 1], 0, 6, 1)], new=[NewRequest("a", [0, 1])])
        check(cache.materialize(first, ["a"]), "a", (1, 0, 6))
        cache.discard(save(cache, [("a", [0, 1], 6, 1, 2)]))
        again = save(cache, [("a", [2, 3], 0, 7, 3)], resumed=[ResumedRequest("a", [2, 3], 0)], dropped_saves={"a": 1})
        check(cache.materialize(again, ["a"]), "a", (3, 6, 1))
        cache.discard(save(cache, [("b", [2, 3, 4], 8, 2, 4)], new=[NewRequest("b", [2, 3, 4], 8)], finished=["a"]))
        cache.discard(save(cache, [("b", [2, 3, 4], 10, 1, 4)]))
        again = save(
            cache, [("b", [2, 5, 6], 4, 7, 5)], resumed=[ResumedRequest("b", [2, 5, 6], 4)], dropped_saves={"b": 2}
        )
        check(cache.materialize(again, ["b"]), "b", (3, 0, 4), (5, 4, 7))
        assert cache.stats().hits == 1


@pytest.mark.parametrize(
    ("dropped_saves", "message"),
    [
        (["a"], "StepEvents.dropped_saves must map request ids to numbers of saves, got list"),
        ({5: 1}, r"StepEvents.dropped_saves holds request ids \(str, valid UTF-8\), got 5"),
        ({"a": 0}, r"request \"a\": 0 dropped saves; a count is 1 or more"),
        ({"a": 17}, r"request \"a\": 17 dropped saves; at most 16 \(the latest saves of a request that are kept\)"),
        ({"a": 2}, r"request \"a\": 2 dropped saves; it has 1"),
        ({"a": -1}, r"StepEvents.dropped_saves\['a'\] must be a number of saves \(an int >= 1\), got -1"),
        ({"a": True}, r"must be a number of saves \(an int >= 1\), got True"),
        ({"b": 1}, r"StepEvents.dropped_saves names request 'b', which is not live \(never scheduled, or finished\)"),
    ],
)
def test_bad_dropped_saves_are_refused_changing_nothing(dropped_saves, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        first = cache.materialize(cache.save(rows(1, 0, 4), {}, StepBatch(["a"], [4], np.arange(4))), ["a"])
        assert torch.equal(first.hidden["a"], rows(1, 0, 4))
        resumed = [ResumedRequest("a", [0, 1], 4)]
        with pytest.raises(InvalidInputError, match=message):
            cache.begin_step(StepEvents(new=[NewRequest("c", [1])], resumed=resumed, dropped_saves=dropped_saves))
        assert cache.stats().requests_live == 1 and cache.stats().misses == 1  # (c not registered)
        with pytest.raises(InvalidInputError, match="which these events do not schedule again"):
            cache.begin_step(StepEvents(dropped_saves={"a": 1}))
        cache.begin_step(StepEvents(resumed=resumed))  # nothing dropped
        sid = cache.save(rows(2, 4, 1), {}, StepBatch(["a"], [1], slots_of([0, 1], 4, 1, BS)))
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], rows(2, 4, 1))


def test_events_refused_for_a_dropped_saves_count_finish_no_request() -> None:
    # A bad count refuses the whole events, their finished ids included (registers nothing):
    # b stays live with its 4 rows delivered, so resuming it at 4 returns no row of them again.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1, 2])]))
        cache.discard(cache.save(spans((1, 0, 4), (2, 0, 4)), {}, StepBatch(["a", "b"], [4, 4], np.arange(8))))
        cache.flush()
        with pytest.raises(InvalidInputError, match=r"request \"a\": 2 dropped saves; it has 1"):
            cache.begin_step(StepEvents(finished=["b"], resumed=[ResumedRequest("a", [0], 0)], dropped_saves={"a": 2}))
        cache.begin_step(StepEvents(resumed=[ResumedRequest("b", [1, 2], 4)]))
        out = cache.materialize(cache.save(rows(3, 4, 1), {}, StepBatch(["b"], [1], np.array([8]))), ["b"])
        assert describe(out.hidden["b"]) == describe(rows(3, 4, 1)), "b's delivered rows came back"
        assert cache.stats().requests_live == 2


def test_a_hit_on_an_open_record_gets_the_newest_row_of_a_slot_saved_twice() -> None:
    # a's deferred hidden rows: slot 3 saved in one step, then again in the next (its row
    # recomputed). b's hit over it is served from a's open record, later c's from the pool:
    # both get the newest row.
    policy = CachePolicy(deferred_keys=frozenset({"hidden"}))
    with small_cache(policy=policy) as cache:
        first = torch.arange(8.0)[:, None].repeat(1, 4)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.materialize(cache.save(first, None, StepBatch(["a"], [8], np.arange(8))), ["a"])
        cache.begin_step(StepEvents())
        cache.materialize(cache.save(torch.full((1, 4), 99.0), None, StepBatch(["a"], [1], np.array([3]))), ["a"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
        step = cache.save(torch.full((1, 4), -1.0), None, StepBatch(["b"], [1], np.array([8])))
        assert cache.materialize(step, ["b"]).hidden["b"][:, 0].tolist() == [0, 1, 2, 99, -1], "from a's record"
        cache.begin_step(StepEvents(finished=["a", "b"]))
        cache.flush()
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 3], 4)]))
        step = cache.save(torch.full((1, 4), -2.0), None, StepBatch(["c"], [1], np.array([12])))
        assert cache.materialize(step, ["c"]).hidden["c"][:, 0].tolist() == [0, 1, 2, 99, -2], "from the pool"


def test_the_same_deferred_keys_in_another_dict_order_extend_the_open_record() -> None:
    # The deferred keys follow the mm dict's order: a step listing them in another order is
    # the same key set, so a's open record grows and is written in one go when a finishes.
    policy = CachePolicy(cache_hidden=False, deferred_keys=frozenset({"codes", "audio"}))
    with small_cache(policy=policy, inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        mm = {"codes": torch.zeros(4, 3), "audio": torch.ones(4, 2)}
        cache.discard(cache.save(None, mm, StepBatch(["a"], [4], np.arange(4))))
        cache.begin_step(StepEvents())
        mm = {"audio": torch.ones(2, 2), "codes": torch.zeros(2, 3)}
        cache.discard(cache.save(None, mm, StepBatch(["a"], [2], np.arange(4, 6))))
        cache.flush()
        stats = cache.stats()
        assert (stats.deferred_open, stats.device_bytes) == (1, 6 * (12 + 8)), stats
        assert stats.bytes_written == {"codes": 0, "audio": 0}, "nothing written before a finishes"
        cache.begin_step(StepEvents(finished=["a"]))
        cache.flush()
        assert cache.stats().bytes_written == {"codes": 6 * 12, "audio": 6 * 8}


def test_a_hit_over_two_live_requests_open_records_reads_each() -> None:
    # a computed block 0 and b, hitting it, block 1; both still run, so those deferred rows are
    # in their open records' clones: c's hit over blocks 0 and 1 is served from both records.
    with small_cache(policy=DEFERRED) as cache:
        cache.discard(save(cache, [("a", [0], 0, 4, 1)], new=[NewRequest("a", [0])]))
        cache.discard(save(cache, [("b", [0, 1], 4, 4, 2)], new=[NewRequest("b", [0, 1], 4)]))
        assert cache.stats().deferred_open == 2
        step = save(cache, [("c", [0, 1, 2], 8, 2, 3)], new=[NewRequest("c", [0, 1, 2], 8)])
        check(cache.materialize(step, ["c"]), "c", (1, 0, 4), (2, 4, 4), (3, 8, 2))
