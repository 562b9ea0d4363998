"""The host pool's scatter: rows copied natively, run by run, land exactly where index_copy_
would put them, whatever the dtype or row width; a refused scatter writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_pcache import CacheClosedError, InvalidInputError, TaskStateError
from omni_pcache._native import (
    SOURCE_ABSENT,
    SOURCE_POOL,
    Ledger,
    StagingSlots,
    WriteTasks,
    block_slots,
    block_table,
    check_batch,
    claim_step,
    close_step_writes,
    scatter_rows,
    write_step_now,
    write_step_rows,
)
from omni_pcache.copy_engine import held_bytes
from omni_pcache.keys import KeySpec
from omni_pcache.pool import HostPool, row_bytes_view


def blocks_in_request_order(rng: np.random.Generator, num_slots: int, block: int, rows: int) -> np.ndarray:
    """Distinct slots as an engine hands them out: whole blocks in a shuffled order, the last
    one partial, and a few single slots (rows stolen by a newer tenant leave gaps)."""
    blocks = rng.permutation(num_slots // block)[: -(-rows // block)]
    slots = (blocks[:, None] * block + np.arange(block)).reshape(-1)[:rows]
    keep = rng.random(slots.size) > 0.05
    return np.ascontiguousarray(slots[keep], dtype=np.int64)


@pytest.mark.parametrize(
    ("row_shape", "dtype"),
    [((2048,), torch.bfloat16), ((8, 64), torch.float32), ((16,), torch.float32), ((3,), torch.int64)],
    ids=["bf16x2048", "fp32x8x64", "fp32x16", "int64x3"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["tensor", "byte_view"])  # (the committer's native path: bytes)
def test_pool_writes_equal_an_indexed_scatter(
    row_shape: tuple[int, ...], dtype: torch.dtype, seed: int, as_bytes: bool
) -> None:
    rng = np.random.default_rng(seed)
    num_slots = 4096
    pool = HostPool(num_slots)
    spec = KeySpec("k", row_shape, dtype, 0)
    pool.ensure(spec)
    want = torch.zeros((num_slots, *row_shape), dtype=dtype)
    written: set[int] = set()
    for _ in range(3):  # later writes overwrite earlier ones
        slots = blocks_in_request_order(rng, num_slots, 16, int(rng.integers(1, 600)))
        rows = torch.randint(-1000, 1000, (slots.size, *row_shape)).to(dtype)
        if as_bytes:  # rows as uint8 bytes, straight into the pool's byte rows (as write_step_rows does)
            scatter_rows(pool.byte_rows("k"), row_bytes_view(rows), slots)
        else:
            pool.write("k", slots, rows)
        want.index_copy_(0, torch.from_numpy(slots), rows)
        written.update(slots.tolist())
    at = torch.tensor(sorted(written))  # (rows never written are never read: the pool is not zeroed)
    assert torch.equal(pool.read("k", at), want[at])


@pytest.mark.parametrize(
    ("shape", "want"), [((0, 64), (0, 256)), ((0, 4, 8), (0, 128)), ((3, 0), (3, 0)), ((5, 2, 3), (5, 24))]
)
def test_the_byte_view_of_no_rows_or_empty_rows_is_an_empty_array_of_that_shape(shape, want) -> None:
    rows = torch.zeros(shape, dtype=torch.float32)
    assert row_bytes_view(rows).shape == want
    if shape[0] == 0:  # (rows of no bytes never reach the scatter: the writer skips their key)
        pool = np.ones((8, want[1]), np.uint8)
        scatter_rows(pool, row_bytes_view(rows), np.arange(0))
        assert pool.all(), "no rows, nothing written"


def test_rows_that_are_views_or_of_another_dtype_are_written_like_index_copy() -> None:
    pool = HostPool(64)
    pool.ensure(KeySpec("k", (4, 8), torch.float32, 0))
    slots = np.array([9, 3, 4, 5], dtype=np.int64)
    base = torch.arange(8 * 4 * 8, dtype=torch.float32).reshape(8, 4, 8)
    row_strided = base[::2]  # each row contiguous, every other row
    within_rows = base[:4].transpose(1, 2).contiguous().transpose(1, 2)  # rows not contiguous themselves
    for rows in (row_strided, within_rows):
        pool.write("k", slots, rows)
        assert torch.equal(pool.read("k", torch.from_numpy(slots)), rows)
    rows = base[:4]
    with pytest.raises(RuntimeError, match="dtype"):  # index_copy_ checks what the native path would not
        pool.write("k", slots, rows.double())
    pool.write("k", np.zeros(0, dtype=np.int64), base[:0])  # no rows: nothing to write, nothing refused
    assert torch.equal(pool.read("k", torch.from_numpy(slots)), within_rows)


def test_rows_of_another_row_shape_or_lazily_conjugated_go_through_index_copy() -> None:
    pool = HostPool(16)
    pool.ensure(KeySpec("k", (2, 3), torch.complex64, 0))
    slots = np.array([1, 2], dtype=np.int64)
    with pytest.raises((RuntimeError, IndexError)):  # same bytes per row, other shape: refused
        pool.write("k", slots, torch.zeros(2, 3, 2, dtype=torch.complex64))
    rows = torch.complex(torch.arange(12.0), torch.ones(12)).reshape(2, 2, 3)
    pool.write("k", slots, rows.conj())  # a lazy conjugate view: written resolved
    assert torch.equal(pool.read("k", torch.from_numpy(slots)), rows.conj().resolve_conj())
    real = HostPool(16)
    real.ensure(KeySpec("r", (2, 3), torch.float32, 1))
    # A contiguous, lazily negated view (its memory holds +1, it reads -1): what `.imag` of a
    # conjugate view is, made contiguous by torch's own helper (a strided one is copied resolved).
    negated = torch._neg_view(torch.ones(2, 2, 3))
    assert negated.is_neg() and negated.is_contiguous()
    real.write("r", slots, negated)
    assert torch.equal(real.read("r", torch.from_numpy(slots)), torch.full((2, 2, 3), -1.0))


def test_storage_of_another_row_shape_or_dtype_under_a_name_is_replaced() -> None:
    # (what a save refused after allocating a key leaves behind, once the key is forgotten)
    pool = HostPool(8)
    pool.ensure(KeySpec("k", (2,), torch.float32, 0))
    pool.write("k", np.array([1, 2]), torch.ones(2, 2))
    pool.byte_rows("k")  # (the writer's byte view of the storage, made once)
    for row_shape, dtype in [((3,), torch.float32), ((3,), torch.int64)]:
        pool.ensure(KeySpec("k", row_shape, dtype, 0))
        rows = torch.arange(6).reshape(2, 3).to(dtype)
        pool.write("k", np.array([4, 5]), rows)  # (the native path, through a fresh byte view)
        assert torch.equal(pool.read("k", torch.tensor([4, 5])), rows)
        assert pool.nbytes() == {"k": 8 * 3 * dtype.itemsize}


def test_a_refused_scatter_raises_a_typed_error_and_writes_nothing() -> None:
    pool = np.zeros((8, 4), dtype=np.uint8)
    rows = np.ones((3, 4), dtype=np.uint8)
    with pytest.raises(InvalidInputError, match="slot id 8 at position 2 is out of range"):
        scatter_rows(pool, rows, np.array([0, 1, 8], dtype=np.int64))
    with pytest.raises(InvalidInputError, match="3 slots but 8 bytes"):
        scatter_rows(pool, rows[:2], np.array([0, 1, 2], dtype=np.int64))
    with pytest.raises(InvalidInputError, match="rows of 2 bytes"):
        scatter_rows(pool, np.ones((3, 2), dtype=np.uint8), np.array([0, 1, 2], dtype=np.int64))
    with pytest.raises(InvalidInputError, match="contiguous"):
        scatter_rows(pool, np.ones((3, 8), dtype=np.uint8)[:, ::2], np.array([0, 1, 2], dtype=np.int64))
    with pytest.raises(InvalidInputError, match="contiguous"):  # column-major: contiguous, but not rows
        scatter_rows(pool, np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)), np.arange(3))
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        scatter_rows(np.asfortranarray(pool), rows, np.arange(3))
    with pytest.raises(InvalidInputError, match="pool"):  # the same array as pool and rows
        scatter_rows(pool, pool, np.arange(8))
    read_only = pool.copy()
    read_only.flags.writeable = False
    with pytest.raises(InvalidInputError, match="pool"):
        scatter_rows(read_only, rows, np.arange(3))
    assert not pool.any()
    scatter_rows(pool, rows, np.array([5, 6, 7], dtype=np.int64))
    assert pool[5:].all() and not pool[:5].any()


def test_a_slot_named_twice_is_written_like_index_copy() -> None:
    pool = HostPool(64)
    pool.ensure(KeySpec("k", (512,), torch.float32, 0))
    slots = np.array([4, 5, 6, 7, 5], dtype=np.int64)
    rows = torch.arange(5.0)[:, None].expand(5, 512).contiguous()
    pool.write("k", slots, rows)
    want = torch.zeros(64, 512).index_copy_(0, torch.from_numpy(slots), rows)
    assert torch.equal(pool.read("k", torch.arange(4, 8)), want[4:8])


def test_a_step_run_writes_only_the_rows_its_tasks_still_own() -> None:
    """`write_step_rows`: two tasks of one step, a newer tenant took one of the first task's
    slots in transit: the pool gets every other row from the page (the gather path), the
    stolen slot keeps the newer tenant's value, and both tasks end WRITTEN."""
    tasks, ledger = WriteTasks(), Ledger(16)
    key = ledger.add_key()
    page = np.arange(8 * 4, dtype=np.uint8).reshape(8, 4)  # eight staged rows of 4 bytes
    pool = np.full((16, 4), 255, dtype=np.uint8)
    first, second, newer = tasks.create_many(3)
    ledger.claim_many(np.array([3, 4, 5, 9, 10], dtype=np.int64), [3, 2], key, [first, second])
    ledger.claim(np.array([4], dtype=np.int64), key, newer)  # slot 4 moves on to a newer tenant
    for t in (first, second):
        tasks.enqueue(t, True)
    assert sorted(tasks.pop_many(8)) == [first, second]
    # the step's rows start at page row 2 (task `first`) and 5 (task `second`)
    assert write_step_rows(tasks, ledger, [first, second], [2, 5], [(key, page, pool)]) == [4]
    assert [tasks.state(t) for t in (first, second)] == ["WRITTEN", "WRITTEN"]
    np.testing.assert_array_equal(pool[[3, 5, 9, 10]], page[[2, 4, 5, 6]])
    np.testing.assert_array_equal(pool[4], np.full(4, 255, dtype=np.uint8))


