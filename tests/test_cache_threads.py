"""Who does what: the committer thread writes the pool and runs CPU staging copies; save never
waits for its copies; inline mode for debugging; stats and the host footprint."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from cachekit import small_cache
from omni_pcache import CachePolicy, NewRequest, StepBatch, StepEvents


def recording_pool_writes(cache) -> list[str]:
    """The thread of every pool write: a step's run of tasks (`PoolWriter.write_step`), a small
    step written by save (`PoolWriter.write_step_now`) or a deferred record's key
    (`HostPool.write`)."""
    names: list[str] = []
    for owner, name in ((cache._writer, "write_step"), (cache._writer, "write_step_now"), (cache._pool, "write")):
        write = getattr(owner, name)

        def record(*args, write=write):
            names.append(threading.current_thread().name)
            write(*args)

        setattr(owner, name, record)
    return names


def test_the_committer_thread_writes_the_pool_and_save_does_not_wait_for_it() -> None:
    with small_cache(inline_write_bytes=0) as cache:
        writers = recording_pool_writes(cache)
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda record: (gate.wait(10), write(record))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4)))
        # save returned while its write is blocked on the committer thread
        assert writers == []
        out = cache.materialize(sid, ["a"])  # (read in place from the caller's tensor: same thread, same step)
        assert torch.equal(out.hidden["a"], torch.ones(4, 2))
        assert cache.stats().tasks_live == 1, "its write is still on its way to the pool"
        gate.set()
        cache.flush()
        assert writers == ["omni-pcache-committer"]
        assert cache.stats().tasks_live == 0, "written: not live once flush returns, before any begin_step"
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))  # what reached the pool
        out = cache.materialize(cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8]))), ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([torch.ones(4, 2), torch.zeros(1, 2)]))


def test_a_small_cpu_step_is_written_inside_save_while_the_committer_is_idle() -> None:
    with small_cache() as cache:  # default inline_write_bytes: 256 KiB
        writers = recording_pool_writes(cache)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4)))
        assert writers == ["MainThread"], "written before save returned, by the saving thread"
        assert cache.stats().bytes_written == {"hidden": 4 * 2 * 4}
        assert cache.stats().tasks_live == 0, "its tasks closed and forgotten inside save (nothing queued)"
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.ones(4, 2))
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))
        out = cache.materialize(cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8]))), ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([torch.ones(4, 2), torch.zeros(1, 2)]))
        cache.begin_step(StepEvents(finished=["b"]))  # reaps what was written
        assert cache.stats().tasks_live == 0


def test_a_step_of_inline_write_bytes_or_more_goes_to_the_committer() -> None:
    with small_cache(inline_write_bytes=4 * 2 * 4) as cache:  # exactly this step's bytes
        writers = recording_pool_writes(cache)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
        cache.flush()
        assert writers == ["omni-pcache-committer"]


def test_a_small_step_saved_while_the_committer_writes_is_handed_to_it_not_waited_for() -> None:
    with small_cache(inline_write_bytes=64) as cache:
        writers = recording_pool_writes(cache)
        entered, gate = threading.Event(), threading.Event()
        write = cache._writer.write_batch

        def held(records):
            entered.set()
            assert gate.wait(10), "test gate never opened"
            write(records)

        cache._writer.write_batch = held
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        first = cache.save(torch.ones(8, 2), {}, StepBatch(["a"], [8], np.arange(8)))  # 64 bytes: committer
        assert entered.wait(10)
        second = cache.save(torch.zeros(1, 2), {}, StepBatch(["a"], [1], np.array([8])))  # small, committer busy
        assert writers == [], "save returned without writing or waiting while the committer held the pool"
        gate.set()
        cache.flush()
        assert writers == ["omni-pcache-committer"] * 2
        cache.discard(first)
        assert torch.equal(cache.materialize(second, ["a"]).hidden["a"], torch.zeros(1, 2))
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 3], 8)]))  # the first step's rows in the pool
        out = cache.materialize(cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([12]))), ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([torch.ones(8, 2), torch.zeros(1, 2)]))


def recording_host_copies(monkeypatch, every_copy_deferred: bool = True) -> list[str]:
    from omni_pcache import copy_engine
    from omni_pcache.copy_engine import HostCopy

    if every_copy_deferred:
        monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 0)
    names: list[str] = []
    run = HostCopy.run

    def record(self) -> None:
        if not self.done():
            names.append(threading.current_thread().name)
        run(self)

    monkeypatch.setattr(HostCopy, "run", record)
    return names


def test_cpu_staging_copies_run_on_the_committer_not_in_save(monkeypatch) -> None:
    copiers = recording_host_copies(monkeypatch)
    with small_cache(inline_write_bytes=0) as cache:  # (else save writes the step from the caller's tensor)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = torch.arange(8.0).reshape(4, 2)
        sid = cache.save(h, {}, StepBatch(["a"], [4], np.arange(4)))
        cache.flush()
        assert copiers == ["omni-pcache-committer"]
        cache.begin_step(StepEvents())  # (after it materialize reads the staging page, not h)
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], h)
        assert copiers == ["omni-pcache-committer"]  # the fence and materialize found the copy done


@pytest.mark.parametrize("fence", ["begin_step", "fence"])
def test_saved_cpu_tensors_may_be_reused_after_the_next_begin_step_or_fence(monkeypatch, fence: str) -> None:
    # `fence` alone, for a forward no step begins (a dummy run), makes them the caller's too.
    from omni_pcache import copy_engine

    monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 0)  # every CPU copy deferred
    with small_cache(inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda records: (gate.wait(10), write(records))  # committer held back
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = torch.arange(8.0).reshape(4, 2)
        sid = cache.save(h.clone(), {}, StepBatch(["a"], [4], np.arange(4)))
        buffer = h.clone()
        sid2 = cache.save(buffer, {}, StepBatch(["a"], [4], np.arange(4, 8)))
        finished = ["a"]
        if fence == "fence":
            cache.fence()  # the buffer is the caller's again
        else:
            cache.begin_step(StepEvents(finished=finished))  # the fence: the buffer is the caller's again
            finished = []
        buffer.fill_(-1.0)
        gate.set()
        assert torch.equal(cache.materialize(sid2, ["a"]).hidden["a"], h)
        cache.discard(sid)
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 2], 8)], finished=finished))
        out = cache.materialize(cache.save(torch.ones(1, 2), {}, StepBatch(["b"], [1], np.array([8]))), ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([h, h, torch.ones(1, 2)]))


def test_a_materialize_on_another_thread_runs_the_steps_pending_copy_itself(monkeypatch) -> None:
    # The committer is held back before it copies the step into staging; a materialize on
    # another thread may not read the caller's tensors in place, so it runs the copy itself
    # (and does not wait for the committer, nor read the page before the copy).
    copiers = recording_host_copies(monkeypatch)
    with small_cache(inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda records: (gate.wait(10), write(records))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = torch.randn(8, 64)
        sid = cache.save(h, {}, StepBatch(["a"], [8], np.arange(8)))
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(cache.materialize(sid, ["a"]).hidden["a"]), name="reader")
        reader.start()
        reader.join(10)
        gate.set()
        assert copiers == ["reader"]
        assert torch.equal(got[0], h)


def test_small_cpu_copies_are_made_in_save(monkeypatch) -> None:
    copiers = recording_host_copies(monkeypatch)
    from omni_pcache import copy_engine

    monkeypatch.setattr(copy_engine, "INLINE_COPY_BYTES", 1024)
    # (handed to the committer: a small step save writes itself is copied by its own path)
    with small_cache(inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = torch.arange(8.0).reshape(4, 2)
        sid = cache.save(h, {}, StepBatch(["a"], [4], np.arange(4)))
        cache.flush()
        assert copiers == []  # no deferred copy: the 32-byte step was copied into the page inside save
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], h)
        assert cache.stats().bytes_written == {"hidden": 32}


def test_the_size_a_cpu_copy_is_made_in_save_under_is_in_bytes(monkeypatch) -> None:
    # 70,000 float32 elements: fewer than INLINE_COPY_BYTES (256 KiB), but 280 KB, so the
    # committer copies them, not the engine thread inside save.
    copiers = recording_host_copies(monkeypatch, every_copy_deferred=False)
    with small_cache(inline_write_bytes=0) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = torch.randn(8, 8750)
        sid = cache.save(h, {}, StepBatch(["a"], [8], np.arange(8)))
        cache.flush()
        assert copiers == ["omni-pcache-committer"]
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], h)


def test_a_host_copy_run_while_another_thread_runs_it_waits_for_that_one() -> None:
    # The fence (engine thread) finding the committer in the middle of a step's CPU copies must
    # wait for them: once it returns, the saved tensors are the caller's again, so no thread may
    # still be reading them (nor copy a pair a second time).
    from omni_pcache.copy_engine import HostCopy

    inside, release = threading.Event(), threading.Event()
    copied: list[str] = []

    class Destination:
        def copy_(self, src: str) -> None:
            copied.append(src)
            if len(copied) == 1:  # (the committer, held in its first copy)
                inside.set()
                assert release.wait(10), "test gate never opened"

    class WatchedLock:
        def __init__(self) -> None:
            self.lock, self.contended = threading.Lock(), threading.Event()

        def __enter__(self) -> None:
            if not self.lock.acquire(blocking=False):
                self.contended.set()
                self.lock.acquire()

        def __exit__(self, *exc) -> None:
            self.lock.release()

    copy = HostCopy([(Destination(), "first"), (Destination(), "second")])
    copy._lock = lock = WatchedLock()
    committer = threading.Thread(target=copy.run)
    committer.start()
    assert inside.wait(10)
    fenced = threading.Event()
    fence = threading.Thread(target=lambda: (copy.run(), fenced.set()))
    try:
        fence.start()
        for _ in range(10_000):  # until the fence either waits for the committer or returns without it
            if lock.contended.is_set() or fenced.is_set():
                break
            time.sleep(0.001)
        assert not fenced.is_set(), "the fence returned while the committer was still copying"
    finally:
        release.set()
        committer.join(10)
        fence.join(10)
    assert fenced.is_set() and copy.done() and copied == ["first", "second"]


def test_threaded_false_writes_inline_on_the_engine_thread() -> None:
    # (inline_write_bytes=0: with a committer thread, this step would go to it)
    with small_cache(threaded=False, inline_write_bytes=0) as cache:
        writers = recording_pool_writes(cache)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
        assert writers == [threading.current_thread().name]


def test_stats_count_hits_rows_bytes_and_holders() -> None:
    with small_cache(staging_depth=2) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        mm = {"codes": torch.arange(8, dtype=torch.int32)}
        first = cache.save(torch.ones(8, 3), mm, StepBatch(["a"], [8], np.arange(8)))
        stats = cache.stats()
        assert stats.steps_outstanding == [first]
        assert ("step", first) in stats.staging_holders[0]
        cache.materialize(first, ["a"])
        cache.flush()
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))
        mm = {"codes": torch.arange(2, dtype=torch.int32)}
        cache.materialize(cache.save(torch.ones(2, 3), mm, StepBatch(["b"], [2], np.array([8, 9]))), ["b"])
        cache.flush()
        stats = cache.stats()
        assert (stats.hits, stats.misses) == (1, 1)
        assert stats.rows_from_pool == 8 and stats.rows_in_flight == 0 and stats.rows_preserved == 0
        assert stats.bytes_written == {"hidden": 10 * 3 * 4, "codes": 10 * 4}
        assert stats.pool_bytes == {"hidden": 64 * 3 * 4, "codes": 64 * 4}
        assert stats.staging_holders == [[], []]
        assert stats.steps_outstanding == []


def test_pool_storage_is_allocated_on_first_sight_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omni_pcache")
    with small_cache(num_blocks=256, block_size=4) as cache:  # (1,024 slots)
        assert cache.stats().pool_bytes == {}
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2, 3])]))
        for i in range(3):
            mm = {"audio": torch.zeros(2, 4, 2, dtype=torch.bfloat16)}
            cache.discard(cache.save(torch.zeros(2, 512), mm, StepBatch(["a"], [2], np.arange(2 * i, 2 * i + 2))))
        # a second key set holding a key already stored: its storage is neither made nor logged again
        cache.discard(cache.save(torch.zeros(2, 512), {}, StepBatch(["a"], [2], np.arange(6, 8))))
        assert cache.stats().pool_bytes == {"hidden": 1024 * 512 * 4, "audio": 1024 * 8 * 2}
    pool_logs = [r.getMessage() for r in caplog.records if "host pool" in r.getMessage()]
    assert pool_logs == [  # (pageable by default, CUDA or not: CacheConfig.pin_pool)
        "host pool for 'hidden' rows (512,) float32: 1024 slots, 2.0 MiB",
        "host pool for 'audio' rows (4, 2) bfloat16: 1024 slots, 16.0 KiB",
    ]


@pytest.mark.parametrize("busy_switching", [1e-6], indirect=True)  # as often as the interpreter allows
def test_flush_on_another_thread_while_the_engine_thread_steps(busy_switching) -> None:
    # begin_step forgets written tasks while flush() on another thread scans them: both under
    # the ledger lock (a scan used to meet "dictionary changed size during iteration").
    errors: list[BaseException] = []
    done = threading.Event()
    per_step = 60
    with small_cache(num_blocks=per_step, staging_capacity_tokens=4 * per_step, inline_write_bytes=0) as cache:

        def flusher() -> None:
            while not done.is_set():
                try:
                    cache.flush()
                except BaseException as exc:  # reported by the assert below
                    errors.append(exc)
                    return

        thread = threading.Thread(target=flusher)
        thread.start()
        try:
            for step in range(150):
                ids = [f"s{step}r{i}" for i in range(per_step)]
                finished = [f"s{step - 1}r{i}" for i in range(per_step)] if step else []
                cache.begin_step(StepEvents(new=[NewRequest(r, [i]) for i, r in enumerate(ids)], finished=finished))
                batch = StepBatch(ids, [4] * per_step, np.arange(4 * per_step))
                cache.discard(cache.save(torch.zeros(4 * per_step, 8), {}, batch))
                if errors:
                    break
        finally:
            done.set()
            thread.join()
    assert errors == []


def test_a_finished_requests_queued_writes_go_to_the_front_of_the_queue() -> None:
    """DESIGN §6: writes of a finished or aborted request are escalated. With the committer held
    inside one batch, a later step's tasks queue up behind it; finishing the last request of that
    step moves its task ahead of the step's earlier ones."""
    with small_cache(inline_write_bytes=0) as cache:
        entered, gate = threading.Event(), threading.Event()
        batches: list[list[str]] = []
        write = cache._writer.write_batch

        def held(groups):
            batches.append([record.req_of(t) for record, ids in groups for t in ids])
            entered.set()
            assert gate.wait(10), "test gate never opened"
            write(groups)

        cache._writer.write_batch = held
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        first = cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4)))
        assert entered.wait(10)  # the committer holds a's batch
        cache.begin_step(StepEvents(new=[NewRequest(r, [b]) for r, b in (("b", 1), ("c", 2), ("d", 3))]))
        second = cache.save(torch.ones(12, 2), {}, StepBatch(["b", "c", "d"], [4, 4, 4], np.arange(4, 16)))
        cache.begin_step(StepEvents(finished=["d"]))
        gate.set()
        cache.flush()
        assert batches == [["a"], ["d", "b", "c"]]
        cache.discard(first)
        cache.discard(second)


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped-without-close"])
def test_a_cache_nobody_holds_is_freed_at_once_with_its_pool_and_device_clones(closed: bool) -> None:
    # Its parts hold the cache only weakly and a released deferred record and its clones drop
    # each other, so the last reference going frees the pool, the pages and the clones then,
    # not at the next cyclic collection (which a server may not run for a long time: a second
    # `pcache_init` would hold two pools meanwhile). Every kind of record is left behind: an
    # open deferred record of a live request, a step not consumed with a hit read planned,
    # a leftover snapshot.
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        cache = small_cache(policy=CachePolicy(deferred_keys={"codes"}), inline_write_bytes=0)
        codes = torch.arange(10).reshape(5, 2)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(
            torch.ones(5, 3), {"codes": codes, "extra": torch.ones(3)}, StepBatch(["a"], [5], np.arange(5))
        )
        cache.materialize(sid, ["a"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)], finished=["a"]))
        kept = cache.save(torch.ones(2, 3), {"codes": codes[:2]}, StepBatch(["b"], [2], np.array([8, 9])))
        cache.flush()
        open_record = cache._deferred.open["b"]
        clone = open_record.chunks["codes"][0][0].tensor
        freed = [weakref.ref(obj) for obj in (cache, cache._pool, cache._pool._rows["hidden"], clone)]
        assert cache.stats().steps_outstanding == [kept] and cache.stats().deferred_open == 1
        thread = cache._committer._thread
        if closed:
            cache.close()
        del cache, open_record, clone
        deadline = time.monotonic() + 5
        while any(ref() is not None for ref in freed) and time.monotonic() < deadline:
            time.sleep(0.01)  # (a committer call under way holds the cache until it returns)
        assert [ref() is None for ref in freed] == [True] * len(freed), "held until a cyclic collection"
        thread.join(5)
        assert not thread.is_alive()
    finally:
        if collecting:
            gc.enable()


