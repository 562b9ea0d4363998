"""What each live request's consumer has been given: the delivered span ``[0, delivered)``.

The contract is that the rows returned for a request across all its steps concatenate to its
full sequence, exactly once. That holds trivially for a fresh request (a hit span read from the
pool, then each step's rows), and this module makes it hold when a request comes back:

- **preempted and resumed** with hit ``H`` (it recomputes from ``H``): rows in
  ``[H, delivered)`` are recomputed but not returned again; if ``H > delivered``, rows
  ``[delivered, H)`` are read from the pool;
- **continued** (an async chunk: a live id reappearing as new with ``num_computed_tokens`` =
  what it computed itself): not a hit; it gets exactly its undelivered rows.

Positions are tracked per request: ``next_pos`` is the position of the next row the engine will
save for it. Engine thread only (begin_step and save).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_pcache._native import block_slots


@dataclass(slots=True)
class Delivery:
    """One live request: next position to be saved, end of the delivered span, and the pool
    read (slots of positions ``[read_from, next_pos)``) due with its next save."""

    next_pos: int = 0
    delivered: int = 0
    read: np.ndarray | None = None


class DeliveryTracker:
    """Delivered spans of live requests."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._live: dict[str, Delivery] = {}

    def is_live(self, req_id: str) -> bool:
        return req_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def schedule(self, req_id: str, blocks: np.ndarray, num_computed: int) -> bool:
        """A request (re)enters with ``num_computed`` tokens already computed; plans the pool
        read of what its consumer has not been given below that. Returns whether it reads."""
        state = self._live.setdefault(req_id, Delivery())
        read_from = state.delivered
        reads = num_computed > read_from
        state.read = block_slots(blocks, read_from, num_computed, self._block_size) if reads else None
        state.next_pos = num_computed
        return state.read is not None

    def finish(self, req_id: str) -> None:
        self._live.pop(req_id, None)

    def take_step(
        self, rows: dict[str, tuple[int, int]]
    ) -> tuple[dict[str, tuple[int, int, int]], dict[str, np.ndarray]]:
        """A save of each request's ``(start, count)`` rows of the step, in batch order.

        Returns per request ``(start, count, drop)``, where ``drop`` is how many leading rows
        were already delivered (not to be returned again), and the pool reads due now, by
        request. One loop for the whole step: this runs for every request of every step."""
        live = self._live
        out: dict[str, tuple[int, int, int]] = {}
        reads: dict[str, np.ndarray] = {}
        for req_id, (row, count) in rows.items():
            state = live.get(req_id)
            if state is None:
                state = live[req_id] = Delivery()
            start = state.next_pos
            if state.read is not None:
                reads[req_id] = state.read
                state.read = None
                if start > state.delivered:
                    state.delivered = start
            drop = state.delivered - start
            out[req_id] = (row, count, 0 if drop <= 0 else min(drop, count))
            end = start + count
            state.next_pos = end
            if end > state.delivered:
                state.delivered = end
        return out, reads
