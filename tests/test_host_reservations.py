"""Host memory shared between processes (`omni_pcache.host_reservations`): caches of several
processes on one host (an omni pipeline's stages) are held to the host's memory together. A
cache with the default budget counts what the other live caches hold; a process that exits,
even killed, stops counting; where nothing can be shared each cache keeps to its own budget."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachekit import slots_of, small_cache
from omni_pcache import ConfigError, NewRequest, PrefixCache, StepBatch, StepEvents, host_reservations
from omni_pcache.host_memory import host_memory_limit
from omni_pcache.host_reservations import DEFAULT_DIR, ENV_DIR, reservations_dir

BS = 4  # (small_cache: blocks of 4 slots)
NUM_BLOCKS = 1 << 16
TESTS = Path(__file__).parent


def width_for(share: float) -> int:
    """The float32 row width whose pool is ``share`` of this host's memory in a cache of
    `NUM_BLOCKS` blocks (allocated untouched: Linux lends it without using it)."""
    limit = host_memory_limit()
    assert limit is not None
    return int(share * limit) // (NUM_BLOCKS * BS * 4)


def save_rows(cache: PrefixCache, req: str, width: int) -> None:
    """A step of one new request: 4 rows of ``width``, saved and materialized."""
    cache.begin_step(StepEvents(new=[NewRequest(req, [0, 1])]))
    rows = torch.randn(4, width)
    out = cache.materialize(cache.save(rows, {}, StepBatch([req], [4], slots_of([0, 1], 0, 4, BS))), [req])
    assert torch.equal(out.hidden[req], rows)


def reservation_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".json")) if os.path.isdir(directory) else []


CHILD = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from cachekit import small_cache
from test_host_reservations import NUM_BLOCKS, save_rows, width_for
cache = small_cache(num_blocks=NUM_BLOCKS)
save_rows(cache, "child", width_for(0.45))
print("saved", flush=True)
sys.stdin.readline()
cache.close()
print("closed", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child_cache():
    """A process whose cache holds 45% of this host (and 11% more kept aside for late reads),
    until a line on its stdin closes it; killed at the end."""
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
    ) as child:
        try:
            assert child.stdout.readline() == "saved\n"
            yield child
        finally:
            child.kill()  # (the pipes close as the `with` ends)


def test_a_cache_of_another_process_holds_its_share_of_the_host_until_it_closes(
    child_cache: subprocess.Popen, own_reservations_dir: str
) -> None:
    """Each cache would fit the host alone, not both: the second process's save is refused
    with a `ConfigError` naming the first process and what it holds, and its keys are
    cached once the first process has closed its cache."""
    with small_cache(num_blocks=NUM_BLOCKS) as cache:
        with pytest.raises(ConfigError) as err:
            save_rows(cache, "a", width_for(0.45))
        assert f"other caches on this host hold (pid {child_cache.pid} (python" in str(err.value)
        assert cache.stats().pool_bytes == {}
        child_cache.stdin.write("close\n")
        child_cache.stdin.flush()
        assert child_cache.stdout.readline() == "closed\n"
        save_rows(cache, "a", width_for(0.45))
        assert len(reservation_files(own_reservations_dir)) == 1
    assert reservation_files(own_reservations_dir) == []


def test_a_killed_process_holds_nothing(child_cache: subprocess.Popen, own_reservations_dir: str) -> None:
    """A process killed with its cache open leaves its file behind: the next admission counts
    nothing of it and removes the file."""
    (left,) = reservation_files(own_reservations_dir)
    assert left.startswith(f"{child_cache.pid}-")
    child_cache.send_signal(signal.SIGKILL)
    child_cache.wait()
    with small_cache(num_blocks=NUM_BLOCKS) as cache:
        save_rows(cache, "a", width_for(0.45))
        (own,) = reservation_files(own_reservations_dir)
        assert own != left and own.startswith(f"{os.getpid()}-")


def plant(directory: str, file_name: str, **entry) -> Path:
    """A reservation file as another cache would write it."""
    os.makedirs(directory, exist_ok=True)
    path = Path(directory) / file_name
    path.write_text(json.dumps(entry))
    return path


def test_a_live_process_id_of_another_start_is_not_counted(own_reservations_dir: str) -> None:
    """A file whose process id is live but started later than its writer (the id was reused)
    is not counted and is removed; one from another pid namespace, whose process cannot be
    looked up, is counted."""
    namespace = os.readlink("/proc/self/ns/pid")
    start = host_reservations._proc_start_time(os.getpid())
    reused = plant(
        own_reservations_dir, "1-0.json", pid=os.getpid(), start=start - 1, pidns=namespace, name="x", bytes=1 << 50
    )
    with small_cache(num_blocks=NUM_BLOCKS) as cache:
        save_rows(cache, "a", width_for(0.45))
    assert not reused.exists()
    plant(own_reservations_dir, "2-0.json", pid=2, start=1, pidns="pid:[1]", name="elsewhere", bytes=1 << 50)
    with small_cache(num_blocks=NUM_BLOCKS) as cache, pytest.raises(ConfigError, match=r"pid 2 \(elsewhere\): "):
        save_rows(cache, "a", 8)


def test_a_budget_of_its_own_is_held_to_the_host_with_the_others(own_reservations_dir: str) -> None:
    """Two caches of this process: one with the default budget, and one with a budget of its
    own (a chosen share: the whole host here), which fits that budget but not the host beside
    the first. It is refused naming the first, and admitted once the first is closed."""
    first = small_cache(num_blocks=NUM_BLOCKS)
    save_rows(first, "a", width_for(0.45))
    with small_cache(num_blocks=NUM_BLOCKS, host_budget_bytes=host_memory_limit()) as second:
        with pytest.raises(ConfigError) as err:
            save_rows(second, "a", width_for(0.45))
        message = str(err.value)
        assert "that other caches on this host hold (another cache of this process: " in message
        assert "past this host's memory: " in message
        first.close()
        save_rows(second, "a", width_for(0.45))


def test_a_budget_past_the_host_is_held_to_itself_alone_and_counted_by_the_others(
    own_reservations_dir: str,
) -> None:
    """A budget past the host's memory says the host's memory is not the limit (swap, ...):
    such caches are admitted beside each other past the host, and a cache with the default
    budget still counts them."""
    with (
        small_cache(num_blocks=NUM_BLOCKS, host_budget_bytes=2**62) as first,
        small_cache(num_blocks=NUM_BLOCKS, host_budget_bytes=2**62) as second,
    ):
        save_rows(first, "a", width_for(0.45))
        save_rows(second, "a", width_for(0.45))
        with small_cache(num_blocks=NUM_BLOCKS) as third, pytest.raises(ConfigError) as err:
            save_rows(third, "a", 8)
        assert str(err.value).count("another cache of this process: ") == 2


def test_a_cache_collected_without_close_gives_up_its_reservation(own_reservations_dir: str) -> None:
    cache = small_cache(num_blocks=NUM_BLOCKS)
    save_rows(cache, "a", 8)
    assert len(reservation_files(own_reservations_dir)) == 1
    del cache
    gc.collect()
    assert reservation_files(own_reservations_dir) == []


def test_an_unusable_directory_leaves_each_cache_to_its_own_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory that cannot be made (a file is in the way): one warning naming it and the
    variable to set, and the caches are admitted as each fits the host alone."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "file" / "reservations"))
    with caplog.at_level(logging.WARNING, logger="omni_pcache"):
        with small_cache(num_blocks=NUM_BLOCKS) as first, small_cache(num_blocks=NUM_BLOCKS) as second:
            save_rows(first, "a", width_for(0.45))
            save_rows(second, "a", width_for(0.45))
    warnings = [r.getMessage() for r in caplog.records if "not shared" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "file" / "reservations") in warnings[0] and ENV_DIR in warnings[0]


def test_a_lock_held_too_long_leaves_each_cache_to_its_own_budget(
    own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the directory's lock (stopped, ...): the save waits
    `LOCK_TIMEOUT_S`, warns, and is admitted on its own budget."""
    monkeypatch.setattr(host_reservations, "LOCK_TIMEOUT_S", 0.1)
    os.makedirs(own_reservations_dir)
    held = os.open(os.path.join(own_reservations_dir, "lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # (another open file: the cache's flock conflicts with it)
    try:
        with caplog.at_level(logging.WARNING, logger="omni_pcache"), small_cache() as cache:
            save_rows(cache, "a", 8)
    finally:
        os.close(held)
    assert any("its lock cannot be taken" in r.getMessage() for r in caplog.records)


def test_the_directory_is_dev_shm_unless_set_and_empty_shares_nothing(
    own_reservations_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_DIR)
    assert reservations_dir() == Path(DEFAULT_DIR) == Path("/dev/shm/omni_pcache")
    monkeypatch.setenv(ENV_DIR, "")
    assert reservations_dir() is None
    with small_cache(num_blocks=NUM_BLOCKS) as first, small_cache(num_blocks=NUM_BLOCKS) as second:
        save_rows(first, "a", width_for(0.45))
        save_rows(second, "a", width_for(0.45))
    assert not os.path.exists(own_reservations_dir)