def test_a_cache_finalized_on_its_committer_thread_ends_the_thread_without_failing() -> None:
    # The cache may be collected on the committer thread (its write held the last reference):
    # the finalizer then runs there and must not wait for its own thread.
    cache = small_cache(inline_write_bytes=0)
    thread, write = cache._committer._thread, cache._writer.write_batch

    def write_then_finalize(groups) -> None:
        write(groups)
        cache._finalizer()  # what collecting the cache on this thread runs

    cache._writer.write_batch = write_then_finalize
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    sid = cache.save(torch.full((4, 2), 3.0), {}, StepBatch(["a"], [4], np.arange(4)))
    thread.join(5)
    assert not thread.is_alive()
    cache.flush()  # the write landed and nothing failed
    assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.full((4, 2), 3.0))
    # (the stopped committer leaves this step to the engine thread, inline)
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
    out = cache.materialize(cache.save(torch.zeros(1, 2), {}, StepBatch(["b"], [1], np.array([8]))), ["b"])
    assert torch.equal(out.hidden["b"], torch.cat([torch.full((4, 2), 3.0), torch.zeros(1, 2)]))
    cache.close()


@pytest.mark.parametrize("deferred", [False, True], ids=["step-writes", "with-deferred-records"])
def test_written_tasks_are_forgotten_so_a_long_run_tracks_nothing_once_idle(deferred) -> None:
    # Every write task the committer publishes as written is forgotten at the next begin_step:
    # its record and its entry in the native task table. A server runs for millions of steps.
    # (With a deferred key every batch also holds a deferred record: the general write path.)
    policy = CachePolicy(deferred_keys=frozenset({"codes"})) if deferred else None
    with small_cache(inline_write_bytes=0, policy=policy) as cache:  # (the committer writes every step)
        for i in range(40):
            finished = [f"r{i - 1}"] if i else []
            cache.begin_step(StepEvents(new=[NewRequest(f"r{i}", [i % 16])], finished=finished))
            slots = np.arange(4) + 4 * (i % 16)
            mm = {"codes": torch.full((4, 3), i)}
            cache.discard(cache.save(torch.full((4, 2), float(i)), mm, StepBatch([f"r{i}"], [4], slots)))
        cache.begin_step(StepEvents(finished=["r39"]))
        cache.flush()
        cache.begin_step(StepEvents())
        assert list(cache._tasks.states()) == [] and cache._records.by_task == {} and cache._records.open_writes == {}
        assert cache.stats().bytes_written == {"hidden": 40 * 4 * 2 * 4, "codes": 40 * 4 * 3 * 8}
        assert cache.stats().deferred_open == 0 and cache.stats().device_bytes == 0


