"""Assembling a step's outputs at `PrefixCache.materialize` (any thread, once per step id).

Per request, the rows it returns come from: the pool (a hit's span, gathered by `HitReader`
straight into the front of the request's rows), and this step's rows behind them — read from
the caller's CPU tensors when materialize runs on the saving thread before the next
`begin_step` (the caller may not reuse them until then), else from the staging page once the
step's copy is done, or from a deferred key's device clone. A small all-CPU step save wrote
itself has its own copies instead of page rows (``StepRecord.owned``): read at once, and
handed out as they are when the step has no hits and is returned whole.

The requests' tensors of a key are slices of one new host tensor per chunk of requests, as a
batch's rows are slices of the batch: one allocation and, for consecutive requests without
hits, one copy per key instead of one per request. A chunk holds requests in order up to
`OUTPUT_CHUNK_BYTES` per key (a larger request gets a chunk of its own). A hit whose prefix
rows a prefetch gathered with room for every row the request returns (less than a block to
spare) gets those rows instead, as a chunk of its own: slices of the prefetch's tensor for the
step's hits (`omni_pcache.prefetch`); the other requests share chunks as if it were not there.
Every returned tensor is the caller's to keep or write; keeping one keeps its chunk's memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from omni_pcache.config import HIDDEN
from omni_pcache.copy_engine import CopyEngine, CopyHandle, host_copy
from omni_pcache.deferred import Clone, reading
from omni_pcache.events import StepOutputs
from omni_pcache.prefetch import Prefetched
from omni_pcache.reads import HitRead, HitReader
from omni_pcache.snapshot import is_per_row
from omni_pcache.stats import Counters

OUTPUT_CHUNK_BYTES = 16 << 20
"""Most bytes per key of one output chunk (see the module docstring). glibc hands an allocation
of up to 32 MiB back from memory it already touched once one such was freed; a larger one is a
fresh mapping that pays a page fault per 4 KiB it is written (measured: one 42 MB output per
key at 8,192 tokens made materialize 2x slower than per-request tensors of ~6 MiB)."""


def request_groups(sizes: Sequence[int], row_bytes: int, own: Sequence[int] = ()) -> list[list[int]]:
    """The requests of each output chunk: those at the indices ``own`` one each (after the
    others), the others in order, grouped as `output_chunks` groups them (so consecutive
    unless an ``own`` one sat between them)."""
    if not own:
        return [list(range(a, b)) for a, b in output_chunks(sizes, row_bytes)]
    owned = set(own)
    rest = [i for i in range(len(sizes)) if i not in owned]
    groups = [rest[a:b] for a, b in output_chunks([sizes[i] for i in rest], row_bytes)]
    groups.extend([i] for i in own)
    return groups


def output_chunks(sizes: Sequence[int], row_bytes: int) -> list[tuple[int, int]]:
    """Consecutive requests ``[a, b)`` per output chunk: as many as fit ``OUTPUT_CHUNK_BYTES``
    at ``row_bytes`` per row (the widest key's), at least one each; none for no requests."""
    if not sizes:
        return []
    if row_bytes <= 0 or sum(sizes) * row_bytes <= OUTPUT_CHUNK_BYTES:
        return [(0, len(sizes))]
    limit = max(1, OUTPUT_CHUNK_BYTES // row_bytes)
    bounds: list[tuple[int, int]] = []
    first, rows = 0, 0
    for i, size in enumerate(sizes):
        if rows and rows + size > limit:
            bounds.append((first, i))
            first, rows = i, 0
        rows += size
    bounds.append((first, len(sizes)))
    return bounds


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
    staged: dict[str, torch.Tensor]  # the immediate keys' rows in the staging page (valid once copied)
    saved_by: int
    epoch: int
    row_bytes: int  # the widest cached key's bytes per row (sizes the output chunks)
    # ``staged`` holds the step's own copies (a small all-CPU step save wrote from them), not
    # page views: nobody else reads them, so a step without hits returned whole hands them out.
    owned: bool = False


class OutputBuilder:
    """Builds `StepOutputs` from a consumed `StepRecord` (the materializing thread; takes the
    ledger lock only inside `HitReader.serve`)."""

    def __init__(self, reader: HitReader, copies: CopyEngine, counters: Counters, timeout_s: float) -> None:
        self._reader = reader
        self._copies = copies
        self._counters = counters
        self._timeout_s = timeout_s

    def build(self, record: StepRecord, req_ids: Sequence[str]) -> StepOutputs:
        """Per-request outputs of the step; raises what `HitReader.serve` raises. A step with
        deferred keys on a CUDA device copies their rows on the clone-read stream (`reading`)."""
        if not record.clones:
            return self._build(record, req_ids)
        with reading(next(iter(record.clones.values())).tensor):
            return self._build(record, req_ids)

    def _build(self, record: StepRecord, req_ids: Sequence[str]) -> StepOutputs:
        in_place = self._sources_in_place(record)
        if not record.clones:  # (every key's rows as they are: no view to make)
            sources = record.sources if in_place else record.staged
        else:
            sources = {name: self._step_rows(record, name, in_place) for name in record.keys}
        whole_step = req_ids == list(record.rows)  # (every request, in batch order: the usual call)
        # (first row in the page, rows, rows not returned) per request
        spans = list(record.rows.values()) if whole_step else [record.rows[req_id] for req_id in req_ids]
        hits = [record.hits.get(req_id) for req_id in req_ids] if record.hits else None
        sizes = [count - drop for _, count, drop in spans]  # rows returned (drop <= count: never negative)
        if hits is None and whole_step and not any(map(itemgetter(2), spans)):
            # The usual step without hits: every request in batch order, each row returned.
            # Each chunk is one copy of a contiguous span of the step's rows per key.
            self._wait_copy(record, in_place)
            bounds = output_chunks(sizes, record.row_bytes)
            groups = [range(a, b) for a, b in bounds]  # (ranges: no list of indices built per step)
            if record.owned and len(bounds) == 1:  # (the step's own copies, read once: no copy to make)
                chunks = [sources]
            elif len(bounds) == 1:  # (the usual case: no view to make)
                chunks = [{name: host_copy(src) for name, src in sources.items()}]
            else:
                chunks = [
                    {
                        name: host_copy(src[spans[a][0] : spans[b - 1][0] + spans[b - 1][1]])
                        for name, src in sources.items()
                    }
                    for a, b in bounds
                ]
        else:
            prefetched: list[Prefetched | None] = [None] * len(req_ids)
            own: dict[int, dict[str, torch.Tensor]] = {}  # requests handed their prefetch's tensors
            if hits is not None:
                sizes = [size + (hit.num_rows if hit else 0) for size, hit in zip(sizes, hits, strict=True)]
                for i, hit in enumerate(hits):
                    if hit is not None and hit.prefetched is not None and hit.keys:
                        prefetched[i] = pre = hit.prefetched.result(hit.keys[0].slots, self._timeout_s)
                        if pre is not None and (rows := _own_rows(pre, sizes[i], sources)) is not None:
                            own[i] = rows
            groups = request_groups(sizes, record.row_bytes, list(own))
            chunks = [
                own[group[0]]
                if len(group) == 1 and group[0] in own
                else {
                    name: torch.empty((sum(sizes[i] for i in group), *src.shape[1:]), dtype=src.dtype, device="cpu")
                    for name, src in sources.items()
                }
                for group in groups
            ]
            # Hit rows first: they come from the pool, so this step's own copy (run by the
            # committer meanwhile) is usually done by the time its rows are needed.
            runs = self._serve_hits(record, req_ids, spans, hits, groups, chunks, prefetched)
            self._wait_copy(record, in_place)
            for out, chunk_runs in zip(chunks, runs, strict=True):  # this step's rows behind the hits'
                for begin, at, rows in chunk_runs:
                    for name, src in sources.items():
                        out[name][at : at + rows].copy_(src[begin : begin + rows])
        per_key: dict[str, dict[str, Any]] = {}
        for name in sources:  # one split per chunk and key (a slice per request costs a Python call each)
            if len(groups) == 1:  # (the usual case: the requests in order)
                out = chunks[0][name]
                pieces = torch.split_with_sizes(out, sizes) if len(sizes) > 1 else (out,)
            else:
                pieces = [None] * len(req_ids)
                for group, chunk in zip(groups, chunks, strict=True):
                    parts = torch.split_with_sizes(chunk[name], [sizes[i] for i in group]) if len(group) > 1 else None
                    for j, i in enumerate(group):
                        pieces[i] = chunk[name] if parts is None else parts[j]
            per_key[name] = dict(zip(req_ids, pieces, strict=True))
        hidden: dict[str, Any] | None = per_key.pop(HIDDEN) if HIDDEN in per_key else None
        mm: dict[str, dict[str, Any]] = per_key
        for name, value in record.leftover.items():  # whole, or the rows each request returns of it
            if is_per_row(value, record.n, record.n_padded):
                # (as for the cached keys, a resumed request's rows its consumer already has are left out)
                mm[name] = {req_id: value[s + d : s + c] for req_id, (s, c, d) in zip(req_ids, spans, strict=True)}
            else:
                mm[name] = dict.fromkeys(req_ids, value)
        return StepOutputs(hidden, mm)

    @staticmethod
    def _wait_copy(record: StepRecord, in_place: bool) -> None:
        """Waits until this step's rows and leftover snapshots may be read: the step's copy,
        or in place only the device copies of CUDA leftovers (they land on the side stream)."""
        if not in_place:
            record.handle.wait()
        elif record.leftover:
            record.handle.wait_device()

    def _serve_hits(self, record, req_ids, spans, hits, groups, chunks, prefetched) -> list[list[tuple[int, int, int]]]:
        """Gathers each hit's rows into the front of its request's rows in its chunk, and plans
        the copies of this step's rows behind them: per chunk, ``(first source row, first
        output row, rows)`` runs, requests whose rows follow each other on both sides coalesced."""
        runs: list[list[tuple[int, int, int]]] = []
        for group, out in zip(groups, chunks, strict=True):
            at = 0  # the chunk's next output row
            chunk_runs: list[tuple[int, int, int]] = []
            for i in group:
                hit = hits[i] if hits is not None else None
                if hit is not None:
                    into = {k: o[at : at + hit.num_rows] for k, o in out.items()}
                    self._serve_hit(record, req_ids[i], hit, into, prefetched[i])
                    at += hit.num_rows
                start, count, drop = spans[i]
                if count == drop:
                    continue
                begin, to, rows = chunk_runs[-1] if chunk_runs else (-1, -1, 0)
                if begin + rows == start + drop and to + rows == at:  # (right behind it, both sides)
                    chunk_runs[-1] = (begin, to, rows + count - drop)
                else:
                    chunk_runs.append((start + drop, at, count - drop))
                at += count - drop
            runs.append(chunk_runs)
        return runs

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
        return record.sources[name] if in_place else record.staged[name]

    def _serve_hit(
        self,
        record: StepRecord,
        req_id: str,
        hit: HitRead,
        into: dict[str, torch.Tensor],
        prefetched: Prefetched | None,
    ) -> None:
        """A hit's rows gathered into ``into[key]`` (the front of the request's rows in the
        output), the ``prefetched`` ones standing in for the pool's (`HitReader.serve`)."""
        served = self._reader.serve(hit, record.step_id, self._timeout_s, into, prefetched)
        self._counters.served(served.from_pool, served.in_flight, served.preserved, served.prefetched)
        for name, rows in served.rows.items():
            if rows.data_ptr() != into[name].data_ptr():
                into[name].copy_(rows)


def _own_rows(pre: Prefetched, size: int, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The request's output rows per key as the front ``size`` rows of its prefetched tensors,
    when every key's has room for them with less than a block to spare and the rows' dtype
    and shape; else ``None`` (its rows go to a chunk, the prefetched ones copied there)."""
    own = {}
    for name, src in sources.items():
        rows = pre.rows.get(name)
        if (
            rows is None
            or not size <= rows.shape[0] < size + pre.max_spare
            or rows.dtype != src.dtype
            or rows.shape[1:] != src.shape[1:]
        ):
            return None
        own[name] = rows[:size]
    return own


__all__ = ["OutputBuilder", "StepRecord"]
