"""Exactly-once step ids, the staging bound, and bad input that leaves the cache usable."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from cachekit import small_cache, start_thread
from omni_pcache import (
    CacheClosedError,
    CacheConfig,
    CachePolicy,
    ConfigError,
    InvalidInputError,
    NewRequest,
    PrefixCache,
    ResumedRequest,
    StagingTimeoutError,
    StepBatch,
    StepEvents,
    StepIdError,
)


def save_one(cache, req="a", first_slot=0, n=2):
    return cache.save(torch.ones(n, 2), {}, StepBatch([req], [n], np.arange(first_slot, first_slot + n)))


def test_step_ids_consumed_out_of_order_and_from_another_thread() -> None:
    with small_cache(staging_depth=3) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        ids = [save_one(cache, first_slot=2 * i) for i in range(3)]
        assert ids == sorted(ids)
        outs = {}
        t = threading.Thread(target=lambda: outs.update(last=cache.materialize(ids[2], ["a"])))
        t.start()
        t.join()
        cache.discard(ids[0])
        first = cache.materialize(ids[1], ["a"])
        assert torch.equal(first.hidden["a"], torch.ones(2, 2))
        assert torch.equal(outs["last"].hidden["a"], torch.ones(2, 2))
        with pytest.raises(StepIdError, match=rf"step#{ids[1]} was already consumed") as err:
            cache.materialize(ids[1], ["a"])
        assert err.value.outstanding == []
        with pytest.raises(StepIdError, match="step#99 was never issued"):
            cache.discard(99)


def test_a_step_id_of_another_cache_is_refused_not_served() -> None:
    # A runner that rebuilds its cache (vLLM re-initializing the KV cache) may still hold ids
    # of the old one: the new cache must not take one for a step of its own.
    with small_cache() as old, small_cache() as new:
        old.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        stale = save_one(old)
        new.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        mine = save_one(new)
        with pytest.raises(StepIdError, match=rf"step#{stale} was never issued"):
            new.materialize(stale, ["a"])
        assert new.stats().steps_outstanding == [mine]
        assert torch.equal(new.materialize(mine, ["a"]).hidden["a"], torch.ones(2, 2))
        old.discard(stale)


def test_full_staging_waits_then_raises_listing_unconsumed_ids() -> None:
    with small_cache(staging_depth=2, claim_timeout_s=0.2) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        ids = [save_one(cache, first_slot=0), save_one(cache, first_slot=2)]
        with pytest.raises(StagingTimeoutError, match=rf"2 step ids are unconsumed: \[{ids[0]}, {ids[1]}\]") as err:
            save_one(cache, first_slot=4)
        assert err.value.unconsumed == ids
        stats = cache.stats()
        assert stats.num_waits == 1 and 0.2 <= stats.wait_time_s < 10
        assert stats.steps_outstanding == ids, "the refused save left no step id behind"
        # A consumer freeing a page from another thread lets a waiting save through.
        timer = threading.Timer(0.05, cache.discard, args=(ids[0],))
        timer.start()
        third = save_one(cache, first_slot=4)
        timer.join()
        cache.discard(ids[1])
        cache.discard(third)


def test_a_staging_timeout_names_each_pages_holders_in_its_holders_attribute() -> None:
    # StagingTimeoutError.holders lists who holds each page (errors.py), not only its message.
    with small_cache(staging_depth=2, claim_timeout_s=0.1, inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        ids = [save_one(cache, first_slot=0), save_one(cache, first_slot=2)]
        cache.flush()  # (the write tasks' holds on the pages are gone: only the steps hold them)
        with pytest.raises(StagingTimeoutError) as err:
            save_one(cache, first_slot=4)
        assert [sorted(page) for page in err.value.holders] == [[("step", ids[0])], [("step", ids[1])]]
        for sid in ids:
            cache.discard(sid)


def test_waiting_save_succeeds_when_a_page_frees_in_time() -> None:
    with small_cache(staging_depth=1, claim_timeout_s=10.0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        first = save_one(cache)
        threading.Timer(0.05, cache.discard, args=(first,)).start()
        second = save_one(cache, first_slot=2)
        cache.discard(second)
        assert cache.stats().num_waits == 1


def test_a_save_waiting_for_a_page_cut_short_by_close_leaves_no_step_id_outstanding() -> None:
    cache = small_cache(staging_depth=1, claim_timeout_s=30.0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    first = save_one(cache)  # (holds the only page, never consumed)
    waiter, errors = start_thread(save_one, cache, "a", 2)
    time.sleep(0.1)  # (lets the save reach its wait for the page; the test passes either way)
    cache.close()
    waiter.join(10)
    assert not waiter.is_alive() and [type(exc) for exc in errors] == [CacheClosedError], errors
    stats = cache.stats()
    assert stats.steps_outstanding == [], "the refused save issued no step id (and close consumed the first's)"
    assert not cache.awaited(first)
    assert not any(stats.staging_holders), "close released the unconsumed step's page"


def test_oversized_step_and_foreign_request_ids_raise_and_change_nothing() -> None:
    with small_cache(staging_capacity_tokens=8) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        with pytest.raises(InvalidInputError, match="a step of 9 tokens exceeds staging_capacity_tokens=8"):
            save_one(cache, n=9)
        sid = save_one(cache, n=8)
        with pytest.raises(InvalidInputError, match=r"requests \['zz'\] were not in step"):
            cache.materialize(sid, ["a", "zz"])
        out = cache.materialize(sid, ["a"])  # the refused call did not consume the id
        assert out.hidden["a"].shape == (8, 2)


def test_materialize_serves_ids_equal_to_the_saved_ones_but_other_objects() -> None:
    with small_cache() as cache:
        saved = "req-" + str(7)
        cache.begin_step(StepEvents(new=[NewRequest(saved, [0, 1, 2])]))
        sid = save_one(cache, req=saved, n=8)
        asked = "".join(["req-", "7"])
        assert asked == saved and asked is not saved
        out = cache.materialize(sid, [asked])
        assert torch.equal(out.hidden[asked], torch.ones(8, 2))
        assert cache.stats().steps_outstanding == []


def test_materialize_refuses_a_bare_str_unhashable_and_duplicate_ids_and_consumes_nothing() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        sid = save_one(cache, n=8)
        # A str is iterable; its characters ("a") must not be read as the request ids.
        with pytest.raises(InvalidInputError, match=r"req_ids must be a sequence, got the single 'a'"):
            cache.materialize(sid, "a")
        with pytest.raises(InvalidInputError, match=r"req_ids holds request ids \(str\), got \['a'\]"):
            cache.materialize(sid, [["a"]])
        # A one-element numpy array of the id compares equal to it, but is no id (unhashable).
        with pytest.raises(InvalidInputError, match=r"req_ids holds request ids \(str\), got array\(\['a'\]"):
            cache.materialize(sid, list(np.array([["a"]])))
        # A tuple has a hash method, but not one holding a list.
        with pytest.raises(InvalidInputError, match=r"req_ids holds request ids \(str\), got \('a', \['x'\]\)"):
            cache.materialize(sid, [("a", ["x"])])
        with pytest.raises(InvalidInputError, match=r"req_ids has duplicates: \['a'\]; nothing was consumed"):
            cache.materialize(sid, ["a", "b", "a"])
        assert cache.stats().steps_outstanding == [sid]  # no refusal consumed the id
        out = cache.materialize(sid, ["a"])
        assert out.hidden["a"].shape == (8, 2)
        assert cache.stats().steps_outstanding == []


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (StepBatch(["a", "b"], [2], np.arange(2)), "2 req_ids but 1 num_scheduled_tokens"),
        (StepBatch(["a", "a"], [1, 1], np.arange(2)), r"req_ids has duplicates: 'a' at positions 0 and 1"),
        (StepBatch(["b", "a", "c", "a"], [1] * 4, np.arange(4)), r"duplicates: 'a' at positions 1 and 3 \(each"),
        (StepBatch(["a", 5], [1, 1], np.arange(2)), r"req_ids holds request ids \(str, valid UTF-8\), got 5 at"),
        (StepBatch(["\ud800"], [2], np.arange(2)), r"req_ids holds request ids \(str, valid UTF-8\), got '\\ud800'"),
        (StepBatch(["a"], [-1], np.arange(2)), "num_scheduled_tokens of 'a' must be an int >= 0"),
        (StepBatch(["a"], [2], np.arange(1)), "slot_mapping has 1 entries for 2 scheduled tokens"),
        (StepBatch(["a"], [2], np.array([0, 64])), r"slot_mapping: slot id 64 at position 1 is out of range \[0, 64\)"),
        (StepBatch(["a"], [2], np.array([-3, 1])), r"slot_mapping: slot id -3 at position 0 is out of range"),
        (StepBatch(["a"], [2], np.array([5, 5])), r"slot_mapping: slot id 5 appears twice \(positions 0 and 1\)"),
        (StepBatch(["a"], [2], np.array([0.0, 1.0])), "slot_mapping must be a 1-D integer array"),
        (
            StepBatch(["a"], [2], torch.arange(2, dtype=torch.bfloat16)),
            "1-D integer array, got a torch.bfloat16 tensor",
        ),
        (StepBatch(["a"], [2], torch.tensor([True, False])), "1-D integer array, got a torch.bool tensor"),
        (StepBatch(["a"], [2], [[0, 1], [2]]), "slot_mapping must be a 1-D integer array: setting an array element"),
        # (device tensors: reading them would wait for the forward inside save; "meta" stands in for CUDA)
        (StepBatch(["a"], [2], torch.arange(2, device="meta")), "slot_mapping must be the CPU slot ids"),
        (
            StepBatch(["a"], torch.tensor([2], device="meta"), np.arange(2)),
            r"num_scheduled_tokens must be host ints \(no device sync\), got a meta tensor",
        ),
        (StepBatch(["a"], [2], np.arange(2), 1), "num_tokens_padded must be an int >= 2"),
        (StepBatch(["a"], [1], np.arange(1), True), "num_tokens_padded must be an int >= 1, got True"),  # (not 1)
        (StepBatch(["a"], [True], np.arange(2)), "num_scheduled_tokens of 'a' must be an int >= 0, got True"),
        (StepBatch(["a"], [1.0], np.arange(2)), "num_scheduled_tokens of 'a' must be an int >= 0, got 1.0"),
        (StepBatch(["a"], [2**70], np.arange(2)), "num_scheduled_tokens of 'a' is 1180591620717411303424: more tokens"),
        (
            StepBatch(["a"], [2], np.arange(4).reshape(2, 2)),
            r"slot_mapping must be a 1-D integer array, got int64 \(2, 2\)",
        ),
        (StepBatch(["a"], [2], np.array([64, 1], dtype=np.uint16)), r"slot_mapping: slot id 64 at position 0"),
        (  # (not read as the negative int64 it wraps to)
            StepBatch(["a"], [2], np.array([1, 2**64 - 1], dtype=np.uint64)),
            r"slot_mapping: slot id 18446744073709551615 at position 1 is out of range \[0, 64\)",
        ),
        # a str is iterable, but its characters are not the batch's request ids
        (StepBatch("ab", [1, 1], np.arange(2)), "StepBatch.req_ids must be a sequence, got the single 'ab'"),
        (StepBatch(None, [2], np.arange(2)), "StepBatch.req_ids must be a sequence, got NoneType"),
        (StepBatch(["a"], None, np.arange(2)), "StepBatch.num_scheduled_tokens must be a sequence, got NoneType"),
        ({"req_ids": ["a"], "num_scheduled_tokens": [2]}, "save takes a StepBatch, got dict"),
    ],
)
def test_bad_batches_raise_and_the_cache_stays_usable(batch, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        with pytest.raises(InvalidInputError, match=message):
            cache.save(torch.ones(2, 2), {}, batch)
        stats = cache.stats()
        assert stats.steps_outstanding == [] and stats.tasks_live == 0 and stats.staging_holders == [[], [], []]
        out = cache.materialize(save_one(cache), ["a"])
        assert torch.equal(out.hidden["a"], torch.ones(2, 2))
        # (the same rows saved with num_tokens_padded == the scheduled tokens: no padding)
        out = cache.materialize(cache.save(torch.ones(2, 2), {}, StepBatch(["a"], [2], np.arange(2, 4), 2)), ["a"])
        assert torch.equal(out.hidden["a"], torch.ones(2, 2))  # (a continued request: this step's rows)


def test_token_counts_may_be_a_cpu_tensor_or_a_numpy_array() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        hidden = torch.arange(8.0).reshape(4, 2)
        for counts in (torch.tensor([3, 1]), np.array([3, 1])):
            out = cache.materialize(cache.save(hidden, {}, StepBatch(["a", "b"], counts, np.arange(4))), ["a", "b"])
            assert torch.equal(out.hidden["a"], hidden[:3]) and torch.equal(out.hidden["b"], hidden[3:])
            hidden = hidden + 8  # (a continued step: the same slots, new rows)


@pytest.mark.parametrize(
    "mapping",
    [
        np.array([7, 8, 9, 0, 1, 63], dtype=np.int64),
        np.array([7, 8, 9, 0, 1, -1, -1], dtype=np.int32),  # padded past the scheduled tokens
        np.array([7, 0, 8, 0, 9, 0, 0, 0, 1, 0], dtype=np.int64)[::2],  # strided
        np.array([7, 8, 9, 0, 1], dtype=np.uint16),  # another integer dtype: converted first
        torch.tensor([7, 8, 9, 0, 1], dtype=torch.int32),  # a CPU tensor
        [7, 8, 9, 0, 1],  # a list
    ],
    ids=["int64", "int32-padded", "strided", "uint16", "tensor", "list"],
)
def test_a_batch_becomes_rows_per_request_whatever_form_its_slot_mapping_takes(mapping) -> None:
    """Whatever form the slot mapping takes, the step's rows go to its first n slots, each
    request's rows are its range of the step, and requests without rows claim nothing."""
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3]), NewRequest("c", [4])]))
        batch = StepBatch(["a", "c", "b"], [3, 0, 2], mapping)
        hidden = torch.arange(10.0).reshape(5, 2)
        out = cache.materialize(cache.save(hidden, {}, batch), ["a", "b", "c"])
        assert torch.equal(out.hidden["a"], hidden[:3]) and torch.equal(out.hidden["b"], hidden[3:])
        assert out.hidden["c"].shape == (0, 2)
        cache.flush()
        assert cache.stats().bytes_written == {"hidden": 5 * 2 * 4}
        pool = cache._pool.read("hidden", torch.tensor([7, 8, 9, 0, 1]))
        assert torch.equal(pool, hidden), "row r went to slot_mapping[r]"
        cache.begin_step(StepEvents(finished=["a", "b", "c"]))
        assert cache.stats().tasks_live == 0


