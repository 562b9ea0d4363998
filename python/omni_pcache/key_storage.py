"""Host memory of each cached key: its pool (a row per KV slot) and, for an immediate key, its
staging pages, allocated when a save first shows a key set and freed again when that save is
refused before any row reached them.

Engine thread only (from `PrefixCache.save`); the pool's and the pages' own locks cover their
readers on other threads.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_pcache.errors import InvalidInputError
from omni_pcache.keys import KeySpec, StepKeys
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool


class KeyStorage:
    """Allocates and frees the pool storage and staging pages of keys (within the host budget,
    which `KeyRegistry.register` checks first: `host_budget.HostBudget`). ``bytes_written`` is
    the pool writer's per-key count (`PoolWriter.bytes_written`), which lists every key from
    its allocation on."""

    def __init__(self, pool: HostPool, pages: StagingPages, bytes_written: dict[str, int]) -> None:
        self._pool = pool
        self._pages = pages
        self._bytes_written = bytes_written

    def make_room(self, keys: StepKeys) -> None:
        """Pool storage for every key of a new key set, and staging room for its immediate ones
        (`KeyRegistry.step_keys`' ``prepare``). Storage the allocator refuses though the host
        budget admitted it (a budget set past the host) is an `InvalidInputError`."""
        for spec in keys.specs:
            _allocate(spec, "host pool", self._pool.ensure)
            self._bytes_written.setdefault(spec.name, 0)  # (listed from the start, 0 until written)
        for spec in keys.immediate:
            _allocate(spec, "staging pages", self._pages.ensure)

    def free(self, names: tuple[str, ...]) -> None:
        """Frees the storage of keys forgotten before any row was written to it (a save refused
        after registering them: `KeyRegistry.forget`)."""
        for name in names:
            self._pool.drop(name)
            self._pages.drop(name)
            if self._bytes_written.get(name) == 0:
                del self._bytes_written[name]


def _allocate(spec: KeySpec, what: str, ensure: Callable[[KeySpec], None]) -> None:
    try:
        ensure(spec)
    except (RuntimeError, MemoryError) as exc:  # (torch's allocation failures)
        raise InvalidInputError(f"{spec.describe()}: its {what} cannot be allocated: {exc}") from exc


__all__ = ["KeyStorage"]
