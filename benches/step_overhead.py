"""One synthetic step workload through omni_pcache and through vLLM-Omni's own prefix cache.

Block 16, 4,096 KV blocks, 8 requests per step, half of them hitting one of four 512-token
shared prefixes (written in a warm-up step), a bf16 hidden of width 2,048 plus one fp32
per-token mm key of width 128; steps of 512, 2,048 and 8,192 scheduled tokens. Each request
is new in its step and finishes at the next one; every step is materialized for all 8
requests on the engine thread. Fresh blocks come from a ring over the non-prefix blocks, so
blocks are reused by new tenants as in a real engine. Each side first runs, unmeasured, the
steps that hand the ring out once, so every pool page has been written before the measured
steps, as in a server that has run a while (a fresh pool faults its pages in as the first
writes reach them, which the 512-token size would otherwise pay on every measured step).

Per side and step size it reports medians of: the engine-thread time (begin_step + save for
omni_pcache; new_step_starts + save_outputs for vLLM-Omni), materialize time and its GB/s
(bytes of the full-sequence rows returned), beside a plain torch ``copy_`` of the same bytes
on this machine (the physical reference; also into newly allocated memory, which returning new
tensors pays in first-touch page faults), beside the fewest torch calls that return the same
rows (per key one ``index_select`` of the hits' prefix rows from a pool of the cache's size
and one copy of the step's rows, into new memory: what gathering costs here before any
bookkeeping), beside that gather run in omni_pcache's own step loop in place of materialize
(after each step's save, while the committer writes it: the caches as a real materialize finds
them), and the ratios ours/theirs. Both sides' outputs are
checked against the expected full-sequence rows on a few steps, then overwritten, and the step
after each is checked too (a wrong answer, or outputs that share a side's cache storage, fail
the run). The sides take turns going first, from one step size and forward to the next,
starting with ``--first``: a second run with the other start measures every row in both orders.

Each step runs as an engine runs it: begin, the forward, save, then materialize on the same
thread. The forward is ``--forward-ms`` of GIL-releasing torch work over ~6 MiB, more
than a core's L2 holds (`save_overhead.busy_forward`; untimed), run at 0 and 5 ms by default:
during it both sides gather the hits' prefix rows (vLLM-Omni's prefetch thread; omni_pcache's
committer, with ``CacheConfig.prefetch_hits=True``, what a cache with CUDA outputs turns on by
itself: the stand-in forward leaves the second core idle, as a GPU forward leaves the host's;
``--no-prefetch`` runs ours as a cache with CPU outputs does by default), omni_pcache's
committer also writes the previous step, and after it both sides' calls run cold, as after a
real forward (out of L1 and L2; a large model's forward also sweeps the L3).
``--malloc-reuse`` reruns the script under glibc settings that reuse freed blocks over 32 MiB
(`MALLOC_REUSE`), which changes the 8,192-token figures of both sides.

vLLM-Omni 0.30.0 is built as its own unit tests build it: ``OmniPrefixCacheManager(config,
view, eager=True)`` with a duck-typed group view, imported without vLLM (its package
``__init__`` imports vLLM, so the parent packages are registered as bare namespaces first,
as its tests do). On CPU eager mode is its only mode (the threaded committer needs CUDA
streams): the pool write runs inline in save_outputs, on the engine thread. omni_pcache's
committer thread does its pool writes off the engine thread. Both sides get the slot mapping
precomputed (not timed).

Run: ``bash scripts/setup-bench.sh && .venv-bench/bin/python benches/step_overhead.py``.
Under a Python without vllm-omni (``.venv/bin/python``) only the omni_pcache side runs and
the JSON says why the comparison is missing. ``--quick`` runs tiny sizes (smoke test).
Writes benches/results/step_overhead.json. Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_pcache import CacheConfig, NewRequest, PrefixCache, StepBatch, StepEvents

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write
from save_overhead import busy_forward

BLOCK = 16
NUM_REQS = 8
HIDDEN_DTYPE = torch.bfloat16
MM_KEY = "mm.feat"
MM_WIDTH = 128
MM_DTYPE = torch.float32
NUM_PREFIXES = 4
VLLM_OMNI_VERSION = "0.30.0"


@dataclass
class Req:
    req_id: str
    blocks: list[int]
    hit: int  # tokens served from the cache (num_computed_tokens at arrival)
    count: int  # tokens scheduled this step
    prefix: int | None = None  # which shared prefix it hits


@dataclass
class Step:
    reqs: list[Req]
    finished: list[str]
    row_offset: int  # where this step's rows start in the source tensor
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @property
    def n(self) -> int:
        return sum(r.count for r in self.reqs)


def req_slots(r: Req) -> np.ndarray:
    pos = np.arange(r.hit, r.hit + r.count)
    return np.asarray(r.blocks, dtype=np.int64)[pos // BLOCK] * BLOCK + pos % BLOCK


def make_steps(
    step_tokens: int, num_steps: int, num_blocks: int, prefix_tokens: int, max_tokens: int
) -> tuple[Step, list[Step]]:
    """The warm-up step (writes the shared prefixes) and ``num_steps`` measured steps."""
    prefix_blocks = prefix_tokens // BLOCK
    warm_reqs = [
        Req(f"prefix{p}", list(range(p * prefix_blocks, (p + 1) * prefix_blocks)), 0, prefix_tokens)
        for p in range(NUM_PREFIXES)
    ]
    warm = Step(warm_reqs, [], 0)
    per_req = step_tokens // NUM_REQS
    fresh_per_req = -(-per_req // BLOCK)
    ring_start = NUM_PREFIXES * prefix_blocks
    ring = num_blocks - ring_start
    if ring < 2 * NUM_REQS * fresh_per_req:
        raise SystemExit(f"{num_blocks} blocks are too few for {step_tokens}-token steps")
    cursor = 0
    steps: list[Step] = []
    prev: list[str] = [r.req_id for r in warm_reqs]
    for s in range(num_steps):
        reqs = []
        for i in range(NUM_REQS):
            fresh = [ring_start + (cursor + k) % ring for k in range(fresh_per_req)]
            cursor = (cursor + fresh_per_req) % ring
            if i % 2 == 0:  # half the requests hit a shared prefix
                p = (s + i // 2) % NUM_PREFIXES
                blocks = list(warm_reqs[p].blocks) + fresh
                reqs.append(Req(f"s{s}r{i}", blocks, prefix_tokens, per_req, p))
            else:
                reqs.append(Req(f"s{s}r{i}", fresh, 0, per_req))
        offset = (1 + s * 7919) % max(1, max_tokens)
        steps.append(Step(reqs, prev, offset))
        prev = [r.req_id for r in reqs]
    for st in (warm, *steps):
        st.slots = np.concatenate([req_slots(r) for r in st.reqs])
    return warm, steps


class Rows:
    """Source rows: step ``s`` uses ``hidden[off : off + n]`` (distinct per step)."""

    def __init__(self, max_tokens: int, width: int) -> None:
        g = torch.Generator().manual_seed(0)
        total = 2 * max_tokens + 1
        self.hidden = torch.randn(total, width, generator=g).to(HIDDEN_DTYPE)
        self.mm = torch.randn(total, MM_WIDTH, generator=g).to(MM_DTYPE)

    def step(self, st: Step) -> tuple[torch.Tensor, torch.Tensor]:
        n = st.n
        return self.hidden[st.row_offset : st.row_offset + n], self.mm[st.row_offset : st.row_offset + n]


def expected(st: Step, warm: Step, rows: Rows) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full-sequence rows each request must get: its prefix's warm-up rows, then its own."""
    wh, wm = rows.step(warm)
    h, m = rows.step(st)
    out = {}
    row = 0
    for r in st.reqs:
        own_h, own_m = h[row : row + r.count], m[row : row + r.count]
        if r.prefix is not None:
            start = r.prefix * r.hit
            own_h = torch.cat([wh[start : start + r.hit], own_h])
            own_m = torch.cat([wm[start : start + r.hit], own_m])
        out[r.req_id] = (own_h, own_m)
        row += r.count
    return out