def test_a_batch_of_one_shot_iterables_is_read_once() -> None:
    """Request ids and counts given as iterators, with a slot list (the path that converts the
    mapping first and checks the batch a second time)."""
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        batch = StepBatch(iter(["a"]), iter([2]), [5, 6])
        out = cache.materialize(cache.save(torch.ones(2, 2), {}, batch), ["a"])
        assert torch.equal(out.hidden["a"], torch.ones(2, 2))


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            StepEvents(new=[NewRequest("a", [0, 1], 3)]),
            "num_computed_tokens=3 is not a whole number of blocks",
        ),
        (StepEvents(new=[NewRequest("a", [0], 8)]), "num_computed_tokens=8 exceeds its 1 blocks of 4"),
        (StepEvents(new=[NewRequest("a", [0, 16])]), r"'a': block id 16 at position 1 is out of range \[0, 16\)"),
        (StepEvents(new=[NewRequest("a", [0]), NewRequest("a", [1])]), "'a' is scheduled twice in one step"),
        (StepEvents(new=["a"]), "StepEvents.new holds NewRequests, got str"),
        (StepEvents(resumed=[NewRequest("a", [0])]), "StepEvents.resumed holds ResumedRequests, got NewRequest"),
        (StepEvents(finished=["b", 5]), r"StepEvents.finished holds request ids \(str, valid UTF-8\), got 5"),
        (StepEvents(new=[NewRequest(7, [0])]), r"StepEvents.new \(its req_id\) holds request ids \(str, valid UTF-8\)"),
        (StepEvents(new=[NewRequest("\udc80", [0])]), r"StepEvents.new \(its req_id\) holds .* got '\\udc80'"),
        (StepEvents(new=[NewRequest("a", [0], True)]), "'a': num_computed_tokens must be an int >= 0, got True"),
        (StepEvents(resumed=[ResumedRequest("a", [0], -4)]), "'a': num_computed_tokens must be an int >= 0, got -4"),
        (StepEvents(new=[NewRequest("a", [0], 4.0)]), "'a': num_computed_tokens must be an int >= 0, got 4.0"),
        # a good request ahead of a bad one is not registered either
        (StepEvents(new=[NewRequest("b", [1]), NewRequest("a", [0], 3)]), "'a': num_computed_tokens=3 is not a whole"),
    ],
)
def test_bad_events_raise_and_change_nothing(events, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("z", [2])]))  # a live request (a miss)
        cache.discard(save_one(cache, "z", first_slot=8))
        with pytest.raises(InvalidInputError, match=message):  # (the events also finish "z")
            cache.begin_step(dataclasses.replace(events, finished=[*events.finished, "z"]))
        assert (cache.stats().hits, cache.stats().misses) == (0, 1)
        # "b" was registered by no refused call: arriving with 4 tokens computed, it is a new hit;
        # "z" was not finished: it is continued (4 tokens of its own progress), not a hit
        cache.begin_step(StepEvents(new=[NewRequest("b", [1], np.int64(4)), NewRequest("z", [2], 4)]))
        assert (cache.stats().hits, cache.stats().misses) == (1, 1)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(save_one(cache))


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (StepEvents(finished="za"), "StepEvents.finished must be a sequence, got the single 'za'"),
        (StepEvents(finished=None), "StepEvents.finished must be a sequence, got NoneType"),
        (StepEvents(new=None), "StepEvents.new must be a sequence, got NoneType"),
        (StepEvents(resumed=5), "StepEvents.resumed must be a sequence, got int"),
        ({"new": [NewRequest("a", [0])]}, "begin_step takes StepEvents, got dict"),
    ],
)
def test_events_that_are_not_sequences_raise_and_change_nothing(events, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("z", [2])]))  # a live request (a miss)
        cache.discard(save_one(cache, "z", first_slot=8))
        with pytest.raises(InvalidInputError, match=message):
            cache.begin_step(events)
        # "z" was not finished (not even by the str "za" read as ids "z" and "a"): continued,
        # neither a hit nor a miss
        cache.begin_step(StepEvents(new=[NewRequest("z", [2], 2)]))
        assert (cache.stats().hits, cache.stats().misses) == (0, 1)


