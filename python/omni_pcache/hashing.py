"""Block hashes as Python ints: the chained 128-bit hash of full KV blocks (see the core)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omni_pcache._native import block_hashes
from omni_pcache.validation import as_list


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: int | None = None,
    extra_keys: Sequence[bytes | None] | None = None,
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, as 128-bit ints.

    ``parent`` is the hash of the block before the first one (``None`` for a prompt's start);
    ``extra_keys`` holds one ``bytes | None`` per full block. Deterministic across processes,
    runs and machines. Raises `InvalidInputError` for negative or too-large token ids, and for a
    ``block_size``, ``parent`` or ``extra_keys`` of the wrong type or out of range.
    """
    keys = None if extra_keys is None else as_list(extra_keys, "extra_keys")  # (an iterator is read once)
    halves = block_hashes(token_ids, block_size, parent, keys)
    return [int(lo) | (int(hi) << 64) for lo, hi in halves.tolist()]


__all__ = ["block_hashes", "hash_blocks"]
