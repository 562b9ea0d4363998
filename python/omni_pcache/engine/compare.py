"""Differential check of a cached run against the reference run (prefix caching off).

For every request, the concatenation of the rows the cached run returned across its steps
must equal the reference rows of its full sequence: the whole sequence for a finished
request; for an aborted one, exactly the positions its saved steps covered (the reference
runs every request to the end), in the reference's dtypes. Exact for the prefix-hash model,
within a tolerance for the transformer. Every leftover returned must have equalled the model's
and been on the host (counted by the engine when it verifies leftovers), every request must
have finished or been aborted (a run cut short at ``max_steps`` fails), every request of the
reference must be in the cached run (both run one workload), and the cache must be
idle at the end: every write landed, every staging page, hit read, preserved row and device
byte released, no step id outstanding and no request still live; and its counters must agree
with the engine's (hits and misses, hit rows served).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_pcache.engine.engine import EngineResult
from omni_pcache.engine.request import Status
from omni_pcache.stats import CacheStats


@dataclass
class Comparison:
    """The outcome of one differential check.

    ``requests_checked``: the requests whose rows were compared with the reference's, aborted
    ones included even when their rows cover no position; not counted: an aborted request that
    got no output at all, having saved nothing, and one whose rows were refused before the
    comparison (a wrong count or dtype: its mismatch line says so).
    ``rows_checked``: the rows compared. ``max_abs_diff``: the largest element-wise difference
    seen. ``mismatches``: one line per disagreement; the check passes (``ok``) without any.
    """

    requests_checked: int = 0
    rows_checked: int = 0
    max_abs_diff: float = 0.0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def compare(cached: EngineResult, reference: EngineResult, atol: float) -> Comparison:
    """Checks every request of ``cached`` against ``reference`` (see the module doc)."""
    result = Comparison()
    if cached.cache_stats is not None:
        result.mismatches.extend(not_idle(cached.cache_stats))
        result.mismatches.extend(miscounted(cached, cached.cache_stats))
    lost = [req_id for req_id in reference.requests if req_id not in cached.requests]
    if lost:
        result.mismatches.append(f"{len(lost)} requests of the reference missing from the cached run: {lost[:5]}")
    for req_id, req in cached.requests.items():
        if req.status not in (Status.FINISHED, Status.ABORTED):
            result.mismatches.append(f"{req_id}: {req.status.value}, neither finished nor aborted (run cut short)")
            continue
        ref = reference.outputs.get(req_id)
        out = cached.outputs.get(req_id)
        if ref is None:
            result.mismatches.append(f"{req_id}: no reference rows")
            continue
        ref_hidden, ref_proj = ref.rows()
        if out is None:
            if req.status is Status.FINISHED or req.saved_upto:
                result.mismatches.append(f"{req_id}: {req.status.value} but no rows were returned")
            continue
        if out.leftover_wrong or out.leftover_off_host:
            result.mismatches.append(
                f"{req_id}: {out.leftover_wrong} leftovers unequal to the model's, "
                f"{out.leftover_off_host} not on the host (of {out.leftover_seen})"
            )
        hidden, proj = out.rows()
        expected_len = req.full_sequence_len() if req.status is Status.FINISHED else req.saved_upto
        if hidden.shape[0] != expected_len:
            what = "full sequence" if req.status is Status.FINISHED else "its saved steps covered"
            result.mismatches.append(f"{req_id}: {hidden.shape[0]} rows returned, {what} {expected_len}")
            continue
        if hidden.shape[0] > ref_hidden.shape[0] or proj.shape[0] != hidden.shape[0]:
            result.mismatches.append(
                f"{req_id}: {hidden.shape[0]} hidden / {proj.shape[0]} proj rows vs {ref_hidden.shape[0]} reference"
            )
            continue
        if (hidden.dtype, proj.dtype) != (ref_hidden.dtype, ref_proj.dtype):
            result.mismatches.append(
                f"{req_id}: rows of {hidden.dtype} / {proj.dtype}, "
                f"the reference's {ref_hidden.dtype} / {ref_proj.dtype}"
            )
            continue
        n = hidden.shape[0]
        if n == 0:  # (an aborted request whose steps covered nothing: nothing to compare)
            result.requests_checked += 1
            continue
        # Per-element |diff|, NaN as infinitely far: a NaN row never passes for equal.
        diffs = [
            (got.double() - want[:n].double()).abs().reshape(n, -1).nan_to_num(nan=float("inf"))
            for got, want in ((hidden, ref_hidden), (proj, ref_proj))
        ]
        row_worst = torch.cat(diffs, dim=1).amax(dim=1)
        worst = float(row_worst.max())
        result.max_abs_diff = max(result.max_abs_diff, worst)
        if worst > atol:
            first = int(torch.nonzero(row_worst > atol)[0])
            result.mismatches.append(
                f"{req_id}: rows differ from the reference (max |diff| {worst:.3g}, first bad position {first})"
            )
        result.requests_checked += 1
        result.rows_checked += n
    return result


def miscounted(cached: EngineResult, stats: CacheStats) -> list[str]:
    """The cache's counters against what the engine saw, each disagreement as a mismatch line:
    its hits and misses against the requests the scheduler admitted for the first time with and
    without a prefix hit; the hit rows it served (counted once per cached key) against the rows
    materialize returned ahead of each step's own; and the rows a prefetch served within those
    from the pool and in-flight writes (a preserved copy is never a prefetch's)."""
    wrong = []
    if (stats.hits, stats.misses) != (cached.new_hits, cached.new_misses):
        wrong.append(
            f"cache counted {stats.hits} hits / {stats.misses} misses; the scheduler admitted "
            f"{cached.new_hits} new requests with a prefix hit / {cached.new_misses} without"
        )
    served = stats.rows_from_pool + stats.rows_in_flight + stats.rows_preserved
    num_keys = len(stats.bytes_written)  # (every cached key the cache has seen)
    if served != cached.prefix_rows_returned * num_keys:
        wrong.append(
            f"cache counted {served} hit rows served; materialize returned {cached.prefix_rows_returned} rows "
            f"ahead of their steps' own, for {num_keys} cached keys"
        )
    if stats.rows_prefetched > stats.rows_from_pool + stats.rows_in_flight:
        wrong.append(
            f"cache counted {stats.rows_prefetched} hit rows served from prefetches, more than the "
            f"{stats.rows_from_pool + stats.rows_in_flight} it served from the pool and in-flight writes"
        )
    return wrong


def not_idle(stats: CacheStats) -> list[str]:
    """What the cache still holds at a run's end, each as a mismatch line (none when idle)."""
    held = {
        "staging pages held": sum(len(holders) for holders in stats.staging_holders),
        "step ids outstanding": len(stats.steps_outstanding),
        "write tasks live": stats.tasks_live,
        "preserved rows kept": stats.preserved_entries,
        "hit reads pending": stats.reads_pending,
        "requests live": stats.requests_live,
        "device bytes held": stats.device_bytes,
        "deferred records open": stats.deferred_open,
    }
    return [f"cache not idle at the end: {count} {what}" for what, count in held.items() if count]