@pytest.mark.parametrize("step_id", [-1, 2**64, 2**70])
def test_step_ids_out_of_range_are_never_issued_ones(step_id) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        sid = save_one(cache)
        for call in (lambda: cache.materialize(step_id, ["a"]), lambda: cache.discard(step_id)):
            with pytest.raises(StepIdError, match=rf"step#{step_id} was never issued; outstanding step ids: \[{sid}\]"):
                call()
        cache.discard(sid)


@pytest.mark.parametrize("step_id", [True, 1.0, "1", None])
def test_step_ids_that_are_not_ints_are_refused_and_consume_nothing(step_id) -> None:
    # (never read as the id they compare equal to: a typed error, whatever the cache issued)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sids = [save_one(cache), save_one(cache, first_slot=2)]
        for call in (lambda: cache.materialize(step_id, ["a"]), lambda: cache.discard(step_id)):
            with pytest.raises(InvalidInputError, match=rf"step_id must be an int, got {step_id!r}"):
                call()
        assert cache.stats().steps_outstanding == sids
        for sid in sids:
            cache.discard(sid)


@pytest.mark.parametrize("req_ids", [["b"], ["a", "a"]], ids=["foreign", "twice"])
def test_request_ids_are_checked_against_a_step_saved_between_takes_two_looks(req_ids) -> None:
    # take looks the record up without the lock (for the checks), then again under it: a save
    # that lands in between (its record stored by another thread) must have the request ids
    # checked too, not be consumed for ids that were not in it. (A records dict that hides the
    # step at the first look stands in for that thread.)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = save_one(cache)

        class SavedAtTheSecondLook(dict):
            looks = 0

            def get(self, key, default=None):
                self.looks += 1
                return default if self.looks == 1 else super().get(key, default)

        cache._steps.records = SavedAtTheSecondLook(cache._steps.records)
        with pytest.raises(InvalidInputError):
            cache.materialize(sid, req_ids)
        assert cache._steps.records.looks == 2 and cache.awaited(sid), "nothing consumed"
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.ones(2, 2))