def test_a_key_with_nothing_to_copy_in_a_step_run_leaves_its_pool_alone() -> None:
    """A key whose rows all moved on to a newer tenant, or whose rows are zero bytes wide, is
    not copied at all: its pool is neither written nor checked (read-only or column-major is
    fine), the run counts no row written, and the task ends WRITTEN."""
    page = np.arange(16, dtype=np.uint8).reshape(4, 4)
    for pool in (np.zeros((16, 4), np.uint8), np.zeros((16, 4), np.uint8, order="F")):
        tasks, ledger, _, _, keys, ids = copying_step([0, 1])
        ledger.claim(np.array([0, 1], dtype=np.int64), keys[0], tasks.create())  # both rows move on
        if pool.flags.c_contiguous:
            pool.flags.writeable = False
        assert write_step_rows(tasks, ledger, ids, [0], [(keys[0], page, pool)]) == [0]
        assert tasks.state(ids[0]) == "WRITTEN" and not pool.any()
    tasks, ledger, _, _, keys, ids = copying_step([0, 1])
    empty = (keys[0], np.zeros((4, 0), np.uint8), np.zeros((16, 0), np.uint8))
    assert write_step_rows(tasks, ledger, ids, [0], [empty]) == [0]
    assert tasks.state(ids[0]) == "WRITTEN"


