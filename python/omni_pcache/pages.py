"""Staging pages: a ring of ``staging_depth`` host pages per key, ``staging_capacity_tokens``
rows each, that a step's device→host copy lands in before the committer scatters it into the
pool. Which page is free is decided by the native `StagingSlots` registry (holders: the step
until its id is consumed, and each write task until it has written the pool).

Storage for a key is allocated on its first sight (pinned when CUDA is available).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from omni_pcache.copy_engine import empty_host, held_bytes, pinned_available
from omni_pcache.keys import KeySpec
from omni_pcache.pool import row_bytes_view

logger = logging.getLogger("omni_pcache")


class StagingPages:
    """Per-key page storage ``(depth, capacity, *row_shape)``."""

    def __init__(self, depth: int, capacity: int) -> None:
        self._depth = depth
        self._capacity = capacity
        self._pages: dict[str, torch.Tensor] = {}
        # One view per page, made once: a view costs microseconds and pages are asked for
        # several times per step on the engine thread and the committer.
        self._views: dict[str, tuple[torch.Tensor, ...]] = {}
        self._bytes: dict[tuple[str, int], np.ndarray] = {}  # (key, page) -> its rows as uint8 (made when asked)
        self._lock = threading.Lock()

    def ensure(self, spec: KeySpec) -> None:
        """Allocates the key's pages on first sight (engine thread). Pages of another row shape
        or dtype under the name (left by a save refused after allocating them, whose key was
        then forgotten) are replaced."""
        existing = self._pages.get(spec.name)
        if existing is not None and existing.shape[2:] == spec.row_shape and existing.dtype == spec.dtype:
            return
        storage = empty_host((self._depth, self._capacity, *spec.row_shape), spec.dtype)
        with self._lock:
            self._pages[spec.name] = storage
            self._views[spec.name] = tuple(storage.unbind(0))
            for page in range(self._depth):
                self._bytes.pop((spec.name, page), None)
        logger.info(
            "staging for %s: %d pages x %d rows, %s", spec.describe(), self._depth, self._capacity, held_bytes(storage)
        )

    def drop(self, key: str) -> None:
        """Frees the pages of a key that was forgotten before any step used them (engine
        thread: a save refused after allocating them)."""
        with self._lock:
            self._pages.pop(key, None)
            self._views.pop(key, None)
            for page in range(self._depth):
                self._bytes.pop((key, page), None)

    def page(self, key: str, page: int) -> torch.Tensor:
        """The whole page ``page`` of ``key`` (a view)."""
        return self._views[key][page]

    def page_bytes(self, key: str, page: int) -> np.ndarray:
        """Page ``page`` of ``key`` as a ``(capacity, row_bytes)`` uint8 numpy array sharing its
        memory (what the writer's `_native.write_step_rows` reads; made once per page). Rows of zero
        bytes have no such view."""
        view = self._bytes.get((key, page))
        if view is None:
            view = self._bytes[(key, page)] = row_bytes_view(self._views[key][page])
        return view

    def nbytes(self) -> dict[str, int]:
        with self._lock:
            return {k: t.numel() * t.element_size() for k, t in self._pages.items()}

    def bytes_for(self, spec: KeySpec) -> int:
        """Bytes the key's pages take (as `nbytes` will list them)."""
        return self._depth * self._capacity * spec.row_bytes

    @property
    def pinned(self) -> bool:
        """Whether the pages are page-locked (where CUDA is available)."""
        return pinned_available()