def test_an_id_whose_save_has_not_returned_is_refused_and_its_step_stays_whole() -> None:
    # Another thread may name an id save has issued but not returned (ids are sequential, and
    # stats lists it): refused, not consumed, so that save's step is consumed normally after.
    # (A leftover's __deepcopy__, which save calls after issuing the id, stands in for the thread.)
    with small_cache() as cache:
        refusals: list[BaseException] = []

        class Probe:
            def __deepcopy__(self, memo):
                (issued,) = cache.stats().steps_outstanding
                for call in (lambda: cache.discard(issued), lambda: cache.materialize(issued, ["a"])):
                    try:
                        call()
                    except BaseException as exc:  # (raised from inside save: kept, not propagated)
                        refusals.append(exc)
                return Probe()

        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.ones(2, 2), {"probe": Probe()}, StepBatch(["a"], [2], np.arange(2)))
        assert [type(exc) for exc in refusals] == [StepIdError, StepIdError], refusals
        assert all(f"step#{sid} is not saved yet" in str(exc) for exc in refusals), refusals
        assert refusals[0].outstanding == [sid]
        assert cache.awaited(sid) and cache.stats().steps_outstanding == [sid]
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.ones(2, 2))
        stats = cache.stats()
        assert (stats.steps_outstanding, stats.staging_holders) == ([], [[], [], []]), stats


