"""Small helpers shared by the cache tests: slot math and self-describing rows."""

from __future__ import annotations

import threading

import numpy as np
import torch

from omni_pcache import CacheConfig, PrefixCache, StepBatch
from omni_pcache._native import Ledger
from omni_pcache.copy_engine import pinned_available
from omni_pcache.host_memory import footprint


def slots_of(block_ids: list[int], start: int, count: int, block_size: int) -> np.ndarray:
    """Slot ids of positions ``[start, start + count)`` of a request with this block table."""
    pos = np.arange(start, start + count)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def rows(writer: int, start: int, count: int, width: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Rows that name themselves: row i is ``[writer, position, 0, 1, ...]``."""
    out = torch.zeros(count, width, dtype=torch.float64)
    out[:, 0] = writer
    out[:, 1] = torch.arange(start, start + count, dtype=torch.float64)
    if width > 2:
        out[:, 2:] = torch.arange(width - 2, dtype=torch.float64)
    return out.to(dtype)


def describe(t: torch.Tensor) -> list[tuple[int, int]]:
    """(writer, position) of each row made by `rows`, for readable failures."""
    return [(int(r[0]), int(r[1])) for r in t.double()]


def batch(req_counts: list[tuple[str, int]], slot_lists: list[np.ndarray], padded: int | None = None):
    return StepBatch([r for r, _ in req_counts], [c for _, c in req_counts], np.concatenate(slot_lists), padded)


SMALL_CACHE = dict(num_blocks=16, block_size=4, staging_depth=3, staging_capacity_tokens=64, claim_timeout_s=5.0)


def small_cache_bytes(row_bytes: dict[str, int], deferred: frozenset[str] = frozenset()) -> int:
    """The host memory keys of these row widths hold in a `small_cache` (what its host budget
    counts): a pool row per slot, staging pages for each key not ``deferred`` (page-locked
    size where CUDA pins them), the ledger's columns of each key, and the most rows kept
    aside for late reads (``max_preserved_rows``, its default, of the widest key's)."""
    slots = SMALL_CACHE["num_blocks"] * SMALL_CACHE["block_size"]
    page_rows = SMALL_CACHE["staging_depth"] * SMALL_CACHE["staging_capacity_tokens"]
    columns = Ledger(slots, SMALL_CACHE["block_size"]).key_column_bytes
    pages = sum(footprint(page_rows * size, pinned_available()) for k, size in row_bytes.items() if k not in deferred)
    preserved = CacheConfig(num_blocks=1, block_size=1).max_preserved_rows * max(row_bytes.values())
    return slots * sum(row_bytes.values()) + pages + len(row_bytes) * columns + preserved


def fail_first_pool_allocation(cache: PrefixCache) -> list[str]:
    """Makes the cache's first pool allocation raise `MemoryError` (later ones allocate);
    returns the list of key names each allocation is asked for, as they are asked."""
    ensure, calls = cache._pool.ensure, []

    def fail_once(spec) -> None:
        calls.append(spec.name)
        if len(calls) == 1:
            raise MemoryError("injected: no host memory")
        ensure(spec)

    cache._pool.ensure = fail_once
    return calls


def small_cache(**overrides) -> PrefixCache:
    cfg = dict(SMALL_CACHE)
    cfg.update(overrides)
    policy = cfg.pop("policy", None)
    return PrefixCache(CacheConfig(**cfg), policy)


def start_thread(fn, *args) -> tuple[threading.Thread, list[BaseException]]:
    """Runs ``fn(*args)`` on a new thread; what it raises lands in the returned list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors
