"""The host pool: one tensor per cached key with a row for every engine KV slot.

Storage for a key is allocated on its first sight (``num_slots`` rows of the key's row
shape, pinned when CUDA is available) and its size is logged once. Rows are addressed by the
engine's slot ids. Single writer: whichever thread holds the committer's write lock writes
(`write`); any thread reads (`read`) rows whose version the ledger vouches for.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from omni_pcache._native import scatter_plan
from omni_pcache.copy_engine import empty_host
from omni_pcache.keys import KeySpec

logger = logging.getLogger("omni_pcache")

RUN_COPY_MIN_ROW_BYTES = 1024
"""Rows at least this wide are written run by run (see `HostPool.write`)."""
MIN_RUN_ROWS = 4
"""...when the slots average at least this many per run."""


class HostPool:
    """Per-key row storage, ``num_slots`` rows each."""

    def __init__(self, num_slots: int) -> None:
        self._num_slots = num_slots
        self._rows: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def ensure(self, spec: KeySpec) -> None:
        """Allocates the key's storage if this is its first sight (engine thread)."""
        if spec.name in self._rows:
            return
        storage = empty_host((self._num_slots, *spec.row_shape), spec.dtype)
        with self._lock:
            self._rows.setdefault(spec.name, storage)
        logger.info(
            "host pool for %s: %d slots, %.1f MiB%s",
            spec.describe(),
            self._num_slots,
            storage.numel() * storage.element_size() / 2**20,
            " (pinned)" if storage.is_pinned() else "",
        )

    def write(self, key: str, slots: np.ndarray, rows: torch.Tensor) -> None:
        """Scatters ``rows`` to ``slots`` (distinct int64 ids; the writer: the committer's write
        lock held). Wide rows move one copy per run of consecutive slots (the engine's blocks):
        torch's CPU ``index_copy_`` walks elements, several times slower than a copy for rows
        of a KiB or more; narrow rows, or slots in runs of under 4, keep ``index_copy_``."""
        pool = self._rows[key]
        if rows.shape[0] and rows.numel() // rows.shape[0] * rows.element_size() >= RUN_COPY_MIN_ROW_BYTES:
            plan = scatter_plan(slots)  # None: a slot named twice (not from a claim), element-wise below
            if plan is not None and plan[0].size * MIN_RUN_ROWS <= slots.size:
                lengths, bounds, order = plan
                sources = torch.split_with_sizes(rows, lengths.tolist())
                targets = torch.tensor_split(pool, bounds.tolist())[1::2]  # every run's rows
                for target, run in zip(targets, order.tolist(), strict=True):
                    target.copy_(sources[run])
                return
        pool.index_copy_(0, torch.from_numpy(slots), rows)

    def read(self, key: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows at ``slots`` (any thread), into ``out`` if given (a contiguous tensor of the
        right shape), else a new tensor."""
        if out is None:
            return self._rows[key].index_select(0, slots)
        return torch.index_select(self._rows[key], 0, slots, out=out)

    def nbytes(self) -> dict[str, int]:
        """Bytes allocated per key."""
        with self._lock:
            return {k: t.numel() * t.element_size() for k, t in self._rows.items()}