@pytest.mark.parametrize("step_id", [True, 1.0, "1", None, [1]])
def test_awaited_refuses_ids_that_are_not_ints(step_id) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        sid = save_one(cache)
        with pytest.raises(InvalidInputError, match=r"step_id must be an int"):
            cache.awaited(step_id)
        assert cache.awaited(sid) and not cache.awaited(sid + 1)
        cache.discard(sid)
        assert not cache.awaited(sid)


@pytest.mark.parametrize("timeout_s", [-1, float("nan"), float("inf"), "1", True])
def test_flush_refuses_a_timeout_that_is_not_a_finite_number(timeout_s) -> None:
    with small_cache() as cache:
        with pytest.raises(InvalidInputError, match="flush timeout_s must be None or a finite number"):
            cache.flush(timeout_s)
        cache.flush(0)  # (nothing queued: returns at once)
        cache.flush(np.float32(0.5))  # (numpy scalars are numbers too)
        cache.flush(threading.TIMEOUT_MAX)  # (the largest a wait takes)


def test_rows_that_require_grad_or_have_no_data() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        rows = torch.ones(2, 2, requires_grad=True)  # (a model run outside inference mode)
        codes = torch.ones(2, 3, requires_grad=True) * 2  # (an mm key's rows in the graph too)
        out = cache.materialize(cache.save(rows, {"codes": codes}, StepBatch(["a"], [2], np.arange(2))), ["a"])
        assert torch.equal(out.hidden["a"], torch.ones(2, 2)) and not out.hidden["a"].requires_grad
        assert torch.equal(out.mm["codes"]["a"], torch.full((2, 3), 2.0)) and not out.mm["codes"]["a"].requires_grad
        with pytest.raises(InvalidInputError, match="hidden states is a meta tensor: it has no rows to cache"):
            cache.save(torch.ones(2, 2, device="meta"), {}, StepBatch(["a"], [2], np.arange(2, 4)))
        assert cache.stats().steps_outstanding == []


