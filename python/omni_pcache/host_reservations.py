"""`HostReservations`: what each cache holds, shared between the processes of one host (or
container), so that the caches of several processes (an omni pipeline's stages, each its own
vLLM engine) are held to the host's memory together, not each to all of it.

Each cache with a known host limit keeps one small file in a directory of this user's, by
default ``/dev/shm/omni_pcache-<uid>-<pid namespace>`` (the processes of one host, or of one
container: a container has a pid namespace, and a memory limit, of its own), or the one named
by the environment variable ``OMNI_PCACHE_RESERVATIONS_DIR`` (empty: nothing shared). The file
says which process holds it and the bytes the cache's keys hold, as `host_budget.HostBudget`
last admitted them (or lowered them, after a refused save). Each cache counts the other
caches' files with its own keys against the host's memory (but for a cache whose
``host_budget_bytes`` is past it: `HostBudget`).

A cache holds a shared ``flock`` on its file as long as it lives; the kernel lets go of it
when the process ends, however it ends. A file that no process holds so is not counted and is
removed: its cache's process exited without closing it. A forked child keeps its parent's
files held until it exits too (counted meanwhile: never too little). The directory must be on
a local filesystem whose locks hold (tmpfs, ...): a cache checks that they do when it makes its
file. A cache whose file was removed by someone else makes a new one at its next admission.

The directory must be a real directory of this user's that no other user can write (it is
made so: mode 0700), so caches of other users are not counted, and cannot plant files or links
for a cache to follow; files in it that are not plain, small, well-formed files are ignored.

Threads: `admit` runs on the engine thread (`HostBudget.check`, `HostBudget.refresh`) and holds
an exclusive ``flock`` on the directory's ``lock`` file while it reads the others and `record`
writes this cache's, so two caches admitting keys at once see each other. `release` runs on
any thread (at close; when the cache is collected; at exit), and a `record` racing it writes
nothing.

Nothing here raises into a cache. Where the directory cannot be made, read or written, or its
locks do not hold, one warning names it and the cache keeps to its own budget from then on,
its file (if any) still held and counted by the others at what it last recorded. Where the
directory's lock is not free within `LOCK_TIMEOUT_S` (its holder stopped, ...), that
admission counts no others (with a warning) but still records its keys, and the next one
tries again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("omni_pcache")

ENV_DIR = "OMNI_PCACHE_RESERVATIONS_DIR"
LOCK_TIMEOUT_S = 5.0
MAX_FILE_BYTES = 4096  # (a reservation is ~100 bytes; anything larger is not one)
MAX_RESERVATION = 2**62 - 1  # (what a file may say: a larger figure is written as this)
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC

_warned: set[tuple[str, bool]] = set()  # (one warning per directory, and per kind: timeout or given up)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Another cache's file: its process id, the process's name and the bytes it holds."""

    pid: int
    name: str
    nbytes: int


def reservations_dir() -> Path | None:
    """The directory in effect: ``OMNI_PCACHE_RESERVATIONS_DIR`` if set (empty: ``None``,
    nothing shared), else ``/dev/shm/omni_pcache-<uid>-<pid namespace>``."""
    text = os.environ.get(ENV_DIR)
    if text is not None:
        return Path(text) if text else None
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return Path("/dev/shm") / f"omni_pcache-{os.getuid()}-{namespace}"


def _process_name() -> str:
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return "?"


class _OwnFile:
    """This cache's file: its path and the descriptor that holds its shared flock."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.fd: int | None = None
        self.owner = os.getpid()

    def drop(self) -> None:
        """Removes the file (in the process that made it: a forked child's copy leaves it) and
        lets go of its flock."""
        if self.path is not None and os.getpid() == self.owner:
            with contextlib.suppress(OSError):
                self.path.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.path = self.fd = None


class HostReservations:
    """This cache's file in the shared directory (`reservations_dir`; ``None``: nothing shared)."""

    def __init__(self, directory: Path | None) -> None:
        self._dir = None if directory is None else directory.absolute()  # (a later chdir moves nothing)
        self._lock = threading.Lock()  # (a `record` racing `release`: a close during a save)
        self._released = False
        self._file = _OwnFile()
        self._drop = weakref.finalize(self, self._file.drop)  # (at release, collection or exit)

    @contextlib.contextmanager
    def admit(self) -> Iterator[list[Reservation]]:
        """Holds the directory's lock and yields the other live caches' reservations; a
        `record` inside keeps this cache's admitted bytes before the lock is let go. Not shared
        (or the directory fails now): yields none, and `record` does nothing."""
        directory = self._dir
        if directory is None:
            yield []
            return
        try:
            lock = _take_lock(directory)
        except TimeoutError as exc:  # (a holder stopped or swapped out: shared again next time)
            self._warn(f"its lock was not free for {LOCK_TIMEOUT_S:g} s ({exc}); these keys are admitted alone")
            yield []
            return
        except Exception as exc:  # (OSError mostly: nothing may raise into the cache)
            self._give_up(f"its lock cannot be taken ({exc})")
            yield []
            return
        try:
            try:
                others = _live(directory, skip=self._file.path)
            except Exception as exc:
                self._give_up(f"it cannot be read ({exc})")
                others = []
            yield others
        finally:
            _let_go(lock)

    def record(self, nbytes: int) -> None:
        """Writes ``nbytes`` as this cache's reservation (inside `admit`). Each figure goes to a
        new file, held and written before it takes the place of the last one, so no other cache
        ever sees this cache's file unheld or half written, nor misses it (one removed by
        someone else, logind's RemoveIPC or a cleanup, is made again)."""
        with self._lock:
            if self._dir is None or self._released:
                return
            try:
                self._write(self._dir, min(int(nbytes), MAX_RESERVATION))
            except Exception as exc:
                self._give_up(f"a file cannot be written there ({exc})")

    def _write(self, directory: Path, nbytes: int) -> None:
        scratch = directory / f".{uuid.uuid4().hex}.tmp"
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (held while this cache lives, or until its next figure)
            if self._file.fd is None:
                _check_locks_hold(scratch)
            os.write(fd, json.dumps({"pid": os.getpid(), "name": _process_name(), "bytes": nbytes}).encode())
            path = self._file.path or directory / f"{uuid.uuid4().hex}.json"
            os.replace(scratch, path)
        except BaseException:
            with contextlib.suppress(OSError):
                scratch.unlink()
            os.close(fd)
            raise
        last = self._file.fd
        self._file.path, self._file.fd, self._file.owner = path, fd, os.getpid()
        if last is not None:
            os.close(last)

    @property
    def released(self) -> bool:
        """Whether `release` has run (its cache is closed)."""
        return self._released

    def release(self) -> None:
        """Removes this cache's file and lets go of it (any thread; idempotent)."""
        with self._lock:
            self._released = True
        self._drop()

    def _give_up(self, why: str) -> None:
        """Stops sharing for this cache (its file, if any, stays held at its last figure)."""
        self._warn(f"{why}; this cache keeps to its own host budget from now on", for_good=True)
        self._dir = None

    def _warn(self, why: str, for_good: bool = False) -> None:
        key = (str(self._dir), for_good)
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "omni_pcache: host memory reservations are not shared through %s: %s (set %s to another "
                "directory, or to '' to share none)",
                key[0],
                why,
                ENV_DIR,
            )


