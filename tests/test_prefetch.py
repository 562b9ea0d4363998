"""Hit prefetch (`CacheConfig.prefetch_hits`, `omni_pcache.prefetch`): the rows the committer
gathers between begin_step and save are served only where the ledger vouches they are the
rows the save's plan reads; every other row is read as without a prefetch, so the outputs
are the same either way."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cachekit import rows, small_cache
from omni_pcache import (
    CacheConfig,
    CachePolicy,
    ConfigError,
    InvalidInputError,
    NewRequest,
    ResumedRequest,
    StepEvents,
    WriteTasks,
)
from omni_pcache._native import Deliveries, Ledger, prefetch_rows
from omni_pcache.committer import Committer
from omni_pcache.prefetch import HitPrefetcher, PrefetchJob
from test_cache_hits import BS, batch, expect, hold_writes, slots_of


def begin(cache, new=(), finished=()) -> None:
    cache.begin_step(StepEvents(new=list(new), finished=list(finished)))


def save(cache, reqs):
    """The save of a step begun already; ``reqs`` as `test_cache_hits.run_step`'s."""
    hidden = torch.cat([rows(w, s, c) for _, _, s, c, w in reqs])
    mm = {"codes": torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for _, _, s, c, w in reqs])}
    slot_lists = [slots_of(b, s, c, BS) for _, b, s, c, _ in reqs]
    return cache.save(hidden, mm, batch([(r, c) for r, _, _, c, _ in reqs], slot_lists))


def step(cache, new, reqs, finished=()):
    begin(cache, new, finished)
    return save(cache, reqs)


def prefetched_by_committer(cache) -> None:
    """Waits until the committer has run every prefetch the last begin_step started."""
    jobs = {id(entry.job): entry.job for entry in cache._prefetch._entries.values()}
    assert jobs, "begin_step started no prefetch"
    for job in jobs.values():
        assert job.wait(5), "the committer never ran the prefetch"


def block_0_committed_and_block_1_in_flight(cache) -> threading.Event:
    """a's rows 0..3 in block 0, written; its rows 4..7 in block 1, their write held until the
    returned gate is set (the committer waits inside it)."""
    sid = step(cache, [NewRequest("a", [0, 1, 2])], [("a", [0, 1, 2], 0, 4, 1)])
    cache.materialize(sid, ["a"])
    cache.flush()
    gate = hold_writes(cache)
    sid = step(cache, [], [("a", [0, 1, 2], 4, 4, 1)])
    cache.materialize(sid, ["a"])
    return gate