def test_bad_hidden_raises() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        with pytest.raises(InvalidInputError, match="hidden states are None"):
            cache.save(None, {}, StepBatch(["a"], [2], np.arange(2)))
        with pytest.raises(InvalidInputError, match=r"hidden states has shape \(3, 2\)"):
            cache.save(torch.ones(3, 2), {}, StepBatch(["a"], [2], np.arange(2)))
        with pytest.raises(InvalidInputError, match="mm must be a dict"):
            cache.save(torch.ones(2, 2), [1], StepBatch(["a"], [2], np.arange(2)))
        with pytest.raises(InvalidInputError, match="mm key 'hidden' is reserved for hidden states"):
            cache.save(torch.ones(2, 2), {"hidden": torch.zeros(2, 2)}, StepBatch(["a"], [2], np.arange(2)))
        assert cache.stats().steps_outstanding == []
        cache.discard(save_one(cache))


def test_config_bounds_are_inclusive() -> None:
    # (each bound itself is accepted: a timeout of 0 never waits, 2**32 - 1 slots are addressable)
    CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=0)
    CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=threading.TIMEOUT_MAX)
    CacheConfig(num_blocks=1, block_size=16, staging_depth=1024, staging_capacity_tokens=2**24)
    assert CacheConfig(num_blocks=2**32 - 1, block_size=1).num_slots == 2**32 - 1
    with pytest.raises(ConfigError, match=r"num_blocks \* block_size = 4294967296 slots exceeds 2\*\*32 - 1"):
        CacheConfig(num_blocks=2**28, block_size=16)


def test_bad_config_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="num_blocks must be a positive int"):
        CacheConfig(num_blocks=0, block_size=16)
    with pytest.raises(ConfigError, match="claim_timeout_s must be a finite number"):
        CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=float("inf"))
    with pytest.raises(
        ConfigError, match=r"claim_timeout_s must be in \[0, .*\] s \(threading.TIMEOUT_MAX\), got 1e\+19"
    ):
        CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=1e19)  # a native wait would overflow its deadline
    with pytest.raises(ConfigError, match=r"inline_write_bytes must be an int >= 0, got -1"):
        CacheConfig(num_blocks=1, block_size=16, inline_write_bytes=-1)
    with pytest.raises(ConfigError, match="config must be a CacheConfig"):
        PrefixCache({"num_blocks": 1})
    with pytest.raises(ConfigError, match="policy must be a CachePolicy, got dict"):
        PrefixCache(CacheConfig(num_blocks=1, block_size=16), {"cache_hidden": False})
    # (were accepted: a huge depth aborted the process allocating its registry, a huge page
    # failed the first save with torch's allocator error, a bool timeout meant 1 s, and a
    # threaded of "no" started the committer thread)
    with pytest.raises(ConfigError, match=r"staging_depth must be at most 1,024, got 8589934592"):
        CacheConfig(num_blocks=1, block_size=16, staging_depth=2**33)
    with pytest.raises(ConfigError, match=r"staging_capacity_tokens must be at most 16,777,216"):
        CacheConfig(num_blocks=1, block_size=16, staging_capacity_tokens=2**50)
    with pytest.raises(ConfigError, match="claim_timeout_s must be a finite number, got True"):
        CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=True)
    for name in ("threaded", "pin_pool"):
        for value in ("no", None, 1):
            with pytest.raises(ConfigError, match=f"{name} must be a bool, got {value!r}"):
                CacheConfig(num_blocks=1, block_size=16, **{name: value})
    # a bool is not a size (True would mean 1), and a negative timeout is no timeout
    for name in ("num_blocks", "staging_depth", "device_budget_bytes", "max_preserved_rows"):
        with pytest.raises(ConfigError, match=f"{name} must be .*got True"):
            CacheConfig(**{"num_blocks": 1, "block_size": 16, name: True})
    with pytest.raises(ConfigError, match=r"claim_timeout_s must be in \[0, .*got -1"):
        CacheConfig(num_blocks=1, block_size=16, claim_timeout_s=-1.0)


def test_every_size_and_the_prefetch_switch_are_checked() -> None:
    # (a page of 0 rows or a copy chunk of 0 bytes was a typo the first save would trip on; a
    # prefetch_hits of "no" is truthy and would have turned prefetching on)
    for name in ("block_size", "staging_capacity_tokens", "copy_chunk_bytes"):
        with pytest.raises(ConfigError, match=f"CacheConfig.{name} must be a positive int, got 0"):
            CacheConfig(**{"num_blocks": 1, "block_size": 16, name: 0})
    for value in ("no", 1, 0.0):
        with pytest.raises(ConfigError, match=f"CacheConfig.prefetch_hits must be None, True or False, got {value!r}"):
            CacheConfig(num_blocks=1, block_size=16, prefetch_hits=value)
    for value in (None, True, False):
        assert CacheConfig(num_blocks=1, block_size=16, prefetch_hits=value).prefetch_hits is value


