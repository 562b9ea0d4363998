"""Rows kept aside for late reads of reused slots (copy-on-write).

When a claim reuses a slot that a pending read captured, the ledger reports it; the cache
registers an *obligation* here under the ledger lock (atomically with the claim) and fills it
outside the lock: from the pool at once (the old row is committed and nobody overwrites it
before the new task is queued, or written by save itself, which fills these first), or from
the old task's staging rows when that task writes (it was still in transit). A reader that
finds a moved slot waits for its entry.

Entries are keyed ``(key, slot, version)`` and dropped once every step that could hold a
read of them is consumed (a read planned at step s can only need entries created by claims
of later steps). The total is bounded by ``max_preserved_rows``; past it no obligation is
registered and the late read raises `UnservableHitError`.

Threads: obligations are registered by the engine thread under the cache's ledger lock;
`fill` runs on the engine thread or the committer; `take` on materializing threads.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

Entry = tuple[str, int, int]  # (key, slot, version)


class PreservedRows:
    """The bounded copy-on-write store."""

    def __init__(self, max_rows: int, cond: threading.Condition) -> None:
        self._max_rows = max_rows
        self._cond = cond  # shares the cache's ledger lock
        self._rows: dict[Entry, torch.Tensor | None] = {}
        self._by_step: dict[int, list[Entry]] = defaultdict(list)

    def register(self, key: str, slots: list[int], versions: list[int], step_id: int) -> list[bool]:
        """Registers obligations (caller holds the ledger lock); returns, per slot, whether it
        fit in the bound (an unregistered slot makes its late reader raise)."""
        accepted = []
        for slot, version in zip(slots, versions, strict=True):
            entry = (key, slot, version)
            if entry in self._rows:
                accepted.append(True)
            elif len(self._rows) < self._max_rows:
                self._rows[entry] = None
                self._by_step[step_id].append(entry)
                accepted.append(True)
            else:
                accepted.append(False)
        return accepted

    def fill(self, key: str, slots: list[int], versions: list[int], rows: torch.Tensor) -> None:
        """Stores the rows of registered obligations and wakes readers (any thread; takes the lock)."""
        with self._cond:
            for i, (slot, version) in enumerate(zip(slots, versions, strict=True)):
                entry = (key, slot, version)
                if entry in self._rows:
                    self._rows[entry] = rows[i]
            self._cond.notify_all()

    def contains(self, key: str, slot: int, version: int) -> bool:
        """Whether an obligation exists (caller holds the ledger lock)."""
        return (key, slot, version) in self._rows

    def take(self, key: str, slots: list[int], versions: list[int], deadline: float, failed) -> list[torch.Tensor]:
        """The preserved rows (one tensor each; stack them after releasing the lock), waiting
        until every one is filled (caller holds the lock, as the condition's owner).
        ``failed()`` returning an exception aborts the wait with it; a timeout raises
        `TimeoutError` naming the missing entries."""
        entries = [(key, s, v) for s, v in zip(slots, versions, strict=True)]
        while True:
            exc = failed()
            if exc is not None:
                raise exc
            missing = [e for e in entries if self._rows.get(e) is None]
            if not missing:
                return [self._rows[e] for e in entries]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"preserved rows not filled in time: {missing[:8]}")
            self._cond.wait(remaining)

    def drop_through(self, step_id: int | None) -> None:
        """Drops entries created at steps ``<= step_id`` (``None``: every entry). Caller holds
        the lock."""
        for step in [s for s in self._by_step if step_id is None or s <= step_id]:
            for entry in self._by_step.pop(step):
                self._rows.pop(entry, None)

    @property
    def steps_held(self) -> bool:
        """Whether any step still has entries for `drop_through` to drop (caller holds the lock)."""
        return bool(self._by_step)

    def __len__(self) -> int:
        return len(self._rows)
