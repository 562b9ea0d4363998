"""`CacheStats`: counters of one cache for metrics and logs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from omni_pcache.host_memory import size_text


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters.

    ``hits``/``misses`` count new requests with and without a prefix hit. Rows served for
    hits (``rows_*``, counted once per cached key: a 40-row hit with hidden states and one mm
    key adds 80) are split by where they came from: the pool, a write still in flight when the
    hit was planned (served after waiting for it), or a copy preserved when the block was reused;
    ``rows_prefetched`` counts the served rows (pool or in flight) that a prefetch had gathered
    off the engine thread (`CacheConfig.prefetch_hits`) instead of materialize.
    ``num_waits``/``wait_time_s`` cover every blocking wait (free staging page, in-flight
    write, preserved copy). ``bytes_written`` has every cached key the cache has seen (the
    hidden states as ``"hidden"``), with the bytes written to its pool so far (0 until its
    first write; a deferred key's are written when its request finishes). ``pool_bytes`` and
    ``staging_bytes`` are the host memory held per key. ``staging_holders`` lists who holds
    each staging page now. ``tasks_live`` counts the write tasks whose rows have not reached
    the pool (pending, queued, copying, or failed): 0 once `flush` returns, with no deferred
    rows open. ``requests_live`` counts the requests registered by `begin_step` (or taken as
    new by a `save` that names one it never registered) and not yet reported finished (as of
    the last `begin_step`): one that only grows means finished or
    aborted ids are not reaching the cache. ``reads_pending`` counts the hit reads (one per hit
    and key) planned at `save` and not yet served or released: 0 once every step id is
    consumed by `materialize` or `discard`. ``host_budget_bytes`` is the host memory the
    cache's keys may hold (`CacheConfig.host_budget_bytes` as resolved: by default this host's
    memory, or a data-parallel replica's share of it; ``None`` where it is not known).
    ``host_reserved_bytes`` is what that budget counted the cache holding at its last admission
    of new keys, and what the other caches on the host count it holding: its keys' pools and
    staging pages, ledger columns and the room for rows kept aside (`host_budget.HostBudget`).
    """

    hits: int = 0
    misses: int = 0
    rows_from_pool: int = 0
    rows_in_flight: int = 0
    rows_preserved: int = 0
    rows_prefetched: int = 0
    bytes_written: dict[str, int] = field(default_factory=dict)
    num_waits: int = 0
    wait_time_s: float = 0.0
    staging_holders: list[list[tuple[str, int]]] = field(default_factory=list)
    pool_bytes: dict[str, int] = field(default_factory=dict)
    staging_bytes: dict[str, int] = field(default_factory=dict)
    steps_outstanding: list[int] = field(default_factory=list)
    tasks_live: int = 0
    preserved_entries: int = 0
    device_bytes: int = 0
    deferred_open: int = 0
    requests_live: int = 0
    reads_pending: int = 0
    host_budget_bytes: int | None = None
    host_reserved_bytes: int = 0

    def summary(self, since: CacheStats | None = None) -> str:
        """One line for a log: the new requests, their prefix hits and the hit rows served since
        ``since`` (an earlier snapshot of the same cache; ``None``: since the cache was made),
        then what the cache holds now: its pools and staging pages on the host, what its host
        budget counts it holding (against the budget), live requests, step ids not consumed,
        writes not in the pool yet, and deferred rows on the device."""
        base = CacheStats() if since is None else since
        hits, misses = self.hits - base.hits, self.misses - base.misses
        pool, in_flight = self.rows_from_pool - base.rows_from_pool, self.rows_in_flight - base.rows_in_flight
        preserved, prefetched = self.rows_preserved - base.rows_preserved, self.rows_prefetched - base.rows_prefetched
        served = pool + in_flight + preserved
        text = f"new requests {hits + misses:,}, prefix hits {hits:,} ({_share(hits, hits + misses)}), "
        text += f"hit rows served {served:,}"
        if served:
            text += (
                f" (from the pool {_share(pool, served)}, in flight {_share(in_flight, served)}, "
                f"preserved {_share(preserved, served)}; prefetched {_share(prefetched, served)})"
            )
        waits = self.num_waits - base.num_waits
        text += f", waits {waits:,}" + (f" ({self.wait_time_s - base.wait_time_s:.3f} s)" if waits else "")
        host = sum(self.pool_bytes.values()) + sum(self.staging_bytes.values())
        text += f". Now: host memory {size_text(host)} allocated, {size_text(self.host_reserved_bytes)} reserved"
        if self.host_budget_bytes is not None:
            text += f" (budget {size_text(self.host_budget_bytes)})"
        text += (
            f", live requests {self.requests_live:,}, step ids not consumed {len(self.steps_outstanding):,}, "
            f"writes not in the pool {self.tasks_live:,}"
        )
        if self.device_bytes:
            text += f", deferred rows on the device {size_text(self.device_bytes)}"
        return text


def _share(part: int, whole: int) -> str:
    """``part`` of ``whole`` in percent, one decimal (0.0% of nothing)."""
    return f"{100 * part / whole if whole else 0.0:.1f}%"


class Counters:
    """Mutable counters behind `CacheStats` (any thread; one small lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.rows_from_pool = self.rows_in_flight = self.rows_preserved = self.rows_prefetched = 0
        self.num_waits = 0
        self.wait_time_s = 0.0

    # (one method per call site, not a **kwargs setattr loop: begin_step calls one every step,
    # right after the forward, where the generic loop cost ~6 us)
    def requests(self, hits: int, misses: int) -> None:
        """New requests registered by a begin_step, with and without a prefix hit."""
        with self._lock:
            self.hits += hits
            self.misses += misses

    def served(self, from_pool: int, in_flight: int, preserved: int, prefetched: int) -> None:
        """Rows a hit was served, by where they came from (and how many a prefetch gathered)."""
        with self._lock:
            self.rows_from_pool += from_pool
            self.rows_in_flight += in_flight
            self.rows_preserved += preserved
            self.rows_prefetched += prefetched

    def waited(self, seconds: float) -> None:
        """One blocking wait of ``seconds``."""
        with self._lock:
            self.num_waits += 1
            self.wait_time_s += seconds