def check(label: str, st: Step, want: dict, got_h: dict, got_m: dict) -> None:
    for req_id, (h, m) in want.items():
        if not (torch.equal(got_h[req_id], h) and torch.equal(got_m[req_id], m)):
            raise SystemExit(f"step_overhead: {label} returned wrong rows for {req_id}")


# ---- the two sides ------------------------------------------------------------------------


class Ours:
    name = "omni_pcache"

    def __init__(self, num_blocks: int, capacity: int, prefetch: bool = True) -> None:
        self.cache = PrefixCache(
            CacheConfig(
                num_blocks=num_blocks,
                block_size=BLOCK,
                staging_depth=4,
                staging_capacity_tokens=capacity,
                prefetch_hits=prefetch,
            )
        )

    def begin(self, st: Step) -> None:
        self.cache.begin_step(
            StepEvents(new=[NewRequest(r.req_id, r.blocks, r.hit) for r in st.reqs], finished=st.finished)
        )

    def save(self, st: Step, hidden: torch.Tensor, mm: torch.Tensor) -> Any:
        return self.cache.save(
            hidden, {MM_KEY: mm}, StepBatch([r.req_id for r in st.reqs], [r.count for r in st.reqs], st.slots)
        )

    def materialize(self, sid: Any, st: Step) -> tuple[dict, dict]:
        out = self.cache.materialize(sid, [r.req_id for r in st.reqs])
        return out.hidden, out.mm[MM_KEY]

    def close(self) -> None:
        self.cache.close()


