"""The exception hierarchy of omni_pcache, rooted at `PrefixCacheError`.

The native core raises these classes too (``crates/pcache-py/src/errors.rs`` maps every core
error here), with structured attributes where they help: ``task_id``/``from_state``/
``to_state`` on `TaskStateError`, ``step_id``/``outstanding`` on `StepIdError`, ``holders`` on
`StagingTimeoutError`. A raised error never leaves the object that raised it half-changed.
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error omni_pcache raises on purpose."""


class InvalidInputError(PrefixCacheError, ValueError):
    """An argument was wrong (slot out of range, bad dtype, unknown id, mismatched lengths)."""


class ConfigError(PrefixCacheError, ValueError):
    """A configuration omni_pcache cannot serve; the message names the option to change."""


class TaskStateError(PrefixCacheError):
    """A write-task transition that is not an edge of the state machine."""

    task_id: int
    from_state: str
    to_state: str


class StepIdError(PrefixCacheError):
    """A step id consumed twice, or never issued (a request the step does not hold is an
    `InvalidInputError`, and leaves the id unconsumed)."""

    step_id: int
    outstanding: list[int]


class StagingTimeoutError(PrefixCacheError):
    """No staging page became free in time; ``holders`` lists who holds each page."""

    holders: list[list[tuple[str, int]]]


class CacheClosedError(PrefixCacheError):
    """The cache (or one of its registries) was closed; waiters are woken with this."""


class UnservableHitError(PrefixCacheError):
    """A hit whose rows cannot be served: never written, overwritten, or its write failed."""


class WriteTimeoutError(PrefixCacheError):
    """A write task did not reach the pool in time; ``states`` maps each stuck task to its state."""

    states: dict[int, str]


class WriteFailedError(PrefixCacheError):
    """A copy or pool write failed; raised by every later call until the cache is reset."""


__all__ = [
    "CacheClosedError",
    "ConfigError",
    "InvalidInputError",
    "PrefixCacheError",
    "StagingTimeoutError",
    "StepIdError",
    "TaskStateError",
    "UnservableHitError",
    "WriteFailedError",
    "WriteTimeoutError",
]