def test_closed_cache_refuses_calls_and_close_is_idempotent() -> None:
    cache = small_cache()
    cache.close()
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.begin_step(StepEvents())
    with pytest.raises(CacheClosedError, match="the cache is closed"):  # (not a with block that fails inside)
        with cache:
            pass


def test_a_with_block_closes_the_cache_it_configured() -> None:
    config, policy = CacheConfig(num_blocks=16, block_size=4), CachePolicy(token_keys=frozenset({"codes"}))
    with PrefixCache(config, policy) as cache:
        assert cache.config is config and cache.policy is policy
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(save_one(cache))
    with pytest.raises(CacheClosedError, match="the cache is closed"):
        cache.begin_step(StepEvents())
    with pytest.raises(CacheClosedError, match="the cache is closed"):
        save_one(cache, first_slot=2)


def test_close_writes_what_is_queued_then_ends_the_committer_thread() -> None:
    cache = small_cache(inline_write_bytes=0)  # (the committer writes every step)
    gate, write = threading.Event(), cache._writer.write_batch

    def held_write(groups) -> None:
        gate.wait(5)
        write(groups)

    cache._writer.write_batch = held_write
    thread = cache._committer._thread
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(6, 2), {}, StepBatch(["a"], [6], np.arange(6))))
    opener = threading.Timer(0.1, gate.set)
    opener.start()
    cache.close()  # (returns once the held write has landed)
    opener.join()
    assert not thread.is_alive()
    stats = cache.stats()
    assert stats.bytes_written == {"hidden": 6 * 2 * 4} and stats.tasks_live == 0


def test_close_wakes_a_save_waiting_for_a_staging_page() -> None:
    cache = small_cache(staging_depth=1, claim_timeout_s=30.0)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    save_one(cache)  # holds the only page, never consumed
    waiter, errors = start_thread(save_one, cache, "a", 2)
    time.sleep(0.1)  # (the save is waiting for the page)
    cache.close()
    waiter.join(5)
    assert not waiter.is_alive(), "close did not wake the save waiting for a staging page"
    assert [type(exc) for exc in errors] == [CacheClosedError], errors


def test_close_between_a_saves_checks_and_its_page_claim_consumes_its_step_id() -> None:
    # close() on another thread lands after save checked the cache was usable and before it
    # claimed a page without waiting (a page is free): the save raises CacheClosedError and
    # leaves no step id outstanding and no page held, as the waiting claim's path does.
    cache = small_cache(staging_depth=2)
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    classify = cache._keys.classify

    def close_then_classify(*args, **kwargs):
        cache.close()  # (what another thread's close does at this moment)
        return classify(*args, **kwargs)

    cache._keys.classify = close_then_classify
    with pytest.raises(CacheClosedError, match="the cache is closed"):
        save_one(cache)
    stats = cache.stats()
    assert stats.steps_outstanding == [] and stats.staging_holders == [[], []]
    assert stats.tasks_live == 0


def test_returned_rows_are_copies_the_caller_may_write() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3])]))
        h = torch.arange(16.0).reshape(8, 2)
        out = cache.materialize(cache.save(h, {}, StepBatch(["a", "b"], [4, 4], np.arange(8))), ["a", "b"])
        assert torch.equal(out.hidden["b"], h[4:])
        out.hidden["a"].fill_(-1.0)  # misses share one copy of the step's rows, never h or staging
        assert torch.equal(out.hidden["b"], h[4:]) and torch.equal(h, torch.arange(16.0).reshape(8, 2))
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1, 3], 8)], finished=["a", "b"]))
        got = cache.materialize(cache.save(torch.ones(1, 2), {}, StepBatch(["c"], [1], np.array([12]))), ["c"])
        assert torch.equal(got.hidden["c"], torch.cat([h, torch.ones(1, 2)]))


def test_materialize_takes_request_ids_from_any_iterable() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        h = torch.arange(16.0).reshape(8, 2)
        sid = cache.save(h, {}, StepBatch(["a", "b"], [4, 4], np.arange(8)))
        out = cache.materialize(sid, (r for r in ["b", "a"]))  # a one-shot generator
        assert list(out.hidden) == ["b", "a"]
        assert torch.equal(out.hidden["a"], h[:4]) and torch.equal(out.hidden["b"], h[4:])
        assert cache.stats().steps_outstanding == []


def test_an_id_finished_and_new_in_one_step_is_checked_as_a_new_request() -> None:
    # begin_step applies finishes first, so a finished id that comes back new is a fresh request:
    # its hit must be whole blocks, as any new request's (it was checked as live, and accepted).
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(save_one(cache))
        with pytest.raises(InvalidInputError, match="num_computed_tokens=3 is not a whole number of blocks"):
            cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1], 3)], finished=["a"]))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1], 4)], finished=["a"]))
        assert cache.stats().hits == 1


