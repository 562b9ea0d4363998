"""omni_pcache: a tensor prefix cache for paged-KV inference engines.

It keeps a host mirror of per-token outputs (hidden states, multimodal tensors) addressed by
the engine's KV block/slot ids, so a prefix-cache hit can still return full-sequence outputs.
The Rust core (``omni_pcache._native``) decides which rows go where and when; this package
moves tensors.
"""

from __future__ import annotations

from omni_pcache._native import (
    HASH_SEED,
    SOURCE_ABSENT,
    SOURCE_POOL,
    ClaimOutcome,
    Ledger,
    ReadPlan,
    StagingSlots,
    StepIds,
    WriteTasks,
    __version__,
)
from omni_pcache.cache import PrefixCache
from omni_pcache.config import HIDDEN, CacheConfig, CachePolicy
from omni_pcache.errors import (
    CacheClosedError,
    ConfigError,
    InvalidInputError,
    PrefixCacheError,
    StagingTimeoutError,
    StepIdError,
    TaskStateError,
    UnservableHitError,
    WriteFailedError,
    WriteTimeoutError,
)
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents, StepOutputs
from omni_pcache.hashing import block_hashes, hash_blocks
from omni_pcache.stats import CacheStats

__all__ = [
    "HASH_SEED",
    "HIDDEN",
    "SOURCE_ABSENT",
    "SOURCE_POOL",
    "CacheClosedError",
    "CacheConfig",
    "CachePolicy",
    "CacheStats",
    "ClaimOutcome",
    "ConfigError",
    "InvalidInputError",
    "Ledger",
    "NewRequest",
    "PrefixCache",
    "PrefixCacheError",
    "ReadPlan",
    "ResumedRequest",
    "StagingSlots",
    "StagingTimeoutError",
    "StepBatch",
    "StepEvents",
    "StepIdError",
    "StepIds",
    "StepOutputs",
    "TaskStateError",
    "UnservableHitError",
    "WriteFailedError",
    "WriteTasks",
    "WriteTimeoutError",
    "__version__",
    "block_hashes",
    "hash_blocks",
]