def test_a_step_run_that_does_not_fit_its_page_is_refused_before_anything_changes() -> None:
    tasks, ledger = WriteTasks(), Ledger(16)
    key = ledger.add_key()
    (task,) = tasks.create_many(1)
    ledger.claim_many(np.array([0, 1], dtype=np.int64), [2], key, [task])
    tasks.enqueue(task, True)
    tasks.pop_many(1)
    pool = np.zeros((16, 4), dtype=np.uint8)
    page = np.arange(1, 17, dtype=np.uint8).reshape(4, 4)  # four distinct rows, none zero
    read_only = np.zeros((16, 4), dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(InvalidInputError, match="key#0: pool: The given array is not writeable"):
        write_step_rows(tasks, ledger, [task], [0], [(key, page, read_only)])
    with pytest.raises(InvalidInputError, match="key#0: pool: The given array is already borrowed"):
        write_step_rows(tasks, ledger, [task], [0], [(key, pool, pool)])  # the same array twice
    with pytest.raises(InvalidInputError, match="page rows of 8 bytes into a pool of 4-byte rows"):
        write_step_rows(tasks, ledger, [task], [0], [(key, np.zeros((4, 8), dtype=np.uint8), pool)])
    with pytest.raises(InvalidInputError, match=r"key#0: row position 4 at 1 is out of range \[0, 4\)"):
        write_step_rows(tasks, ledger, [task], [3], [(key, page, pool)])
    with pytest.raises(InvalidInputError, match=r"key#0: slot id 1 at position 1 is out of range \[0, 1\)"):
        write_step_rows(tasks, ledger, [task], [0], [(key, page, np.zeros((1, 4), dtype=np.uint8))])
    assert tasks.state(task) == "COPYING" and not pool.any(), "refused: nothing changed"
    assert write_step_rows(tasks, ledger, [task], [2], [(key, page, pool)]) == [2]
    assert tasks.state(task) == "WRITTEN" and not pool[2:].any()
    np.testing.assert_array_equal(pool[:2], page[2:4])  # the task's rows start at page row 2


def test_a_step_claim_creates_tasks_claims_every_key_and_holds_the_page() -> None:
    """`claim_step`: one task per request, its slots claimed on each key, each task a holder of
    the step's page; a key's outcome is None unless the claim stole a slot in transit."""
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    keys = [ledger.add_key(), ledger.add_key()]
    page = staging.claim(("step", 0))
    (older,) = tasks.create_many(1)
    ledger.claim(np.array([6], dtype=np.int64), keys[1], older)  # in transit on key 1 only
    ids, outcomes = claim_step(tasks, ledger, staging, page, np.array([4, 5, 6], dtype=np.int64), [2, 1], keys)
    assert ids == [older + 1, older + 2]
    assert outcomes[0] is None
    assert outcomes[1].stolen_slots.tolist() == [6] and outcomes[1].stolen_from.tolist() == [older]
    assert ledger.owned(ids[0], keys[0])[1].tolist() == [4, 5] and ledger.owned(ids[1], keys[1])[1].tolist() == [6]
    assert sorted(staging.holders()[page]) == [("step", 0), ("task", ids[0]), ("task", ids[1])]
    assert [tasks.state(t) for t in ids] == ["PENDING", "PENDING"]
    live, holders = len(tasks), staging.holders()
    with pytest.raises(InvalidInputError, match="2 counts for 2 tasks, summing to 2 for 3 slots"):
        claim_step(tasks, ledger, staging, page, np.array([1, 2, 3], dtype=np.int64), [1, 1], keys)
    before = ledger.peek(np.array([4, 5, 6], dtype=np.int64), keys[0])
    with pytest.raises(InvalidInputError, match=r"unknown key#7 \(registered keys: 2\)"):
        claim_step(tasks, ledger, staging, page, np.array([4, 5, 6], dtype=np.int64), [2, 1], [keys[0], 7])
    after = ledger.peek(np.array([4, 5, 6], dtype=np.int64), keys[0])
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True)), "key 0's slots did not move"
    staging.close()  # (as when the cache fails or closes between its save's page and its claims)
    with pytest.raises(CacheClosedError):
        claim_step(tasks, ledger, staging, page, np.array([7, 8], dtype=np.int64), [1, 1], keys)
    assert ledger.peek(np.array([7, 8], dtype=np.int64), keys[0])[0].tolist() == [SOURCE_ABSENT] * 2
    assert len(tasks) == live and staging.holders() == holders, "a refused claim leaves nothing behind"


