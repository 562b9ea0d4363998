"""Which mm entries are per-token keys (cached by slot) and which are leftover (passed through).

A per-token key has dim 0 equal to the step's token count (padded or not) and a fixed row
shape and dtype. With discovery on (``CachePolicy.token_keys is None``) each name is
classified once, on the first step that shows it (or, with ``reclassify_each_step``, afresh at
every step, as vLLM-Omni does); an explicit ``token_keys`` set turns discovery off. A later
step whose tensor breaks a key's classification raises `InvalidInputError` before anything is
written (with ``reclassify_each_step``, that entry is the step's leftover instead).
Classifying a step (`classify`) only checks it; its new keys and leftover names are remembered
by `register`, which `PrefixCache.save` calls once nothing can refuse the step for its input
any more, so a refused step leaves the classification as it was (a corrected retry is
classified afresh).

Engine thread only (called from `PrefixCache.save`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_pcache.config import HIDDEN, CachePolicy
from omni_pcache.errors import InvalidInputError
from omni_pcache.row_arrays import numpy_readable


@dataclass(frozen=True, slots=True)
class KeySpec:
    """A cached per-token tensor: its name, row shape (shape after dim 0), dtype and ledger id."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    key_id: int
    row_bytes: int = field(init=False, compare=False)  # bytes of one row

    def __post_init__(self) -> None:
        numel = 1
        for d in self.row_shape:
            numel *= d
        object.__setattr__(self, "row_bytes", numel * self.dtype.itemsize)

    def describe(self) -> str:
        return f"{self.name!r} rows {tuple(self.row_shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True, slots=True)
class StepKeys:
    """A step's cached keys as save uses them: all of them (in classification order), the
    immediate ones (staged and written with the step) and the deferred ones, with the
    immediate rows' total width and the widest row, and the registered keys it leaves out.
    Made once per key set (`KeyRegistry.step_keys`); every step with the same keys shares it."""

    specs: tuple[KeySpec, ...]
    immediate: tuple[KeySpec, ...]
    deferred: tuple[KeySpec, ...]
    immediate_row_bytes: int  # bytes of one row of every immediate key
    max_row_bytes: int  # the widest row of any key (0 without keys)
    # Whether every immediate key's rows can be read by the native write as numpy arrays of
    # their own dtype (`row_arrays.numpy_rows`), as a small step save writes itself is.
    immediate_numpy_readable: bool
    # Keys registered before that these are not (a step that leaves them out has no rows of
    # them): current, since registering a key drops every `StepKeys` made before it.
    omitted: tuple[KeySpec, ...] = ()


def row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one row (a slice along dim 0) of ``rows``: what its key's spec would record."""
    return math.prod(rows.shape[1:]) * rows.element_size()


def _what(name: str) -> str:
    """How an error message names a key."""
    return "hidden states" if name == HIDDEN else f"mm key {name!r}"


def _is_per_token(value: Any, n: int, n_padded: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] in (n, n_padded)


