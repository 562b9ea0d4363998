"""The committer: the thread that writes the pool.

It pops write tasks from the native copy queues (escalated first, then high, then low) and
hands what is queued, in pop order, to a write function as one batch. Popping and writing
happen under one write lock, so the pool has one writer at a time: `hold_writer` lets the
engine thread write a small step itself while the committer is idle (no queueing, no wake-up,
no GIL contention); when the committer is writing, the step is queued for it instead.
``threaded=False`` runs the committer's loop inline, on the caller's thread, until the queues
are empty, for every step (debugging; the engine thread then pays for every pool write).

Between batches the committer also runs side jobs the engine thread hands it (`submit`: a
hit prefetch, `omni_pcache.prefetch`), the queued writes first, each under the write lock: a
prefetch reads the pool natively, which no write may overlap (a small step `save` would
write itself meanwhile is queued for the committer instead).

A batch that raises is reported to ``on_failure`` with its first task (which makes the cache's
failure sticky and releases everything); the committer then keeps draining so every queued
task is settled. If the committer's own loop raises, that is reported with task id -1 and
the thread ends: waiters get the sticky error instead of a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from omni_pcache._native import WriteTasks

logger = logging.getLogger("omni_pcache")


class SideJob(Protocol):
    """Work the committer runs between write batches (`Committer.submit`)."""

    def run(self) -> None:
        """Runs the job (the committer thread; must not raise)."""

    def cancel(self) -> None:
        """Gives the job up, unless it is running or done (the committer stopping)."""


class Committer:
    """Runs ``write(task_ids)`` for every queued task, in batches of what is queued (up to
    ``max_batch``), on its own thread or inline."""

    max_batch = 1024  # a whole decode step of up to 1,024 requests: one gather/scatter per key per step

    def __init__(
        self,
        tasks: WriteTasks,
        write: Callable[[list[int]], None],
        on_failure: Callable[[int, BaseException], None],
        threaded: bool,
    ) -> None:
        self._tasks = tasks
        self._write = write
        self._on_failure = on_failure
        self._threaded = threaded
        # A binary wake-up: held while no wake-up is pending; released to wake the committer.
        # A plain lock rather than a Semaphore: releasing it costs the engine thread ~9 µs
        # where a Semaphore's release (its condition variable, whose lock the woken thread
        # takes back) cost ~28 µs when the committer then runs a GIL-releasing copy.
        self._wake = threading.Lock()
        self._wake.acquire()
        # Held while popping and writing a batch (the committer) or while the engine thread writes
        # a small step itself (`hold_writer`): the pool's only writer meanwhile.
        self._writing = threading.Lock()
        # Set by the committer just before it checks the queue and sleeps: a notify that finds
        # it clear skips the wake-up (tens of microseconds on the engine thread). The GIL
        # orders the two threads' flag and queue accesses, so either the committer sees the
        # new entries or the notifier sees the flag.
        self._sleeping = False
        self._stopping = False
        self._jobs: deque[SideJob] = deque()  # side jobs, run in order after the queued writes
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="omni-pcache-committer", daemon=True)
            self._thread.start()

    def notify(self, num_tasks: int = 1) -> None:
        """Tasks were queued (engine thread). Inline mode, or a committer stopping or stopped,
        writes them now.

        At most one wake-up per call, whatever ``num_tasks``, and none while the committer is
        awake: it drains every queued task and checks the queue again before sleeping."""
        if self._threaded and not self._stopping:
            if num_tasks > 0 and self._sleeping:
                self._wake_up()
        else:
            # Inline mode, or tasks queued while `stop` runs or after it (a save that began
            # before close): written here, after the thread's last batch (the write lock), so
            # close's "writes what is queued" holds for them too.
            self._drain()

    def submit(self, job: SideJob) -> bool:
        """Queues a side job (engine thread) and wakes the committer if it sleeps; false, and
        nothing queued, when there is no committer thread or it is stopping. The same
        flag-then-check ordering as `notify` keeps a job from waiting for the next wake-up."""
        if not self._threaded or self._stopping:
            return False
        self._jobs.append(job)
        if self._sleeping:
            self._wake_up()
        return True

    def _run_jobs(self) -> None:
        """Runs the queued side jobs, the writes queued meanwhile first (the committer)."""
        while self._jobs:
            try:
                job = self._jobs.popleft()
            except IndexError:  # (cancelled by stop meanwhile)
                return
            with self._writing:  # (a prefetch borrows the pool's rows: no write meanwhile)
                job.run()
            if self._tasks.num_queue_entries:
                self._drain()

    def _cancel_jobs(self) -> None:
        while self._jobs:
            try:
                self._jobs.popleft().cancel()
            except IndexError:
                return

    def _wake_up(self) -> None:
        """Makes one wake-up pending (any thread); a second before the committer takes the first
        is one wake-up, as the committer drains everything queued once awake."""
        try:
            self._wake.release()
        except RuntimeError:  # already pending
            pass

    def hold_writer(self) -> bool:
        """Takes the pool writer's lock if nobody is writing (engine thread, for a small step
        it writes itself without queueing it: `PrefixCache.save`); the caller must call
        `release_writer` after. False when the committer is writing, and always in inline mode
        (``threaded=False``), where every write goes through the committer's own loop."""
        return self._threaded and self._writing.acquire(blocking=False)

    def release_writer(self) -> None:
        self._writing.release()

    @contextlib.contextmanager
    def writer_held(self) -> Iterator[None]:
        """Holds the pool writer's lock, waiting for a batch being written (any thread but the
        committer's): what a failure outside a write holds, so that releasing every task and
        page hold never races the committer moving them."""
        with self._writing:
            yield

    def _drain(self) -> None:
        with self._writing:
            self._drain_locked()

    def _drain_locked(self) -> None:
        while True:
            batch = self._tasks.pop_many(self.max_batch)
            if not batch:
                return
            try:
                self._write(batch)
            except BaseException as exc:  # reported, made sticky by the cache
                self._on_failure(batch[0], exc)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the committer itself broke: fail loudly, never leave waiters hanging
            logger.exception("omni_pcache: the committer thread failed")
            try:
                self._on_failure(-1, exc)
            except BaseException:
                logger.exception("omni_pcache: reporting the committer's failure failed")

    def _loop(self) -> None:
        while True:
            self._sleeping = True
            if not self._stopping and self._tasks.num_queue_entries == 0 and not self._jobs:
                self._wake.acquire()
            self._sleeping = False
            self._drain()
            if self._stopping:
                self._cancel_jobs()
                self._drain()
                return
            self._run_jobs()

    def stop(self, timeout_s: float) -> None:
        """Writes what is queued, then ends the thread. Idempotent. On the committer thread
        itself (a cache dropped while its write held the last reference is collected there) the
        thread ends after the batch it is writing, not waited for."""
        self._stopping = True
        self._cancel_jobs()
        if self._thread is not None:
            self._wake_up()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout_s)
                if self._thread.is_alive():
                    logger.warning("omni_pcache: committer did not stop within %.1f s", timeout_s)
            self._thread = None
        else:
            self._drain()
