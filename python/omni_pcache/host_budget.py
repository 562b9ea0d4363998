"""The cache's host-memory budget (`CacheConfig.host_budget_bytes`): what its keys hold on the
host (each key's pool, an immediate key's staging pages, the ledger's columns per key, and
the most rows kept aside for late reads: ``max_preserved_rows`` of the widest key's) may not
pass it. Checked when a save brings keys never registered before, the only time what the
cache can hold grows, before their ledger columns, pool or pages are allocated.

What a cache admitted is shared with the other caches of this host (`host_reservations`), and
each cache counts what the others hold against the host's memory, so several processes'
caches (an omni pipeline's stages) are held to the host together.

Engine thread only (`KeyRegistry.register`, from `PrefixCache.save`), but for `release`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from omni_pcache._native import Ledger
from omni_pcache.config import CacheConfig
from omni_pcache.errors import ConfigError
from omni_pcache.host_memory import footprint, host_memory_limit, size_text
from omni_pcache.host_reservations import HostReservations, Reservation, reservations_dir
from omni_pcache.keys import KeySpec
from omni_pcache.pages import StagingPages
from omni_pcache.pool import HostPool


def budget_limit(config: CacheConfig) -> tuple[int | None, str]:
    """The budget of a cache of ``config`` in bytes (``None``: none known) and where it came
    from, for messages: ``host_budget_bytes``, else this host's memory (a pool past it would
    be killed for memory, not refused)."""
    if config.host_budget_bytes is None:
        return host_memory_limit(), "this host's memory (CacheConfig.host_budget_bytes=None)"
    return config.host_budget_bytes, "CacheConfig.host_budget_bytes"


class Holding(NamedTuple):
    """What a cache holds on the host, as its budget counts it: per key held, per new key
    needed (named by `KeySpec.describe`), the ledger's columns, and the room for rows kept
    aside for late reads (``max_preserved_rows`` of the widest row held or new)."""

    held: dict[str, int]
    needs: dict[str, int]
    columns: int
    preserved: int

    @property
    def total(self) -> int:
        return sum(self.held.values()) + sum(self.needs.values()) + self.columns + self.preserved


class HostBudget:
    """Refuses new keys past the budget of ``config`` (`budget_limit`; none known: nothing
    refused), or past this host's memory with what the other caches on the host hold (their
    reservations: `host_reservations`; not for a budget past the host's memory, which says the
    host's memory is not the limit); ``deferred`` names the keys without staging pages."""

    def __init__(
        self, config: CacheConfig, deferred: frozenset[str], pool: HostPool, pages: StagingPages, ledger: Ledger
    ) -> None:
        self._limit, self._limit_name = budget_limit(config)
        host = self._limit if config.host_budget_bytes is None else host_memory_limit()
        # (the host's memory, which the caches on it share, a budget of its own or not; but a
        # budget past it says the host's memory is not the limit there (swap, ...): that cache
        # is held to its budget alone, and still counted by the others)
        self._host = host if host is not None and (self._limit is None or self._limit <= host) else None
        self._pool = pool
        self._pages = pages
        self._ledger = ledger
        self._deferred = deferred  # (keys kept on the device until finish: no staging pages)
        self._max_preserved_rows = config.max_preserved_rows
        # The row bytes of each key admitted: the widest of those the cache holds (and the new
        # keys') sizes the room kept aside for late reads.
        self._row_bytes: dict[str, int] = {}
        self._recorded: int | None = None  # (what `record` last wrote for the others to count)
        self._shared = HostReservations(reservations_dir() if host is not None else None)

    @property
    def limit(self) -> int | None:
        """The budget in bytes (``None``: none known)."""
        return self._limit

    @property
    def reserved(self) -> int:
        """What the budget counted this cache holding at its last admission (or `refresh`),
        as the other caches count it: 0 before any."""
        return self._recorded or 0

    def check(self, new: Sequence[KeySpec], new_columns: int) -> None:
        """Raises `ConfigError` when the ``new`` keys' storage (and ``new_columns`` more ledger
        columns: a forgotten key's are reused) would take what the cache holds past its budget,
        or, with what the other caches on this host hold, past the host's memory; else records
        what the cache holds for the others to count."""
        if self._limit is None:  # (and so no host's memory known either)
            return
        held, needs, columns, preserved = holding = self._holding(new, new_columns)
        total = holding.total
        others: list[Reservation] = []
        if total <= self._limit:
            with self._shared.admit() as others:
                if self._host is None or total + sum(other.nbytes for other in others) <= self._host:
                    self._row_bytes.update((spec.name, spec.row_bytes) for spec in new)
                    self._shared.record(total)
                    self._recorded = total
                    return
        listed = ", ".join(f"{what}: {size_text(nbytes)}" for what, nbytes in needs.items())
        holding = ", ".join(f"{name!r}: {size_text(nbytes)}" for name, nbytes in held.items()) or "none"
        if total > self._limit:
            past = f", past {self._limit_name}: {size_text(self._limit)} ({self._limit:,} bytes)"
            advice = "Cache fewer keys (CachePolicy), lower num_blocks, or raise CacheConfig.host_budget_bytes"
        else:
            assert self._host is not None
            host = f"{size_text(self._host)} ({self._host:,} bytes)"
            past = f"{_with_others(total, others)}, past this host's memory: {host}"
            advice = (
                "Cache fewer keys (CachePolicy), lower num_blocks here or in the other caches, or close them "
                "(`omni-pcache reservations` lists them)"
            )
        raise ConfigError(
            f"this step's new keys would bring the cache's host memory to {size_text(total)} ({total:,} bytes)"
            f"{past}. New keys (pool and staging pages): {listed}. Keys held: {holding}. "
            f"Ledger columns: {size_text(columns)}. Rows kept aside for late reads, at most: {size_text(preserved)} "
            f"(max_preserved_rows of the widest row). {advice}"
        )

    def refresh(self) -> None:
        """After a save refused once its keys were admitted (their storage could not be
        allocated, ...): records what the cache holds now, if less than it last recorded, so
        the others do not count keys it dropped (engine thread)."""
        if self._recorded is None or self._shared.released:
            return
        total = self._holding((), 0).total
        if total < self._recorded:
            with self._shared.admit():
                self._shared.record(total)
                self._recorded = total

    def _holding(self, new: Sequence[KeySpec], new_columns: int) -> Holding:
        """What the cache would hold with the ``new`` keys and ``new_columns`` more ledger
        columns (pinned storage at its page-locked size: `footprint`)."""
        pool, pages = self._pool, self._pages
        held: dict[str, int] = {}
        for store in (pool, pages):
            for name, nbytes in store.nbytes().items():
                held[name] = held.get(name, 0) + footprint(nbytes, store.pinned)
        needs = {
            spec.describe(): footprint(pool.bytes_for(spec), pool.pinned)
            + (0 if spec.name in self._deferred else footprint(pages.bytes_for(spec), pages.pinned))
            for spec in new
        }
        columns = (self._ledger.num_keys + new_columns) * self._ledger.key_column_bytes
        widest = max((*(self._row_bytes.get(name, 0) for name in held), *(spec.row_bytes for spec in new)), default=0)
        return Holding(held, needs, columns, self._max_preserved_rows * widest)

    def release(self) -> None:
        """Gives up this cache's reservation (any thread; idempotent): at `PrefixCache.close`."""
        self._shared.release()


def _with_others(total: int, others: Sequence[Reservation]) -> str:
    """The other caches' part of a refusal's message (none: nothing)."""
    if not others:
        return ""
    elsewhere = sum(other.nbytes for other in others)
    each = ", ".join(f"{_owner(other)}: {size_text(other.nbytes)}" for other in others)
    return (
        f", and with the {size_text(elsewhere)} that other caches on this host have reserved ({each}) "
        f"to {size_text(total + elsewhere)} ({total + elsewhere:,} bytes)"
    )


def _owner(other: Reservation) -> str:
    return "another cache of this process" if other.pid == os.getpid() else f"pid {other.pid} ({other.name})"


__all__ = ["HostBudget", "budget_limit"]