@pytest.mark.parametrize("prefetch_hits", [True, False, None])
def test_a_hit_is_served_from_its_prefetch_into_the_tensor_it_returns(prefetch_hits: bool | None) -> None:
    # (None, the default, decides by the rows' device: CPU rows here, so no prefetch)
    with small_cache(prefetch_hits=prefetch_hits) as cache:
        sid = step(cache, [NewRequest("a", [0, 1, 2])], [("a", [0, 1, 2], 0, 10, 1)])
        expect(cache.materialize(sid, ["a"]), "a", [(1, 0, 10)])
        cache.flush()
        begin(cache, [NewRequest("b", [0, 1, 5], 8), NewRequest("c", [6, 7])])
        if prefetch_hits:
            prefetched_by_committer(cache)
        else:
            assert not cache._prefetch.pending, "no prefetch started"
        sid = save(cache, [("b", [0, 1, 5], 8, 3, 2), ("c", [6, 7], 0, 5, 3)])
        assert not cache._prefetch.pending, "the save took b's prefetch: no later save may"
        out = cache.materialize(sid, ["b", "c"])
        expect(out, "b", [(1, 0, 8), (2, 8, 3)])
        expect(out, "c", [(3, 0, 5)])
        stats = cache.stats()
        assert stats.rows_from_pool == 16  # 8 hidden + 8 codes rows, either way
        assert stats.rows_prefetched == (16 if prefetch_hits else 0)
        # With the prefetch, b's rows are the front 11 of the 12 rows (its 3 blocks) the
        # prefetch gathered into: not copied into a chunk shared with c.
        b_rows = out.hidden["b"].untyped_storage().nbytes() // out.hidden["b"][0].nbytes
        assert b_rows == (12 if prefetch_hits else 16)
        out.hidden["b"].fill_(-1)  # the caller's to write: the next hit still gets the cached rows
        sid = step(cache, [NewRequest("d", [0, 1, 8], 8)], [("d", [0, 1, 8], 8, 2, 4)])
        expect(cache.materialize(sid, ["d"]), "d", [(1, 0, 8), (4, 8, 2)])
        assert cache.stats().reads_pending == 0


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20])
def test_a_same_step_hit_on_a_reused_block_gets_the_new_rows_not_the_prefetched_old_ones(
    inline_write_bytes: int,
) -> None:
    # Block 0 held a's rows; a finishes, block 0 goes to d, which computes it now, and b hits
    # it in the same step. At begin_step the prefetch gathers a's committed rows for b; the
    # save's plan then sees d's claim (a newer version), so none of them may be served.
    with small_cache(inline_write_bytes=inline_write_bytes, prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0])], [("a", [0], 0, 4, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("d", [0]), NewRequest("b", [0, 3], 4)], finished=["a"])
        prefetched_by_committer(cache)
        sid = save(cache, [("d", [0], 0, 4, 4), ("b", [0, 3], 4, 3, 5)])
        out = cache.materialize(sid, ["d", "b"])
        expect(out, "d", [(4, 0, 4)])
        expect(out, "b", [(4, 0, 4), (5, 4, 3)])
        assert cache.stats().rows_prefetched == 0


def test_a_prefetch_vouches_only_for_rows_committed_before_and_after_its_gather() -> None:
    with small_cache(inline_write_bytes=0, prefetch_hits=True) as cache:
        gate = block_0_committed_and_block_1_in_flight(cache)
        job = PrefetchJob([("b", slots_of([0, 1], 0, 8, BS), 4)], cache._prefetch.specs, cache._ledger, cache._pool, BS)
        job.run()  # (here, on the test's thread: the committer is held inside block 1's write)
        assert job.wait(0), "a job that ran is done"
        got = job.result(0, 1.0)
        gate.set()
        cache.flush()
        assert got is not None and got.num_rows == 8
        for name in ("hidden", "codes"):
            assert got.rows[name].shape[0] == 12  # the 8 rows read, and room for 4 behind them
            assert (got.versions[name][:4] > 0).all(), "block 0 was committed throughout"
            assert (got.versions[name][4:] == 0).all(), "block 1 was in flight"
        assert torch.equal(got.rows["hidden"][:4], rows(1, 0, 4))


def test_a_prefetch_that_ran_after_the_plan_vouches_only_for_what_the_plan_captured() -> None:
    # Block 0 committed, block 1 in flight when b's read is planned; the prefetch then runs
    # after block 1's write landed: block 1 is vouched for at the version the plan captured,
    # block 0 too, and b gets exactly a's rows.
    with small_cache(inline_write_bytes=0, prefetch_hits=True) as cache:
        gate = block_0_committed_and_block_1_in_flight(cache)
        begin(cache, [NewRequest("b", [0, 1, 3], 8)])
        sid = save(cache, [("b", [0, 1, 3], 8, 2, 2)])
        gate.set()
        cache.flush()
        (hit,) = cache._steps.records[sid].hits.values()
        assert hit.prefetched.job.wait(5)
        expect(cache.materialize(sid, ["b"]), "b", [(1, 0, 8), (2, 8, 2)])
        stats = cache.stats()
        assert (stats.rows_from_pool, stats.rows_in_flight) == (8, 8)  # as the plan found them
        assert stats.rows_prefetched == 16  # all served from the prefetch