def live_reservations(directory: Path) -> list[Reservation]:
    """The reservations of the live caches sharing ``directory`` (the files of exited ones are
    removed), read under its lock as a cache's admission reads them: for an operator's look
    (`omni-pcache reservations`). None (an empty list) where no cache has made the directory.
    Raises `OSError`
    (`TimeoutError` for a lock not free in `LOCK_TIMEOUT_S`) where it cannot be used."""
    if not os.path.lexists(directory):
        return []
    lock = _take_lock(directory)
    try:
        return _live(directory, skip=None)
    finally:
        _let_go(lock)


def _take_lock(directory: Path) -> int:
    """Makes the directory if needed, checks it is this user's alone, opens its lock file and
    takes the exclusive flock, trying for `LOCK_TIMEOUT_S`; returns the descriptor."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError("it is not a directory (a link?)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"another user owns it or may write to it (uid {st.st_uid}, mode {st.st_mode & 0o7777:o})")
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("another process holds it") from None
            time.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise


def _let_go(lock: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(lock, fcntl.LOCK_UN)  # (before the close: a forked child's copy keeps no lock)
    os.close(lock)


def _live(directory: Path, skip: Path | None) -> list[Reservation]:
    """The reservations of the live caches in ``directory`` but ``skip`` (this cache's file);
    removes the files no cache holds. Under the directory's lock."""
    found = []
    for path in directory.iterdir():
        if path.suffix == ".json" and path != skip:
            reservation = _read_live(path)
            if reservation is not None:
                found.append(reservation)
        elif path.suffix == ".tmp" and _stale(path):
            with contextlib.suppress(OSError):
                path.unlink()  # (left by a process that died between making and placing a file)
    return found


def _stale(path: Path) -> bool:
    """Whether a scratch file is a minute old and no process holds it."""
    try:
        if time.time() - os.lstat(path).st_mtime < 60:
            return False
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | _OPEN_FLAGS)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _check_locks_hold(path: Path) -> None:
    """Raises `OSError` unless the shared flock just taken on ``path`` keeps an exclusive one
    off (it would not on a filesystem without working locks)."""
    probe = os.open(path, os.O_RDWR | _OPEN_FLAGS)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    finally:
        os.close(probe)
    raise OSError("its file locks do not hold (not a local filesystem such as tmpfs?)")


def _read_live(path: Path) -> Reservation | None:
    """The reservation in ``path`` if a live cache holds it; removes it if none does; ``None``
    too for what is not a plain, small, well-formed reservation file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | _OPEN_FLAGS)
    except OSError:
        return None  # (removed meanwhile, a link, a fifo no one writes, not ours to read)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # (its cache holds it: alive)
        else:  # (no process holds it: its cache's process exited without closing it)
            if os.lstat(path).st_ino == st.st_ino:  # (not a file placed there since it was opened)
                with contextlib.suppress(OSError):
                    path.unlink()
            return None
        # (any other flock error is the caller's: `admit` stops sharing rather than count nothing)
        entry = json.loads(os.pread(fd, MAX_FILE_BYTES, 0))
        pid, name, nbytes = entry["pid"], entry.get("name", "?"), entry["bytes"]
        if not all(type(n) is int and 0 <= n < 2**62 for n in (pid, nbytes)):
            return None
        return Reservation(pid, str(name)[:64], nbytes)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    finally:
        os.close(fd)


__all__ = ["ENV_DIR", "HostReservations", "Reservation", "live_reservations", "reservations_dir"]
