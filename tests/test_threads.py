"""The binding releases the GIL while it waits or loops, and its objects work across threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from omni_pcache import CacheClosedError, Ledger, StagingSlots, StepIds, TaskStateError, WriteTasks


def test_a_waiting_staging_claim_lets_another_python_thread_release() -> None:
    staging = StagingSlots(1)
    assert staging.claim(("step", 0)) == 0

    def release_later() -> None:
        time.sleep(0.05)
        staging.release(0, ("step", 0))

    releaser = threading.Thread(target=release_later)
    releaser.start()
    # If claim held the GIL while waiting, the releaser could never run and this would time out.
    assert staging.claim(("step", 1), timeout_s=30.0) == 0
    releaser.join()
    assert staging.holders() == [[("step", 1)]]


def test_close_wakes_a_waiting_claim_with_an_error() -> None:
    staging = StagingSlots(1)
    staging.claim(("step", 0))
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            staging.claim(("step", 1), timeout_s=60.0)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    staging.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CacheClosedError)


def test_step_ids_consumed_out_of_order_from_other_threads() -> None:
    ids = StepIds()
    issued = [ids.issue() for _ in range(200)]
    results: list[int] = []
    lock = threading.Lock()

    def consume(chunk: list[int]) -> None:
        for step_id in reversed(chunk):
            ids.consume(step_id)
            with lock:
                results.append(step_id)

    threads = [threading.Thread(target=consume, args=(issued[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == issued
    assert len(ids) == 0


def test_copiers_on_two_python_threads_start_each_task_once() -> None:
    # What two Python threads calling the same transitions see: each task started once, the
    # other caller refused with TaskStateError, no entry left to pop. `start_copy` holds the GIL,
    # so the calls never overlap in native code: the compare-and-swap race itself is tested in
    # Rust (`racing_copiers_exactly_one_wins`, threads without a GIL) and by the loom models.
    tasks = WriteTasks()
    task_ids = [tasks.create() for _ in range(300)]
    for t in task_ids:
        tasks.enqueue(t)
    wins = [0, 0]
    barrier = threading.Barrier(2)

    def copier(me: int) -> None:
        barrier.wait()
        for t in task_ids:
            try:
                tasks.start_copy(t)
                wins[me] += 1
            except TaskStateError:
                pass

    threads = [threading.Thread(target=copier, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == len(task_ids)
    assert {s for _, s in tasks.states()} == {"COPYING"}
    assert tasks.pop() is None, "claimed tasks leave only stale entries behind"


# Slots per claim: a claim this long runs with the GIL released (the binding's DETACH_AT), so
# the threads' claims meet in the ledger's own mutex; shorter ones hold the GIL and never overlap.
SPAN = 8192


@pytest.mark.parametrize("num_threads", [2, 4])
def test_ledger_claims_from_several_threads_stay_consistent(num_threads: int) -> None:
    ledger = Ledger(num_threads * SPAN)
    key = ledger.add_key()

    def writer(me: int) -> None:
        for round_ in range(50):
            task_id = me * 1000 + round_
            ledger.claim(np.arange(me * SPAN, (me + 1) * SPAN, dtype=np.int64), key, task_id)
            ledger.commit(task_id)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sources, versions = ledger.peek(np.arange(num_threads * SPAN), key)
    assert set(sources.tolist()) == {-1}
    # A version numbers the claim that wrote the row: each thread's range holds its last claim's
    # number, the threads' numbers differ, and the newest is the count of all claims (none lost).
    last = [set(versions[i * SPAN : (i + 1) * SPAN].tolist()) for i in range(num_threads)]
    assert all(len(v) == 1 for v in last)
    assert len(set.union(*last)) == num_threads
    assert max(versions.tolist()) == 50 * num_threads
    assert ledger.num_tasks == 0