def test_a_prefetch_the_committer_has_not_started_is_given_up_and_the_hit_read_at_materialize() -> None:
    with small_cache(inline_write_bytes=0, prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1, 2])], [("a", [0, 1, 2], 0, 10, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        gate = hold_writes(cache)
        sid = step(cache, [NewRequest("c", [4])], [("c", [4], 0, 4, 3)])  # the committer blocks in c's write
        cache.materialize(sid, ["c"])
        begin(cache, [NewRequest("b", [0, 1, 5], 8)])  # its prefetch queued behind c's write
        jobs = [entry.job for entry in cache._prefetch._entries.values()]
        sid = save(cache, [("b", [0, 1, 5], 8, 3, 2)])
        expect(cache.materialize(sid, ["b"]), "b", [(1, 0, 8), (2, 8, 3)])
        gate.set()
        cache.flush()
        assert cache.stats().rows_prefetched == 0
        assert [job._results for job in jobs] == [[]], "a job given up is never run"


class _BrokenPool:
    def rows_of(self, key: str) -> torch.Tensor:
        raise RuntimeError("storage went away")


def test_a_prefetch_that_fails_leaves_nothing_prefetched_and_never_raises() -> None:
    with small_cache(prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0])], [("a", [0], 0, 4, 1)])
        cache.materialize(sid, ["a"])
        planned = [("b", np.arange(4, dtype=np.int64), 4)]
        job = PrefetchJob(planned, cache._prefetch.specs, cache._ledger, _BrokenPool(), BS)
        job.run()
        assert job.result(0, 1.0) is None


def test_jobs_still_queued_when_the_committer_stops_are_cancelled_not_run() -> None:
    tasks = WriteTasks()
    task = tasks.create()
    entered, release = threading.Event(), threading.Event()

    def write(batch):
        entered.set()
        assert release.wait(10)  # (longer than the wait for the cancel below)

    committer = Committer(tasks, write, lambda *a: None, threaded=True)
    ran: list[str] = []

    class Job:
        def run(self) -> None:
            ran.append("run")

        def cancel(self) -> None:
            ran.append("cancel")

    tasks.enqueue_many([task])
    committer.notify(1)
    assert entered.wait(5)
    assert committer.submit(Job())
    stopper = threading.Thread(target=committer.stop, args=(5.0,))
    stopper.start()
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:  # (stop cancels it while the write holds the committer)
        time.sleep(0.001)
    assert ran == ["cancel"], "stop cancels a queued job at once, not once the write is done"
    release.set()
    stopper.join(5)
    assert ran == ["cancel"]
    assert not committer.submit(Job()), "a stopped committer takes no job"


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_prefetch_hits_takes_none_or_a_bool(value) -> None:
    with pytest.raises(ConfigError, match="prefetch_hits must be None, True or False"):
        CacheConfig(num_blocks=4, block_size=4, prefetch_hits=value)


def test_no_prefetch_without_a_committer_thread() -> None:
    with small_cache(threaded=False, prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1])], [("a", [0, 1], 0, 8, 1)])
        cache.materialize(sid, ["a"])
        begin(cache, [NewRequest("b", [0, 1, 2], 8)])
        assert not cache._prefetch.pending
        sid = save(cache, [("b", [0, 1, 2], 8, 1, 2)])
        expect(cache.materialize(sid, ["b"]), "b", [(1, 0, 8), (2, 8, 1)])
        assert cache.stats().rows_prefetched == 0


def _prefetch_args():
    ledger = Ledger(16, 4)
    key = ledger.add_key()
    ledger.claim(np.arange(8), key, 1)
    ledger.commit(1)
    pool = np.arange(16 * 4, dtype=np.uint8).reshape(16, 4)
    return ledger, key, pool


def test_the_native_gather_copies_runs_and_vouches_for_committed_rows_only() -> None:
    ledger, key, pool = _prefetch_args()
    out = np.zeros((6, 4), dtype=np.uint8)
    versions = prefetch_rows(ledger, key, pool, np.array([6, 7, 8, 2]), out, np.array([0, 1, 4, 5]))
    assert np.array_equal(out[[0, 1, 4, 5]], pool[[6, 7, 8, 2]])
    assert not out[2:4].any(), "rows no slot maps to are left alone"
    assert versions.tolist()[:2] == [versions[0]] * 2 and versions[0] > 0
    assert versions[2] == 0, "slot 8 was never written"
    assert versions[3] == versions[0]


