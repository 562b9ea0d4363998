"""Values the engine hands the cache each step (`StepEvents`, `StepBatch`) and what it gets
back (`StepOutputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request scheduled for the first time. ``block_ids`` is its whole block table (hit
    blocks first); ``num_computed_tokens`` is its prefix-cache hit length (whole blocks)."""

    req_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ResumedRequest:
    """A preempted request scheduled again: its new block table replaces the old one, and
    it recomputes from ``num_computed_tokens``."""

    req_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepEvents:
    """What changed since the last step: new and resumed requests, and finished or aborted ids
    (an aborted request is reported as finished). ``dropped`` maps a live request to the
    position from which the rows saved for it never reached its consumer (the engine dropped
    the output that carried them, as vLLM's ``drop_stale_output`` does when a streaming turn
    ends with a step in flight): those positions are delivered again, from the pool below the
    request's resume point, else when computed again. The request must be scheduled again in
    the same events (``new`` or ``resumed``); ``begin_step`` refuses a dropped entry for one
    that is not, or that is not live. ``dropped_saves`` maps a live request to how many of its
    latest saved steps' outputs never reached its consumer (vLLM's
    ``reset_prefix_cache(reset_running_requests=True)`` drops the outputs of the steps in
    flight, and so does a preemption while a reset's or a stopped streaming turn's outputs
    are outstanding): every row those steps returned for it, prefix-hit rows included, is delivered
    again, on the same conditions (no more than it had, at most ``_native.MAX_DROPPED_SAVES`` = 16; a
    request not saved since it entered has nothing to undo, and any count from 1 to 16 is a no-op)."""

    new: Sequence[NewRequest] = ()
    resumed: Sequence[ResumedRequest] = ()
    finished: Sequence[str] = ()
    dropped: Mapping[str, int] = field(default_factory=dict)
    dropped_saves: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The step's batch in the order of the model's rows: request ids, their scheduled token
    counts, and the CPU slot id of every scheduled token (``sum(num_scheduled_tokens)`` of them,
    or more with trailing padding). ``num_tokens_padded`` is the row count of hidden/mm when
    CUDA graphs pad the batch (default: unpadded)."""

    req_ids: Sequence[str]
    num_scheduled_tokens: Sequence[int]
    slot_mapping: np.ndarray
    num_tokens_padded: int | None = None


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """Per-request outputs of one step: ``hidden[req_id]`` (cached prefix rows followed by this
    step's rows, or ``None`` when hidden states are not cached) and ``mm[key][req_id]`` (per-token
    keys merged the same way; leftover entries sliced per request or passed whole)."""

    hidden: dict[str, Any] | None
    mm: dict[str, dict[str, Any]]
