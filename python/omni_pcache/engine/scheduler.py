"""The embedded engine's scheduler, after vLLM v1's: a token budget per step, chunked
prefill, decode, a cap on running requests, preemption when blocks run out, aborts.

Each `schedule` returns what a vLLM `SchedulerOutput` carries for the cache: requests
scheduled for the first time (block table and prefix-hit length), resumed ones (new block
table, re-matched hit), finished or aborted ids since the last step, and every scheduled
request's token count in batch order (running first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omni_pcache.engine.kv_manager import KVCacheManager
from omni_pcache.engine.request import Request, Status


@dataclass
class ScheduledStep:
    """One step's schedule."""

    step: int
    new: list[tuple[str, list[int], int]] = field(default_factory=list)
    resumed: list[tuple[str, list[int], int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # back in the waiting queue this step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Schedules requests over a `KVCacheManager`."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_running: int,
        long_prefill_tokens: int | None = None,
    ) -> None:
        self.kv = kv
        self.budget = max_num_batched_tokens
        self.max_running = max_num_running
        self.long_prefill_tokens = long_prefill_tokens or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since: list[str] = []
        self.num_preemptions = 0
        self.num_hit_tokens = 0
        self.num_new_hits = self.num_new_misses = 0  # first admissions with and without a prefix hit

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Aborts a waiting or running request; it is reported as finished next step, as vLLM
        reports every aborted id (one never scheduled included) in ``finished_req_ids``."""
        if req.is_done:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.ABORTED
        self._finished_since.append(req.req_id)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.preempted = True
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self, step: int) -> ScheduledStep:
        out = ScheduledStep(step, finished=self._finished_since)
        self._finished_since = []
        budget = self.budget
        preempted_any = False
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:
                continue  # preempted below for an earlier request
            num_new = min(req.num_tokens - req.num_computed, budget, self.long_prefill_tokens)
            while not self.kv.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                preempted_any = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            out.scheduled.append((req, num_new))
            budget -= num_new
        if preempted_any:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            hit = self.kv.match_prefix(req)
            num_new = min(req.num_tokens - len(hit) * self.kv.block_size, budget, self.long_prefill_tokens)
            if not self.kv.allocate(req, num_new, hit):
                break
            self.waiting.popleft()
            req.num_computed = len(hit) * self.kv.block_size
            self.num_hit_tokens += req.num_computed
            entry = (req.req_id, list(req.blocks), req.num_computed)
            if req.scheduled_before:
                out.resumed.append(entry)
            else:
                out.new.append(entry)
                if req.num_computed:
                    self.num_new_hits += 1
                else:
                    self.num_new_misses += 1
            req.scheduled_before = True
            req.preempted = False
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out

    def update(self, scheduled: ScheduledStep) -> list[Request]:
        """Advances each scheduled request by its tokens; a request that computed all its known
        tokens "samples" its next (predetermined) token or finishes. Returns finished ones."""
        done = []
        for req, num_new in scheduled.scheduled:
            if req.status is not Status.RUNNING:
                continue
            req.num_computed += num_new
            if req.num_computed == req.num_tokens:
                req.tokens.append(req.outputs[req.num_output_tokens])
                if req.num_output_tokens == len(req.outputs):
                    self.running.remove(req)
                    self.kv.free(req)
                    req.status = Status.FINISHED
                    self._finished_since.append(req.req_id)
                    done.append(req)
        return done

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
