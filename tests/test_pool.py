"""The host pool's scatter: wide rows copied run by run land exactly where index_copy_ would
put them; the native scatter plan it follows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_pcache._native import scatter_plan
from omni_pcache.keys import KeySpec
from omni_pcache.pool import RUN_COPY_MIN_ROW_BYTES, HostPool


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
def test_pool_writes_equal_an_indexed_scatter(row_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
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
        pool.write("k", slots, rows)
        want.index_copy_(0, torch.from_numpy(slots), rows)
        written.update(slots.tolist())
    at = torch.tensor(sorted(written))  # (rows never written are never read: the pool is not zeroed)
    assert torch.equal(pool.read("k", at), want[at])


@pytest.mark.parametrize(
    ("row_shape", "dtype", "planned"),
    [((2048,), torch.bfloat16, True), ((16,), torch.float32, False)],
    ids=["wide-rows-run-by-run", "narrow-rows-index-copy"],
)
def test_only_rows_of_a_kib_or_more_are_written_run_by_run(
    monkeypatch, row_shape: tuple[int, ...], dtype: torch.dtype, planned: bool
) -> None:
    from omni_pcache import pool as pool_module

    plans = []
    monkeypatch.setattr(pool_module, "scatter_plan", lambda slots: plans.append(slots.size) or scatter_plan(slots))
    pool = HostPool(256)
    pool.ensure(KeySpec("k", row_shape, dtype, 0))
    slots = np.arange(32, 64, dtype=np.int64)  # two whole blocks of 16
    rows = torch.randint(-9, 9, (32, *row_shape)).to(dtype)
    pool.write("k", slots, rows)
    assert (plans == [32]) is planned
    assert (row_shape[0] * dtype.itemsize >= RUN_COPY_MIN_ROW_BYTES) is planned
    assert torch.equal(pool.read("k", torch.from_numpy(slots)), rows)


def test_scatter_plan_sorts_runs_by_slot_and_keeps_row_order_lengths() -> None:
    lengths, bounds, order = scatter_plan(np.array([8, 9, 10, 11, 0, 1, 2, 3, 20, 21], dtype=np.int64))
    assert lengths.tolist() == [4, 4, 2]
    assert bounds.tolist() == [0, 4, 8, 12, 20, 22]
    assert order.tolist() == [1, 0, 2]
    empty = scatter_plan(np.empty(0, dtype=np.int64))
    assert empty is not None and [a.size for a in empty] == [0, 0, 0]
    assert scatter_plan(np.array([4, 5, 6, 5], dtype=np.int64)) is None, "overlapping runs have no plan"
    # Slots at the end of the int64 range have no plan (their run's end would overflow).
    assert scatter_plan(np.array([2**63 - 1, 5], dtype=np.int64)) is None


def test_a_slot_named_twice_is_written_like_index_copy() -> None:
    pool = HostPool(64)
    pool.ensure(KeySpec("k", (512,), torch.float32, 0))
    slots = np.array([4, 5, 6, 7, 5], dtype=np.int64)
    rows = torch.arange(5.0)[:, None].expand(5, 512).contiguous()
    pool.write("k", slots, rows)
    want = torch.zeros(64, 512).index_copy_(0, torch.from_numpy(slots), rows)
    assert torch.equal(pool.read("k", torch.arange(4, 8)), want[4:8])
