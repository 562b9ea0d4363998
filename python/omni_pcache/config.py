"""Sizing and behaviour of a `PrefixCache`: `CacheConfig` (engine-shaped sizes) and
`CachePolicy` (what a model caches)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from omni_pcache.errors import ConfigError

MiB = 1 << 20

HIDDEN = "hidden"
"""The key under which hidden states are cached (and reported in stats)."""


MAX_STAGING_DEPTH = 1024
"""Most step ids a cache lets be unconsumed at once (`CacheConfig.staging_depth`)."""
MAX_STAGING_TOKENS = 1 << 24
"""Most rows of one step (`CacheConfig.staging_capacity_tokens`)."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes of one cache, taken from the engine's KV cache and scheduler.

    ``num_blocks`` and ``block_size`` must match the engine's KV cache: rows are addressed by
    its slot ids. ``staging_depth`` bounds how many step ids may be unconsumed at once (each
    holds one staging page of ``staging_capacity_tokens`` rows per key until materialized or
    discarded). ``claim_timeout_s`` bounds every wait (a free staging page, a write task, a
    preserved copy) before a diagnostic error. ``max_preserved_rows`` bounds the rows kept
    aside for late reads of reused blocks. ``threaded=False`` runs pool writes inline on the
    engine thread (debugging only).

    ``inline_write_bytes``: a step whose rows are on the host when `PrefixCache.save` returns
    (CPU outputs small enough to be copied inside save) and whose cached rows total fewer
    bytes than this is written to the pool inside save when the committer is idle. On a
    CPU-only host that is cheaper than waking the committer thread, which would then contend
    with the engine thread for the GIL. 0 hands every step to the committer. Steps from CUDA
    outputs always go to the committer.

    ``pin_pool``: allocate the host pool (a row per KV slot per key) in pinned memory. Off by
    default: nothing copies between the pool and a device (device→host copies land in the
    pinned staging pages, and the committer scatters them into the pool on the CPU), while
    torch's pinned allocator rounds every allocation up to a power of two (a 9 GiB pool would
    page-lock 16 GiB) and allocates it on the engine thread at the key's first save.

    ``host_budget_bytes``: the most host memory all keys may hold: each key's pool, staging
    pages (page-locked sizes where pinned) and ledger columns, and the most rows kept aside
    (``max_preserved_rows`` of the widest key's; `host_budget.HostBudget`). A save
    that brings keys whose storage would pass it raises `ConfigError` before allocating
    anything, and caches nothing of that step.
    ``None`` (the default) takes this host's memory, the smaller of its physical memory and
    its control group's limit (`host_memory.host_memory_limit`, read when the cache is made):
    a pool past that allocates fine, since Linux lends more than it has, and is killed for
    memory once the engine has used enough of its slots. Every cache also counts what the
    other live caches of this user on the host (or in its container) hold, in this process or
    others (an omni pipeline's stages), shared through a directory in ``/dev/shm``
    (`host_reservations`; the variable ``OMNI_PCACHE_RESERVATIONS_DIR`` names another, and
    empty shares none). A number is this cache's share: the cache is held to it, and with the
    others to the host's memory. A number past the host's memory says that is not the limit
    here (swap, ...): the cache is held to its number alone (the others still count what it
    holds). Set a share where processes without a cache need much of the host.

    ``prefetch_hits``: at `PrefixCache.begin_step`, hand the committer thread a gather of each
    new hit's committed prefix rows, which it runs during the forward (`omni_pcache.prefetch`),
    so `materialize` finds them gathered, usually into the very tensor it returns. Rows are
    served exactly as without it. It costs the engine thread at most a wake-up of the committer per
    step with new hits, and the host a core during the forward: a gain where the forward runs
    on a GPU and leaves the host's cores idle, a loss where a CPU forward needs them (measured
    on the embedded engine). ``None`` (the default) turns it on once the first save with
    cached rows brings them on a CUDA device, and leaves it off for CPU rows; ``True`` or
    ``False`` decide for every step. Without ``threaded`` no thread runs it: nothing is prefetched.
    """

    num_blocks: int
    block_size: int
    staging_depth: int = 4
    staging_capacity_tokens: int = 8192
    claim_timeout_s: float = 30.0
    device_budget_bytes: int = 512 * MiB
    copy_chunk_bytes: int = 16 * MiB
    max_preserved_rows: int = 65536
    threaded: bool = True
    inline_write_bytes: int = 256 * 1024
    pin_pool: bool = False
    prefetch_hits: bool | None = None
    host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        positive = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "staging_depth": self.staging_depth,
            "staging_capacity_tokens": self.staging_capacity_tokens,
            "copy_chunk_bytes": self.copy_chunk_bytes,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        # (upper bounds far past any engine's, so a typo fails here, not as an allocation abort)
        for name, most in (("staging_depth", MAX_STAGING_DEPTH), ("staging_capacity_tokens", MAX_STAGING_TOKENS)):
            if getattr(self, name) > most:
                raise ConfigError(f"CacheConfig.{name} must be at most {most:,}, got {getattr(self, name)!r}")
        for name in ("threaded", "pin_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"CacheConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.prefetch_hits is not None and not isinstance(self.prefetch_hits, bool):
            raise ConfigError(f"CacheConfig.prefetch_hits must be None, True or False, got {self.prefetch_hits!r}")
        for name in ("device_budget_bytes", "max_preserved_rows", "inline_write_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"CacheConfig.{name} must be an int >= 0, got {value!r}")
        budget = self.host_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ConfigError(f"CacheConfig.host_budget_bytes must be None or an int >= 0, got {budget!r}")
        timeout = self.claim_timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and math.isfinite(timeout)):
            raise ConfigError(f"CacheConfig.claim_timeout_s must be a finite number, got {self.claim_timeout_s!r}")
        if not 0 <= self.claim_timeout_s <= threading.TIMEOUT_MAX:
            raise ConfigError(
                f"CacheConfig.claim_timeout_s must be in [0, {threading.TIMEOUT_MAX:g}] s (threading.TIMEOUT_MAX), "
                f"got {self.claim_timeout_s!r}"
            )
        if self.num_blocks * self.block_size >= 2**32:
            raise ConfigError(f"num_blocks * block_size = {self.num_blocks * self.block_size} slots exceeds 2**32 - 1")

    @property
    def num_slots(self) -> int:
        """Slots per key: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size


def _key_names(names: object, what: str) -> frozenset[str]:
    """A policy's set of mm key names: a collection of str (a single str is refused: its
    characters would be read as the names)."""
    if isinstance(names, str | bytes):
        raise ConfigError(f"CachePolicy.{what} must be a collection of key names, got the single {names!r}")
    try:
        keys = frozenset(names)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"CachePolicy.{what} must be a collection of key names, got {names!r}") from None
    bad = sorted(repr(k) for k in keys if not isinstance(k, str))
    if bad:
        raise ConfigError(f"CachePolicy.{what} holds key names (str), got {', '.join(bad)}")
    return keys


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """What one model caches.

    ``cache_hidden``: cache the hidden states passed to `PrefixCache.save`. ``token_keys``:
    ``None`` discovers per-token mm keys by shape (dim 0 equals the step's token count, padded
    or not) and classifies each key once; an explicit set turns discovery off, so only those
    keys are cached and every other mm entry is leftover. ``deferred_keys``: per-token keys kept
    on the device until their request finishes (they must be per-token keys; ``"hidden"``
    names the hidden states, with or without ``token_keys``, when ``cache_hidden``).
    ``reclassify_each_step`` (discovery only): vLLM-Omni's rule instead of classifying each
    key once, for models whose mm entries may look per-token in one step and not in the next
    (a tensor with a row per request, in a decode step where every request has one token): an
    entry is per-token in a step when it is a tensor of 2+ dims whose dim 0 is the step's token
    count (padded or not) and, for a key seen before, whose rows have that key's shape and
    dtype; otherwise it is that step's leftover, not an error (deferred keys included). A new
    key is found only in a step where some request has more than one row, so a tensor with a
    row per request never becomes one. A step that leaves a key out holds no rows of it: a
    later hit over those positions that reads the key raises `UnservableHitError` (where
    vLLM-Omni's cache would serve whatever its pool held there).
    """

    cache_hidden: bool = True
    token_keys: frozenset[str] | None = None
    deferred_keys: frozenset[str] = field(default_factory=frozenset)
    reclassify_each_step: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cache_hidden, bool):
            raise ConfigError(f"CachePolicy.cache_hidden must be a bool, got {self.cache_hidden!r}")
        if self.token_keys is not None:
            object.__setattr__(self, "token_keys", _key_names(self.token_keys, "token_keys"))
            if HIDDEN in self.token_keys:
                raise ConfigError(f"{HIDDEN!r} is reserved for hidden states; use cache_hidden")
        object.__setattr__(self, "deferred_keys", _key_names(self.deferred_keys, "deferred_keys"))
        if HIDDEN in self.deferred_keys and not self.cache_hidden:
            raise ConfigError(f"deferred_keys names {HIDDEN!r}, but cache_hidden=False caches no hidden states")
        if not isinstance(self.reclassify_each_step, bool):
            raise ConfigError(f"CachePolicy.reclassify_each_step must be a bool, got {self.reclassify_each_step!r}")
        if self.reclassify_each_step and self.token_keys is not None:
            raise ConfigError("reclassify_each_step applies to discovered keys: it needs token_keys=None")
        if self.token_keys is not None and not self.deferred_keys <= self.token_keys | {HIDDEN}:
            missing = sorted(self.deferred_keys - self.token_keys - {HIDDEN})
            raise ConfigError(f"deferred_keys {missing} are not in token_keys")
