"""SchedulerOutput → `StepEvents` (at step begin) and the runner's batch → `StepBatch` (at save).

Both read only host data the runner already has: the SchedulerOutput and a `BlockTracker`
updated from it. Nothing touches the device, so nothing syncs with it.

- `step_events`: ``scheduled_new_reqs`` → `NewRequest` (block list, ``num_computed_tokens`` = the
  prefix-hit length, or the resume point of a request V2 sends again as new); cached requests in
  ``resumed_req_ids`` → `ResumedRequest` with their replaced block list and
  ``num_computed_tokens``; ``finished_req_ids`` (finished or aborted) → ``finished``.
- `step_batch`: the runner's row order (``req_ids``), each request's scheduled token count and,
  from the tracker's block lists, the CPU slot mapping
  ``slot = block_ids[pos // bs] * bs + pos % bs`` for ``pos`` in
  ``[num_computed, num_computed + num_scheduled)``, concatenated in row order (vectorized numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import getitem
from typing import Any

import numpy as np

from omni_pcache.errors import InvalidInputError
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents
from omni_pcache.validation import as_int
from omni_pcache.vllm.tracker import BlockTracker, resumed_ids


def step_events(scheduler_output: Any, tracker: BlockTracker) -> StepEvents:
    """The cache events of one SchedulerOutput; ``tracker`` must already have applied it."""
    so = scheduler_output
    cached = so.scheduled_cached_reqs
    resumed = resumed_ids(cached)
    return StepEvents(
        new=[
            NewRequest(r.req_id, list(tracker.blocks(r.req_id)), int(r.num_computed_tokens))
            for r in so.scheduled_new_reqs
        ],
        resumed=[
            ResumedRequest(req_id, list(tracker.blocks(req_id)), int(cached.num_computed_tokens[i]))
            for i, req_id in enumerate(cached.req_ids)
            if req_id in resumed
        ],
        finished=sorted(so.finished_req_ids or ()),
        # Outputs vLLM dropped (drop_stale_output) after the cache counted their rows as delivered:
        # a streaming session's next chunk, rewound to the rows its consumer got (a no-op when
        # nothing was dropped), and a request resumed after a preemption in drop mode (a reset's,
        # or one while a reset's or a stopped turn's outputs were outstanding) dropped its steps in flight.
        dropped={r.req_id: int(r.num_computed_tokens) for r in so.scheduled_new_reqs if r.req_id in tracker.continued},
        dropped_saves=tracker.dropped_saves,
    )


def computed_tokens(scheduler_output: Any) -> dict[str, int]:
    """``num_computed_tokens`` (before this step's tokens) of every request the output schedules."""
    so = scheduler_output
    cached = so.scheduled_cached_reqs
    out = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for r in so.scheduled_new_reqs:
        out[r.req_id] = r.num_computed_tokens
    return out


def _short_list_error(block_lists, starts: np.ndarray, counts: np.ndarray, block_size: int) -> InvalidInputError:
    needed = np.where(counts > 0, (starts + counts - 1) // block_size + 1, 0)
    lengths = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
    short = np.flatnonzero(needed > lengths)
    if not short.size:  # (every list is long enough: an entry that is not a block id)
        return InvalidInputError("block lists must hold int block ids")
    i = int(short[0])
    return InvalidInputError(
        f"row {i}: positions [{int(starts[i])}, {int(starts[i] + counts[i])}) need {int(needed[i])} blocks "
        f"of {block_size} but the request has {int(lengths[i])}"
    )


def slot_mapping(
    block_lists: Sequence[Sequence[int]], starts: np.ndarray, counts: np.ndarray, block_size: int
) -> np.ndarray:
    """Slots of positions ``[starts[i], starts[i] + counts[i])`` under ``block_lists[i]``, concatenated
    (int64). Only the blocks those positions touch are gathered, so a decode step costs O(1) per
    request whatever its length. Raises `InvalidInputError` for a negative start, a list too
    short for its positions, an entry that is not a block id, arguments of unequal lengths, a
    negative count or a block size under 1."""
    block_size = as_int(block_size, "block_size", 1)
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if not len(block_lists) == len(starts) == len(counts):  # (else the extra entries would be ignored)
        raise InvalidInputError(f"{len(block_lists)} block lists for {len(starts)} starts and {len(counts)} counts")
    if len(counts) and counts.min() < 0:
        i = int(np.flatnonzero(counts < 0)[0])
        raise InvalidInputError(f"row {i}: {int(counts[i])} tokens scheduled; counts are >= 0")
    n = int(counts.sum())
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if starts.min() < 0:  # (a negative position would index a block list from its end)
        i = int(np.flatnonzero(starts < 0)[0])
        raise InvalidInputError(f"row {i}: its first position is {int(starts[i])}; positions start at 0")
    first = starts // block_size
    try:
        if n == len(block_lists) and not (counts - 1).any():  # decode: one token per request
            flat = np.fromiter(map(getitem, block_lists, first.tolist()), dtype=np.int64, count=n)
            return flat * block_size + starts % block_size
        # (a zero-count row touches no block, wherever its start falls)
        touched = np.where(counts > 0, (starts + counts - 1) // block_size - first + 1, 0)
        stop = first + touched
        spans = zip(block_lists, first.tolist(), stop.tolist(), strict=True)
        flat = np.fromiter(
            chain.from_iterable(blocks[lo:hi] for blocks, lo, hi in spans), dtype=np.int64, count=int(touched.sum())
        )
    except (IndexError, ValueError):  # a block list shorter than its positions need
        raise _short_list_error(block_lists, starts, counts, block_size) from None
    row_of = np.repeat(np.arange(len(counts)), counts)
    token_start = np.cumsum(counts) - counts  # first token index of each row
    pos = starts[row_of] + (np.arange(n, dtype=np.int64) - token_start[row_of])
    block_start = np.cumsum(touched) - touched  # first entry of each row in `flat`
    blocks = flat[block_start[row_of] + pos // block_size - first[row_of]]
    return blocks * block_size + pos % block_size


def step_batch(
    scheduler_output: Any,
    tracker: BlockTracker,
    req_ids: Sequence[str],
    block_size: int,
    num_tokens_padded: int | None = None,
) -> StepBatch:
    """The `StepBatch` of a forward whose rows are ``req_ids``' scheduled tokens in that order
    (V1: ``input_batch.req_ids``); ``num_tokens_padded`` is the row count of the hidden states
    when CUDA graphs pad the batch."""
    so = scheduler_output
    req_ids = list(req_ids)
    scheduled = so.num_scheduled_tokens
    computed = computed_tokens(so)
    if len(req_ids) != len(scheduled) or scheduled.keys() != set(req_ids) or computed.keys() != scheduled.keys():
        missing = [r for r in req_ids if r not in scheduled or r not in computed]
        if missing:
            raise InvalidInputError(f"req_ids {missing} are not scheduled by this SchedulerOutput")
        if len(set(req_ids)) != len(req_ids):
            twice = sorted({r for r in req_ids if req_ids.count(r) > 1})
            raise InvalidInputError(f"req_ids has duplicates: {twice} (each request once per step)")
        extra = sorted(set(scheduled) - set(req_ids))
        if extra:
            raise InvalidInputError(f"scheduled requests {extra} are missing from req_ids (the forward's rows)")
        raise InvalidInputError(
            f"SchedulerOutput schedules {sorted(scheduled)} but its requests are {sorted(computed)}: inconsistent"
        )
    counts = np.fromiter(map(scheduled.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
    starts = np.fromiter(map(computed.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
    slots = slot_mapping(tracker.lists(req_ids), starts, counts, block_size)
    if len(slots) and slots.min() < block_size and ((slots >= 0) & (slots < block_size)).any():
        raise _null_block_error(slots, req_ids, starts, counts, block_size)  # (a negative id: save refuses it)
    return StepBatch(req_ids, counts.tolist(), slots, num_tokens_padded)


def _null_block_error(
    slots: np.ndarray, req_ids: list[str], starts: np.ndarray, counts: np.ndarray, block_size: int
) -> InvalidInputError:
    """Block 0 is vLLM's null block, never allocated to a request: it stands in a block list
    only where a block was freed (a sliding window's gap, which RSWA writes into a running
    request's list), so a scheduled token there would be written into a block other requests'
    lists share. Names the first such token."""
    at = int(np.argmax((slots >= 0) & (slots < block_size)))
    row = int(np.searchsorted(np.cumsum(counts), at, side="right"))
    position = int(starts[row]) + at - int(np.sum(counts[:row]))
    return InvalidInputError(
        f"request {req_ids[row]!r}: position {position} is scheduled in block 0, vLLM's null block "
        "(a freed block's stand-in); the tracker's block list for it is likely out of step with the scheduler's"
    )
