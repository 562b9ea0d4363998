"""Host memory of each cached key: its pool (a row per KV slot) and, for an immediate key, its
staging pages, allocated when a save first shows a key set and freed again when that save is
refused before any row reached them.

Engine thread only (from `PrefixCache.save`); the pool's and the pages' own locks cover their
readers on other threads.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_pcache.errors import ConfigError, InvalidInputError
from omni_pcache.keys import KeySpec, StepKeys
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool


class KeyStorage:
    """Allocates and frees the pool storage and staging pages of keys, within ``budget`` bytes
    of host memory (`CacheConfig.host_budget_bytes`, resolved; ``None``: no limit known).
    ``bytes_written`` is the pool writer's per-key count (`PoolWriter.bytes_written`), which
    lists every key from its allocation on."""

    def __init__(
        self,
        pool: HostPool,
        pages: StagingPages,
        bytes_written: dict[str, int],
        budget: int | None = None,
        budget_name: str = "CacheConfig.host_budget_bytes",
    ) -> None:
        self._pool = pool
        self._pages = pages
        self._bytes_written = bytes_written
        self._budget = budget
        self._budget_name = budget_name  # (what the budget is, for the error)

    def make_room(self, keys: StepKeys) -> None:
        """Pool storage for every key of a new key set, and staging room for its immediate ones
        (`KeyRegistry.step_keys`' ``prepare``). Storage past the budget is a `ConfigError`,
        raised before anything is allocated; storage that cannot be allocated (a row too wide
        for the host) is an `InvalidInputError`."""
        self._check_budget(keys)
        for spec in keys.specs:
            _allocate(spec, "host pool", self._pool.ensure)
            self._bytes_written.setdefault(spec.name, 0)  # (listed from the start, 0 until written)
        for spec in keys.immediate:
            _allocate(spec, "staging pages", self._pages.ensure)

    def _check_budget(self, keys: StepKeys) -> None:
        """Refuses a key set whose storage would take the cache past its budget: what every key
        holds now, with this set's keys as they will be held (a key seen before holds the same)."""
        if self._budget is None:
            return
        pool, pages = self._pool.footprints(), self._pages.footprints()
        for spec in keys.specs:
            pool[spec.name] = self._pool.footprint(spec)
        for spec in keys.immediate:
            pages[spec.name] = self._pages.footprint(spec)
        total = sum(pool.values()) + sum(pages.values())
        if total <= self._budget:
            return
        held = self._pool.footprints()
        per_key = ", ".join(
            f"{spec.describe()}: {_size(pool[spec.name] + pages.get(spec.name, 0))}"
            + (" (new)" if spec.name not in held else "")
            for spec in keys.specs
        )
        raise ConfigError(
            f"the pool and staging pages of this step's keys would hold {_size(total)} of host memory "
            f"({per_key}), past {self._budget_name}: {_size(self._budget)}; cache fewer keys "
            "(CachePolicy), lower num_blocks, or raise CacheConfig.host_budget_bytes"
        )

    def free(self, names: tuple[str, ...]) -> None:
        """Frees the storage of keys forgotten before any row was written to it (a save refused
        after registering them: `KeyRegistry.forget`)."""
        for name in names:
            self._pool.drop(name)
            self._pages.drop(name)
            if self._bytes_written.get(name) == 0:
                del self._bytes_written[name]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _allocate(spec: KeySpec, what: str, ensure: Callable[[KeySpec], None]) -> None:
    try:
        ensure(spec)
    except (RuntimeError, MemoryError) as exc:  # (torch's allocation failures)
        raise InvalidInputError(f"{spec.describe()}: its {what} cannot be allocated: {exc}") from exc


__all__ = ["KeyStorage"]
