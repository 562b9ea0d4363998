"""Host memory shared between processes (`omni_pcache.host_reservations`): caches of several
processes on one host (an omni pipeline's stages) are held to the host's memory together. Each
cache counts what the other live caches hold; a process that exits, even killed, stops counting;
where nothing can be shared each cache keeps to its own budget, and nothing raises into it.

The caches here reserve most of their share as room for rows kept aside for late reads
(``max_preserved_rows``), which the budget counts and nothing allocates until used: no test
allocates more than a few MiB."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cachekit import SMALL_CACHE, fail_first_pool_allocation, slots_of, small_cache
from omni_pcache import (
    ConfigError,
    InvalidInputError,
    NewRequest,
    PrefixCache,
    StepBatch,
    StepEvents,
    host_reservations,
)
from omni_pcache._native import Ledger
from omni_pcache.host_memory import host_memory_limit
from omni_pcache.host_reservations import ENV_DIR, reservations_dir

BS = 4  # (small_cache: blocks of 4 slots)
WIDTH = 1024  # (float32 rows of 4 KiB)
TESTS = Path(__file__).parent


def reserving_cache(share: float, **overrides) -> PrefixCache:
    """A `small_cache` whose budget, once it has saved rows of `WIDTH`, counts ``share`` of this
    host's memory (nearly all of it room for rows kept aside, not allocated)."""
    limit = host_memory_limit()
    assert limit is not None
    return small_cache(max_preserved_rows=int(share * limit) // (WIDTH * 4), **overrides)


def save_rows(cache: PrefixCache, req: str, mm: dict | None = None) -> None:
    """A step of one new request: 4 rows of `WIDTH` (and ``mm``), saved and materialized."""
    cache.begin_step(StepEvents(new=[NewRequest(req, [0, 1])]))
    rows = torch.randn(4, WIDTH)
    out = cache.materialize(cache.save(rows, mm or {}, StepBatch([req], [4], slots_of([0, 1], 0, 4, BS))), [req])
    assert torch.equal(out.hidden[req], rows)


def reservation_files(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).glob("*.json")) if os.path.isdir(directory) else []


def read_line(child: subprocess.Popen, timeout_s: float = 120.0) -> str:
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    assert ready, f"the child said nothing in {timeout_s} s"
    return child.stdout.readline()


CHILD = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from test_host_reservations import reserving_cache, save_rows
cache = reserving_cache(0.55)
save_rows(cache, "child")
print("saved", flush=True)
sys.stdin.readline()
cache.close()
print("closed", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child_cache():
    """A process whose cache counts 55% of this host, until a line on its stdin closes it;
    killed at the end."""
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
    ) as child:
        try:
            assert read_line(child) == "saved\n"
            yield child
        finally:
            child.kill()  # (the pipes close as the `with` ends)


def test_a_cache_of_another_process_holds_its_share_of_the_host_until_it_closes(
    child_cache: subprocess.Popen, own_reservations_dir: str
) -> None:
    """Each cache would fit the host alone, not both: the second process's save is refused
    with a `ConfigError` naming the first process, and it is cached once the first process has
    closed its cache."""
    with reserving_cache(0.55) as cache:
        with pytest.raises(ConfigError) as err:
            save_rows(cache, "a")
        assert f"that other caches on this host have reserved (pid {child_cache.pid} (" in str(err.value)
        assert "past this host's memory: " in str(err.value)
        assert cache.stats().pool_bytes == {}
        child_cache.stdin.write("close\n")
        child_cache.stdin.flush()
        assert read_line(child_cache) == "closed\n"
        save_rows(cache, "a")
        assert len(reservation_files(own_reservations_dir)) == 1
    assert reservation_files(own_reservations_dir) == []


def test_a_killed_process_holds_nothing(child_cache: subprocess.Popen, own_reservations_dir: str) -> None:
    """A process killed with its cache open leaves its file behind: the next admission counts
    nothing of it and removes the file."""
    (left,) = reservation_files(own_reservations_dir)
    child_cache.send_signal(signal.SIGKILL)
    child_cache.wait()
    with reserving_cache(0.55) as cache:
        save_rows(cache, "a")
        (own,) = reservation_files(own_reservations_dir)
        assert own != left


