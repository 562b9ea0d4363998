"""Checks of what the engine hands the cache, done before anything changes: a bad batch raises
`InvalidInputError` saying what was wrong and leaves the cache as it was (a step's events are
checked by the native `Deliveries.begin`, with the same contract)."""

from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass

import numpy as np
import torch

from omni_pcache._native import check_batch as native_check_batch
from omni_pcache.config import CacheConfig
from omni_pcache.errors import InvalidInputError
from omni_pcache.events import StepBatch


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs 3x, once per step)
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


def as_list(value: object, what: str) -> list:
    """``value`` as a list: a list as it is, a tuple or any other iterable listed. A single str
    or bytes (iterable, but its characters are not request ids) or a non-iterable raises
    `InvalidInputError` naming ``what``."""
    if type(value) is list:
        return value
    if isinstance(value, str | bytes):
        raise InvalidInputError(f"{what} must be a sequence, got the single {value!r}")
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"{what} must be a sequence, got {type(value).__name__}") from None


def as_id_map(value: object, what: str, values: str = "positions") -> dict:
    """``value`` (request id -> an int: a position, or the ``values`` named) as a dict: a dict
    as it is, any other mapping (or iterable of pairs) copied into one; anything else raises
    `InvalidInputError` naming ``what``. The ids and values themselves are checked natively
    (`Deliveries.begin`)."""
    if type(value) is dict:
        return value
    try:
        return dict(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise InvalidInputError(f"{what} must map request ids to {values}, got {type(value).__name__}") from None


def is_seconds(value: object) -> bool:
    """Whether ``value`` is a finite real number of seconds >= 0 that a wait can take (numpy
    scalars included; bools, NaN and infinity not)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and 0 <= value <= threading.TIMEOUT_MAX  # (NaN fails both)
    )


def check_timeout(timeout_s: object, what: str) -> None:
    """Refuses a timeout that is not ``None`` or `is_seconds` with `InvalidInputError`."""
    if timeout_s is not None and not is_seconds(timeout_s):
        raise InvalidInputError(f"{what} must be None or a finite number of seconds >= 0, got {timeout_s!r}")


def as_int(value: object, what: str, minimum: int = 0) -> int:
    """``value`` as an int (a Python or numpy int, not a bool) >= ``minimum``; else
    `InvalidInputError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidInputError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_step_id(step_id: object) -> None:
    """Refuses a step id that is not a Python int (bools, floats and numpy ints included: never
    read as the id they compare equal to) with `InvalidInputError`."""
    if isinstance(step_id, bool) or not isinstance(step_id, int):
        raise InvalidInputError(f"step_id must be an int, got {step_id!r}")


def check_batch(batch: StepBatch, config: CacheConfig) -> BatchShape:
    """Checks a step's batch against the config: natively, in one call (`_native.check_batch`),
    for a slot mapping that is a 1-D int64/int32 array (numpy, or a CPU tensor); any other
    integer array is converted to int64 here first."""
    if not isinstance(batch, StepBatch):
        raise InvalidInputError(f"save takes a StepBatch, got {type(batch).__name__}")
    mapping = batch.slot_mapping
    if isinstance(mapping, torch.Tensor):
        if not mapping.is_cpu:
            raise InvalidInputError("slot_mapping must be the CPU slot ids (no device sync), got a device tensor")
        if mapping.is_floating_point() or mapping.is_complex() or mapping.dtype == torch.bool:
            # (refused here: numpy has no bfloat16, so `.numpy()` would raise its own TypeError)
            raise InvalidInputError(f"slot_mapping must be a 1-D integer array, got a {mapping.dtype} tensor")
        mapping = mapping.numpy()
    # (the slots come back as a copy, always: write records keep them until their writes land,
    # and the caller may refill its slot buffer as soon as save returns; vLLM reuses one)
    args = (config.staging_capacity_tokens, config.num_slots)
    req_ids, counts = batch.req_ids, batch.num_scheduled_tokens
    req_ids = as_list(req_ids, "StepBatch.req_ids")  # (an iterator would be spent by a second call below)
    if type(counts) is not list:
        if isinstance(counts, torch.Tensor) and not counts.is_cpu:
            # (each count read off the device would wait for the whole forward, inside save)
            raise InvalidInputError(
                f"num_scheduled_tokens must be host ints (no device sync), got a {counts.device} tensor"
            )
        counts = (
            counts.tolist()
            if isinstance(counts, np.ndarray | torch.Tensor)
            else as_list(counts, "StepBatch.num_scheduled_tokens")
        )
    checked = native_check_batch(req_ids, counts, mapping, *args)
    if checked is None:  # not an int64/int32 numpy array
        try:
            mapping = np.asarray(mapping)
        except (ValueError, TypeError) as exc:  # a ragged list, an object numpy cannot read
            raise InvalidInputError(f"slot_mapping must be a 1-D integer array: {exc}") from None
        if mapping.ndim != 1 or mapping.dtype.kind not in "iu":
            raise InvalidInputError(f"slot_mapping must be a 1-D integer array, got {mapping.dtype} {mapping.shape}")
        if mapping.dtype.kind == "u" and mapping.size and int(mapping.max()) > np.iinfo(np.int64).max:
            at = int(np.argmax(mapping > np.iinfo(np.int64).max))  # (as int64 it would read as a negative id)
            raise InvalidInputError(
                f"slot_mapping: slot id {int(mapping[at])} at position {at} is out of range [0, {config.num_slots})"
            )
        checked = native_check_batch(req_ids, counts, mapping.astype(np.int64), *args)
    n, slots, rows, req_ids, starts, counts = checked
    n_padded = n if batch.num_tokens_padded is None else as_int(batch.num_tokens_padded, "num_tokens_padded", n)
    return BatchShape(n, n_padded, rows, slots, req_ids, starts, counts)
