"""Assembling a step's outputs at `PrefixCache.materialize` (any thread, once per step id).

Per request, the rows it returns come from: the pool (a hit's span, gathered by `HitReader`
straight into the front of the request's own tensor), and this step's rows — read from the
caller's CPU tensors when materialize runs on the saving thread before the next `begin_step`
(the caller may not reuse them until then), else from the staging page once the step's copy
is done, or from a deferred key's device clone. The misses of a step get slices of one host
copy of their rows per key, as a batch's rows are slices of the batch; hits get tensors of
their own. Every returned tensor is the caller's to keep or write.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from omni_pcache.config import HIDDEN
from omni_pcache.copy_engine import CopyEngine, CopyHandle
from omni_pcache.deferred import Clone
from omni_pcache.events import StepOutputs
from omni_pcache.pages import StagingPages
from omni_pcache.reads import HitRead, HitReader
from omni_pcache.snapshot import is_per_row
from omni_pcache.stats import Counters


@dataclass(slots=True)
class StepRecord:
    """What `materialize` needs of one saved step."""

    step_id: int
    page: int
    handle: CopyHandle
    n: int
    n_padded: int
    rows: dict[str, tuple[int, int, int]]  # req_id -> (first row in the page, rows, rows not returned)
    keys: list[str]
    hits: dict[str, HitRead]
    leftover: dict[str, Any]
    clones: dict[str, Clone]  # this step's rows of deferred keys
    # The caller's CPU rows of the immediate keys, readable in place by the saving thread until
    # the next begin_step (the copy fence `epoch`), so materialize there skips the copy wait.
    sources: dict[str, torch.Tensor]
    saved_by: int
    epoch: int


class OutputBuilder:
    """Builds `StepOutputs` from a consumed `StepRecord` (the materializing thread; takes the
    ledger lock only inside `HitReader.serve`)."""

    def __init__(
        self, pages: StagingPages, reader: HitReader, copies: CopyEngine, counters: Counters, timeout_s: float
    ) -> None:
        self._pages = pages
        self._reader = reader
        self._copies = copies
        self._counters = counters
        self._timeout_s = timeout_s

    def build(self, record: StepRecord, req_ids: Sequence[str]) -> StepOutputs:
        """Per-request outputs of the step; raises what `HitReader.serve` raises."""
        in_place = self._sources_in_place(record)
        sources = {name: self._step_rows(record, name, in_place) for name in record.keys}
        # Hit rows first: they come from the pool, so this step's own copy (run by the
        # committer meanwhile) is usually done by the time its rows are needed.
        hit_out = {}
        if record.hits:
            for req_id in req_ids:
                hit = record.hits.get(req_id)
                if hit is not None:
                    hit_out[req_id] = self._serve_hit(record, req_id, hit, sources)
        if not in_place:
            record.handle.wait()
        elif record.leftover:  # snapshots of CUDA leftovers land on the side stream, even in place
            record.handle.wait_device()
        misses = [r for r in req_ids if r not in hit_out] if hit_out else req_ids
        shared, sizes = self._miss_rows(record, misses, sources)
        # One split per key (a slice per request would cost a Python indexing call each).
        miss_out = {name: torch.split_with_sizes(rows, sizes) for name, rows in shared.items()} if misses else {}
        # Keys in the order asked, whichever path fills them (without hits: the misses' pieces).
        per_key = {name: dict.fromkeys(req_ids) for name in record.keys} if hit_out else {}
        for name, pieces in miss_out.items():
            if hit_out:
                per_key[name].update(zip(misses, pieces, strict=True))
            else:
                per_key[name] = dict(zip(misses, pieces, strict=True))
        hidden: dict[str, Any] | None = per_key.get(HIDDEN, {}) if HIDDEN in record.keys else None
        mm: dict[str, dict[str, Any]] = {name: per_key.get(name, {}) for name in record.keys if name != HIDDEN}
        spans = None  # each asked request's (start, count, drop), made for the first per-row entry
        for name, value in record.leftover.items():  # whole, or each request's rows of it
            if is_per_row(value, record.n, record.n_padded):
                spans = spans or [record.rows[req_id] for req_id in req_ids]
                mm[name] = {req_id: value[s : s + c] for req_id, (s, c, _) in zip(req_ids, spans, strict=True)}
            else:
                mm[name] = dict.fromkeys(req_ids, value)
        for req_id, out in hit_out.items():  # this step's rows behind the hit's
            start, count, drop = record.rows[req_id]
            for name, src in sources.items():
                out[name][out[name].shape[0] - (count - drop) :].copy_(src[start + drop : start + count])
                (hidden if name == HIDDEN else mm[name])[req_id] = out[name]  # type: ignore[index]
        return StepOutputs(hidden, mm)

    def _sources_in_place(self, record: StepRecord) -> bool:
        """Whether this step's rows may be read from the caller's CPU tensors: only on the thread
        that saved them and before its next begin_step, when the caller may reuse them."""
        return (
            len(record.sources) == len(record.keys) - len(record.clones)
            and record.saved_by == threading.get_ident()
            and record.epoch == self._copies.epoch
        )

    def _step_rows(self, record: StepRecord, name: str, in_place: bool) -> torch.Tensor:
        """This step's rows ``[0, n)`` of key ``name`` (a view): the deferred clone, the caller's
        tensor (``in_place``), else the staging page (valid once the copy handle is waited)."""
        if name in record.clones:
            return record.clones[name].rows(0, record.n)
        if in_place:
            return record.sources[name]
        return self._pages.page(name, record.page)[: record.n]

    @staticmethod
    def _miss_rows(record: StepRecord, misses: list[str], sources: dict[str, torch.Tensor]):
        """One host copy per key of the rows the misses return, in request order, and how many
        rows each miss has in it: its tensors are slices of that copy, as a batch's rows are."""
        spans = [record.rows[req_id] for req_id in misses]
        sizes = [count - drop for _, count, drop in spans]  # (drop <= count: never negative)
        runs: list[list[int]] = []
        if misses == list(record.rows) and not any(map(itemgetter(2), spans)):
            if record.n:  # every request of the step in batch order, each row returned: one run
                runs.append([0, record.n])
        else:
            for start, count, drop in spans:
                begin, end = start + drop, start + count
                if end > begin:
                    if runs and runs[-1][1] == begin:
                        runs[-1][1] = end
                    else:
                        runs.append([begin, end])
        if not runs:  # every miss returns zero rows (all delivered before)
            return {name: src.new_empty((0, *src.shape[1:]), device="cpu") for name, src in sources.items()}, sizes
        if len(runs) == 1:
            (begin, end), index = runs[0], None
        else:
            index = torch.from_numpy(np.concatenate([np.arange(b, e) for b, e in runs]))
        shared = {}
        for name, src in sources.items():
            if index is None:
                rows = src if begin == 0 and end == src.shape[0] else src[begin:end]  # (a view less: every row)
                shared[name] = rows.cpu() if rows.is_cuda else rows.clone()
            else:
                shared[name] = src.index_select(0, index.to(src.device)).cpu()
        return shared, sizes

    def _serve_hit(self, record: StepRecord, req_id: str, hit: HitRead, sources: dict) -> dict[str, torch.Tensor]:
        """A hit's own output tensor per key, its rows gathered into the front (this step's rows
        go behind them once copied)."""
        _, count, drop = record.rows[req_id]
        out = {
            name: torch.empty((hit.num_rows + count - drop, *src.shape[1:]), dtype=src.dtype)
            for name, src in sources.items()
        }
        into = {name: o[: hit.num_rows] for name, o in out.items()}
        served = self._reader.serve(hit, record.step_id, self._timeout_s, into)
        self._counters.add(
            rows_from_pool=served.from_pool, rows_in_flight=served.in_flight, rows_preserved=served.preserved
        )
        for name, rows in served.rows.items():
            if rows.data_ptr() != into[name].data_ptr():
                into[name].copy_(rows)
        return out


__all__ = ["OutputBuilder", "StepRecord"]