def test_a_materialize_waiting_for_an_in_flight_write_is_counted_with_its_wait_time() -> None:
    with small_cache(inline_write_bytes=0) as cache:  # (the committer writes every step)
        gate, write = threading.Event(), cache._writer.write_batch

        def held_write(groups) -> None:
            assert gate.wait(10), "test gate never opened"
            write(groups)

        cache._writer.write_batch = held_write
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [0, 2], 4)]))
        # b hits block 0, which a computes in this very step: b's rows wait for a's write
        sid = cache.save(torch.ones(8, 2), {}, StepBatch(["a", "b"], [6, 2], np.array([0, 1, 2, 3, 4, 5, 8, 9])))
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        out = cache.materialize(sid, ["b"])
        timer.join()
        assert torch.equal(out.hidden["b"], torch.ones(6, 2))
        stats = cache.stats()
        # (the gate opens 0.2 s after the timer starts, a little before or after the read begins
        # to wait on a loaded machine: the wait counted is well above zero, not exactly 0.2 s)
        assert stats.num_waits == 1 and 0.1 <= stats.wait_time_s < 10 and stats.rows_in_flight == 4


def test_a_flush_finding_every_write_in_the_pool_counts_no_wait() -> None:
    # (the tasks are written but not forgotten until the next begin_step: nothing to wait for)
    with small_cache(inline_write_bytes=0) as cache:  # (the committer writes the step)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(torch.ones(4, 2), {}, StepBatch(["a"], [4], np.arange(4))))
        cache.flush()
        waits = cache.stats().num_waits
        cache.flush()
        assert cache.stats().num_waits == waits


