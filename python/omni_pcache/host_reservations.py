"""`HostReservations`: what each cache on this host holds, shared between processes, so that
the caches of several processes (an omni pipeline's stages, each its own vLLM engine) are held
to the host's memory together, not each to all of it.

Each cache with a host budget keeps one small file in a shared directory: ``/dev/shm/omni_pcache``
(the host's tmpfs, shared by the processes of one machine or container), or the directory
named by the environment variable ``OMNI_PCACHE_RESERVATIONS_DIR`` (empty: nothing shared).
The file names its process and the bytes the cache's keys hold, as `host_budget.HostBudget`
last admitted them; each cache counts the other caches' files with its own keys against this
host's memory (but for a cache whose ``host_budget_bytes`` is past the host's memory, which is
held to that budget alone).

A file whose process has exited (no such process, or another one with the same id: its start
time differs) is not counted, and is removed. A file of another pid namespace is counted, as its
process cannot be looked up. The file goes when its cache is closed or collected.

Threads: `admit` runs on the engine thread (from `HostBudget.check`) and holds an exclusive
``flock`` on the directory's lock file while it reads the others and writes its own, so two
caches admitting keys at once see each other. `release` runs on any thread.

It never fails a cache: where the directory cannot be made, written or locked (in 5 s), or where
processes cannot be looked up (no ``/proc``), each cache keeps to its own budget, and one
warning says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("omni_pcache")

ENV_DIR = "OMNI_PCACHE_RESERVATIONS_DIR"
DEFAULT_DIR = "/dev/shm/omni_pcache"
LOCK_TIMEOUT_S = 5.0

_serials = itertools.count()  # (one file per cache of this process)
_warned: set[str] = set()  # (directories already warned about: one warning each)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Another cache's file: its process id, the process's name and the bytes it holds."""

    pid: int
    name: str
    nbytes: int


def reservations_dir() -> Path | None:
    """The shared directory in effect: ``OMNI_PCACHE_RESERVATIONS_DIR`` if set (empty: ``None``,
    nothing shared), else ``/dev/shm/omni_pcache``."""
    text = os.environ.get(ENV_DIR, DEFAULT_DIR)
    return Path(text) if text else None


def _proc_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat``, field 22), ``None`` when no
    such process is seen."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rpartition(")")[2].split()  # (the name in brackets may hold spaces)
    try:
        return int(fields[19])  # (field 22; the split starts at field 3)
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_name() -> str:
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return "?"


def _unlink(path: Path, owner: int) -> None:
    # (a forked child's copy of the finalizer leaves its parent's file alone)
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            path.unlink()


class HostReservations:
    """This cache's file in the shared directory (`reservations_dir`; ``None``: nothing shared)."""

    def __init__(self, directory: Path | None) -> None:
        self._dir = directory
        self._pid = os.getpid()
        self._namespace = _pid_namespace()
        self._start = _proc_start_time(self._pid)
        if directory is not None and (self._namespace is None or self._start is None):
            self._give_up("processes cannot be looked up here (no /proc)")
        self._path = None if self._dir is None else self._dir / f"{self._pid}-{next(_serials)}.json"
        self._release = weakref.finalize(self, _unlink, self._path, self._pid) if self._path else None

    @property
    def shared(self) -> bool:
        """Whether this cache's reservation is shared (the directory is usable so far)."""
        return self._dir is not None

    @contextlib.contextmanager
    def admit(self) -> Iterator[list[Reservation]]:
        """Holds the directory's lock and yields the other live caches' reservations; a
        `record` inside keeps this cache's admitted bytes before the lock is let go. Not shared
        (or the directory fails now): yields none, and `record` does nothing."""
        if self._dir is None:
            yield []
            return
        try:
            lock = self._lock()
        except OSError as exc:
            self._give_up(f"its lock cannot be taken ({exc})")
            yield []
            return
        try:
            yield self._others()
        finally:
            os.close(lock)  # (lets the flock go)

    def record(self, nbytes: int) -> None:
        """Writes ``nbytes`` as this cache's reservation (inside `admit`, which holds the lock)."""
        if self._dir is None or self._path is None:
            return
        entry = {"pid": self._pid, "start": self._start, "pidns": self._namespace, "name": _process_name()}
        scratch = self._path.with_name(f".{self._path.name}.tmp")
        try:
            scratch.write_text(json.dumps({**entry, "bytes": nbytes}))
            os.replace(scratch, self._path)
        except OSError as exc:
            self._give_up(f"a file cannot be written there ({exc})")

    def release(self) -> None:
        """Removes this cache's file (any thread; idempotent)."""
        if self._release is not None:
            self._release()

    def _lock(self) -> int:
        """Opens the directory's lock file (making both if needed) and takes its flock, trying
        for `LOCK_TIMEOUT_S`; returns the open descriptor (closing it lets the lock go)."""
        assert self._dir is not None
        if not self._dir.is_dir():
            with contextlib.suppress(FileExistsError):
                self._dir.mkdir(parents=True)
                os.chmod(self._dir, 0o1777)  # (as /tmp: every user's caches share it, each removes its own)
        fd = os.open(self._dir / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # (past the umask, where this process made it: other users lock it too)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise OSError(f"held by another process for over {LOCK_TIMEOUT_S:g} s") from None
                time.sleep(0.01)
            except OSError:
                os.close(fd)
                raise

    def _others(self) -> list[Reservation]:
        """The reservations of the other caches whose process lives (or cannot be looked up);
        removes the files of exited processes. Under the directory's lock."""
        assert self._dir is not None
        found = []
        for path in self._dir.glob("*.json"):
            if path == self._path:
                continue
            try:
                entry = json.loads(path.read_text())
                pid, nbytes = int(entry["pid"]), int(entry["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # (removed meanwhile, or not ours to read)
            if entry.get("pidns") == self._namespace and _proc_start_time(pid) != entry.get("start"):
                with contextlib.suppress(OSError):
                    path.unlink()  # (its process exited without removing it: killed, ...)
                continue
            found.append(Reservation(pid, str(entry.get("name", "?")), nbytes))
        return found

    def _give_up(self, why: str) -> None:
        directory = str(self._dir)
        if directory not in _warned:
            _warned.add(directory)
            logger.warning(
                "omni_pcache: host memory reservations are not shared through %s: %s; each cache keeps to its "
                "own host budget (set %s to another directory, or to '' to share none)",
                directory,
                why,
                ENV_DIR,
            )
        self._dir = None


__all__ = ["DEFAULT_DIR", "ENV_DIR", "HostReservations", "Reservation", "reservations_dir"]
