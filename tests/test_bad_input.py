"""Bad input to the native core: a typed error that says what was wrong, and no change.

Every case keeps using the object afterwards and checks its state is what it was.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from cachekit import start_thread
from omni_pcache import (
    SOURCE_ABSENT,
    SOURCE_POOL,
    CacheClosedError,
    ConfigError,
    InvalidInputError,
    Ledger,
    PrefixCacheError,
    StagingSlots,
    StepIds,
    TaskStateError,
    WriteTasks,
    hash_blocks,
)
from omni_pcache._native import Deliveries, block_slots, block_table, check_batch, scatter_rows


@pytest.fixture
def ledger() -> Ledger:
    ledger = Ledger(32)
    key = ledger.add_key()
    ledger.claim(np.arange(4, dtype=np.int64), key, task_id=1)
    ledger.commit(1)
    return ledger


def snapshot(ledger: Ledger) -> tuple[list[int], list[int], int, int]:
    sources, versions = ledger.peek(np.arange(32), 0)
    return sources.tolist(), versions.tolist(), ledger.num_tasks, ledger.num_pending_reads


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (np.array([5, -1], dtype=np.int64), "slot id -1 at position 1 is out of range [0, 32)"),
        (np.array([32], dtype=np.int64), "slot id 32 at position 0 is out of range [0, 32)"),
        (np.array([7, 8, 7], dtype=np.int64), "slot id 7 appears twice (positions 0 and 2)"),
        (np.array([1.0, 2.0]), "slots must be an int64 or int32 array, got dtype float64"),
        (np.array([1, 2], dtype=np.uint8), "got dtype uint8"),
        (np.zeros((2, 2), dtype=np.int64), "slots must be a 1-D integer array, got 2 dimensions"),
        ("not slots", "slots must be"),
        (torch.tensor([1.0, 2.0]), "slots must be an int64 or int32 array, got dtype float32"),
        # (only an empty list is no slots: empty float arrays and lists of floats name their dtype)
        ([1.5, 2.5], "slots must be an int64 or int32 array, got dtype float64"),
        (np.array([], dtype=np.float64), "slots must be an int64 or int32 array, got dtype float64"),
        (torch.tensor([]), "slots must be an int64 or int32 array, got dtype float32"),
    ],
)
def test_bad_claims_are_refused_and_change_nothing(ledger: Ledger, slots: object, message: str) -> None:
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError) as err:
        ledger.claim(slots, 0, task_id=2)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError), "InvalidInputError is also a ValueError"
    assert snapshot(ledger) == before
    # Still usable.
    out = ledger.claim(np.array([4, 5]), 0, task_id=2)
    assert out.stolen_slots.size == 0
    assert ledger.commit(2) == 2


def test_unknown_key_task_and_read(ledger: Ledger) -> None:
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError, match=r"unknown key#3 \(registered keys: 1\)"):
        ledger.claim([1, 2], 3, task_id=5)
    with pytest.raises(InvalidInputError, match=r"unknown key#1"):
        ledger.plan_read([1], 1)
    with pytest.raises(InvalidInputError, match=r"unknown task#77") as err:
        ledger.commit(77)
    assert err.value.task_id == 77
    with pytest.raises(InvalidInputError, match=r"unknown task#77"):
        ledger.abandon(77)
    with pytest.raises(InvalidInputError, match=r"unknown read#9 \(never planned, or already released\)"):
        ledger.validate(9)
    with pytest.raises(InvalidInputError, match=r"unknown read#9"):
        ledger.release(9)
    with pytest.raises(InvalidInputError, match=r"unknown read#9"):
        ledger.captured_versions(9)
    assert snapshot(ledger) == before
    plan = ledger.plan_read([0, 1], 0)
    assert plan.sources.tolist() == [SOURCE_POOL, SOURCE_POOL]
    assert len(plan) == 2
    assert ledger.captured_versions(plan.read_id).tolist() == ledger.peek([0, 1], 0)[1].tolist()
    ledger.release(plan.read_id)
    with pytest.raises(InvalidInputError, match=r"unknown read#"):
        ledger.captured_versions(plan.read_id)  # (released: its versions are gone with it)


def test_a_batch_commit_with_an_unknown_or_repeated_task_commits_none_of_it(ledger: Ledger) -> None:
    ledger.claim([5, 6], 0, task_id=2)
    ledger.claim([7], 0, task_id=3)
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError, match=r"unknown task#77"):
        ledger.commit_many([2, 77, 3])
    with pytest.raises(InvalidInputError, match=r"task#3 is listed twice in one commit"):
        ledger.commit_many([3, 2, 3])
    with pytest.raises(InvalidInputError, match=r"offset -1 of task#2 is out of range"):
        ledger.owned_many([2], 0, [-1])
    assert snapshot(ledger) == before
    assert ledger.commit_many([3, 2]) == 3 and ledger.num_tasks == 0


def test_lists_and_int32_arrays_are_accepted(ledger: Ledger) -> None:
    plan = ledger.plan_read([0, 9], 0)
    assert plan.sources.tolist() == [SOURCE_POOL, SOURCE_ABSENT]
    ledger.release(plan.read_id)
    strided = np.arange(0, 8, dtype=np.int32)[::2]
    plan = ledger.plan_read(strided, 0)
    assert plan.sources.tolist() == [SOURCE_POOL, SOURCE_POOL, SOURCE_ABSENT, SOURCE_ABSENT]
    ledger.release(plan.read_id)
    assert ledger.plan_read([], 0).sources.size == 0


@pytest.mark.parametrize("factory", [lambda: Ledger(0), lambda: StagingSlots(0)])
def test_zero_sized_registries_raise_config_error(factory) -> None:
    with pytest.raises(ConfigError, match="at least one slot"):
        factory()


def test_a_ledger_needs_a_block_size_and_reports_it() -> None:
    with pytest.raises(ConfigError, match=r"a block size of at least one \(got 16 slots in blocks of 0\)"):
        Ledger(16, 0)
    ledger = Ledger(48, 6)  # (any size: the last block may end past the last slot)
    assert ledger.block_size == 6 and Ledger(16).block_size == 16
    assert repr(ledger).startswith("Ledger(num_slots=48, block_size=6, ")


def test_negative_sizes_are_rejected_before_the_core() -> None:
    with pytest.raises(OverflowError):
        Ledger(-4)


def test_unknown_task_ids_and_illegal_moves_on_write_tasks() -> None:
    tasks = WriteTasks()
    task = tasks.create()
    with pytest.raises(InvalidInputError, match=r"unknown task#42"):
        tasks.state(42)
    with pytest.raises(InvalidInputError, match=r"unknown task#42"):
        tasks.enqueue(42)
    with pytest.raises(TaskStateError, match=rf"task#{task}: illegal transition PENDING -> HOST_READY") as err:
        tasks.copy_done(task)
    assert (err.value.from_state, err.value.to_state) == ("PENDING", "HOST_READY")
    with pytest.raises(InvalidInputError, match="is still PENDING and cannot be removed"):
        tasks.remove(task)
    assert tasks.state(task) == "PENDING"
    tasks.enqueue(task)
    assert tasks.pop() == task
    assert tasks.state(task) == "COPYING"


def test_write_tasks_count_live_tasks_and_queue_entries_stale_ones_included() -> None:
    tasks = WriteTasks()
    assert repr(tasks) == "WriteTasks(live=0, queue_entries=0)"
    a, b = tasks.create_many(2)
    tasks.enqueue(a, True)
    tasks.enqueue(b, False)
    tasks.start_copy(b)  # taken out of turn: its low-lane entry goes stale, still counted
    assert (len(tasks), tasks.num_queue_entries) == (2, 2)
    assert repr(tasks) == "WriteTasks(live=2, queue_entries=2)"
    assert tasks.pop() == a and tasks.pop() is None  # (the stale entry is dropped on the way)
    assert tasks.num_queue_entries == 0


@pytest.mark.slow  # (it issues 2**24 tasks: ~15 s and ~3 GB)
def test_create_many_issues_exactly_its_bound_and_refuses_one_more() -> None:
    tasks = WriteTasks()
    with pytest.raises(InvalidInputError, match=r"create_many\(16777217\): at most 16777216 tasks at once"):
        tasks.create_many(2**24 + 1)
    assert len(tasks) == 0, "a refused create_many issues nothing"
    assert len(tasks.create_many(2**24)) == 2**24 == len(tasks)


def test_step_ids_errors_list_outstanding() -> None:
    ids = StepIds()
    a, b = ids.issue(), ids.issue()
    ids.consume(b)
    with pytest.raises(PrefixCacheError, match=r"step#1 was already consumed; outstanding step ids: \[0\]"):
        ids.consume(b)
    with pytest.raises(PrefixCacheError, match=r"step#-?\d+ was never issued") as err:
        ids.consume(10)
    assert err.value.outstanding == [a]
    with pytest.raises(OverflowError):
        ids.consume(-1)
    assert ids.outstanding() == [a] and len(ids) == 1


def test_staging_bad_input() -> None:
    staging = StagingSlots(2)
    with pytest.raises(InvalidInputError, match="holder kind must be 'step' or 'task'"):
        staging.claim(("page", 1))
    with pytest.raises(InvalidInputError, match="timeout_s must be a finite number >= 0, got -1"):
        staging.claim(("step", 1), -1.0)
    with pytest.raises(InvalidInputError, match="timeout_s must be a finite number"):
        staging.claim(("step", 1), float("nan"))
    with pytest.raises(InvalidInputError, match=r"staging slot 5 is out of range \[0, 2\)"):
        staging.hold(5, ("task", 1))
    with pytest.raises(InvalidInputError, match="does not hold staging slot 0"):
        staging.release(0, ("step", 1))
    assert staging.num_free == 2
    assert staging.claim(("step", 1)) == 0
    staging.close()
    with pytest.raises(CacheClosedError):
        staging.claim(("step", 2))
    assert staging.release(0, ("step", 1)) is True


def test_a_staging_wait_too_long_for_a_deadline_waits_for_a_free_slot() -> None:
    staging = StagingSlots(1)
    staging.claim(("step", 1))
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(staging.claim(("step", 2), 1e19)))  # ~3e11 years
    waiter.start()
    staging.release(0, ("step", 1))
    waiter.join(10)
    assert got == [0], "the claim panicked computing its deadline, or never woke"


def test_hash_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="token id -5 at position 1 is outside"):
        hash_blocks([1, -5, 3, 4], 2)
    with pytest.raises(InvalidInputError, match="block_size must be 1 to 16777216 tokens, got 0"):
        hash_blocks([1, 2], 0)
    for huge in (2**40, 2**62):  # used to abort the process (a 4 TB buffer) or panic (4x wrapped to 0)
        with pytest.raises(InvalidInputError, match=f"got {huge}"):
            hash_blocks([1, 2, 3], huge)
    with pytest.raises(InvalidInputError, match="1 extra keys for 2 full blocks"):
        hash_blocks([1, 2, 3, 4], 2, extra_keys=[None])
    with pytest.raises(InvalidInputError, match="got dtype float32"):
        hash_blocks(np.ones(4, dtype=np.float32), 2)
    # arguments of the wrong type or range: typed, naming the argument (were TypeError/OverflowError)
    for size in (-1, "2", True):
        with pytest.raises(InvalidInputError, match=rf"block_size must be 1 to 16777216 tokens, got {size!r}"):
            hash_blocks([1, 2], size)
    for parent in (-1, 2**128, "x", True):
        with pytest.raises(InvalidInputError, match=r"parent must be a block hash \(an int in \[0, 2\*\*128\)\)"):
            hash_blocks([1, 2], 2, parent=parent)
    # extra keys are bytes or None: a str, or a tuple of ints that would read as bytes, is refused
    for key in ("a", (104, 105), [104, 105], np.array([104, 105])):
        with pytest.raises(InvalidInputError, match="extra_keys must be a list of bytes or None, one per full block"):
            hash_blocks([1, 2], 2, extra_keys=[key])
    assert hash_blocks([1, 2], 2, extra_keys=[bytearray(b"hi")]) == hash_blocks([1, 2], 2, extra_keys=[b"hi"])
    # the ids of the trailing partial block are checked too (it is not hashed)
    with pytest.raises(InvalidInputError, match="token id -1 at position 2 is outside"):
        hash_blocks([1, 2, -1], 2)
    with pytest.raises(InvalidInputError, match="extra_keys must be a sequence, got the single b'a'"):
        hash_blocks([1, 2], 2, extra_keys=b"a")
    # (an iterator of extra keys is read once, as a list would be)
    assert hash_blocks([1, 2], 2, extra_keys=iter([b"a"])) == hash_blocks([1, 2], 2, extra_keys=[b"a"])


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([0, True], "block_ids must be a list of ints, got True at position 1"),
        ((3, 1.5), r"block_ids must be a list of ints, got 1.5 at position 1"),
        ([0, "1"], "block_ids must be a list of ints, got '1' at position 1"),
        ([2, 8], r"block id 8 at position 1 is out of range \[0, 8\)"),
        (np.array([-1, 2]), r"block id -1 at position 0 is out of range \[0, 8\)"),
        (np.array([1.0, 2.0]), "block_ids must be an int64 or int32 array, got dtype float64"),
        (np.zeros((2, 2), dtype=np.int64), "block_ids must be a 1-D integer array"),
    ],
)
def test_block_tables_refuse_what_is_not_a_list_of_block_ids(blocks, message) -> None:
    from omni_pcache._native import block_table

    with pytest.raises(InvalidInputError, match=message):
        block_table(blocks, 8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_slots(np.array([1]), -1, 2, 4), r"start must be an int in \[0, 9223372036854775807\], got -1"),
        (lambda: block_slots(np.array([1]), "0", 2, 4), r"start must be an int in \[0, .*\], got '0'"),
        (lambda: block_slots(np.array([1]), 0, 2, 2**32), r"block_size must be an int in \[0, 4294967295\]"),
        (lambda: block_slots(np.array([1]), 0, 2, True), r"block_size must be an int .*, got True"),
        (lambda: block_table([1], -1), r"num_blocks must be an int in \[0, 4294967295\], got -1"),
        (lambda: block_table([0], True), r"num_blocks must be an int .*, got True"),
    ],
)
def test_block_table_arguments_of_the_wrong_type_or_range_are_typed_errors(call, message) -> None:
    # (were PyO3's bare OverflowError/TypeError, and a bool passed as 1)
    with pytest.raises(InvalidInputError, match=message):
        call()


def test_the_last_block_of_the_slot_range_gives_all_its_slots() -> None:
    # its last slot is 2**63 - 1: one past it overflowed (an empty answer in release builds)
    slots = block_slots(np.array([2**59 - 1]), 0, 16, 16)
    assert slots.tolist() == list(range(2**63 - 16, 2**63))


def test_block_tables_accept_ints_numpy_ints_and_arrays_and_give_slots() -> None:
    from omni_pcache._native import block_slots, block_table

    for blocks in ([7, 2, 5], (7, 2, 5), [np.int64(7), 2, np.int32(5)], np.array([7, 2, 5], dtype=np.int32)):
        table = block_table(blocks, 8)
        assert table.dtype == np.int64 and table.tolist() == [7, 2, 5]
    assert block_slots(table, 3, 10, 4).tolist() == [31, 8, 9, 10, 11, 20, 21]
    assert block_slots(table.astype(np.int32), 3, 10, 4).tolist() == [31, 8, 9, 10, 11, 20, 21]
    with pytest.raises(InvalidInputError, match=r"positions 0..13 do not fit a table of 3 blocks of 4"):
        block_slots(table, 0, 13, 4)
    # A block id whose slots overflow int64 is refused (its multiply wrapped to small slots).
    with pytest.raises(InvalidInputError, match=rf"block id {2**62} at position 0 has no slots of 16"):
        block_slots(np.array([2**62]), 0, 4, 16)


def test_claim_counts_that_overflow_when_summed_are_refused_whole(ledger: Ledger) -> None:
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError, match="summing to more than usize::MAX for 1 slots"):
        ledger.claim_many(np.array([5]), [1, 2**64 - 1, 1], 0, [7, 8, 9])
    assert snapshot(ledger) == before


def test_torch_index_tensors_are_read_like_numpy_arrays(ledger: Ledger) -> None:
    out = ledger.claim(torch.tensor([4, 5]), 0, task_id=2)
    assert out.stolen_slots.size == 0 and ledger.commit(2) == 2
    assert ledger.peek(torch.tensor([4, 5], dtype=torch.int32), 0)[0].tolist() == [SOURCE_POOL, SOURCE_POOL]


def test_a_completion_published_twice_loses_no_other_task() -> None:
    tasks = WriteTasks()
    first, second = tasks.create_many(2)
    tasks.enqueue_many([first, second])
    tasks.pop_many(2)
    tasks.copy_done_many([first, second])
    tasks.written_many([first, second])
    tasks.complete(first)
    with pytest.raises(InvalidInputError, match=rf"task#{first} was already published as complete"):
        tasks.complete(first)  # a caller's mistake: the same task published twice
    tasks.complete(second)
    assert tasks.reap_completions() == [first, second]  # each once, none lost
    assert len(tasks) == 0
    early = tasks.create()
    with pytest.raises(InvalidInputError, match=rf"task#{early} is PENDING and cannot complete"):
        tasks.complete(early)
    assert tasks.reap_completions() == [] and tasks.state(early) == "PENDING"


def test_task_ids_a_ledger_could_not_report_are_refused(ledger: Ledger) -> None:
    # A source is reported as a task id >= 0 beside negative pool/absent codes: an id of 2**63
    # or more would read as one of those codes.
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError, match=r"task id 18446744073709551615 is out of range \[0, 2\*\*63\)"):
        ledger.claim(np.arange(4), 0, 2**64 - 1)
    with pytest.raises(InvalidInputError, match=r"task id 9223372036854775808 is out of range"):
        ledger.claim_many(np.arange(4), [2, 2], 0, [1, 2**63])
    assert snapshot(ledger) == before


def test_a_delivery_table_refuses_a_block_size_of_zero() -> None:
    with pytest.raises(ConfigError, match="block size of at least 1"):
        Deliveries(0)


def test_slots_changed_by_another_thread_during_a_scatter_never_escape_the_check() -> None:
    # scatter_rows copies without the GIL; the slots it checked are the slots it uses, whatever
    # another thread writes into the caller's array meanwhile (a typed refusal, or the checked
    # slots: never a panic or a write outside the pool).
    n, row_bytes = 50_000, 256
    pool, rows = np.zeros((n, row_bytes), np.uint8), np.ones((n, row_bytes), np.uint8)
    good = np.random.default_rng(0).permutation(n).astype(np.int64)
    slots, stop = good.copy(), threading.Event()

    def scribble() -> None:
        while not stop.is_set():
            slots[-1000:] = 10**12
            slots[-1000:] = good[-1000:]

    thread = threading.Thread(target=scribble)
    thread.start()
    outcomes = []
    try:
        for _ in range(30):
            slots[:] = good
            try:
                scatter_rows(pool, rows, slots)
                outcomes.append("written")
            except InvalidInputError:
                outcomes.append("refused")
    finally:
        stop.set()
        thread.join()
    assert set(outcomes) <= {"written", "refused"}
    assert pool.sum() == pool.size * ("written" in outcomes)  # (only checked slots were written)


def test_an_index_array_a_native_write_is_writing_meanwhile_is_a_typed_error() -> None:
    # scatter_rows holds its pool writable without the GIL; an index array over the same memory,
    # passed to another native call meanwhile, is refused with a typed error, never a panic.
    base = np.zeros(1 << 22, np.int64)
    pool = base.view(np.uint8).reshape(-1, 4096)
    rows, slots = np.ones_like(pool), np.arange(pool.shape[0])[::-1].copy()
    thread, errors = start_thread(lambda: [scatter_rows(pool, rows, slots) for _ in range(20)])
    outcomes = set()
    while thread.is_alive():
        for call in (lambda: block_table(base[:4], 10), lambda: check_batch(["a"], [4], base[:4], 8, 64)):
            try:
                call()
                outcomes.add("read")
            except InvalidInputError as err:  # (the ids it reads once written: out of range)
                outcomes.add("busy" if "cannot be read" in str(err) else "out of range")
                if "cannot be read" in str(err):
                    assert "its memory is being written by another thread" in str(err)
    thread.join()
    assert errors == [] and "busy" in outcomes


def test_batch_calls_on_staging_and_tasks_are_refused_as_a_whole() -> None:
    staging = StagingSlots(1)
    staging.claim(("step", 0))
    staging.hold_many(0, "task", [1, 2])
    with pytest.raises(InvalidInputError, match=r"task#99 does not hold"):
        staging.release_many(0, "task", [1, 99])
    assert staging.holders() == [[("step", 0), ("task", 1), ("task", 2)]]
    tasks = WriteTasks()
    done, pending = tasks.create(), tasks.create()
    tasks.fail(done)
    with pytest.raises(InvalidInputError, match=rf"task#{pending} is PENDING and cannot complete"):
        tasks.complete_many([done, pending])
    with pytest.raises(InvalidInputError, match=rf"task#{done} is listed twice in one completion"):
        tasks.complete_many([done, done])
    assert tasks.reap_completions() == []  # nothing was published
    tasks.complete_many([done])
    assert tasks.reap_completions() == [done]


def test_sizes_and_ids_that_would_overflow_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match=r"staging takes at most 1048576 slots, got 4611686018427387904"):
        StagingSlots(2**62)
    with pytest.raises(InvalidInputError, match=r"at most 16777216 tasks at once"):
        WriteTasks().create_many(2**61)
    with pytest.raises(ConfigError, match=r"the first step id must be at most 9223372036854775807"):
        StepIds(2**63)
    ids = StepIds(2**63 - 1)
    assert [ids.issue(), ids.issue()] == [2**63 - 1, 2**63]
    deliveries = Deliveries(4)
    deliveries.take_step({"a": (0, 5)})
    with pytest.raises(InvalidInputError, match=r"request \"a\": 18446744073709551615 rows from position 5"):
        deliveries.take_step({"a": (0, 2**64 - 1)})
    rows, _ = deliveries.take_step({"a": (0, 3)})
    assert rows == {"a": (0, 3, 0)}  # a goes on at position 5: nothing was registered by the refusal


def test_a_key_whose_ledger_columns_cannot_be_allocated_is_refused_not_aborted() -> None:
    # A KV cache too large for the host's memory (an address-space limit stands in for a
    # memory-limited container): the key's ledger columns (16 bytes per slot) fail to allocate.
    # That used to abort the process; it is an InvalidInputError, and nothing is registered.
    script = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import numpy as np, torch
from omni_pcache import CacheConfig, InvalidInputError, NewRequest, PrefixCache, StepBatch, StepEvents
cache = PrefixCache(CacheConfig(num_blocks=100_000_000, block_size=4))
cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
for _ in range(2):  # (refused alike twice: the first refusal registered nothing)
    try:
        cache.save(torch.randn(4, 8), None, StepBatch(["a"], [4], np.arange(4)))
    except InvalidInputError as exc:
        print(exc)
stats = cache.stats()
assert stats.steps_outstanding == [] and stats.pool_bytes == {}, stats
cache.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line == lines[0] for line in lines), lines
    assert lines[0].startswith("hidden states: invalid input: the ledger's columns for a new key (400000000 slots")
    assert "lower num_blocks" in lines[0]


def test_a_request_id_subclass_that_names_one_request_twice_is_refused() -> None:
    # A str subclass with its own hash lets a dict hold two keys of one text: the core would take
    # them as one request named twice (its positions wrapped past the largest), so it is refused.
    class Twin(str):
        def __hash__(self) -> int:
            return id(self)

        def __eq__(self, other: object) -> bool:
            return self is other

    deliveries = Deliveries(4)
    with pytest.raises(InvalidInputError, match=r'StepBatch.req_ids names request "a" twice'):
        deliveries.take_step({Twin("a"): (0, 2**63), Twin("a"): (0, 2**63)})
    rows, _ = deliveries.take_step({Twin("a"): (0, 3)})
    assert list(rows.values()) == [(0, 3, 0)]  # nothing registered by the refusal: a starts at 0


def test_a_zero_count_in_a_batch_claim_registers_a_task_that_commits_nothing(ledger) -> None:
    key = ledger.add_key()
    ledger.claim_many(np.array([0, 1, 2]), [2, 0, 1], key, [1, 2, 3])
    assert ledger.commit_many([1, 2, 3]) == 3  # (task 2 was unknown to the ledger: the commit refused)
    assert ledger.num_tasks == 0


def test_index_arrays_at_an_odd_byte_offset_are_read_from_an_aligned_copy(ledger) -> None:
    key = ledger.add_key()
    for dtype in (np.int64, np.int32):
        size = np.dtype(dtype).itemsize
        raw = bytearray(1 + 4 * size)
        odd = np.frombuffer(raw, dtype=dtype, offset=1, count=4)
        assert not odd.flags.aligned
        odd[:] = [4, 5, 6, 7]
        sources, versions = ledger.peek(odd, key)
        assert len(sources) == 4 and versions.tolist() == [0, 0, 0, 0]
        checked = check_batch(["a"], [4], odd, 8, 64)
        assert checked[1].tolist() == [4, 5, 6, 7]


def test_a_span_whose_slots_cannot_be_allocated_is_refused_not_aborted() -> None:
    # block_slots over 2**32 - 1 positions asks for 32 GiB of slot ids: under an address-space
    # limit (a memory-limited container) that used to abort the process.
    script = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import numpy as np
from omni_pcache import InvalidInputError
from omni_pcache._native import block_slots
try:
    block_slots(np.array([0]), 0, 2**32 - 1, 2**32 - 1)
except InvalidInputError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the slots of positions 0..4294967295 cannot be allocated" in done.stdout, done.stdout


def test_the_largest_task_id_a_ledger_can_report_is_accepted_and_one_more_refused(ledger: Ledger) -> None:
    # 2**63 - 1 is the last id the ledger can report as a non-negative int64 source.
    top = 2**63 - 1
    ledger.claim(np.array([4, 5]), 0, top)
    assert ledger.peek(np.array([4, 5]), 0)[0].tolist() == [top, top]
    before = snapshot(ledger)
    with pytest.raises(InvalidInputError, match=r"task id 9223372036854775808 is out of range \[0, 2\*\*63\)"):
        ledger.commit_many([top, 2**63])  # (refused as the out-of-range id it is, committing nothing)
    assert snapshot(ledger) == before
    assert ledger.commit_many([top]) == 2 and ledger.num_tasks == 0


def test_owned_rows_of_several_tasks_say_where_their_one_contiguous_run_starts(ledger: Ledger) -> None:
    key = ledger.add_key()
    ledger.claim_many(np.array([7, 8, 2]), [2, 1], key, [5, 6])
    positions, slots, first = ledger.owned_many([5, 6], key, [3, 5])
    assert (positions.tolist(), slots.tolist(), first) == ([3, 4, 5], [7, 8, 2], 3)
    positions, slots, first = ledger.owned_many([5, 6], key, [0, 4])
    assert (positions.tolist(), slots.tolist(), first) == ([0, 1, 4], [7, 8, 2], -1), "not one run: -1"


def test_try_claim_gives_none_for_a_full_ring_and_raises_once_it_is_closed() -> None:
    staging = StagingSlots(2)
    assert staging.try_claim(("step", 1)) == 0
    assert staging.try_claim(("step", 2)) == 1
    assert staging.try_claim(("step", 3)) is None  # full: no exception built
    with pytest.raises(InvalidInputError, match="holder kind must be 'step' or 'task'"):
        staging.try_claim(("page", 4))
    staging.release(1, ("step", 2))
    staging.close()
    with pytest.raises(CacheClosedError):
        staging.try_claim(("step", 5))  # (a free slot, but the ring is closed: not a silent None)
    assert staging.holders() == [[("step", 1)], []]


def test_a_reaped_completion_that_is_refused_still_removes_every_other_drained_task() -> None:
    tasks = WriteTasks()
    first, second, third = tasks.create_many(3)
    for task in (first, second, third):
        tasks.fail(task)
    tasks.complete_many([first, second, third])
    tasks.remove(first)  # (removed by hand while its completion was queued)
    with pytest.raises(InvalidInputError, match=rf"unknown task#{first}"):
        tasks.reap_completions()
    assert len(tasks) == 0, "the other drained tasks were removed before the refusal was raised"
    assert tasks.reap_completions() == []


def test_long_index_arrays_changed_by_another_thread_during_a_call_never_escape_the_check() -> None:
    # A call on 8192 indices or more runs without the GIL on a copy of the caller's array made
    # while it is held: another thread writing the array meanwhile makes it see the old ids or
    # the new ones (a typed refusal), never ids that changed between its check and their use.
    n = 1 << 16
    ledger = Ledger(n)
    key = ledger.add_key()
    good = np.random.default_rng(1).permutation(n).astype(np.int64)
    slots, stop = good.copy(), threading.Event()

    def scribble() -> None:
        while not stop.is_set():
            slots[-2000:] = 10**12
            slots[-2000:] = good[-2000:]

    thread = threading.Thread(target=scribble)
    thread.start()
    outcomes = []
    try:
        for _ in range(3000):
            try:
                sources, _ = ledger.peek(slots, key)
                outcomes.append("read" if len(sources) == n else "short")
            except InvalidInputError:
                outcomes.append("refused")
    finally:
        stop.set()
        thread.join()
    assert set(outcomes) <= {"read", "refused"}


def test_enqueue_many_stops_at_the_first_refusal_keeping_the_ones_before_it() -> None:
    tasks = WriteTasks()
    first, second = tasks.create_many(2)
    with pytest.raises(InvalidInputError, match=r"unknown task#99"):
        tasks.enqueue_many([first, 99, second])
    assert (tasks.state(first), tasks.state(second)) == ("QUEUED", "PENDING")
    assert tasks.pop() == first and tasks.pop() is None


def test_versions_that_are_not_one_contiguous_array_are_a_typed_error(ledger: Ledger) -> None:
    plan = ledger.plan_read(np.arange(4), 0)
    strided = np.repeat(ledger.captured_versions(plan.read_id), 2)[::2]
    assert not strided.flags.c_contiguous
    with pytest.raises(InvalidInputError, match="versions: "):
        ledger.unvouched(plan.read_id, strided)
    assert ledger.unvouched(plan.read_id, strided.copy()).tolist() == []
    ledger.release(plan.read_id)


@pytest.mark.parametrize(
    ("versions", "described"),
    [
        ([0, 0, 0, 0], "a list"),
        (np.zeros(4, np.int64), "a 1-D array of dtype int64"),
        (np.zeros((2, 2), np.uint64), "a 2-D array of dtype uint64"),
        (7, "an int"),
    ],
)
def test_versions_of_another_kind_are_a_typed_error_naming_what_came(ledger: Ledger, versions, described: str) -> None:
    plan = ledger.plan_read(np.arange(4), 0)
    with pytest.raises(InvalidInputError, match=f"versions must be a 1-D uint64 array .*got {described}$"):
        ledger.unvouched(plan.read_id, versions)
    assert ledger.unvouched(plan.read_id, ledger.captured_versions(plan.read_id)).tolist() == [], (
        "the read is still there"
    )
    ledger.release(plan.read_id)


def test_strided_int64_index_arrays_are_read_like_contiguous_ones(ledger: Ledger) -> None:
    strided = np.arange(0, 16, dtype=np.int64)[::2]  # slots 0, 2, ..., 14
    assert not strided.flags.c_contiguous
    sources, _ = ledger.peek(strided, 0)
    assert sources.tolist() == [SOURCE_POOL, SOURCE_POOL] + [SOURCE_ABSENT] * 6
    assert ledger.readers(strided, 0).tolist() == [0] * 8
    assert block_table(strided[:3], 8).tolist() == [0, 2, 4]
    assert block_slots(np.array([3, 0, 1, 0], dtype=np.int64)[::2], 0, 4, 2).tolist() == [6, 7, 2, 3]
    pool = np.zeros((16, 2), np.uint8)
    scatter_rows(pool, np.ones((8, 2), np.uint8), strided)
    assert pool[::2].all() and not pool[1::2].any()