def test_stats_count_live_requests_and_pending_hit_reads_back_to_zero() -> None:
    with small_cache() as cache:  # (blocks of 4 slots)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2])]))
        slots = np.array([0, 1, 2, 3, 8, 9])  # a's 4 rows in block 0, b's 2 in block 2
        cache.materialize(
            cache.save(torch.ones(6, 2), {"codes": torch.arange(6)}, StepBatch(["a", "b"], [4, 2], slots)), ["a", "b"]
        )
        assert (cache.stats().requests_live, cache.stats().reads_pending) == (2, 0)
        # c hits a's first block: one pending read per cached key until its step is consumed.
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 3], 4)], finished=["b"]))
        hit = cache.save(torch.ones(1, 2), {"codes": torch.arange(1)}, StepBatch(["c"], [1], np.array([12])))
        stats = cache.stats()
        assert (stats.requests_live, stats.reads_pending) == (2, 2)  # a and c; hidden and codes
        cache.discard(hit)
        assert cache.stats().reads_pending == 0
        cache.begin_step(StepEvents(finished=["a", "c"]))
        assert cache.stats().requests_live == 0


def test_a_request_no_begin_step_registered_is_taken_as_new_without_a_hit() -> None:
    # README (save): from position 0, counted as neither hit nor miss; it stays live (its next
    # step returns only that step's rows) until reported finished.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(cache.save(torch.ones(2, 2), {}, StepBatch(["a"], [2], np.arange(2))))
        cache.begin_step(StepEvents())
        first = torch.arange(4.0).reshape(2, 2)
        sid = cache.save(torch.cat([torch.ones(1, 2), first]), {}, StepBatch(["a", "x"], [1, 2], np.array([2, 16, 17])))
        assert torch.equal(cache.materialize(sid, ["x"]).hidden["x"], first)
        cache.begin_step(StepEvents())
        stats = cache.stats()
        assert (stats.hits, stats.misses, stats.requests_live) == (0, 1, 2), stats
        sid = cache.save(torch.full((1, 2), 9.0), {}, StepBatch(["x"], [1], np.array([18])))
        assert torch.equal(cache.materialize(sid, ["x"]).hidden["x"], torch.full((1, 2), 9.0))
        cache.begin_step(StepEvents(finished=["a", "x"]))
        assert cache.stats().requests_live == 0


def test_stats_are_a_snapshot_that_later_writes_and_the_caller_do_not_change() -> None:
    with small_cache(inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(save_one(cache))
        cache.flush()
        before = cache.stats()
        assert before.bytes_written == {"hidden": 2 * 2 * 4}
        cache.discard(save_one(cache, first_slot=2))
        cache.flush()
        assert before.bytes_written == {"hidden": 2 * 2 * 4}, "an earlier snapshot changed with later writes"
        before.bytes_written.clear()  # (the caller's to keep or change)
        assert cache.stats().bytes_written == {"hidden": 2 * 2 * 2 * 4}


def test_close_releases_the_hit_reads_of_steps_never_consumed() -> None:
    cache = small_cache()
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.materialize(cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8))), ["a"])
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))  # b hits a's first block
    sid = cache.save(torch.ones(1, 2), {}, StepBatch(["b"], [1], np.array([8])))
    assert cache.stats().reads_pending == 1
    assert cache.awaited(sid) and cache.stats().steps_outstanding == [sid]
    cache.close()
    stats = cache.stats()
    assert (stats.reads_pending, stats.staging_holders) == (0, [[], [], []]), stats
    # (nothing can consume it after close: its id is consumed, so no check reports it as held)
    assert (stats.steps_outstanding, cache.awaited(sid)) == ([], False), stats
    with pytest.raises(CacheClosedError):
        cache.materialize(sid, ["b"])


def test_a_step_is_awaited_once_its_save_returns_not_while_it_runs() -> None:
    cache = small_cache(inline_write_bytes=0)
    keep_aside, seen = cache._claims.keep_aside, []

    def look_then_keep_aside(*args):
        [sid] = cache.stats().steps_outstanding  # (issued, its claims made: the save is under way)
        seen.append(cache.awaited(sid))
        return keep_aside(*args)

    cache._claims.keep_aside = look_then_keep_aside
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    sid = cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8)))
    assert seen == [False] and cache.awaited(sid)
    cache.close()


def test_a_save_that_close_overtakes_after_its_claims_records_no_step() -> None:
    # close() lands (here: on the same thread, as another thread's would) after the save's
    # claims: its rows are still written, but its step is not recorded, as nothing can take it.
    cache = small_cache(inline_write_bytes=0)
    keep_aside = cache._claims.keep_aside

    def close_then_keep_aside(*args):
        cache.close()
        return keep_aside(*args)

    cache._claims.keep_aside = close_then_keep_aside
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    sid = cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8)))
    stats = cache.stats()
    assert (stats.steps_outstanding, cache.awaited(sid), stats.tasks_live) == ([], False, 0), stats
    assert stats.bytes_written == {"hidden": 8 * 2 * 4}, "close writes what is queued"
    with pytest.raises(CacheClosedError):
        cache.materialize(sid, ["a"])
