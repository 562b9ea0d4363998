"""Rows that say where they came from, for whole-system cache tests.

A *stamp* row is ``[key index, slot, writer, step]``: which key it belongs to, the slot it was
written for, the request (writer id) that computed it and the engine step that computed it.
Tests write stamp rows (as a per-token mm key, or as the hidden states themselves) so that a
misplaced, stale or foreign row names its origin in the failure message instead of showing up
as an anonymous wrong number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

STAMP_WIDTH = 4


class Stamp(NamedTuple):
    key: int
    slot: int
    writer: int
    step: int


def stamps(rows: Sequence[Stamp], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A ``(len(rows), STAMP_WIDTH)`` tensor of stamp rows (exact in int64 and float64)."""
    if not rows:
        return torch.empty((0, STAMP_WIDTH), dtype=dtype)
    return torch.tensor([list(r) for r in rows], dtype=dtype)


def decode(row: torch.Tensor) -> Stamp | None:
    """The stamp of one row, or ``None`` when the row is not a stamp (wrong width, fractions)."""
    values = row.reshape(-1).tolist()
    if len(values) != STAMP_WIDTH or any(float(v) != int(v) for v in values):
        return None
    return Stamp(*(int(v) for v in values))


def describe(row: torch.Tensor | None, block_size: int) -> str:
    """A readable origin of one stamp row: ``key 1, slot 13 (block 3 +1), writer 42, step 100``."""
    if row is None:
        return "<no row>"
    stamp = decode(row)
    if stamp is None:
        return f"<not a stamp: {row.tolist()}>"
    block, offset = divmod(stamp.slot, block_size)
    return f"key {stamp.key}, slot {stamp.slot} (block {block} +{offset}), writer {stamp.writer}, step {stamp.step}"


def row_diff(
    label: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    explain: Callable[[int], str] | None = None,
    limit: int = 6,
) -> str | None:
    """``None`` when ``got`` equals ``expected`` exactly (shape, dtype, values); otherwise a
    message naming the first ``limit`` wrong rows, each followed by ``explain(position)``
    (e.g. the decoded stamps of who wrote the row that came back and who should have)."""
    problems = []
    if got.dtype != expected.dtype:
        problems.append(f"dtype {got.dtype}, expected {expected.dtype}")
    if tuple(got.shape) != tuple(expected.shape):
        problems.append(f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    common = min(got.shape[0], expected.shape[0]) if got.dim() and expected.dim() else 0
    if got.dtype == expected.dtype and got.shape[1:] == expected.shape[1:]:
        equal = (got[:common] == expected[:common]).reshape(common, -1) if common else None
        bad = (~equal.all(dim=1)).nonzero().reshape(-1).tolist() if equal is not None else []
    else:
        bad = list(range(common))
    if not problems and not bad:
        return None
    lines = [f"{label}: " + ("; ".join(problems) if problems else f"{len(bad)} wrong rows")]
    for position in bad[:limit]:
        line = f"  row {position}: got {got[position].tolist()}, expected {expected[position].tolist()}"
        if explain is not None:
            line += f"\n      {explain(position)}"
        lines.append(line)
    if len(bad) > limit:
        lines.append(f"  ... {len(bad) - limit} more wrong rows (first ones: {bad[:20]})")
    return "\n".join(lines)