def import_vllm_omni_prefix_cache() -> tuple[types.ModuleType | None, str]:
    """vllm_omni.core.prefix_cache without vLLM, as vLLM-Omni's own unit tests load it."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        return None, f"vllm-omni is not installed in {sys.prefix} (run scripts/setup-bench.sh, use .venv-bench)"
    root = Path(next(iter(spec.submodule_search_locations)))
    if importlib.util.find_spec("vllm") is None:
        # vllm_omni/__init__ imports vLLM; register the parents as bare namespaces instead.
        for name in ("vllm_omni", "vllm_omni.core"):
            if name not in sys.modules:
                mod = types.ModuleType(name)
                mod.__path__ = [str(root / name.replace("vllm_omni", "", 1).replace(".", "/").lstrip("/"))]
                sys.modules[name] = mod
    try:
        import vllm_omni.core.prefix_cache as pc
    except Exception as exc:
        return None, f"vllm_omni.core.prefix_cache failed to import: {type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        got = version("vllm-omni")
    except Exception:
        got = "unknown"
    if got != VLLM_OMNI_VERSION:
        return pc, f"vllm-omni {got} installed (the comparison is defined for {VLLM_OMNI_VERSION})"
    return pc, ""


class _View:
    """Duck-typed FullAttentionGroupView: the batch order and the (precomputed) CPU slots."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.slots = torch.empty(0, dtype=torch.long)

    def batch_req_ids(self) -> list[str]:
        return list(self.order)

    def step_slots_cpu(self, req_ids: list[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        return self.slots


class Theirs:
    name = "vllm_omni"

    def __init__(self, pc: types.ModuleType, num_blocks: int, capacity: int) -> None:
        self.view = _View()
        config = pc.PrefixCacheConfig(
            num_blocks=num_blocks, block_size=BLOCK, staging_depth=4, staging_capacity_tokens=capacity
        )
        self.mgr = pc.OmniPrefixCacheManager(config, self.view, eager=True)

    def begin(self, st: Step) -> None:
        self.view.order = [r.req_id for r in st.reqs]
        self.view.slots = torch.from_numpy(st.slots)
        sched = types.SimpleNamespace(
            scheduled_new_reqs=[
                types.SimpleNamespace(req_id=r.req_id, num_computed_tokens=r.hit, block_ids=[r.blocks]) for r in st.reqs
            ],
            finished_req_ids=set(st.finished),
            num_scheduled_tokens={r.req_id: r.count for r in st.reqs},
        )
        self.mgr.new_step_starts(sched)

    def save(self, st: Step, hidden: torch.Tensor, mm: torch.Tensor) -> Any:
        n = st.n
        return self.mgr.save_outputs(hidden, {MM_KEY: mm}, num_tokens_unpadded=n, num_tokens_padded=n)

    def materialize(self, sid: Any, st: Step) -> tuple[dict, dict]:
        out = self.mgr.materialize(sid, [r.req_id for r in st.reqs])
        return out.hidden_states, out.mm_outputs[MM_KEY]

    def close(self) -> None:
        self.mgr.shutdown()


# ---- measuring ----------------------------------------------------------------------------


def steps_to_wrap(step_tokens: int, num_blocks: int, prefix_tokens: int) -> int:
    """Steps until the ring of fresh blocks has been handed out once: after them every pool
    page of the ring has been written, as in a server that has run a while (before, each
    step's writes fault fresh pages in, on whichever thread writes the pool)."""
    fresh_per_step = NUM_REQS * -(-(step_tokens // NUM_REQS) // BLOCK)
    ring = num_blocks - NUM_PREFIXES * (prefix_tokens // BLOCK)
    return -(-ring // fresh_per_step)


def saved_step(side: Any, st: Step, h: torch.Tensor, m: torch.Tensor, forward_ms: float) -> tuple[Any, float]:
    """One step as an engine runs it: begin, the forward (``forward_ms`` of `busy_forward`,
    untimed), save. Returns the step id and the seconds spent in begin and save."""
    t0 = time.perf_counter()
    side.begin(st)
    t1 = time.perf_counter()
    if forward_ms:
        busy_forward(forward_ms)
    t2 = time.perf_counter()
    sid = side.save(st, h, m)
    return sid, (t1 - t0) + (time.perf_counter() - t2)


def run_side(
    side: Any, warm: Step, steps: list[Step], rows: Rows, checks: int, warmup: int, forward_ms: float
) -> dict[str, float]:
    """Runs every step through ``side`` (`saved_step`, then materialize on the same thread);
    the first ``warmup`` are not measured (`steps_to_wrap`)."""
    h, m = rows.step(warm)
    sid, _ = saved_step(side, warm, h, m, forward_ms)
    side.materialize(sid, warm)
    engine_s, mat_s, mat_bytes = [], [], []
    measured = len(steps) - warmup
    check_at = {warmup + i for i in np.linspace(0, measured - 2, num=min(checks, measured - 1), dtype=int).tolist()}
    gc.collect()
    gc.disable()
    try:
        for i, st in enumerate(steps):
            h, m = rows.step(st)
            sid, engine = saved_step(side, st, h, m, forward_ms)
            t1 = time.perf_counter()
            out = side.materialize(sid, st)
            t2 = time.perf_counter()
            # (the previous step's outputs are freed here, outside the timer, as every reference
            # frees its own: at 8,192 tokens vLLM-Omni's free of a fresh 32 MiB mapping is ~3 ms)
            got_h, got_m = out
            engine_s.append(engine)
            mat_s.append(t2 - t1)
            mat_bytes.append(sum(t.numel() * t.element_size() for d in (got_h, got_m) for t in d.values()))
            if i in check_at or i - 1 in check_at:
                check(side.name, st, expected(st, warm, rows), got_h, got_m)
            if i in check_at:
                # Returned rows are the caller's to write: overwrite them, and the next step (which
                # hits every shared prefix again) is checked too, so a side whose outputs share
                # its cache's storage fails the run.
                for t in (*got_h.values(), *got_m.values()):
                    with torch.inference_mode(t.is_inference()):  # (vLLM-Omni returns inference tensors)
                        t.fill_(-7)
    finally:
        gc.enable()
    skip = warmup + 2  # (and the allocator's first rounds of output buffers)
    eng = statistics.median(engine_s[skip:])
    mat = statistics.median(mat_s[skip:])
    nbytes = statistics.median(mat_bytes[skip:])
    return {
        "engine_thread_us": eng * 1e6,
        "materialize_us": mat * 1e6,
        "materialize_bytes": int(nbytes),
        "materialize_gbps": nbytes / mat / 1e9,
        "steps_measured": len(steps) - skip,
    }


def copy_reference(nbytes: int, repeat: int) -> float:
    """Median seconds of one plain torch copy_ of ``nbytes`` (contiguous, CPU)."""
    src = torch.randn(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fresh_copy_reference(nbytes: int, repeat: int) -> float:
    """Median seconds of a torch copy of ``nbytes`` into newly allocated memory, the previous
    result kept alive as the measured loop keeps its last outputs: what returning new tensors
    costs on this machine, first-touch page faults included."""
    src = torch.randn(max(1, nbytes // 4))
    kept = None
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        dst = torch.empty_like(src)
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
        kept = dst  # noqa: F841 (held until the next iteration's copy is done)
    return statistics.median(times[1:])


COLD_SPAN_BYTES = 128 << 20  # the sources cycle over 4x this VM's 32 MiB L3
SWEEP_BYTES = 64 << 20  # written before each timed copy: twice the L3


def cold_copy_reference(nbytes: int, repeat: int) -> float:
    """Median seconds of a torch copy of ``nbytes`` between memory no CPU cache holds: each
    copy's source another slice of a buffer past the L3, into one destination touched before
    (no page faults, as materialize's output chunks under 16 MiB find memory glibc reuses), 64
    MiB written just before each copy, as a large model's forward sweeps the caches. The physical
    reference of a gather from a pool larger than the caches, which `copy_reference` (the same
    bytes copied back to back, source and destination within the L3 together at 512 tokens)
    is not."""
    span = max(1, nbytes // 4)
    count = max(4, COLD_SPAN_BYTES // max(1, nbytes) + 1)
    sources = torch.randn(span * count)
    dst = torch.zeros(span)
    sweep = torch.empty(SWEEP_BYTES, dtype=torch.uint8)
    times = []
    for i in range(repeat):
        src = sources[(i % count) * span : (i % count + 1) * span]
        sweep.fill_(i & 0xFF)
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_gather(index: torch.Tensor, pools: list[torch.Tensor], own: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fewest torch calls returning a step's rows, per key: one tensor in new memory, one
    ``index_select`` of the hits' rows (``index``) from the key's pool, one copy of the step's
    own rows behind them."""
    outs = []
    for pool, rows in zip(pools, own, strict=True):
        out = torch.empty((index.numel() + rows.shape[0], pool.shape[1]), dtype=pool.dtype)
        torch.index_select(pool, 0, index, out=out[: index.numel()])
        out[index.numel() :].copy_(rows)
        outs.append(out)
    return outs


def gather_reference(
    num_slots: int, width: int, hit_slots: np.ndarray, own_rows: int, repeat: int
) -> tuple[float, int]:
    """Median seconds, and bytes returned, of `torch_gather` of the same rows as a measured
    step's materialize (every hit's prefix rows, ``hit_slots`` in order, from pools of the
    cache's size, and the step's own rows behind them), the previous result kept alive.
    The floor for any implementation gathering rows with torch on this machine (no per-request
    tensors, no bookkeeping, no committer sharing the memory bus)."""
    index = torch.from_numpy(hit_slots)
    pools, own = [], []
    for w, dtype in ((width, HIDDEN_DTYPE), (MM_WIDTH, MM_DTYPE)):
        pools.append(torch.ones((num_slots, w), dtype=dtype))  # touched, as the cache's pool is once written
        own.append(torch.randn(own_rows, w).to(dtype))
    kept = None
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        outs = torch_gather(index, pools, own)
        times.append(time.perf_counter() - t0)
        kept = outs  # noqa: F841 (held until the next iteration's gather is done)
    nbytes = sum(o.numel() * o.element_size() for o in outs)
    return statistics.median(times[1:]), nbytes


def gather_in_loop_reference(
    num_blocks: int,
    capacity: int,
    width: int,
    warm: Step,
    steps: list[Step],
    rows: Rows,
    warmup: int,
    forward_ms: float,
) -> tuple[float, int]:
    """Median seconds, and bytes returned, of `torch_gather` as in `gather_reference`, run in
    omni_pcache's own step loop in place of its materialize: each
    measured step is saved by a fresh cache (with the same forward, whose committer writes it
    meanwhile, as in `run_side`), then gathered from a torch pool of the cache's size holding the shared
    prefixes, then discarded. What gathering costs in the step loop on this machine (the
    step's writes and the engine thread's save leave the caches as a real materialize finds
    them); no bookkeeping."""
    pools = []
    for w, dtype in ((width, HIDDEN_DTYPE), (MM_WIDTH, MM_DTYPE)):
        pools.append(torch.ones((num_blocks * BLOCK, w), dtype=dtype))
    for pool, src in zip(pools, rows.step(warm), strict=True):  # the shared prefixes, as the warm-up wrote them
        pool[torch.from_numpy(warm.slots)] = src
    side = Ours(num_blocks, capacity, prefetch=False)  # (no materialize: nothing to prefetch for)
    kept = None
    times = []
    gc.collect()
    gc.disable()  # (as in run_side)
    try:
        side.materialize(saved_step(side, warm, *rows.step(warm), forward_ms)[0], warm)
        for st in steps:
            index = torch.from_numpy(hit_slots_of(st))
            own_rows = rows.step(st)
            sid, _ = saved_step(side, st, *own_rows, forward_ms)
            t0 = time.perf_counter()
            outs = torch_gather(index, pools, list(own_rows))
            times.append(time.perf_counter() - t0)
            kept = outs  # noqa: F841 (held until the next step's gather is done, as run_side keeps its outputs)
            side.cache.discard(sid)
    finally:
        gc.enable()
        side.close()
    nbytes = sum(o.numel() * o.element_size() for o in outs)
    return statistics.median(times[warmup + 2 :]), nbytes


def hit_slots_of(st: Step) -> np.ndarray:
    """The slots of every hitting request's cached prefix in step ``st``, in request order."""
    parts = []
    for r in st.reqs:
        if r.hit:
            pos = np.arange(r.hit)
            parts.append(np.asarray(r.blocks, dtype=np.int64)[pos // BLOCK] * BLOCK + pos % BLOCK)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


MALLOC_REUSE = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
"""glibc settings under which a freed block over 32 MiB is reused rather than unmapped
(``--malloc-reuse``): by default glibc maps each allocation over its 32 MiB mmap-threshold
ceiling afresh, so a new output tensor that large pays a page fault per 4 KiB written
(vLLM-Omni's materialize at 8,192 tokens returns one 42 MB tensor per step; omni_pcache's
output chunks stay under 16 MiB). Tuning glibc is the user's choice, so the default run keeps
glibc's defaults and this one shows what that choice is worth to each side."""


def torch_references(
    step_bytes: int, mat_bytes: int, num_blocks: int, width: int, size: int, hit_slots: np.ndarray
) -> dict[str, Any]:
    """The plain torch references of one step size: copies of the step's and of materialize's
    bytes, the latter also into new memory, and `gather_reference`."""
    copy_step = copy_reference(step_bytes, 30)
    copy_mat = copy_reference(mat_bytes, 30)
    fresh_mat = fresh_copy_reference(mat_bytes, 30)
    cold_mat = cold_copy_reference(mat_bytes, 30)
    gather_s, gather_bytes = gather_reference(num_blocks * BLOCK, width, hit_slots, size, 30)
    torch_copy = {
        "step_bytes_us": copy_step * 1e6,
        "step_bytes_gbps": step_bytes / copy_step / 1e9,
        "materialize_bytes_us": copy_mat * 1e6,
        "materialize_bytes_gbps": mat_bytes / copy_mat / 1e9,
        "materialize_bytes_into_new_memory_us": fresh_mat * 1e6,
        "materialize_bytes_into_new_memory_gbps": mat_bytes / fresh_mat / 1e9,
        "materialize_bytes_cold_us": cold_mat * 1e6,
        "materialize_bytes_cold_gbps": mat_bytes / cold_mat / 1e9,
    }
    return {"torch_copy": torch_copy, "torch_gather": gathered(gather_s, gather_bytes, torch_copy)}


def gathered(seconds: float, nbytes: int, torch_copy: dict[str, float]) -> dict[str, float]:
    """A gather reference's figures, its bandwidth also as a share of the plain copy's."""
    gbps = nbytes / seconds / 1e9
    return {
        "bytes": nbytes,
        "us": seconds * 1e6,
        "gbps": gbps,
        "vs_copy_bandwidth": gbps / torch_copy["materialize_bytes_gbps"],
    }


def with_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """Adds each side's bandwidth as a share of the references', and ours/theirs."""
    ours = row["omni_pcache"]
    copy_gbps = row["torch_copy"]["materialize_bytes_gbps"]
    cold_gbps = row["torch_copy"]["materialize_bytes_cold_gbps"]
    ours["materialize_vs_copy_bandwidth"] = ours["materialize_gbps"] / copy_gbps
    ours["materialize_vs_cold_copy_bandwidth"] = ours["materialize_gbps"] / cold_gbps
    ours["materialize_vs_gather_bandwidth"] = ours["materialize_gbps"] / row["torch_gather"]["gbps"]
    ours["materialize_vs_gather_in_loop_bandwidth"] = ours["materialize_gbps"] / row["torch_gather_in_loop"]["gbps"]
    if "vllm_omni" in row:
        theirs = row["vllm_omni"]
        theirs["materialize_vs_copy_bandwidth"] = theirs["materialize_gbps"] / copy_gbps
        theirs["materialize_vs_cold_copy_bandwidth"] = theirs["materialize_gbps"] / cold_gbps
        row["ratio_ours_over_theirs"] = {
            "engine_thread": ours["engine_thread_us"] / theirs["engine_thread_us"],
            "materialize": ours["materialize_us"] / theirs["materialize_us"],
        }
    return row


def summary(row: dict[str, Any]) -> str:
    """One printed line per step size and forward."""
    ours = row["omni_pcache"]
    line = (
        f"{row['step_tokens']:>5} tok, forward {row['forward_ms']:g} ms: omni_pcache engine "
        f"{ours['engine_thread_us']:>8.0f} us, materialize {ours['materialize_us']:>7.0f} us"
        f" ({ours['materialize_gbps']:.2f} GB/s)"
    )
    if "vllm_omni" in row:
        t = row["vllm_omni"]
        r = row["ratio_ours_over_theirs"]
        line += (
            f" | vllm_omni engine {t['engine_thread_us']:>8.0f} us, materialize {t['materialize_us']:>7.0f} us"
            f" ({t['materialize_gbps']:.2f} GB/s) | ours/theirs engine {r['engine_thread']:.3f},"
            f" materialize {r['materialize']:.3f}"
        )
    return line + (
        f" | torch copy: step {row['torch_copy']['step_bytes_us']:.0f} us,"
        f" {row['torch_copy']['materialize_bytes_gbps']:.2f} GB/s"
        f" ({row['torch_copy']['materialize_bytes_into_new_memory_gbps']:.2f} GB/s into new memory,"
        f" {row['torch_copy']['materialize_bytes_cold_gbps']:.2f} GB/s cold: ours"
        f" {ours['materialize_vs_cold_copy_bandwidth']:.0%} of it)"
        f" | torch gather of the same rows: {row['torch_gather']['gbps']:.2f} GB/s"
        f" ({row['torch_gather']['vs_copy_bandwidth']:.0%} of the copy; ours"
        f" {ours['materialize_vs_gather_bandwidth']:.0%} of it)"
        f" | that gather in our step loop: {row['torch_gather_in_loop']['gbps']:.2f} GB/s"
        f" ({row['torch_gather_in_loop']['vs_copy_bandwidth']:.0%} of the copy; ours"
        f" {ours['materialize_vs_gather_in_loop_bandwidth']:.0%} of it)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test): width 64, short steps")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per size (default 40; quick 6)")
    parser.add_argument("--no-theirs", action="store_true", help="skip the vLLM-Omni side")
    parser.add_argument(
        "--first",
        choices=("ours", "theirs"),
        default="ours",
        help="the side that goes first at the first step size and forward (they alternate from there): "
        "run twice, once with each, so every row is measured in both orders",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="step sizes in tokens (default 512 2048 8192)"
    )
    parser.add_argument(
        "--forward-ms",
        type=float,
        action="append",
        default=None,
        help="ms of GIL-releasing torch work between begin and save, as a forward (default: 0 and 5)",
    )
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="run omni_pcache with CacheConfig.prefetch_hits=False (its hits gathered inside materialize)",
    )
    parser.add_argument(
        "--malloc-reuse",
        action="store_true",
        help="rerun under glibc settings that reuse freed blocks over 32 MiB (see MALLOC_REUSE)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON to write (default: results/step_overhead.json, or step_overhead_malloc_reuse.json "
        "with --malloc-reuse, so a run under other allocator settings never replaces the default run's)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("step_overhead_malloc_reuse.json" if args.malloc_reuse else "step_overhead.json")
    if args.malloc_reuse and any(os.environ.get(k) != v for k, v in MALLOC_REUSE.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_REUSE})
    torch.set_num_threads(1)
    forwards = args.forward_ms or [0.0, 5.0]

    if args.quick:
        sizes, width, num_blocks, prefix_tokens, default_steps = (64, 256), 64, 256, 32, 6
    else:
        sizes, width, num_blocks, prefix_tokens, default_steps = (512, 2048, 8192), 2048, 4096, 512, 40
    num_steps = args.steps or default_steps
    sizes = tuple(args.sizes) if args.sizes else sizes
    pc, why_missing = (None, "skipped (--no-theirs)") if args.no_theirs else import_vllm_omni_prefix_cache()
    if pc is not None and why_missing:
        print(f"step_overhead: note: {why_missing}")
    elif pc is None:
        print(f"step_overhead: vLLM-Omni side missing: {why_missing}")

    max_tokens = max(max(sizes), NUM_PREFIXES * prefix_tokens)
    rows = Rows(max_tokens, width)
    results = []
    for size in sizes:
        warmup = steps_to_wrap(size, num_blocks, prefix_tokens)
        warm, steps = make_steps(size, warmup + num_steps, num_blocks, prefix_tokens, max_tokens)
        capacity = max(size, warm.n)
        step_bytes = size * (width * torch.finfo(HIDDEN_DTYPE).bits // 8 + MM_WIDTH * 4)
        references: dict[str, Any] | None = None  # (no forward in them: measured once per size)
        for forward_ms in forwards:
            row: dict[str, Any] = {
                "step_tokens": size,
                "forward_ms": forward_ms,
                "step_bytes": step_bytes,
                "warmup_steps": warmup,
            }
            makers = [functools.partial(Ours, num_blocks, capacity, not args.no_prefetch)]
            if pc is not None:
                makers.append(functools.partial(Theirs, pc, num_blocks, capacity))
            if (len(results) % 2 == 1) != (args.first == "theirs"):  # (the sides take turns going first)
                makers.reverse()
            row["order"] = []
            for make in makers:
                side = make()
                row["order"].append(side.name)
                try:
                    row[side.name] = run_side(side, warm, steps, rows, checks=3, warmup=warmup, forward_ms=forward_ms)
                finally:
                    side.close()
            if references is None:
                mat_bytes = row["omni_pcache"]["materialize_bytes"]
                references = torch_references(step_bytes, mat_bytes, num_blocks, width, size, hit_slots_of(steps[-1]))
            row.update(references)
            in_loop_s, in_loop_bytes = gather_in_loop_reference(
                num_blocks, capacity, width, warm, steps, rows, warmup, forward_ms
            )
            row["torch_gather_in_loop"] = gathered(in_loop_s, in_loop_bytes, row["torch_copy"])
            results.append(with_ratios(row))
            print(summary(row), flush=True)

    doc = {
        "bench": "step_overhead",
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "command": command(),
        "quick": args.quick,
        "first": args.first,
        "workload": {
            "block_size": BLOCK,
            "num_blocks": num_blocks,
            "requests_per_step": NUM_REQS,
            "hitting_requests_per_step": NUM_REQS // 2,
            "shared_prefix_tokens": prefix_tokens,
            "hidden": {"dtype": str(HIDDEN_DTYPE), "width": width},
            "mm": {MM_KEY: {"dtype": str(MM_DTYPE), "width": MM_WIDTH}},
            "steps_per_size": num_steps,
            "forward_ms": forwards,
            "prefetch_hits": not args.no_prefetch,
        },
        # (what this process runs under: --malloc-reuse has re-executed it with MALLOC_REUSE)
        "malloc": " ".join(f"{k}={os.environ[k]}" for k in MALLOC_REUSE if k in os.environ) or "glibc defaults",
        "vllm_omni": {
            "version": VLLM_OMNI_VERSION,
            "compared": pc is not None,
            "note": why_missing
            or "eager=True (its only CPU mode): the pool write runs inline in save_outputs on the engine thread",
        },
        "results": results,
    }
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
