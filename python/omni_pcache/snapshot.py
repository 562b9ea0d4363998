"""Leftover mm snapshots: a CPU copy taken at save, so materialize never reads a live buffer
that the engine may overwrite (CUDA-graph outputs, in-place updates)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from omni_pcache.copy_engine import StepCopy
from omni_pcache.errors import InvalidInputError


def snapshot(value: Any, engine: StepCopy, name: str = "") -> Any:
    """`_copied`, with a container that holds itself (or is nested past Python's recursion
    limit) refused with `InvalidInputError` like any value that cannot be copied."""
    try:
        return _copied(value, engine, name)
    except RecursionError:
        raise InvalidInputError(
            f"leftover mm {name!r} holds itself, or is nested too deeply to copy at save; pass it without the cycle"
        ) from None


def _copied(value: Any, engine: StepCopy, name: str) -> Any:
    """A deep CPU copy of ``value``: tensors are copied (device tensors through ``engine``, so
    the reader must wait the step's copy handle before reading them), containers (dicts, lists,
    tuples, namedtuples, and subclasses of them as their own type where a shallow copy of
    theirs can be filled) are rebuilt, numpy arrays copied, anything else deep-copied (a device
    tensor inside another object is then copied on its device). Raises `InvalidInputError`,
    naming the leftover ``name``, for a value that cannot be deep-copied, a meta tensor, or a
    sparse or quantized CUDA tensor."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise InvalidInputError(f"leftover mm {name!r} holds a meta tensor: it has no data to hand back")
        if value.is_cuda and (value.layout != torch.strided or value.is_quantized):
            # (a dense pinned copy cannot hold it, and a synchronous one would wait for the forward)
            kind = "quantized" if value.is_quantized else str(value.layout).removeprefix("torch.")
            raise InvalidInputError(
                f"leftover mm {name!r} holds a {kind} CUDA tensor: save copies device leftovers into dense "
                "host memory without waiting for the forward; pass it dense (.to_dense()) or on the CPU"
            )
        return engine.snapshot(value)
    if isinstance(value, dict):
        items = {k: _copied(v, engine, name) for k, v in value.items()}
        return items if type(value) is dict else _same_type(value, lambda out: out.update(items), items)
    if isinstance(value, list):
        rows = [_copied(v, engine, name) for v in value]
        return rows if type(value) is list else _same_type(value, lambda out: out.__setitem__(slice(None), rows), rows)
    if isinstance(value, tuple):
        entries = [_copied(v, engine, name) for v in value]
        if type(value) is tuple:
            return tuple(entries)
        try:  # (a namedtuple takes its fields as arguments, another subclass an iterable)
            out = type(value)(*entries) if hasattr(value, "_fields") else type(value)(entries)
        except Exception:
            return tuple(entries)
        # (kept only if it holds exactly the copies: a constructor of another signature may wrap them)
        same = len(out) == len(entries) and all(a is b for a, b in zip(out, entries, strict=True))
        return out if same and not _has_attributes(out) else tuple(entries)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (int, float, bool, str, bytes, type(None))):
        return value
    try:
        return copy.deepcopy(value)
    except MemoryError:
        raise
    except Exception as exc:  # (a lock, a file, a generator: nothing a step's outputs can hand back later)
        raise InvalidInputError(
            f"leftover mm {name!r} holds a {type(value).__name__}, which cannot be copied at save ({exc!r}); "
            "pass tensors, numpy arrays, plain containers or copyable objects"
        ) from exc


def _same_type(value: Any, fill: Any, plain: Any) -> Any:
    """A dict or list subclass rebuilt as its own type (an OrderedDict, a defaultdict with its
    factory): a shallow copy with its entries replaced by ``fill``; ``plain`` (the entries in a
    dict or list) when the type cannot be copied that way, or when the instance carries
    attributes of its own (a shallow copy would share them with the caller, whose tensors may
    be overwritten before materialize reads them)."""
    if _has_attributes(value):
        return plain
    try:
        out = copy.copy(value)
        fill(out)
    except Exception:
        return plain
    return out


def _has_attributes(value: Any) -> bool:
    """Whether ``value`` has instance attributes (a non-empty ``__dict__``)."""
    return bool(getattr(value, "__dict__", None))


def is_per_row(value: Any, n: int, n_padded: int) -> bool:
    """Whether a leftover entry is sliced per request: a tensor whose dim 0 is the step's token
    count (padded or not); everything else is passed to every request whole."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] in (n, n_padded)