@pytest.mark.parametrize(
    ("slots", "dest", "out_shape", "message"),
    [
        ([0, 16], [0, 1], (2, 4), r"slot 16 at position 1 is out of range \[0, 16\)"),
        ([0, -1], [0, 1], (2, 4), "slot -1 at position 1"),
        ([0, 1], [0, 2], (2, 4), r"output row 2 at position 1 is out of range \[0, 2\)"),
        ([0, 1], [0], (2, 4), "2 slots but 1 output rows"),
        ([0, 1], [0, 1], (2, 3), "out rows of 3 bytes from a pool of 4-byte rows"),
    ],
)
def test_the_native_gather_refuses_bad_arguments_copying_nothing(slots, dest, out_shape, message) -> None:
    ledger, key, pool = _prefetch_args()
    out = np.zeros(out_shape, dtype=np.uint8)
    with pytest.raises(InvalidInputError, match=message):
        prefetch_rows(ledger, key, pool, np.array(slots), out, np.array(dest))
    assert not out.any()


def test_the_native_gather_refuses_arrays_it_cannot_borrow_or_read_as_rows() -> None:
    ledger, key, pool = _prefetch_args()
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        prefetch_rows(ledger, key, pool, np.array([0]), np.zeros((4, 2), dtype=np.uint8).T, np.array([0]))
    with pytest.raises(InvalidInputError, match="out:"):  # (the pool itself as the output)
        prefetch_rows(ledger, key, pool, np.array([0]), pool, np.array([1]))
    read_only = np.zeros((2, 4), dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(InvalidInputError, match="out:"):
        prefetch_rows(ledger, key, pool, np.array([0]), read_only, np.array([0]))
    with pytest.raises(InvalidInputError, match="key"):
        prefetch_rows(ledger, key + 5, pool, np.array([0]), np.zeros((2, 4), dtype=np.uint8), np.array([0]))


def test_a_read_planned_again_before_its_save_is_served_from_the_later_prefetch() -> None:
    # b's span is planned twice before its save (continued as new, the same length, other
    # blocks). a wrote all four blocks in one claim, so the first prefetch's rows carry the
    # versions the second read captures: only dropping that prefetch keeps a's rows 0..7 out.
    with small_cache(inline_write_bytes=0, prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1, 2, 3])], [("a", [0, 1, 2, 3], 0, 16, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", [0, 1, 5], 8)])
        first = next(iter(cache._prefetch._entries.values())).job
        assert first.wait(5)
        begin(cache, [NewRequest("b", [2, 3, 5], 8)])
        prefetched_by_committer(cache)
        sid = save(cache, [("b", [2, 3, 5], 8, 2, 2)])
        expect(cache.materialize(sid, ["b"]), "b", [(1, 8, 8), (2, 8, 2)])  # blocks 2 and 3, then b's own
        assert cache.stats().rows_prefetched == 16


def test_a_read_planned_again_drops_its_earlier_prefetch_even_when_none_starts_for_it() -> None:
    # (the committer stopping refuses the second job: the first must not serve the new read)
    with small_cache(prefetch_hits=True) as cache:
        step(cache, [NewRequest("a", [0])], [("a", [0], 0, 4, 1)])
        accept = [True, False]
        prefetcher = HitPrefetcher(cache._ledger, cache._pool, lambda job: accept.pop(0), BS, 64, True)
        prefetcher.specs = cache._prefetch.specs
        prefetcher.start([("b", np.arange(4, dtype=np.int64), 4)])
        assert prefetcher.pending
        prefetcher.start([("b", np.arange(4, 8, dtype=np.int64), 4)])
        assert not prefetcher.pending


def test_unvouched_names_the_rows_a_read_cannot_take_from_a_prefetch() -> None:
    ledger, key, _pool = _prefetch_args()
    plan = ledger.plan_read(np.arange(4, 12), key)
    version = ledger.captured_versions(plan.read_id)[0]
    vouched = np.array([version] * 4 + [0] * 4, dtype=np.uint64)
    assert ledger.unvouched(plan.read_id, vouched).tolist() == [4, 5, 6, 7]
    with pytest.raises(InvalidInputError, match="3 versions for a read of 8 slots"):
        ledger.unvouched(plan.read_id, vouched[:3])
    ledger.release(plan.read_id)
    with pytest.raises(InvalidInputError):
        ledger.unvouched(plan.read_id, vouched)


@pytest.mark.parametrize("plan_reads", [True, False])
def test_begin_hands_out_the_planned_reads_only_when_asked(plan_reads: bool) -> None:
    deliveries = Deliveries(4)
    hit = NewRequest("b", [3, 1, 5], 8)
    *_, planned = deliveries.begin([], [hit], [], NewRequest, ResumedRequest, 8, {}, {}, plan_reads)
    if plan_reads:
        [(req_id, slots, room)] = planned
        assert (req_id, slots.tolist(), room) == ("b", [12, 13, 14, 15, 4, 5, 6, 7], 4)
    else:
        assert planned == []
    _, reads = deliveries.take_step({"b": (0, 2)})
    assert reads["b"].tolist() == [12, 13, 14, 15, 4, 5, 6, 7], "the read is planned either way"


def test_each_hit_of_a_step_is_matched_against_the_versions_gathered_for_its_own_slots() -> None:
    # b hits a's block 1 and c its block 0, written by two steps (two versions): both are
    # served from the one job's prefetch, each vouched for by its own part of it.
    with small_cache(prefetch_hits=True) as cache:
        for start in (0, 4):
            sid = step(cache, [NewRequest("a", [0, 1, 2])] if start == 0 else [], [("a", [0, 1, 2], start, 4, 1)])
            cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", [1, 5], 4), NewRequest("c", [0, 6], 4)])
        prefetched_by_committer(cache)
        sid = save(cache, [("b", [1, 5], 4, 1, 2), ("c", [0, 6], 4, 1, 3)])
        out = cache.materialize(sid, ["b", "c"])
        expect(out, "b", [(1, 4, 4), (2, 4, 1)])
        expect(out, "c", [(1, 0, 4), (3, 4, 1)])
        assert cache.stats().rows_prefetched == 16  # both hits' 4 rows, hidden and codes


@pytest.mark.parametrize(
    ("staging", "blocks", "count", "storage_rows"),
    [
        (64, [0, 1, 5], 4, 12),  # 8 + 4 rows: the 12 the prefetch gathered into
        (64, [0, 1, 5, 6], 4, 14),  # 16 gathered into, a block to spare: a chunk shared with c
        (10, [0, 1, 5, 6, 7], 7, 18),  # room for a step's rows past the hit (10), not the table's 12
    ],
    ids=["exact-fit", "a-block-to-spare", "room-of-one-step"],
)
def test_a_hit_gets_its_prefetched_tensor_only_with_less_than_a_block_to_spare(
    staging: int, blocks: list[int], count: int, storage_rows: int
) -> None:
    with small_cache(staging_capacity_tokens=staging, prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1])], [("a", [0, 1], 0, 8, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", blocks, 8), NewRequest("c", [9])])
        prefetched_by_committer(cache)
        sid = save(cache, [("b", blocks, 8, count, 2), ("c", [9], 0, 2, 3)])
        out = cache.materialize(sid, ["b", "c"])
        expect(out, "b", [(1, 0, 8), (2, 8, count)])
        expect(out, "c", [(3, 0, 2)])
        assert out.hidden["b"].untyped_storage().nbytes() // out.hidden["b"][0].nbytes == storage_rows


def test_a_prefetched_row_overwritten_before_materialize_is_served_from_its_preserved_copy() -> None:
    # The prefetch vouches for both of a's blocks at the versions b's plan captures; block 0 is
    # then reused before b's step is materialized: those rows are preserved ones, not prefetched.
    with small_cache(prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1])], [("a", [0, 1], 0, 8, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", [0, 1, 2], 8)], finished=["a"])
        prefetched_by_committer(cache)
        hit_step = save(cache, [("b", [0, 1, 2], 8, 3, 2)])
        reuse_step = step(cache, [NewRequest("c", [0, 3])], [("c", [0, 3], 0, 5, 3)], finished=["b"])
        expect(cache.materialize(hit_step, ["b"]), "b", [(1, 0, 8), (2, 8, 3)])
        stats = cache.stats()
        assert (stats.rows_preserved, stats.rows_from_pool, stats.rows_prefetched) == (8, 8, 8)
        expect(cache.materialize(reuse_step, ["c"]), "c", [(3, 0, 5)])


def test_a_hit_in_a_step_that_caches_no_key_ignores_its_prefetch() -> None:
    with small_cache(prefetch_hits=True, policy=CachePolicy(cache_hidden=False)) as cache:
        begin(cache, [NewRequest("a", [0, 1])])
        codes = rows(1, 0, 8, width=2, dtype=torch.int64)
        sid = cache.save(None, {"codes": codes}, batch([("a", 8)], [slots_of([0, 1], 0, 8, BS)]))
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", [0, 1, 2], 8)])
        prefetched_by_committer(cache)
        sid = cache.save(None, {}, batch([("b", 1)], [slots_of([0, 1, 2], 8, 1, BS)]))
        out = cache.materialize(sid, ["b"])
        assert out.hidden is None and out.mm == {}


def test_a_key_of_rows_without_bytes_is_read_from_the_pool_the_others_from_the_prefetch() -> None:
    with small_cache(prefetch_hits=True) as cache:
        begin(cache, [NewRequest("a", [0, 1])])
        empty = {"codes": rows(1, 0, 8, width=2, dtype=torch.int64), "none": torch.zeros(8, 0)}
        sid = cache.save(rows(1, 0, 8), empty, batch([("a", 8)], [slots_of([0, 1], 0, 8, BS)]))
        cache.materialize(sid, ["a"])
        cache.flush()
        begin(cache, [NewRequest("b", [0, 1, 2], 8)])
        prefetched_by_committer(cache)
        mm = {"codes": rows(2, 8, 1, width=2, dtype=torch.int64), "none": torch.zeros(1, 0)}
        sid = cache.save(rows(2, 8, 1), mm, batch([("b", 1)], [slots_of([0, 1, 2], 8, 1, BS)]))
        out = cache.materialize(sid, ["b"])
        expect(out, "b", [(1, 0, 8), (2, 8, 1)])
        assert out.mm["none"]["b"].shape == (9, 0)
        assert cache.stats().rows_prefetched == 16  # hidden and codes; "none" has no bytes to gather


class _HeldPool:
    """The cache's pool, whose gather holds until ``go`` is set (``started`` once it holds)."""

    def __init__(self, pool, started: threading.Event, go: threading.Event) -> None:
        self._pool, self._started, self._go = pool, started, go

    def rows_of(self, key: str) -> torch.Tensor | None:
        self._started.set()
        assert self._go.wait(5), "nobody waited for the job"
        return self._pool.rows_of(key)

    def byte_rows(self, key: str) -> np.ndarray:
        return self._pool.byte_rows(key)


class _GoOnWaits:
    """A job's end-of-run lock that sets ``go`` once ``consumers`` consumers wait on it at once."""

    def __init__(self, lock, go: threading.Event, consumers: int) -> None:
        self._lock, self._go, self._left, self._count = lock, go, consumers, threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._count:
            self._left -= 1
            if self._left == 0:
                self._go.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()


def test_a_consumer_that_finds_its_prefetch_running_waits_for_its_rows() -> None:
    with small_cache(prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0])], [("a", [0], 0, 4, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        started, go = threading.Event(), threading.Event()
        pool = _HeldPool(cache._pool, started, go)
        job = PrefetchJob([("b", slots_of([0], 0, 4, BS), 0)], cache._prefetch.specs, cache._ledger, pool, BS)
        job._running = _GoOnWaits(job._running, go, 1)  # (the gather goes on once the consumer waits for it)
        runner = threading.Thread(target=job.run)
        runner.start()
        assert started.wait(5)
        got = job.result(0, 5.0)
        runner.join(5)
        assert got is not None, "a running prefetch was given up"
        assert torch.equal(got.rows["hidden"][:4], rows(1, 0, 4))


def test_every_consumer_that_finds_the_prefetch_running_gets_its_rows() -> None:
    # b's and c's hits are gathered by one job; two threads (as two materializing threads would)
    # ask for their rows while it runs and both wait for it: the first that wakes must let the
    # other wake too, not leave it to give the job up at its timeout.
    with small_cache(prefetch_hits=True) as cache:
        sid = step(cache, [NewRequest("a", [0, 1])], [("a", [0, 1], 0, 8, 1)])
        cache.materialize(sid, ["a"])
        cache.flush()
        started, go = threading.Event(), threading.Event()
        pool = _HeldPool(cache._pool, started, go)
        planned = [("b", slots_of([0], 0, 4, BS), 0), ("c", slots_of([0, 1], 4, 4, BS), 0)]
        job = PrefetchJob(planned, cache._prefetch.specs, cache._ledger, pool, BS)
        job._running = _GoOnWaits(job._running, go, consumers=2)  # (the gather goes on once both wait)
        runner = threading.Thread(target=job.run)
        runner.start()
        assert started.wait(5)
        got: dict[int, object] = {}
        consumers = [threading.Thread(target=lambda i=i: got.update({i: job.result(i, 5.0)})) for i in (0, 1)]
        for consumer in consumers:
            consumer.start()
        for thread in (*consumers, runner):
            thread.join(10)
        assert got[0] is not None and got[1] is not None, "a consumer waiting for a running prefetch gave it up"
        assert torch.equal(got[0].rows["hidden"][:4], rows(1, 0, 4))
        assert torch.equal(got[1].rows["hidden"][:4], rows(1, 4, 4))


def test_writes_queued_while_a_side_job_runs_go_before_the_next_job() -> None:
    tasks = WriteTasks()
    first, second = tasks.create(), tasks.create()
    release, done = threading.Event(), threading.Event()
    order: list[str] = []

    def write(batch) -> None:
        assert release.wait(5)
        order.append("write")

    class Job:
        def __init__(self, name: str, then: int | None = None) -> None:
            self.name, self.then = name, then

        def run(self) -> None:
            order.append(self.name)
            if self.then is None:
                done.set()
            else:
                tasks.enqueue_many([self.then])

        def cancel(self) -> None:
            order.append("cancel")

    committer = Committer(tasks, write, lambda *a: None, threaded=True)
    tasks.enqueue_many([first])
    committer.notify(1)
    assert committer.submit(Job("job 1", then=second)) and committer.submit(Job("job 2"))
    release.set()
    assert done.wait(5)
    committer.stop(5.0)
    assert order == ["write", "job 1", "write", "job 2"]


def test_a_job_queued_just_before_the_committer_sleeps_is_run_without_a_wake_up() -> None:
    # (a submit that found the committer still awake woke nobody: the committer must see the
    # job when it checks for work before it sleeps; simulated here inside that check)
    tasks, ran, wrote, box = WriteTasks(), threading.Event(), threading.Event(), []

    class Job:
        def run(self) -> None:
            ran.set()

        def cancel(self) -> None:
            pass

    class Tasks:  # the committer's queue, a job slipped in at its last check before sleeping
        @property
        def num_queue_entries(self) -> int:
            if wrote.is_set() and box and box[0]._sleeping and box[0]._wake.locked():  # (no wake-up pending)
                box.pop()._jobs.append(Job())
            return tasks.num_queue_entries

        def pop_many(self, n: int) -> list[int]:
            return tasks.pop_many(n)

    committer = Committer(Tasks(), lambda batch: wrote.set(), lambda *a: None, threaded=True)
    box.append(committer)
    tasks.enqueue_many([tasks.create()])
    committer.notify(1)
    assert ran.wait(5), "the committer slept with a job queued"
    committer.stop(5.0)
