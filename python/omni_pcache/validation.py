"""Checks of what the engine hands the cache, done before anything changes: a bad event or
batch raises `InvalidInputError` saying what was wrong and leaves the cache as it was."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from omni_pcache._native import block_table, check_slots
from omni_pcache.config import CacheConfig
from omni_pcache.errors import InvalidInputError
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents


@dataclass(frozen=True, slots=True)
class BatchShape:
    """A checked batch: token counts, each request's row range, and int64 slot ids; also the
    requests that have rows this step, in batch order, as lists (what the claims take)."""

    n: int
    n_padded: int
    rows: dict[str, tuple[int, int]]
    slot_mapping: np.ndarray
    claim_req_ids: list[str]
    claim_starts: list[int]
    claim_counts: list[int]


def _int(value: object, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidInputError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _block_ids(req, num_blocks: int) -> np.ndarray:
    """The request's block ids as a checked int64 array (natively: one pass over the list)."""
    try:
        return block_table(req.block_ids, num_blocks)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{req.req_id!r}: {exc}") from None


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs 3x, once per scheduled request)
class Scheduled:
    """A checked new or resumed request: its block table and computed-token count."""

    req_id: str
    blocks: np.ndarray  # int64 block ids, checked
    num_computed: int
    resumed: bool


def check_events(events: StepEvents, config: CacheConfig, is_live) -> list[Scheduled]:
    """Checks a step's events. A request the cache does not know yet (or one this step finishes,
    whose id comes back new) that arrives with ``num_computed_tokens > 0`` is a prefix hit and
    must cover whole blocks; a live one (resumed, or continued as new) may have computed any
    count."""
    if not isinstance(events, StepEvents):
        raise InvalidInputError(f"begin_step takes StepEvents, got {type(events).__name__}")
    for req_id in events.finished:
        if not isinstance(req_id, str):
            raise InvalidInputError(f"StepEvents.finished holds request ids (str), got {req_id!r}")
    ending = set(events.finished)  # finished before the scheduled requests are registered
    out: list[Scheduled] = []
    seen: set[str] = set()
    for kind, requests, cls in (("new", events.new, NewRequest), ("resumed", events.resumed, ResumedRequest)):
        for req in requests:
            if not isinstance(req, cls):
                raise InvalidInputError(f"StepEvents.{kind} holds {cls.__name__}s, got {type(req).__name__}")
            computed = req.num_computed_tokens
            if type(computed) is not int or computed < 0:  # (the message is built only when needed)
                computed = _int(computed, f"{req.req_id!r}: num_computed_tokens")
            blocks = _block_ids(req, config.num_blocks)
            if computed > len(blocks) * config.block_size:
                raise InvalidInputError(
                    f"{req.req_id!r}: num_computed_tokens={computed} exceeds its "
                    f"{len(blocks)} blocks of {config.block_size}"
                )
            if (req.req_id in ending or not is_live(req.req_id)) and computed % config.block_size:
                raise InvalidInputError(
                    f"{req.req_id!r}: num_computed_tokens={computed} is not a whole number of "
                    f"blocks (block_size={config.block_size}); prefix hits are whole blocks"
                )
            if req.req_id in seen:
                raise InvalidInputError(f"request {req.req_id!r} is scheduled twice in one step's events")
            seen.add(req.req_id)
            out.append(Scheduled(req.req_id, blocks, computed, kind == "resumed"))
    return out


def check_batch(batch: StepBatch, config: CacheConfig) -> BatchShape:
    """Checks a step's batch against the config."""
    if not isinstance(batch, StepBatch):
        raise InvalidInputError(f"save takes a StepBatch, got {type(batch).__name__}")
    req_ids = list(batch.req_ids)
    if len(req_ids) != len(batch.num_scheduled_tokens):
        raise InvalidInputError(f"{len(req_ids)} req_ids but {len(batch.num_scheduled_tokens)} num_scheduled_tokens")
    counts = list(batch.num_scheduled_tokens)
    if counts and (set(map(type, counts)) != {int} or min(counts) < 0):  # (C-speed check of the common case)
        counts = [_int(c, f"num_scheduled_tokens of {r!r}") for r, c in zip(req_ids, counts, strict=True)]
    if len(set(req_ids)) != len(req_ids):
        raise InvalidInputError(f"req_ids has duplicates: {req_ids}")
    n = sum(counts)
    n_padded = n if batch.num_tokens_padded is None else _int(batch.num_tokens_padded, "num_tokens_padded", n)
    if n > config.staging_capacity_tokens:
        raise InvalidInputError(
            f"a step of {n} tokens exceeds staging_capacity_tokens={config.staging_capacity_tokens}; "
            "size it to the scheduler's max_num_batched_tokens"
        )
    mapping = batch.slot_mapping
    if isinstance(mapping, torch.Tensor):
        if mapping.device.type != "cpu":
            raise InvalidInputError("slot_mapping must be the CPU slot ids (no device sync), got a device tensor")
        mapping = mapping.numpy()
    mapping = np.asarray(mapping)
    if mapping.ndim != 1 or mapping.dtype.kind not in "iu":
        raise InvalidInputError(f"slot_mapping must be a 1-D integer array, got {mapping.dtype} {mapping.shape}")
    if mapping.size < n:
        raise InvalidInputError(f"slot_mapping has {mapping.size} entries for {n} scheduled tokens")
    # A copy, always: write records keep the step's slots until their writes land, and the
    # caller may refill its slot buffer as soon as save returns (vLLM reuses one).
    slots = np.array(mapping[:n], dtype=np.int64)
    check_slots(slots, config.num_slots, "slot_mapping")
    starts = list(itertools.accumulate(counts, initial=0))  # each request's first row (and the end: one more)
    rows: dict[str, tuple[int, int]] = dict(zip(req_ids, zip(starts, counts, strict=False), strict=True))
    if 0 in counts:  # (C-level filters; a decode step, every request with rows, skips them)
        req_ids, starts, counts = (
            list(itertools.compress(req_ids, counts)),
            list(itertools.compress(starts, counts)),
            list(filter(None, counts)),
        )
    else:
        starts.pop()
    return BatchShape(n, n_padded, rows, slots, req_ids, starts, counts)
