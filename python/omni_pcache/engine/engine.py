"""`Engine`: the embedded stand-in for a vLLM v1 engine, with or without the omni cache.

Each step: abort what is due, schedule, tell the cache (`begin_step`), run the model on the
scheduled tokens only, `save` its outputs, and hand the *previous* step's id to the output
path (`materialize` one step late, like vLLM's async scheduling, or ``consume_lag`` steps late:
0 hands each step's id over right after its save, as sync scheduling does; optionally on its
own thread). With prefix caching off (the reference) no cache is used: every token is computed
and its rows are recorded by position.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_pcache.cache import PrefixCache
from omni_pcache.config import CacheConfig, CachePolicy
from omni_pcache.engine.kv_manager import KVCacheManager
from omni_pcache.engine.model import ForwardBatch, PrefixHashModel, TinyTransformer
from omni_pcache.engine.output_buffers import OutputBuffers
from omni_pcache.engine.request import Request, Status
from omni_pcache.engine.scheduler import ScheduledStep, Scheduler
from omni_pcache.events import NewRequest, ResumedRequest, StepBatch, StepEvents
from omni_pcache.stats import CacheStats

MODELS = ("transformer", "prefix-hash")
ROW_INFO = "row_info"
"""A per-row leftover the engine adds when it verifies leftovers: each row's position (a
resumed request's rows its consumer already has must be left out of it, as of the keys)."""


class EngineCapacityError(RuntimeError):
    """The workload cannot run on this engine's KV pool (a request alone does not fit)."""


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and modes of one engine run."""

    num_blocks: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_running: int = 16
    long_prefill_tokens: int | None = 96
    enable_prefix_caching: bool = True
    model: str = "transformer"
    output_thread: bool = False
    deferred_proj: bool = False  # keep the "proj" key on the device until its request finishes
    # Find the cached mm keys as vLLM-Omni does, afresh each step (`CachePolicy.reclassify_each_step`)
    # instead of naming "proj" (its rows are 2-D; the per-row leftover's are 1-D).
    reclassify_keys: bool = False
    device_budget_bytes: int = 512 << 20
    # The cache's `CacheConfig.inline_write_bytes` (None: its default). 0 hands every step to the
    # committer, so a step consumed before the next begin_step reads its rows from the caller's
    # tensors (the engine's steps are otherwise small enough for save to write them itself).
    inline_write_bytes: int | None = None
    # The cache's `CacheConfig.prefetch_hits` (None: by the outputs' device, so off for CPU ones).
    prefetch_hits: bool | None = None
    # None: the model's output tensors go to save as they are. A device ("cpu", "cuda", ...):
    # they are copied into persistent buffers on it, reused every step as vLLM's runner reuses
    # its own (see `OutputBuffers`).
    output_device: str | None = None
    seed: int = 0
    max_steps: int = 100_000
    # Chance that a request preempted in a step is aborted at the next one, while it waits to
    # resume (a client giving up on a stalled request): workload aborts, drawn at arrival,
    # almost never find a request preempted.
    abort_preempted: float = 0.0
    # Rows of a step in a random order of its requests, not the scheduler's (vLLM's input batch
    # condenses and reorders its rows).
    shuffle_batch: bool = False
    # Steps saved after a step before its id goes to the output path: 0 hands it over right
    # after its save (vLLM's sync scheduling: the output built in the same step, before the
    # next begin_step; on the output thread, racing it); 1 materializes the step before (vLLM's
    # async scheduling); more keep that many ids outstanding, as pipeline stages or a lagging
    # output thread do (at most the cache's staging_depth - 1).
    consume_lag: int = 1


@dataclass
class RequestOutput:
    """Everything the output path received for one request, in order."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    proj: list[torch.Tensor] = field(default_factory=list)
    leftover_seen: int = 0
    leftover_off_host: int = 0  # returned leftovers holding a tensor not on the host
    leftover_wrong: int = 0  # returned leftovers unequal to what the model produced that step
    delivered: int = 0  # rows returned so far (the per-row leftover check's position)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.hidden), torch.cat(self.proj)


@dataclass
class EngineResult:
    """A run's outputs and counters."""

    outputs: dict[str, RequestOutput]
    requests: dict[str, Request]
    steps: int
    tokens_computed: int
    hit_tokens: int
    new_hits: int  # requests admitted for the first time with a prefix hit
    new_misses: int  # ... and without one
    prefix_rows_returned: int  # rows materialize returned ahead of each step's own rows, summed
    preemptions: int
    evictions: int
    wall_s: float
    cache_stats: CacheStats | None