def test_closing_a_written_step_run_commits_it_releases_its_page_and_publishes_it() -> None:
    """`close_step_writes`, the usual end of a write: rows committed in the ledger, the tasks'
    staging holds dropped, the tasks on the completion queue."""
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    key = ledger.add_key()
    page = staging.claim(("step", 0))
    ids, _ = claim_step(tasks, ledger, staging, page, np.array([3, 4, 9], dtype=np.int64), [2, 1], [key])
    tasks.enqueue_many(ids)
    tasks.pop_many(8)
    rows = np.arange(8 * 4, dtype=np.uint8).reshape(8, 4)
    write_step_rows(tasks, ledger, ids, [0, 2], [(key, rows, np.zeros((16, 4), dtype=np.uint8))])
    assert close_step_writes(tasks, ledger, staging, page, ids) == 3
    assert ledger.peek(np.array([3, 4, 9], dtype=np.int64), key)[0].tolist() == [SOURCE_POOL] * 3
    assert staging.holders()[page] == [("step", 0)]
    assert tasks.reap_completions() == ids and len(tasks) == 0
    with pytest.raises(InvalidInputError, match=r"unknown task"):
        close_step_writes(tasks, ledger, staging, page, ids)  # once only


def test_a_small_step_written_by_its_saver_is_committed_released_and_forgotten_in_one_call() -> None:
    """`write_step_now`: a step's tasks as `claim_step` leaves them (PENDING, holding the page)
    written whole with no queue entry: rows in the pool, committed, holds dropped, the tasks
    gone from the table and never published; a refusal before the copy changes nothing."""
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    key = ledger.add_key()
    page = staging.claim(("step", 0))
    slots = np.array([3, 4, 9, 10, 11], dtype=np.int64)
    ids, _ = claim_step(tasks, ledger, staging, page, slots, [2, 3], [key])
    rows = np.arange(1, 6 * 4 + 1, dtype=np.uint8).reshape(6, 4)  # six distinct rows, none zero
    pool = np.zeros((16, 4), dtype=np.uint8)
    with pytest.raises(InvalidInputError, match=r"write_step_now: key#0: row position 6 at 4 is out of range \[0, 6\)"):
        write_step_now(tasks, ledger, staging, page, ids, [1, 4], [(key, rows, pool)])
    assert [tasks.state(t) for t in ids] == ["PENDING", "PENDING"] and not pool.any(), "refused: nothing changed"
    assert write_step_now(tasks, ledger, staging, page, ids, [1, 3], [(key, rows, pool)]) == [5]
    np.testing.assert_array_equal(pool[slots], rows[1:6])  # task 0's rows from page row 1, task 1's from 3
    assert not np.delete(pool, slots, axis=0).any()
    assert ledger.peek(slots, key)[0].tolist() == [SOURCE_POOL] * 5
    assert staging.holders()[page] == [("step", 0)]
    assert len(tasks) == 0 and tasks.reap_completions() == [] and tasks.num_queue_entries == 0
    (queued,) = claim_step(tasks, ledger, staging, page, np.array([5], dtype=np.int64), [1], [key])[0]
    tasks.enqueue(queued, True)  # the committer's now: not the saver's to take
    with pytest.raises(TaskStateError, match="illegal transition QUEUED -> QUEUED"):
        write_step_now(tasks, ledger, staging, page, [queued], [0], [(key, rows, pool)])
    assert tasks.state(queued) == "QUEUED" and not pool[5].any()


