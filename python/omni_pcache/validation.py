"""Checks of what the engine hands the cache, done before anything changes: a bad event or
batch raises `InvalidInputError` saying what was wrong and leaves the cache as it was."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_pcache._native import block_table
from omni_pcache._native import check_batch as native_check_batch
from omni_pcache.config import CacheConfig
from omni_pcache.errors import InvalidInputError
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents


@dataclass(slots=True)  # (not frozen: see `Scheduled`)
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
    """Checks a step's batch against the config: natively, in one call (`_native.check_batch`),
    for a slot mapping that is a 1-D int64/int32 array (numpy, or a CPU tensor); any other
    integer array is converted to int64 here first."""
    if not isinstance(batch, StepBatch):
        raise InvalidInputError(f"save takes a StepBatch, got {type(batch).__name__}")
    mapping = batch.slot_mapping
    if isinstance(mapping, torch.Tensor):
        if mapping.device.type != "cpu":
            raise InvalidInputError("slot_mapping must be the CPU slot ids (no device sync), got a device tensor")
        mapping = mapping.numpy()
    # (the slots come back as a copy, always: write records keep them until their writes land,
    # and the caller may refill its slot buffer as soon as save returns; vLLM reuses one)
    args = (config.staging_capacity_tokens, config.num_slots)
    req_ids, counts = batch.req_ids, batch.num_scheduled_tokens
    if type(req_ids) is not list:  # (an iterator would be spent by a second call below)
        req_ids = list(req_ids)
    if type(counts) is not list:
        counts = counts.tolist() if isinstance(counts, np.ndarray) else list(counts)
    checked = native_check_batch(req_ids, counts, mapping, *args)
    if checked is None:  # not an int64/int32 numpy array
        mapping = np.asarray(mapping)
        if mapping.ndim != 1 or mapping.dtype.kind not in "iu":
            raise InvalidInputError(f"slot_mapping must be a 1-D integer array, got {mapping.dtype} {mapping.shape}")
        checked = native_check_batch(req_ids, counts, mapping.astype(np.int64), *args)
    n, slots, rows, req_ids, starts, counts = checked
    n_padded = n if batch.num_tokens_padded is None else _int(batch.num_tokens_padded, "num_tokens_padded", n)
    return BatchShape(n, n_padded, rows, slots, req_ids, starts, counts)
