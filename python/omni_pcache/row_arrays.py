"""A small step's own copies of its rows, and their numpy arrays, which the native step write
reads as they are (`_native.write_step_now`: each row's bytes, whatever they hold), without a
uint8 view (see `InlineWrites.owns_rows`).

After a forward, every distinct torch call costs several times its hot time; ``tensor.numpy()``
is one call where `pool.row_bytes_view` (a reshape, a dtype view, then numpy) is three.
"""

from __future__ import annotations

import numpy as np
import torch

from omni_pcache.copy_engine import host_copy

_NUMPY_AS_IS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64})
"""Dtypes whose numpy arrays `_native.write_step_now` reads as they are."""

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype another dtype's rows are read as (their bits: bf16 and fp16 as int16, bool as uint8)."""


def numpy_readable(dtype: torch.dtype) -> bool:
    """Whether `numpy_rows` takes tensors of ``dtype``."""
    return dtype in _NUMPY_AS_IS or (not dtype.is_complex and dtype.itemsize in _SAME_WIDTH_INT)


def numpy_rows(tensor: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor as a numpy array sharing its memory, in a dtype the native step
    write reads (`_native.write_step_now`: the rows' bytes, whatever they hold); ``None`` for one
    it cannot take as it is (not contiguous, complex, a lazily negated view, or needing grad
    where its dtype is read as it is; the integer view of a 16-bit float or bool tensor drops
    the grad and shows the same bytes). One torch call for the usual dtypes (two for 16-bit
    floats and bools): cheaper after a forward than the uint8 view of `pool.row_bytes_view`.
    Its callers pass rows without grad (`KeyRegistry.classify` detaches them)."""
    if tensor.dtype not in _NUMPY_AS_IS:
        view_as = _SAME_WIDTH_INT.get(tensor.element_size())
        if view_as is None or tensor.is_complex():
            return None
        tensor = tensor.view(view_as)
    if not tensor.is_contiguous():
        return None
    try:
        return tensor.numpy()
    except RuntimeError:  # (needs grad, or a negated view: not rows to read as they are)
        return None


def own_copies(specs, rows: dict[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """Replaces each of ``rows`` (the caller's CPU tensors, by key name) by a contiguous copy of
    its own and returns the copies' numpy arrays for the keys of ``specs`` with bytes (the
    pool write's); ``None``, with ``rows`` unchanged, for rows numpy cannot show as they are.
    The engine thread, in save."""
    owned = {name: host_copy(src) for name, src in rows.items()}  # (no grad: `KeyRegistry.classify` detached them)
    arrays = {}
    for spec in specs:
        if spec.row_bytes:
            array = numpy_rows(owned[spec.name])
            if array is None:
                return None
            arrays[spec.name] = array
    rows.update(owned)
    return arrays


__all__ = ["numpy_readable", "numpy_rows", "own_copies"]