def _fits_this_step(value: Any, n: int, n_padded: int, spec: KeySpec | None) -> bool:
    """`CachePolicy.reclassify_each_step`'s test: a dense tensor of 2+ dims with a row per token
    of this step, with ``spec``'s rows when the key is known."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] not in (n, n_padded):
        return False
    if value.layout != torch.strided or value.is_quantized or value.is_meta:
        return False
    return spec is None or (tuple(value.shape[1:]) == spec.row_shape and value.dtype == spec.dtype)


class KeyRegistry:
    """Classifies mm entries and remembers each key's spec. ``add_key`` registers a new key in
    the ledger and returns its id; ``check_room(new_specs, new_ledger_columns)`` refuses new
    keys the host cannot hold (`host_budget.HostBudget.check`) before any is registered."""

    def __init__(self, policy: CachePolicy, add_key, check_room) -> None:
        self._policy = policy
        self._add_key = add_key
        self._check_room = check_room
        self._specs: dict[str, KeySpec] = {}
        self._leftover: set[str] = set()
        self._step_keys: dict[tuple[str, ...], StepKeys] = {}
        self._spare_key_ids: list[int] = []  # ledger ids of keys forgotten (`forget`), reused first

    def _check(self, name: str, value: Any, n: int, n_padded: int, spec: KeySpec | None) -> None:
        if not isinstance(value, torch.Tensor):
            raise InvalidInputError(f"{_what(name)} must be a tensor, got {type(value).__name__}")
        if value.layout != torch.strided or value.is_quantized:
            layout = "quantized" if value.is_quantized else str(value.layout).removeprefix("torch.")
            raise InvalidInputError(f"{_what(name)} is a {layout} tensor; the cache keeps dense (strided) rows")
        if value.is_meta:
            raise InvalidInputError(f"{_what(name)} is a meta tensor: it has no rows to cache")
        if value.dim() < 1 or value.shape[0] not in (n, n_padded):
            raise InvalidInputError(
                f"{_what(name)} has shape {tuple(value.shape)}; dim 0 must be the step's token count "
                f"{n} (or the padded count {n_padded})"
            )
        if spec is not None and (value.shape[1:] != spec.row_shape or value.dtype != spec.dtype):
            got = f"rows {tuple(value.shape[1:])} {str(value.dtype).removeprefix('torch.')}"
            raise InvalidInputError(f"{_what(name)} was classified as {spec.describe()}, but this step has {got}")

    def _spec_for(self, name: str, value: torch.Tensor) -> KeySpec:
        """Registers a new key (its ledger id: a forgotten key's, else a new one)."""
        try:
            key_id = self._spare_key_ids.pop() if self._spare_key_ids else self._add_key()
        except InvalidInputError as exc:  # (the ledger's columns for it cannot be allocated)
            raise InvalidInputError(f"{_what(name)}: {exc}; lower num_blocks or give the host more memory") from None
        spec = self._specs[name] = KeySpec(name, tuple(value.shape[1:]), value.dtype, key_id)
        self._step_keys.clear()  # (their `omitted` keys are made again with this one)
        return spec

    def classify(
        self, hidden: Any, mm: dict[str, Any], n: int, n_padded: int, *, one_row_each: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Splits a step's outputs into per-token rows ``{name: tensor}`` and leftover
        ``{name: value}``, checked against the keys registered so far. Registers nothing (see
        `register`). ``one_row_each``: every request with rows has one (a tensor with a row per
        request has a row per token too: with ``reclassify_each_step`` no new key is found in
        such a step). A request of the batch with no rows is not counted: a caller that passes
        tensors with a row for it too (vLLM schedules none) may see one found as a key."""
        if not isinstance(mm, dict):
            raise InvalidInputError(f"mm must be a dict of name -> value, got {type(mm).__name__}")
        cached: dict[str, Any] = {}
        leftover: dict[str, Any] = {}
        if self._policy.cache_hidden:
            if hidden is None:
                raise InvalidInputError("hidden states are None but CachePolicy.cache_hidden is True")
            self._check(HIDDEN, hidden, n, n_padded, self._specs.get(HIDDEN))
            # (rows that require grad are copied without their graph: the cache keeps values only)
            cached[HIDDEN] = hidden.detach() if hidden.requires_grad else hidden
        token_keys = self._policy.token_keys
        for name, value in mm.items():
            if not isinstance(name, str):
                raise InvalidInputError(f"mm keys must be str, got {name!r}")
            if name == HIDDEN:
                raise InvalidInputError(f"mm key {HIDDEN!r} is reserved for hidden states")
            if token_keys is not None:
                per_token = name in token_keys
            elif self._policy.reclassify_each_step:
                spec = self._specs.get(name)
                known = spec is not None or name in self._policy.deferred_keys  # (named: no coincidence)
                per_token = n > 0 and (known or not one_row_each) and _fits_this_step(value, n, n_padded, spec)
            elif name in self._specs:
                per_token = True
            elif name in self._leftover:
                per_token = False
            else:
                per_token = n > 0 and _is_per_token(value, n, n_padded)
            if per_token:
                self._check(name, value, n, n_padded, self._specs.get(name))
                cached[name] = value.detach() if value.requires_grad else value
            else:
                leftover[name] = value
        return cached, leftover

    def register(
        self, cached: dict[str, torch.Tensor], leftover: dict[str, Any], n: int
    ) -> tuple[dict[str, tuple[KeySpec, torch.Tensor]], tuple[str, ...]]:
        """Remembers a classified step's new keys (each registered in the ledger) and, with
        discovery on, its new leftover names; returns its rows as ``{name: (spec, tensor)}``
        and the names it added (for `forget`, should the step still be refused). New keys past
        the host budget register nothing (``check_room`` raises `ConfigError`)."""
        added: list[str] = []
        out: dict[str, tuple[KeySpec, torch.Tensor]] = {}
        try:
            for name, rows in cached.items():
                spec = self._specs.get(name)
                if spec is None:
                    if not added:  # (the step's first new key: all of them, before any registers)
                        self._check_new_keys(cached)
                    spec = self._spec_for(name, rows)  # (InvalidInputError: no ledger columns for it)
                    added.append(name)
                out[name] = (spec, rows)
        except BaseException:
            self.forget(tuple(added))  # (a refused step registers none of its keys)
            raise
        if leftover and self._policy.token_keys is None and n > 0 and not self._policy.reclassify_each_step:
            new_leftover = [k for k in leftover if k not in self._specs and k not in self._leftover]
            self._leftover.update(new_leftover)
            added += new_leftover
        return out, tuple(added)

    def _check_new_keys(self, cached: dict[str, torch.Tensor]) -> None:
        """``check_room`` for the keys of ``cached`` not registered yet (before any of them is)."""
        new = [
            KeySpec(name, tuple(rows.shape[1:]), rows.dtype, -1)
            for name, rows in cached.items()
            if name not in self._specs
        ]
        self._check_room(new, max(0, len(new) - len(self._spare_key_ids)))

    def forget(self, names: tuple[str, ...]) -> None:
        """Undoes `register` for a step refused after it (its key storage could not be
        allocated, ...): those keys and leftover names are classified afresh by a later step,
        their ledger ids reused (nothing was claimed on them)."""
        for name in names:
            spec = self._specs.pop(name, None)
            if spec is not None:
                self._spare_key_ids.append(spec.key_id)
            self._leftover.discard(name)
        if names:
            self._step_keys.clear()

    def step_keys(self, cached: dict[str, tuple[KeySpec, Any]], prepare: Callable[[StepKeys], None]) -> StepKeys:
        """The `StepKeys` of a step's cached keys (`classify`'s first result). A key set seen
        for the first time is handed to ``prepare`` (which gives its keys pool and staging room)
        and remembered only once that returns: a ``prepare`` that raised runs again next step."""
        names = tuple(cached)
        keys = self._step_keys.get(names)
        if keys is not None:
            return keys
        specs = tuple(spec for spec, _ in cached.values())
        deferred_names = self._policy.deferred_keys
        immediate = tuple(spec for spec in specs if spec.name not in deferred_names)
        keys = StepKeys(
            specs,
            immediate,
            tuple(spec for spec in specs if spec.name in deferred_names),
            sum(spec.row_bytes for spec in immediate),
            max((spec.row_bytes for spec in specs), default=0),
            all(numpy_readable(spec.dtype) for spec in immediate),
            tuple(spec for name, spec in self._specs.items() if name not in cached),
        )
        prepare(keys)
        self._step_keys[names] = keys
        return keys
