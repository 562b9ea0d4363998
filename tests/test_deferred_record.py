"""A deferred record's rows across several steps' clones: gathered per chunk before its write,
from its host copy after, and its clones let go once written."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from omni_pcache.deferred import Clone, DeferredRecord, DeviceBudget
from omni_pcache.errors import CacheClosedError
from omni_pcache.keys import KeySpec

CODES = KeySpec("codes", (3,), torch.int64, 0)


def record_of_three_steps(budget: DeviceBudget) -> tuple[DeferredRecord, torch.Tensor, list[Clone]]:
    """A record holding rows of three steps (4, 1 and 5 rows, each a slice of its step's clone
    shared with another request), the record's rows in order, and the three clones."""
    record = DeferredRecord(7, "r", 1, (CODES,), copy_chunk_bytes=2 * CODES.row_bytes)  # 2-row pieces
    expected, clones = [], []
    for step, (start, count) in enumerate([(2, 4), (0, 1), (3, 5)]):
        step_rows = torch.arange(step * 100, step * 100 + 30).reshape(10, 3)
        clone = Clone.of(step_rows, holders=2, budget=budget)
        budget.charge(clone.nbytes)
        clone.owners.append(record.task_id)
        clones.append(clone)
        record.append({"codes": clone}, start, count, np.arange(count) + 10 * step)
        expected.append(step_rows[start : start + count])
    return record, torch.cat(expected), clones


def test_a_clone_of_permuted_rows_is_row_major() -> None:
    """Rows that are a transposed tensor (dense, column-major) are cloned row-major: a clone
    keeping their strides would make each row range's host copy a contiguous temporary on the
    device first, outside the device budget."""
    budget = DeviceBudget(1 << 20)
    rows = torch.arange(30).reshape(3, 10).t()  # 10 rows of 3, column-major
    clone = Clone.of(rows, holders=1, budget=budget)
    assert clone.tensor.is_contiguous() and clone.tensor.stride() == (3, 1)
    assert torch.equal(clone.rows(2, 7), rows[2:7]) and clone.rows(2, 7).is_contiguous()
    assert clone.nbytes == rows.numel() * rows.element_size()


def test_rows_before_the_write_are_gathered_from_each_chunk_in_the_order_asked() -> None:
    record, expected, _ = record_of_three_steps(DeviceBudget(1 << 20))
    positions = torch.tensor([9, 0, 4, 5, 3, 9, 6], dtype=torch.int64)  # across chunks, unordered, repeated
    assert torch.equal(record.rows(CODES, positions), expected[positions])
    assert record.rows(CODES, torch.tensor([], dtype=torch.int64)).shape == (0, 3)
    assert torch.equal(record.slot_rows(7, CODES, [21, 0, 10]), expected[[6, 0, 4]])


def test_the_host_copy_serves_reads_and_release_lets_the_clones_go() -> None:
    budget = DeviceBudget(1 << 20)
    record, expected, clones = record_of_three_steps(budget)
    record.prepare()
    assert torch.equal(record.host["codes"], expected)
    record.release()
    assert record.chunks == {}, "written to the host: the record no longer holds the device clones"
    assert [clone.holders for clone in clones] == [1, 1, 1], "the record let each clone go once"
    assert budget.used == 3 * 10 * CODES.row_bytes, "the clones' other holders still hold them"
    assert torch.equal(record.rows(CODES, torch.tensor([8, 1])), expected[[8, 1]])
    for clone in clones:  # (the other requests' records let go too)
        clone.release()
    assert budget.used == 0


def test_a_release_before_the_host_copy_keeps_the_clones_readable() -> None:
    budget = DeviceBudget(1 << 20)
    record, expected, clones = record_of_three_steps(budget)
    record.release()  # (a failure before the write)
    record.release()  # idempotent: each clone released once
    assert [clone.holders for clone in clones] == [1, 1, 1]
    assert budget.used == 3 * 10 * CODES.row_bytes
    assert torch.equal(record.rows(CODES, torch.tensor([2, 7])), expected[[2, 7]])


def test_a_budget_wait_times_out_at_its_deadline() -> None:
    budget = DeviceBudget(10)
    budget.charge(10)
    start = time.monotonic()
    assert budget.wait_for_room(1, start + 0.05) is False
    assert time.monotonic() - start < 0.5


def test_closing_the_budget_wakes_a_waiter_at_once() -> None:
    budget = DeviceBudget(10)
    budget.charge(10)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            budget.wait_for_room(1, time.monotonic() + 10)
        except CacheClosedError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)  # (waiting for room)
    assert waiter.is_alive()
    budget.close()
    waiter.join(2)
    assert not waiter.is_alive() and len(errors) == 1
