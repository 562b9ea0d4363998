"""The committer thread (`omni_pcache.committer.Committer`) never sleeps on queued tasks: tasks
queued while it drains (their notify finds it awake, so it wakes nobody) are written before it
sleeps, tasks queued just before `stop` are written before its thread ends, and close()
returns only once the write in progress has landed."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from cachekit import small_cache
from omni_pcache import NewRequest, StepBatch, StepEvents, WriteTasks
from omni_pcache.committer import Committer


class Racing:
    """The real task queue, where ``on_empty`` runs right after a `pop_many` found it empty,
    before the committer sees that result: another thread's enqueue landing mid-drain."""

    def __init__(self) -> None:
        self.tasks = WriteTasks()
        self.on_empty: list = []

    @property
    def num_queue_entries(self) -> int:
        return self.tasks.num_queue_entries

    def pop_many(self, n: int) -> list[int]:
        batch = self.tasks.pop_many(n)
        if not batch and self.on_empty:
            self.on_empty.pop(0)()
        return batch


def recording(written: list[int], done: dict[int, threading.Event]):
    def write(batch: list[int]) -> None:
        for task_id in batch:
            written.append(task_id)
            done[task_id].set()

    return write


def two_tasks_and_a_committer():
    """Two tasks on a `Racing` table, and a threaded committer recording what it writes into
    ``written`` (setting ``done[task]`` as each lands)."""
    racing = Racing()
    first, second = racing.tasks.create(), racing.tasks.create()
    written: list[int] = []
    done = {first: threading.Event(), second: threading.Event()}
    committer = Committer(racing, recording(written, done), lambda *a: None, threaded=True)
    return racing, first, second, written, done, committer


def test_tasks_queued_while_the_committer_drains_are_written_without_another_notify() -> None:
    racing, first, second, written, done, committer = two_tasks_and_a_committer()
    try:

        def engine_enqueues_second() -> None:  # (its notify finds the committer awake: no wake-up)
            racing.tasks.enqueue(second)
            committer.notify(1)

        racing.on_empty.append(engine_enqueues_second)
        racing.tasks.enqueue(first)
        committer.notify(1)
        assert done[first].wait(10)
        assert done[second].wait(10), "the committer went to sleep with a task queued"
        assert written == [first, second]
    finally:
        committer.stop(10)


def test_tasks_queued_as_stop_begins_are_written_before_the_thread_ends() -> None:
    racing, first, second, written, done, committer = two_tasks_and_a_committer()
    stopper: list[threading.Thread] = []

    def engine_enqueues_then_close_begins() -> None:
        racing.tasks.enqueue(second)
        committer.notify(1)  # (the committer is awake, and not stopping yet: no wake-up, no drain)
        thread = threading.Thread(target=committer.stop, args=(10,))  # close, on another thread
        thread.start()
        stopper.append(thread)
        while not committer._stopping:  # (stop has begun)
            time.sleep(0.001)

    racing.on_empty.append(engine_enqueues_then_close_begins)
    racing.tasks.enqueue(first)
    committer.notify(1)
    assert done[first].wait(10)
    while not stopper:
        time.sleep(0.001)
    stopper[0].join(10)
    assert not stopper[0].is_alive()
    assert written == [first, second], "stop ended the committer with a task still queued"
    assert racing.num_queue_entries == 0


def test_without_a_thread_a_failed_batch_is_reported_and_the_batches_queued_behind_it_still_written() -> None:
    tasks = WriteTasks()
    first, second, third = tasks.create(), tasks.create(), tasks.create()
    written: list[int] = []
    failures: list[tuple[int, str]] = []

    def write(batch: list[int]) -> None:
        if first in batch:
            raise RuntimeError("injected: pool write failed")
        written.extend(batch)

    committer = Committer(tasks, write, lambda task_id, exc: failures.append((task_id, str(exc))), threaded=False)
    committer.max_batch = 1  # (a batch per task: the failed one first, two queued behind it)
    tasks.enqueue_many([first, second, third])
    committer.notify(3)
    assert failures == [(first, "injected: pool write failed")]
    assert written == [second, third], "the committer stopped draining at the failed batch"
    assert tasks.num_queue_entries == 0


def test_without_a_thread_stop_writes_what_is_queued() -> None:
    tasks = WriteTasks()
    first, second = tasks.create(), tasks.create()
    done = {first: threading.Event(), second: threading.Event()}
    written: list[int] = []
    committer = Committer(tasks, recording(written, done), lambda *a: None, threaded=False)
    tasks.enqueue_many([first, second])  # (queued, with no notify yet)
    committer.stop(10)
    assert written == [first, second], "stop left queued tasks unwritten"
    assert tasks.num_queue_entries == 0


def test_close_returns_only_once_the_write_in_progress_has_landed() -> None:
    # The committer's write is held; it is let through once close has returned, or after
    # 0.3 s: a close that does not wait for the committer returns with the write unlanded
    # (one that does waits for the gate; the test passes either way on a slow machine).
    cache = small_cache(inline_write_bytes=0)  # (the committer writes every step)
    gate, close_returned = threading.Event(), threading.Event()
    write = cache._writer.write_batch
    cache._writer.write_batch = lambda groups: (gate.wait(10), write(groups))[1]
    opener = threading.Thread(target=lambda: (close_returned.wait(0.3), gate.set()))
    opener.start()
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.discard(cache.save(torch.ones(6, 2), {}, StepBatch(["a"], [6], np.arange(6))))
    cache.close()
    stats = cache.stats()  # (read before the opener may let a held write through)
    close_returned.set()
    opener.join()
    assert stats.bytes_written == {"hidden": 6 * 2 * 4}, "close returned before the queued write landed"
    assert stats.tasks_live == 0


def test_without_a_thread_save_never_writes_a_step_itself() -> None:
    # threaded=False (debugging): every write goes through the committer's own loop, run
    # inline when save queues it, even a step small enough for save to write while a committer
    # thread is idle.
    cache = small_cache(threaded=False, inline_write_bytes=1 << 20)
    try:
        held = cache._committer.hold_writer()
        if held:  # (released, or close would wait for it forever instead of the test failing)
            cache._committer.release_writer()
        assert held is False
        calls = []
        write_now = cache._writer.write_step_now
        cache._writer.write_step_now = lambda *args, **kwargs: (calls.append(1), write_now(*args, **kwargs))[1]
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.discard(cache.save(torch.zeros(4, 2), None, StepBatch(["a"], [4], np.arange(4))))
        assert calls == [] and cache.stats().tasks_live == 0
        assert cache.stats().bytes_written == {"hidden": 4 * 2 * 4}
    finally:
        cache.close()