def test_a_step_written_by_its_saver_may_read_its_rows_from_arrays_of_any_numeric_dtype() -> None:
    """`write_step_now` reads each key's rows from a C-contiguous array of the rows' own dtype
    (what `row_arrays.numpy_rows` gives: 16-bit floats as int16), one row per index of dim 0, and
    refuses an array it cannot read as rows, before anything changes."""
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    wide, narrow = ledger.add_key(), ledger.add_key()
    page = staging.claim(("step", 0))
    slots = np.array([3, 4, 9], dtype=np.int64)
    ids, _ = claim_step(tasks, ledger, staging, page, slots, [3], [wide, narrow])
    hidden = np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 0.5  # rows of 8 bytes
    codes = np.array([[-1, 7], [300, -300], [5, 6]], dtype=np.int16)  # rows of 4 bytes (a bf16 pair's bits)
    pools = np.zeros((16, 8), dtype=np.uint8), np.zeros((16, 4), dtype=np.uint8)
    for bad, why in (
        (np.zeros((3, 4), dtype=np.float16), "page: rows must be a numpy array of .* got a 2-D array of dtype float16"),
        (np.zeros((3, 4, 2), dtype=np.int16)[:, :, 0], "page: rows must be a C-contiguous array"),
        (np.zeros((3, 1), dtype=np.float64), "page rows of 8 bytes into a pool of 4-byte rows"),
        ([1, 2], "page: rows must be a numpy array of .* got a list"),
        (np.empty((2**61, 0), dtype=np.uint8), "page rows of 0 bytes into a pool of 4-byte rows"),  # (no overflow)
        (np.empty((0, 7), dtype=np.uint8), "page rows of 7 bytes into a pool of 4-byte rows"),
    ):
        with pytest.raises(InvalidInputError, match=f"write_step_now: key#1: {why}"):
            write_step_now(tasks, ledger, staging, page, ids, [0], [(wide, hidden, pools[0]), (narrow, bad, pools[1])])
        assert tasks.state(ids[0]) == "PENDING" and not pools[0].any(), "refused: nothing changed"
    written = write_step_now(
        tasks, ledger, staging, page, ids, [0], [(wide, hidden, pools[0]), (narrow, codes, pools[1])]
    )
    assert written == [3, 3]
    np.testing.assert_array_equal(pools[0][slots].view(np.float32), hidden)
    np.testing.assert_array_equal(pools[1][slots].view(np.int16), codes)


