"""The host pool: one tensor per cached key with a row for every engine KV slot.

Storage for a key is allocated on its first sight (``num_slots`` rows of the key's row
shape; pageable unless ``pinned``, see `CacheConfig.pin_pool`) and its size is logged once. Rows are addressed by the
engine's slot ids. Single writer: whichever thread holds the committer's write lock writes
(`write`); any thread reads (`read`) rows whose version the ledger vouches for.
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import torch

from omni_pcache._native import scatter_rows
from omni_pcache.copy_engine import empty_host, held_bytes, pinned_available
from omni_pcache.keys import KeySpec

logger = logging.getLogger("omni_pcache")


def row_bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor of ``n`` rows as an ``(n, row_bytes)`` uint8 numpy array sharing
    its memory (how `scatter_rows` sees rows of any dtype, bf16 included). No rows, or rows of
    no elements, give an empty array of that shape (``reshape(n, -1)`` cannot size either)."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).view(torch.uint8).numpy()


class HostPool:
    """Per-key row storage, ``num_slots`` rows each."""

    def __init__(self, num_slots: int, pinned: bool = False) -> None:
        self._num_slots = num_slots
        self._pinned = pinned
        self._rows: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, np.ndarray] = {}  # each key's storage as (num_slots, row_bytes) uint8 (writer only)
        self._lock = threading.Lock()

    def ensure(self, spec: KeySpec) -> None:
        """Allocates the key's storage if this is its first sight (engine thread). Storage of
        another row shape or dtype under the name (left by a save refused after allocating it,
        whose key was then forgotten) is replaced."""
        existing = self._rows.get(spec.name)
        if existing is not None and existing.shape[1:] == spec.row_shape and existing.dtype == spec.dtype:
            return
        shape = (self._num_slots, *spec.row_shape)
        storage = empty_host(shape, spec.dtype) if self._pinned else torch.empty(shape, dtype=spec.dtype)
        with self._lock:
            self._rows[spec.name] = storage
            self._bytes.pop(spec.name, None)
        logger.info("host pool for %s: %d slots, %s", spec.describe(), self._num_slots, held_bytes(storage))

    def drop(self, key: str) -> None:
        """Frees the storage of a key that was forgotten before any row was written to it
        (engine thread: a save refused after allocating it)."""
        with self._lock:
            self._rows.pop(key, None)
            self._bytes.pop(key, None)

    def write(self, key: str, slots: np.ndarray, rows: torch.Tensor) -> None:
        """Scatters ``rows`` to ``slots`` (int64 ids; the writer: the committer's write lock
        held). Natively, one memory copy per run of consecutive slots (the engine's blocks) and
        without the GIL: torch's CPU ``index_copy_`` walks elements, several times slower for
        rows of a KiB or more, and holds the GIL the engine thread needs. (A step's staging rows
        go through `_native.write_step_rows` instead, over `byte_rows`.) Rows of another dtype or
        row shape than the pool's, or lazily conjugated/negated views (never from the cache), go
        through ``index_copy_``, which checks or resolves them."""
        pool = self._rows[key]
        if rows.shape[0] == 0 or pool.numel() == 0:  # (no rows, or rows of zero elements)
            return
        if (
            rows.dtype != pool.dtype
            or rows.shape[1:] != pool.shape[1:]
            or not rows.is_cpu
            or rows.is_conj()
            or rows.is_neg()
        ):
            pool.index_copy_(0, torch.from_numpy(slots), rows)  # checks shapes; resolves conj/neg views
            return
        scatter_rows(self.byte_rows(key), row_bytes_view(rows.contiguous()), slots)

    def byte_rows(self, key: str) -> np.ndarray:
        """The key's storage as ``(num_slots, row_bytes)`` uint8 (made once; the writer scatters into it)."""
        view = self._bytes.get(key)
        if view is None:
            view = self._bytes[key] = row_bytes_view(self._rows[key])
        return view

    def rows_of(self, key: str) -> torch.Tensor | None:
        """The key's storage (any thread; ``None`` before its first sight): a prefetch gathers
        from it outside the writer's lock, vouching for rows with the ledger before and after."""
        return self._rows.get(key)

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

    def bytes_for(self, spec: KeySpec) -> int:
        """Bytes the key's storage takes (as `nbytes` will list them)."""
        return self._num_slots * spec.row_bytes

    @property
    def pinned(self) -> bool:
        """Whether the storage is page-locked (``pin_pool``, where CUDA is available)."""
        return self._pinned and pinned_available()