def test_the_fence_forgets_the_copies_it_finished() -> None:
    # Steps of 256 KiB and more are copied off the engine thread; each begin_step's fence
    # finishes the step before's copies and forgets them, so it never walks old steps again.
    with small_cache(staging_capacity_tokens=64) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", list(range(16)))]))
        for i in range(6):
            rows = torch.full((64, 1024), float(i))  # 256 KiB: copied by the committer or the fence
            cache.discard(cache.save(rows, {}, StepBatch(["a"], [64], np.arange(64))))
            cache.begin_step(StepEvents())
            assert cache._copies._last_host == [], f"step {i}: finished copies are still listed"
        cache.flush()
        sid = cache.save(torch.ones(1, 1024), {}, StepBatch(["a"], [1], np.arange(1)))
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.ones(1, 1024))


@pytest.mark.parametrize(
    ("width", "inline_write_bytes"),
    [(8, None), (8, 0), (1024, None)],  # (save writes the step; the committer does; a 256 KiB step it copies too)
    ids=["written-in-save", "written-by-committer", "copied-by-committer"],
)
def test_save_and_materialize_under_inference_mode_hand_out_plain_tensors(width, inline_write_bytes) -> None:
    # vLLM runs execute_model under torch.inference_mode(). The pages and pool a key's first
    # save allocates there must still be writable by the committer (which is not in inference
    # mode), and what materialize hands out writable anywhere: on another thread here.
    overrides = {} if inline_write_bytes is None else {"inline_write_bytes": inline_write_bytes}
    with small_cache(num_blocks=128, staging_capacity_tokens=256, **overrides) as cache:
        rows = torch.randn(2 * 256, width)
        with torch.inference_mode():
            cache.begin_step(StepEvents(new=[NewRequest("a", list(range(64)))]))
            first = cache.save(rows[:256], {"codes": torch.arange(256)}, StepBatch(["a"], [256], np.arange(256)))
        out: dict = {}
        reader = threading.Thread(target=lambda: out.update(first=cache.materialize(first, ["a"])))
        reader.start()
        reader.join()
        cache.flush()  # (the committer wrote the pool)
        with torch.inference_mode():  # b hits a's first 64 blocks' rows, computes 256 of its own
            cache.begin_step(StepEvents(new=[NewRequest("b", list(range(64)) + list(range(64, 128)), 256)]))
            second = cache.save(rows[256:], {"codes": torch.arange(256)}, StepBatch(["b"], [256], 256 + np.arange(256)))
            awaited = cache.materialize(second, ["b"])
        cache.flush()  # (b's rows written: nothing in flight for the counters below)
        got = {"a": out["first"].hidden["a"], "b": awaited.hidden["b"]}
        assert torch.equal(got["a"], rows[:256]) and torch.equal(got["b"], torch.cat([rows[:256], rows[256:]]))
        for tensor in (*got.values(), out["first"].mm["codes"]["a"], awaited.mm["codes"]["b"]):
            assert not tensor.is_inference()
            tensor.add_(1)  # the caller's to write, outside inference mode
        stats = cache.stats()
        assert (stats.steps_outstanding, stats.tasks_live, stats.reads_pending) == ([], 0, 0), stats