class Engine:
    """Runs a workload to completion. Not reusable: build one per run."""

    verify_leftovers = True
    """Checks each returned leftover against the model's, and keeps a copy of each returned row
    tensor, then overwrites the tensor it was handed (a harness check on the engine and output
    threads: returned rows are the caller's to write, so a tensor that shares memory with the
    cache's storage would corrupt later hits; benches/engine.py turns it off so it is not
    timed as cache overhead)."""

    def __init__(self, config: EngineConfig, cache_config: CacheConfig | None = None) -> None:
        if config.model not in MODELS:
            raise ValueError(f"unknown model {config.model!r}; choose from {', '.join(MODELS)}")
        self.config = config
        self._abort_rng = random.Random(config.seed + 104_729)  # (apart from the workload's draws)
        self._batch_rng = random.Random(config.seed + 15_485_863)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_running, config.long_prefill_tokens
        )
        num_slots = config.num_blocks * config.block_size
        if config.model == "transformer":
            self.model = TinyTransformer(num_slots, config.block_size, seed=config.seed)
        else:
            self.model = PrefixHashModel(num_slots, config.block_size, seed=config.seed)
        self.cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            cache_config = cache_config or CacheConfig(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                staging_capacity_tokens=config.max_num_batched_tokens,
                claim_timeout_s=60.0,
                device_budget_bytes=config.device_budget_bytes,
                **({} if config.inline_write_bytes is None else {"inline_write_bytes": config.inline_write_bytes}),
                prefetch_hits=config.prefetch_hits,
            )
            if not 0 <= config.consume_lag < cache_config.staging_depth:  # (else save waits for a page forever)
                raise ValueError(
                    f"consume_lag must be from 0 to the cache's staging_depth - 1, got {config.consume_lag}"
                )
            deferred = frozenset({"proj"}) if config.deferred_proj else frozenset()
            if config.reclassify_keys:
                policy = CachePolicy(deferred_keys=deferred, reclassify_each_step=True)
            else:
                policy = CachePolicy(token_keys=frozenset({"proj"}), deferred_keys=deferred)
            self.cache = PrefixCache(cache_config, policy)
        self.buffers: OutputBuffers | None = None
        if config.output_device is not None and self.cache is not None:
            self.buffers = OutputBuffers(config.output_device, config.max_num_batched_tokens)
        self.outputs: dict[str, RequestOutput] = {}
        self._reference_rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._leftovers: dict[int, dict[str, object]] = {}  # step id -> a host copy of the model's step_info
        self._row_starts: dict[int, dict[str, int]] = {}  # step id -> each request's first position in it
        self._prefix_rows_returned = 0  # rows returned ahead of their steps' own (from the cache)
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    # ---- output path -------------------------------------------------------------------

    def _consume(self, step_id: int, req_ids: list[str]) -> None:
        assert self.cache is not None
        out = self.cache.materialize(step_id, req_ids)
        with self._lock:
            for req_id in req_ids:
                rec = self.outputs.setdefault(req_id, RequestOutput())
                hidden, proj = out.hidden[req_id], out.mm["proj"][req_id]
                if self.verify_leftovers:  # (the caller's to write: keep a copy, then scribble on it)
                    hidden, proj = _kept_then_overwritten(hidden), _kept_then_overwritten(proj)
                rec.hidden.append(hidden)
                rec.proj.append(proj)
                rec.leftover_seen += 1
                # The rows returned cover the positions from the first not returned before; those
                # ahead of the step's first position came from the cache (`compare` checks the
                # cache's counters against their sum).
                start, end = rec.delivered, rec.delivered + hidden.shape[0]
                rec.delivered = end
                step_start = self._row_starts[step_id][req_id]
                self._prefix_rows_returned += max(0, step_start - start)
                if self.verify_leftovers:
                    # The per-row leftover holds this step's rows the cached keys returned: from
                    # the step's first position, or the first not returned before, to the end.
                    expected = torch.arange(max(start, step_start), end)
                    rec.leftover_wrong += not torch.equal(out.mm[ROW_INFO][req_id], expected)
                    leftover = out.mm["step_info"][req_id]
                    rec.leftover_off_host += any(
                        isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in leftover.values()
                    )
                    rec.leftover_wrong += not _same_leftover(leftover, self._leftovers[step_id])
            self._leftovers.pop(step_id, None)
            self._row_starts.pop(step_id, None)

    def _output_worker(self, inbox: queue.Queue) -> None:
        while (item := inbox.get()) is not None:
            try:
                self._consume(*item)
            except BaseException as exc:
                self._errors.append(exc)
                return

    # ---- one step ------------------------------------------------------------------------

    def _forward_batch(self, sched: ScheduledStep) -> ForwardBatch:
        tokens, positions, slots, reqs = [], [], [], []
        row = 0
        bs = self.config.block_size
        for req, count in sched.scheduled:
            pos = np.arange(req.num_computed, req.num_computed + count)
            table = np.asarray(req.blocks, dtype=np.int64)
            tokens.extend(req.tokens[req.num_computed : req.num_computed + count])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            reqs.append((row, count, list(req.blocks), req.num_computed + count))
            row += count
        return ForwardBatch(
            torch.tensor(tokens, dtype=torch.int64),
            torch.from_numpy(np.concatenate(positions)),
            np.concatenate(slots).astype(np.int64),
            reqs,
        )

    def _shuffled(self, scheduled: list, hidden: torch.Tensor, mm: dict, slots: np.ndarray) -> tuple:
        """The step's requests, rows and slots regrouped in a random order of its requests, as
        vLLM's input batch reorders them. The forward itself ran in the scheduler's order (the
        prefix-hash model computes requests in batch order: writers of same-step hits first)."""
        order = self._batch_rng.sample(range(len(scheduled)), len(scheduled))
        starts = np.cumsum([0] + [count for _, count in scheduled])
        index = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order])
        rows = torch.from_numpy(index)
        per_row = {k: v[rows] for k, v in mm.items() if k in ("proj", ROW_INFO)}
        return [scheduled[i] for i in order], hidden[rows], {**mm, **per_row}, slots[index]

    def _record_reference(self, sched: ScheduledStep, hidden: torch.Tensor, proj: torch.Tensor) -> None:
        row = 0
        for req, count in sched.scheduled:
            rows = self._reference_rows.setdefault(req.req_id, {})
            for i in range(count):
                rows.setdefault(req.num_computed + i, (hidden[row + i], proj[row + i]))
            row += count

    def run(self, requests: list[Request], progress: Callable[[int, int], None] | None = None) -> EngineResult:
        """Runs every request to completion (or abort). ``progress(done, total)`` is called
        after each step."""
        by_arrival = sorted(requests, key=lambda r: r.arrival_step)
        pending = list(by_arrival)
        aborts: dict[int, list[Request]] = {}
        for req in requests:
            if req.abort_step is not None:
                aborts.setdefault(req.abort_step, []).append(req)
        inbox: queue.Queue | None = None
        worker = None
        if self.cache is not None and self.config.output_thread:
            inbox = queue.Queue()
            worker = threading.Thread(target=self._output_worker, args=(inbox,), name="engine-output")
            worker.start()
        saved: deque[tuple[int, list[str]]] = deque()  # step ids not yet handed to the output path
        tokens_computed = 0
        start = time.perf_counter()
        step = 0
        try:
            while (pending or self.scheduler.has_work) and step < self.config.max_steps:
                while pending and pending[0].arrival_step <= step:
                    self.scheduler.add(pending.pop(0))
                for req in aborts.pop(step, []):
                    self.scheduler.abort(req)
                sched = self.scheduler.schedule(step)
                for victim in sched.preempted:
                    if self.config.abort_preempted and self._abort_rng.random() < self.config.abort_preempted:
                        aborts.setdefault(step + 1, []).append(victim)
                if not sched.scheduled and not self.scheduler.running and self.scheduler.waiting:
                    head = self.scheduler.waiting[0]
                    raise EngineCapacityError(
                        f"request {head.req_id} needs {-(-head.num_tokens // self.config.block_size)} KV blocks "
                        f"but the pool has {self.config.num_blocks}; raise --num-blocks"
                    )
                if self.cache is not None and (sched.scheduled or sched.finished):
                    self.cache.begin_step(
                        StepEvents(
                            new=[NewRequest(r, b, n) for r, b, n in sched.new],
                            resumed=[ResumedRequest(r, b, n) for r, b, n in sched.resumed],
                            finished=sched.finished,
                        )
                    )
                if sched.scheduled:
                    batch = self._forward_batch(sched)
                    out = self.model.forward(batch)
                    tokens_computed += sched.num_tokens
                    if self.cache is not None:
                        scheduled, hidden, mm, slots = sched.scheduled, out.hidden, out.mm, batch.slot_mapping
                        if self.verify_leftovers:  # (a per-row leftover: each row's position)
                            mm = {**mm, ROW_INFO: batch.positions.clone()}
                        padded = None
                        if self.config.shuffle_batch and len(scheduled) > 1:
                            scheduled, hidden, mm, slots = self._shuffled(scheduled, hidden, mm, slots)
                        if self.buffers is not None:
                            row_info = mm.get(ROW_INFO)
                            hidden, mm, padded, slots = self.buffers.fill(hidden, mm["proj"], mm["step_info"], slots)
                            if row_info is not None:
                                mm[ROW_INFO] = row_info
                        req_ids, counts = [r.req_id for r, _ in scheduled], [n for _, n in scheduled]
                        step_batch = StepBatch(req_ids, counts, slots, padded)
                        step_id = self.cache.save(hidden, mm, step_batch)
                        for req, count in sched.scheduled:  # (before `update` moves num_computed on)
                            req.saved_upto = max(req.saved_upto, req.num_computed + count)
                        with self._lock:
                            self._row_starts[step_id] = {req.req_id: req.num_computed for req, _ in sched.scheduled}
                            if self.verify_leftovers:
                                self._leftovers[step_id] = {
                                    k: v.clone() if isinstance(v, torch.Tensor) else v
                                    for k, v in out.mm["step_info"].items()
                                }
                        saved.append((step_id, step_batch.req_ids))
                        if len(saved) > self.config.consume_lag:
                            self._hand_off(saved.popleft(), inbox)
                    else:
                        self._record_reference(sched, out.hidden, out.mm["proj"])
                    self.scheduler.update(sched)
                step += 1
                if self._errors:
                    raise self._errors[0]
                if progress is not None:
                    progress(sum(1 for r in requests if r.is_done), len(requests))
            while saved:
                self._hand_off(saved.popleft(), inbox)
            last = self.scheduler.schedule(step)  # reports what finished in the last step
            if self.cache is not None and last.finished:
                self.cache.begin_step(StepEvents(finished=last.finished))
        finally:
            if inbox is not None and worker is not None:
                inbox.put(None)
                worker.join()
        if self._errors:
            raise self._errors[0]
        stats = None
        if self.cache is not None:
            self.cache.flush()
            stats = self.cache.stats()
            self.cache.close()
        wall = time.perf_counter() - start
        if self.cache is None:
            self._outputs_from_reference()
        return EngineResult(
            outputs=self.outputs,
            requests={r.req_id: r for r in requests},
            steps=step,
            tokens_computed=tokens_computed,
            hit_tokens=self.scheduler.num_hit_tokens,
            new_hits=self.scheduler.num_new_hits,
            new_misses=self.scheduler.num_new_misses,
            prefix_rows_returned=self._prefix_rows_returned,
            preemptions=self.scheduler.num_preemptions,
            evictions=self.kv.pool.num_evictions,
            wall_s=wall,
            cache_stats=stats,
        )

    def _hand_off(self, item: tuple[int, list[str]], inbox: queue.Queue | None) -> None:
        if inbox is None:
            self._consume(*item)
        else:
            inbox.put(item)

    def _outputs_from_reference(self) -> None:
        for req_id, rows in self._reference_rows.items():
            positions = sorted(rows)
            assert positions == list(range(len(positions))), f"{req_id}: gap in reference rows"
            rec = RequestOutput()
            rec.hidden.append(torch.stack([rows[p][0] for p in positions]))
            rec.proj.append(torch.stack([rows[p][1] for p in positions]))
            self.outputs[req_id] = rec


def _kept_then_overwritten(rows: torch.Tensor) -> torch.Tensor:
    """A copy of ``rows``; ``rows`` itself is then overwritten (NaN, or -7 for integers)."""
    kept = rows.clone()
    rows.fill_(float("nan") if rows.is_floating_point() else -7)
    return kept


def _same_leftover(got: dict[str, object], want: dict[str, object]) -> bool:
    """A returned leftover dict against the model's (tensors compared on the host, exactly)."""
    if got.keys() != want.keys():
        return False
    for key, value in want.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(other, torch.Tensor) or not torch.equal(other.cpu(), value):
                return False
        elif other != value:
            return False
    return True


def unfinished(result: EngineResult) -> list[str]:
    """Requests neither finished nor aborted (the run hit ``max_steps``)."""
    return [r for r, req in result.requests.items() if req.status not in (Status.FINISHED, Status.ABORTED)]