def plant(directory: str, **entry) -> Path:
    """A reservation file as another cache would write it."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = Path(directory) / f"planted-{len(os.listdir(directory))}.json"
    path.write_text(json.dumps(entry))
    return path


def test_a_file_is_counted_while_a_process_holds_it(own_reservations_dir: str) -> None:
    """What makes a file live is the flock its cache holds, not its process id (which another
    pid namespace, or a reused id, would make wrong): a file held is counted, whatever pid it
    names; once let go it is not, and is removed."""
    path = plant(own_reservations_dir, pid=1, name="elsewhere", bytes=1 << 50)
    held = os.open(path, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        with reserving_cache(0.1) as cache, pytest.raises(ConfigError, match=r"pid 1 \(elsewhere\): "):
            save_rows(cache, "a")
        assert path.exists()
    finally:
        os.close(held)
    with reserving_cache(0.1) as cache:
        save_rows(cache, "a")
    assert not path.exists()


def test_files_that_are_not_reservations_are_ignored(
    own_reservations_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fifo (which a read would wait on), a link, a large file and entries with numbers out
    of range or of the wrong type neither count (a negative figure would make room) nor raise
    into the save, and the caches go on sharing."""
    limit = host_memory_limit()
    junk = [
        {"pid": 1, "bytes": 1e400},
        {"pid": 1, "bytes": -limit},
        {"pid": "1", "bytes": 1 << 50},
        {"pid": 1, "bytes": True},
        {"pid": 1},
    ]
    held = []
    for entry in junk:
        fd = os.open(plant(own_reservations_dir, **entry), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        held.append(fd)
    os.mkfifo(Path(own_reservations_dir) / "fifo.json")
    (Path(own_reservations_dir) / "large.json").write_text(json.dumps({"pid": 1, "bytes": 1 << 50}) + " " * 8192)
    os.symlink(plant(own_reservations_dir, pid=1, bytes=1 << 50), Path(own_reservations_dir) / "link.json")
    nested = Path(own_reservations_dir) / "nested.json"
    nested.write_text("[" * 2000 + "]" * 2000)
    held.append(os.open(nested, os.O_RDONLY))
    fcntl.flock(held[-1], fcntl.LOCK_SH)
    try:
        with caplog.at_level(logging.WARNING, logger="omni_pcache"):
            with reserving_cache(0.6) as first, reserving_cache(0.3) as second, reserving_cache(0.3) as third:
                save_rows(first, "a")
                save_rows(second, "a")
                with pytest.raises(ConfigError, match="other caches on this host have reserved"):
                    save_rows(third, "a")
    finally:
        for fd in held:
            os.close(fd)
    assert not [r for r in caplog.records if "not shared" in r.getMessage()]


def test_a_budget_of_its_own_is_held_to_the_host_with_the_others(own_reservations_dir: str) -> None:
    """Two caches of this process: one with the default budget, and one with a budget of its
    own (a chosen share: the whole host here), which fits that budget but not the host beside
    the first. It is refused naming the first, and admitted once the first is closed."""
    first = reserving_cache(0.55)
    save_rows(first, "a")
    with reserving_cache(0.55, host_budget_bytes=host_memory_limit()) as second:
        with pytest.raises(ConfigError) as err:
            save_rows(second, "a")
        assert "that other caches on this host have reserved (another cache of this process: " in str(err.value)
        first.close()
        save_rows(second, "a")


def test_a_budget_past_the_host_is_held_to_itself_alone_and_counted_by_the_others(
    own_reservations_dir: str,
) -> None:
    """A budget past the host's memory says the host's memory is not the limit (swap, ...):
    such caches are admitted beside each other past the host, and a cache with the default
    budget still counts them."""
    with (
        reserving_cache(0.55, host_budget_bytes=2**62) as first,
        reserving_cache(0.55, host_budget_bytes=2**62) as second,
    ):
        save_rows(first, "a")
        save_rows(second, "a")
        with reserving_cache(0.1) as third, pytest.raises(ConfigError) as err:
            save_rows(third, "a")
        assert str(err.value).count("another cache of this process: ") == 2


def test_a_cache_counts_itself_once_as_its_keys_grow(own_reservations_dir: str) -> None:
    """A key twice as wide admitted later takes the cache from 45% to 90% of the host: admitted,
    since the cache's own file is not one of the others (counted with them, 135%)."""
    with reserving_cache(0.45) as cache:
        save_rows(cache, "a")
        save_rows(cache, "b", {"codes": torch.zeros(4, 2 * WIDTH)})
        assert set(cache.stats().pool_bytes) == {"hidden", "codes"}


def test_a_key_refused_after_its_admission_is_no_longer_counted(own_reservations_dir: str) -> None:
    """A key admitted whose pool cannot be allocated (the allocator refuses it): the save is
    refused, and the cache's file, and its stats, say what it holds then: what it held before
    and the key's ledger columns (kept for the next key), not the key's pool or its wider rows."""
    with small_cache() as cache:
        save_rows(cache, "a")
        (path,) = Path(own_reservations_dir).glob("*.json")
        before = json.loads(path.read_text())["bytes"]
        assert cache.stats().host_reserved_bytes == before
        fail_first_pool_allocation(cache)
        with pytest.raises(InvalidInputError, match="cannot be allocated"):
            save_rows(cache, "b", {"wide": torch.zeros(4, 4 * WIDTH)})
        columns = Ledger(SMALL_CACHE["num_blocks"] * BS, BS).key_column_bytes
        assert json.loads(path.read_text())["bytes"] == cache.stats().host_reserved_bytes == before + columns


def test_a_close_racing_a_save_leaves_no_file(own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close while a save is admitting its keys: the file is gone once both have returned."""
    cache = reserving_cache(0.1)
    entered, go_on = threading.Event(), threading.Event()
    admit = host_reservations.HostReservations.admit
    slow_admit = lambda self: (entered.set(), go_on.wait(10), admit(self))[2]  # noqa: E731
    monkeypatch.setattr(host_reservations.HostReservations, "admit", slow_admit)

    def save() -> None:
        with contextlib.suppress(Exception):  # (refused once closed, or saved before: either way)
            save_rows(cache, "a")

    saver = threading.Thread(target=save)
    saver.start()
    assert entered.wait(10)
    closer = threading.Thread(target=cache.close)
    closer.start()
    closer.join(10)  # (closed while the save waits to admit its keys)
    go_on.set()
    saver.join(10)
    assert not saver.is_alive() and not closer.is_alive()
    assert reservation_files(own_reservations_dir) == []


def test_a_cache_collected_without_close_gives_up_its_reservation(own_reservations_dir: str) -> None:
    cache = reserving_cache(0.1)
    save_rows(cache, "a")
    assert len(reservation_files(own_reservations_dir)) == 1
    del cache
    gc.collect()
    assert reservation_files(own_reservations_dir) == []


FORKING = f"""
import fcntl, os, sys
sys.path.insert(0, {str(TESTS)!r})
from test_host_reservations import reserving_cache, reservation_files, save_rows
cache = reserving_cache(0.1)
save_rows(cache, "a")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # (the child's exit runs the finalizers of its copy of the cache)
os.waitpid(pid, 0)
(name,) = reservation_files(os.environ[{ENV_DIR!r}])
fd = os.open(os.path.join(os.environ[{ENV_DIR!r}], name), os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("let go")
except BlockingIOError:
    print("held")
"""


def test_a_forked_child_leaves_its_parents_file_held(own_reservations_dir: str) -> None:
    """A process with a cache forks, and the child exits: the parent's file is still there and
    still held (the child's exit ran the finalizers of its copy of the cache)."""
    done = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "held\n"


def test_a_file_removed_by_someone_else_is_made_again(own_reservations_dir: str) -> None:
    """Its file removed (logind's RemoveIPC at logout, a cleanup of /dev/shm, ...), a cache
    makes it again at its next admission, counted by the others with all its keys."""
    with reserving_cache(0.3) as cache:
        save_rows(cache, "a")
        for path in Path(own_reservations_dir).glob("*.json"):
            path.unlink()
        save_rows(cache, "b", {"codes": torch.zeros(4, 2 * WIDTH)})  # (now 60%)
        assert len(reservation_files(own_reservations_dir)) == 1
        with reserving_cache(0.45) as other, pytest.raises(ConfigError, match="another cache of this process"):
            save_rows(other, "a")


def test_a_directory_whose_locks_do_not_hold_is_not_used(
    own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a flock keeps nothing off (a filesystem without working locks), a live cache's
    file would look dead to the others: the first cache to make its file there warns and keeps
    to its own budget, leaving no file."""
    monkeypatch.setattr(fcntl, "flock", lambda fd, operation: None)
    with caplog.at_level(logging.WARNING, logger="omni_pcache"):
        with reserving_cache(0.55) as first, reserving_cache(0.55) as second:
            save_rows(first, "a")
            save_rows(second, "a")
    assert any("its file locks do not hold" in r.getMessage() for r in caplog.records)
    assert reservation_files(own_reservations_dir) == []


@pytest.mark.parametrize("how", ["a file in the way", "a directory other users may write"])
def test_an_unusable_directory_leaves_each_cache_to_its_own_budget(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory that cannot be made, or that another user could plant files in: one warning
    naming it and the variable to set, and the caches are admitted as each fits the host alone."""
    if how == "a file in the way":
        (tmp_path / "file").write_text("")
        directory = tmp_path / "file" / "reservations"
    else:
        directory = tmp_path / "open"
        directory.mkdir()
        directory.chmod(0o777)
    monkeypatch.setenv(ENV_DIR, str(directory))
    with caplog.at_level(logging.WARNING, logger="omni_pcache"):
        with reserving_cache(0.55) as first, reserving_cache(0.55) as second:
            save_rows(first, "a")
            save_rows(second, "a")
    warnings = [r.getMessage() for r in caplog.records if "not shared" in r.getMessage()]
    assert len(warnings) == 1 and str(directory) in warnings[0] and ENV_DIR in warnings[0]


def test_a_lock_held_too_long_admits_alone_and_the_next_admission_shares_again(
    own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the directory's lock (stopped, ...): the save waits
    `LOCK_TIMEOUT_S`, warns, and its keys are admitted counting no others, but recorded; once
    the lock is free, the next cache's admission counts them."""
    monkeypatch.setattr(host_reservations, "LOCK_TIMEOUT_S", 0.1)
    os.makedirs(own_reservations_dir, mode=0o700)
    held = os.open(os.path.join(own_reservations_dir, "lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # (another open file: the cache's flock conflicts with it)
    try:
        with caplog.at_level(logging.WARNING, logger="omni_pcache"):
            first = reserving_cache(0.55)
            save_rows(first, "a")
    finally:
        os.close(held)
    assert any("its lock was not free for 0.1 s" in r.getMessage() for r in caplog.records)
    with first, reserving_cache(0.55) as second, pytest.raises(ConfigError, match="another cache of this process"):
        save_rows(second, "a")


def test_the_directory_is_this_users_in_dev_shm_unless_set_and_empty_shares_nothing(
    own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_DIR)
    namespace = os.stat("/proc/self/ns/pid").st_ino
    assert reservations_dir() == Path(f"/dev/shm/omni_pcache-{os.getuid()}-{namespace}")
    monkeypatch.setenv(ENV_DIR, "")
    assert reservations_dir() is None
    with reserving_cache(0.55) as first, reserving_cache(0.55) as second:
        save_rows(first, "a")
        save_rows(second, "a")
    assert not os.path.exists(own_reservations_dir)