class _HostTensor:
    """A tensor's size and pinning, as `held_bytes` reads them (pinned memory needs CUDA)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes, self.pinned = nbytes, pinned

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def is_pinned(self) -> bool:
        return self.pinned


def test_log_lines_give_the_page_locked_size_of_pinned_memory() -> None:
    assert held_bytes(_HostTensor(3 << 20, pinned=True)) == "3.0 MiB (pinned: 4.0 MiB page-locked)"
    assert held_bytes(_HostTensor(4 << 20, pinned=True)) == "4.0 MiB (pinned)"
    assert held_bytes(_HostTensor(3 << 20, pinned=False)) == "3.0 MiB"
    assert held_bytes(torch.zeros(1 << 18)) == "1.0 MiB"


def test_staging_pages_are_replaced_under_another_row_shape_or_dtype_and_freed_by_drop() -> None:
    from omni_pcache.pages import StagingPages

    pages = StagingPages(2, 4)
    pages.ensure(KeySpec("k", (2,), torch.float32, 0))
    pages.page_bytes("k", 1)  # (the writer's byte view of page 1, made once)
    for row_shape, dtype in [((3,), torch.float32), ((3,), torch.int64)]:
        pages.ensure(KeySpec("k", row_shape, dtype, 0))
        page = pages.page("k", 1)
        assert page.shape == (4, *row_shape) and page.dtype == dtype
        page.copy_(torch.arange(12).reshape(4, 3).to(dtype))
        view = pages.page_bytes("k", 1)  # (a view of the new storage, not the old one's)
        assert view.shape == (4, 3 * dtype.itemsize) and view.tobytes() == page.numpy().tobytes()
        assert pages.nbytes() == {"k": 2 * 4 * 3 * dtype.itemsize}
    pages.drop("k")
    assert pages.nbytes() == {}
    with pytest.raises(KeyError):
        pages.page("k", 0)
    with pytest.raises(KeyError):  # (no byte view of the dropped storage is kept either)
        pages.page_bytes("k", 1)


# ---- binding checks a mutation audit of crates/pcache-py found untested ---------------------------


def copying_step(slots: list[int], num_keys: int = 1):
    """A ledger with ``num_keys`` keys and one task claiming ``slots`` on key 0, popped (COPYING)."""
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    keys = [ledger.add_key() for _ in range(num_keys)]
    page = staging.claim(("step", 0))
    ids, _ = claim_step(tasks, ledger, staging, page, np.array(slots, dtype=np.int64), [len(slots)], keys[:1])
    tasks.enqueue_many(ids)
    tasks.pop_many(8)
    return tasks, ledger, staging, page, keys, ids


def test_check_batch_leaves_zero_count_requests_out_of_the_claims() -> None:
    _, _, rows, req_ids, starts, counts = check_batch(["a", "b", "c"], [2, 0, 1], np.arange(3), 8, 16)
    assert rows == {"a": (0, 2), "b": (2, 0), "c": (2, 1)}
    assert (req_ids, starts, counts) == (["a", "c"], [0, 2], [2, 1])


def test_a_claim_naming_the_next_unregistered_key_is_refused_before_any_key_moves() -> None:
    tasks, ledger, staging, page, keys, ids = copying_step([4, 5, 6], num_keys=2)
    slots = np.array([4, 5, 6], dtype=np.int64)
    write_step_rows(tasks, ledger, ids, [0], [(keys[0], np.ones((3, 4), np.uint8), np.zeros((16, 4), np.uint8))])
    close_step_writes(tasks, ledger, staging, page, ids)
    tasks.reap_completions()
    before = ledger.peek(slots, keys[0])
    live, holders = len(tasks), staging.holders()
    with pytest.raises(InvalidInputError, match=r"unknown key#2 \(registered keys: 2\)"):
        claim_step(tasks, ledger, staging, page, slots, [3], [keys[0], 2])  # (key ids 0 and 1 exist)
    after = ledger.peek(slots, keys[0])
    assert after[0].tolist() == [SOURCE_POOL] * 3
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
    assert len(tasks) == live and staging.holders() == holders


@pytest.mark.parametrize(
    "make_pool",
    [lambda: np.asfortranarray(np.zeros((16, 4), np.uint8)), lambda: np.zeros((32, 4), np.uint8)[::2]],
    ids=["fortran", "strided"],
)
def test_step_rows_into_a_pool_that_is_not_c_contiguous_are_refused_before_any_transition(make_pool) -> None:
    tasks, ledger, _, _, keys, ids = copying_step([3, 4, 9])
    pool = make_pool()
    with pytest.raises(InvalidInputError, match="the pool must be C-contiguous"):
        write_step_rows(tasks, ledger, ids, [0], [(keys[0], np.arange(12, dtype=np.uint8).reshape(3, 4), pool)])
    assert [tasks.state(t) for t in ids] == ["COPYING"] and not pool.any()


def test_a_page_without_dimensions_is_a_typed_error_not_a_panic() -> None:
    tasks, ledger, _, _, keys, ids = copying_step([3])
    with pytest.raises(InvalidInputError, match="at least one dimension"):
        write_step_rows(tasks, ledger, ids, [0], [(keys[0], np.array(7, np.uint8), np.zeros((16, 1), np.uint8))])
    assert tasks.state(ids[0]) == "COPYING"


def test_int_arguments_accept_their_largest_value() -> None:
    assert block_table([0, 5], 2**32 - 1).tolist() == [0, 5]
    assert block_slots(np.array([1], np.int64), 0, 2, 2**32 - 1).tolist() == [2**32 - 1, 2**32]


def test_a_key_with_nothing_to_copy_still_has_its_page_checked_before_anything_changes() -> None:
    # A page that could not be read as the pool's rows is refused even when the key's rows all
    # moved on (nothing to copy) or are zero bytes wide: refused before any transition.
    tasks, ledger, _, _, keys, ids = copying_step([0, 1])
    ledger.claim(np.array([0, 1], dtype=np.int64), keys[0], tasks.create())  # both rows move on
    pool = np.zeros((16, 4), np.uint8)
    for page, pool_of, why in (
        (np.zeros((4, 8), np.uint8), pool, "page rows of 8 bytes into a pool of 4-byte rows"),
        (np.array(7, np.uint8), pool, "page: rows must be a C-contiguous array of at least one dimension"),
        (np.zeros((4, 2), np.uint8), np.zeros((16, 0), np.uint8), "page rows of 2 bytes into a pool of 0-byte rows"),
    ):
        with pytest.raises(InvalidInputError, match=f"write_step_rows: key#0: {why}"):
            write_step_rows(tasks, ledger, ids, [0], [(keys[0], page, pool_of)])
        assert tasks.state(ids[0]) == "COPYING", "refused: nothing changed"
    assert write_step_rows(tasks, ledger, ids, [0], [(keys[0], np.zeros((4, 4), np.uint8), pool)]) == [0]
    assert tasks.state(ids[0]) == "WRITTEN" and not pool.any()


def test_rows_at_an_odd_byte_offset_for_their_dtype_are_refused_before_anything_changes() -> None:
    # `write_step_now` reads a key's rows in their own dtype: a float32 view at an odd byte
    # offset is not aligned for it, and is refused (a typed error, nothing changed).
    tasks, ledger, staging = WriteTasks(), Ledger(16), StagingSlots(2)
    key = ledger.add_key()
    page = staging.claim(("step", 0))
    slots = np.array([3, 4, 9], dtype=np.int64)
    ids, _ = claim_step(tasks, ledger, staging, page, slots, [3], [key])
    hidden = np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 0.5
    raw = bytearray(1 + hidden.nbytes)
    odd = np.frombuffer(raw, dtype=np.float32, offset=1, count=hidden.size).reshape(hidden.shape)
    odd[:] = hidden
    assert odd.flags.c_contiguous and not odd.flags.aligned
    pool = np.zeros((16, 8), dtype=np.uint8)
    why = "page: rows must be aligned for their element type"
    with pytest.raises(InvalidInputError, match=f"write_step_now: key#0: {why}"):
        write_step_now(tasks, ledger, staging, page, ids, [0], [(key, odd, pool)])
    assert tasks.state(ids[0]) == "PENDING" and not pool.any(), "refused: nothing changed"
    assert write_step_now(tasks, ledger, staging, page, ids, [0], [(key, hidden, pool)]) == [3]
    np.testing.assert_array_equal(pool[slots].view(np.float32), hidden)


def test_a_step_run_whose_close_is_refused_publishes_none_of_its_tasks() -> None:
    # `close_step_writes` publishes the run only once its rows are committed and its holds
    # dropped: a refusal there (a page the tasks do not hold) leaves nothing on the completion queue.
    tasks, ledger, staging, _, keys, ids = copying_step([3, 4])
    write_step_rows(tasks, ledger, ids, [0], [(keys[0], np.ones((2, 4), np.uint8), np.zeros((16, 4), np.uint8))])
    other = staging.claim(("step", 1))
    with pytest.raises(InvalidInputError, match=rf"task#{ids[0]} does not hold staging slot {other}"):
        close_step_writes(tasks, ledger, staging, other, ids)
    assert tasks.reap_completions() == [], "a refused close publishes nothing"
    assert tasks.state(ids[0]) == "WRITTEN"
