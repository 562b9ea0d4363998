"""A recorded sequence of vLLM scheduler outputs, replayed through `PrefixCacheRunnerMixin`.

The sequence (block size 4) is what vLLM 0.33's scheduler sends for six requests, written out
step by step: a prefix hit (B on A's first two blocks), a same-step hit (D on the block C
computes in the same step), a chunked prefill (E), an abort whose ``finished`` id arrives in the
step that already reuses one of its freed blocks while another request (F) hits its first block,
a preemption resumed V1-style (B, through ``resumed_req_ids``), a preemption resumed V2-style
(D, sent again in ``scheduled_new_reqs`` with ``prefill_token_ids``), normal finishes, and a
final step with zero scheduled tokens.

The model is a stand-in with the one property that matters: a token's output row is a function
of the tokens up to it (causal), as a transformer's hidden state is. Row ``p`` of a request is
``[p, token_p, h_hi, h_lo]`` (``h`` a 48-bit digest of ``tokens[: p + 1]``) and its per-token
``codes`` entry is ``1000 * p + token_p``; so a row names its position and its sequence, and a
prefix computed by another request is the requester's own. `replay` checks that the scenario
itself is consistent (every hit covers slots that hold exactly that prefix), that the adapter's
slot mapping is the per-token formula, and that the rows returned for each request concatenate
to its full-sequence rows.

`replay` takes a namespace of types (`vllm_standins`, or vLLM's real classes) so the same
sequence runs with both.
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_pcache import CachePolicy
from omni_pcache.vllm import PrefixCacheRunnerMixin, step_batch

BLOCK_SIZE = 4
NUM_BLOCKS = 32
S = [11, 12, 13, 14, 15, 16, 17, 18]  # a shared two-block prefix

PROMPTS = {
    "A": [*S, 21, 22],
    "B": [*S, 31, 32, 33],
    "C": [41, 42, 43, 44, 45, 46, 47, 48, 49],
    "D": [41, 42, 43, 44, 61, 62, 63],
    "E": list(range(71, 83)),
    "F": [71, 72, 73, 74, 91, 92],
}
OUTPUTS = {
    "A": [23, 24, 25, 26, 27, 28],
    "B": [34, 35, 36, 37],
    "C": [50, 51, 52],
    "D": [64, 65, 66, 67, 68],
    "E": [83],
    "F": [93, 94, 95, 96],
}
TOKENS = {r: PROMPTS[r] + OUTPUTS[r] for r in PROMPTS}
# Positions each request's consumer must have received at the end (aborted ones: what ran).
EXPECTED_ROWS = {"A": 15, "B": 14, "C": 11, "D": 11, "E": 12, "F": 9}


@dataclass
class New:
    req_id: str
    blocks: list[int]
    num_computed: int
    num_tokens: int
    v2_resume: bool = False  # V2 runner: a resumed request sent again as new
    known_tokens: int | None = None  # a resume's token count (prefill_token_ids); None: computed + scheduled


@dataclass
class Cached:
    req_id: str
    new_blocks: list[int] | None  # appended; the whole list when resumed
    num_computed: int
    num_tokens: int
    resumed: bool = False
    known_tokens: int | None = None  # a resume's token count (all_token_ids); None: not sent


@dataclass
class Step:
    new: list[New] = field(default_factory=list)
    cached: list[Cached] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)


RECORDED = [
    # 1: A misses; E's 12-token prompt is chunked (8 now).
    Step(new=[New("A", [1, 2, 3], 0, 10), New("E", [10, 11], 0, 8)]),
    # 2: B hits A's blocks 1-2; D hits block 5, which C computes in this same step.
    Step(
        cached=[Cached("A", None, 10, 1), Cached("E", [12], 8, 4)],
        new=[New("B", [1, 2, 4], 8, 3), New("C", [5, 6, 7], 0, 9), New("D", [5, 8], 4, 3)],
    ),
    # 3: E was aborted (its blocks freed last step); F hits E's block 10 and reuses E's block 11
    #    in the step that reports E finished. B is preempted.
    Step(
        finished={"E"},
        preempted={"B"},
        cached=[Cached("A", None, 11, 1), Cached("C", None, 9, 1), Cached("D", None, 7, 1)],
        new=[New("F", [10, 11], 4, 2)],
    ),
    # 4: B resumes V1-style (resumed_req_ids; the list is replaced): hit 8, recomputes 8..11.
    Step(
        cached=[
            Cached("A", [13], 12, 1),
            Cached("C", None, 10, 1),
            Cached("D", [14], 8, 1),
            Cached("F", None, 6, 1),
            Cached("B", [1, 2, 9], 8, 4, resumed=True),
        ]
    ),
    # 5: C finished; D is preempted.
    Step(
        finished={"C"},
        preempted={"D"},
        cached=[Cached("A", None, 13, 1), Cached("B", [15], 12, 1), Cached("F", None, 7, 1)],
    ),
    # 6: D resumes V2-style: sent as new while still live, hit 8 (block 5 from C, 8 its own).
    Step(
        cached=[Cached("A", None, 14, 1), Cached("B", None, 13, 1), Cached("F", [17], 8, 1)],
        new=[New("D", [5, 8, 16], 8, 2, v2_resume=True)],
    ),
    # 7: A and B finished, F aborted.
    Step(finished={"A", "B", "F"}, cached=[Cached("D", None, 10, 1)]),
    # 8: D finished; nothing scheduled (the runner returns before the forward).
    Step(finished={"D"}),
]


@dataclass
class Scenario:
    """A sequence of scheduler steps and what the requests in it are: their tokens (prompt then
    outputs) and how many positions each one's consumer must have received at the end."""

    steps: list[Step]
    tokens: dict[str, list[int]]
    prompts: dict[str, list[int]]
    expected_rows: dict[str, int]
    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS
    max_num_batched_tokens: int = 64


RECORDED_SCENARIO = Scenario(RECORDED, TOKENS, PROMPTS, EXPECTED_ROWS)


def import_vllm_or_skip() -> None:
    """Imports vLLM for a real-type test module (call it under a warnings filter, at import):
    with ``OMNI_PCACHE_REQUIRE_VLLM`` set (`just test-vllm`) a broken install fails, never
    skips; otherwise the module is skipped where vLLM is not installed."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("OMNI_PCACHE_REQUIRE_VLLM"):
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vLLM is not installed here (run `just test-vllm`)")


def padded_step(rows: list[list[float]], codes: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A forward's outputs from its rows: the hidden states and the per-token ``codes``, padded
    CUDA-graph style to a multiple of 8 rows with junk."""
    n = len(rows)
    padded = -(-n // 8) * 8
    hidden = torch.full((padded, 4), -7.0, dtype=torch.float64)
    hidden[:n] = torch.tensor(rows, dtype=torch.float64)
    code_t = torch.full((padded,), -7, dtype=torch.int64)
    code_t[:n] = torch.tensor(codes, dtype=torch.int64)
    return hidden, {"codes": code_t}


def digest(tokens: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=6).digest(), "big")


def hidden_row(tokens: list[int], pos: int) -> list[float]:
    h = digest(tokens[: pos + 1])
    return [float(pos), float(tokens[pos]), float(h >> 24), float(h & 0xFFFFFF)]


def full_rows(tokens: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-sequence rows (hidden, codes) of a request's first ``count`` positions."""
    hidden = torch.tensor([hidden_row(tokens, p) for p in range(count)], dtype=torch.float64).reshape(count, 4)
    codes = torch.tensor([1000 * p + tokens[p] for p in range(count)], dtype=torch.int64)
    return hidden, codes


def scheduler_output(t: Any, step: Step, scenario: Scenario = RECORDED_SCENARIO) -> Any:
    """One step as a SchedulerOutput built from ``t``'s classes (stand-ins or vLLM's)."""
    new_reqs = [
        t.NewRequestData(
            req_id=n.req_id,
            prompt_token_ids=list(scenario.prompts[n.req_id]),
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=(list(n.blocks),),
            num_computed_tokens=n.num_computed,
            lora_request=None,
            prefill_token_ids=list(scenario.tokens[n.req_id][: n.known_tokens or n.num_computed + n.num_tokens])
            if n.v2_resume
            else None,
        )
        for n in step.new
    ]
    cached = t.CachedRequestData(
        req_ids=[c.req_id for c in step.cached],
        resumed_req_ids={c.req_id for c in step.cached if c.resumed},
        new_token_ids=[],
        all_token_ids={
            c.req_id: list(scenario.tokens[c.req_id][: c.known_tokens]) for c in step.cached if c.known_tokens
        },
        new_block_ids=[None if c.new_blocks is None else (list(c.new_blocks),) for c in step.cached],
        num_computed_tokens=[c.num_computed for c in step.cached],
        num_output_tokens=[max(0, c.num_computed + 1 - len(scenario.prompts[c.req_id])) for c in step.cached],
    )
    counts = {c.req_id: c.num_tokens for c in step.cached} | {n.req_id: n.num_tokens for n in step.new}
    return t.SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(step.finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(step.preempted),
    )


class KVModel:
    """The test's own bookkeeping of the recorded sequence: each request's block table and which
    token prefix each slot's KV holds, to check that every hit in the scenario is a real one."""

    def __init__(self, scenario: Scenario) -> None:
        self.tokens = scenario.tokens
        self.block_size = scenario.block_size
        self.blocks: dict[str, list[int]] = {}
        self.slot_prefix: dict[int, int] = {}

    def slots(self, req_id: str, start: int, count: int) -> np.ndarray:
        pos = np.arange(start, start + count)
        table = np.asarray(self.blocks[req_id], dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def apply(self, step: Step) -> dict[str, int]:
        """Applies a step; returns each scheduled request's num_computed."""
        computed = {}
        for n in step.new:
            self.blocks[n.req_id] = list(n.blocks)
            computed[n.req_id] = n.num_computed
        for c in step.cached:
            if c.resumed:
                self.blocks[c.req_id] = list(c.new_blocks or [])
            elif c.new_blocks:
                self.blocks[c.req_id] += c.new_blocks
            computed[c.req_id] = c.num_computed
        for req_id, start in computed.items():
            count = next(e.num_tokens for e in [*step.new, *step.cached] if e.req_id == req_id)
            for i, slot in enumerate(self.slots(req_id, start, count).tolist()):
                self.slot_prefix[slot] = digest(self.tokens[req_id][: start + i + 1])
        # Hits are checked after this step's writes: a same-step hit reads KV written in this forward.
        for req_id, start in computed.items():
            fresh = [n for n in step.new if n.req_id == req_id] + [c for c in step.cached if c.req_id == req_id]
            if any(isinstance(e, New) or e.resumed for e in fresh) and start:
                for pos, slot in enumerate(self.slots(req_id, 0, start).tolist()):
                    want = digest(self.tokens[req_id][: pos + 1])
                    assert self.slot_prefix.get(slot) == want, f"scenario bug: {req_id} hits slot {slot} at {pos}"
        return computed


def stage_configs(t: Any, scenario: Scenario = RECORDED_SCENARIO) -> dict[str, Any]:
    """The vLLM configs of the replayed stage, from ``t``'s classes."""
    bs = scenario.block_size
    spec = t.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=8, dtype=torch.float16)
    return {
        "cache_config": t.CacheConfig(block_size=bs, enable_prefix_caching=True),
        "kv_cache_config": t.KVCacheConfig(
            num_blocks=scenario.num_blocks, kv_cache_tensors=[], kv_cache_groups=[t.KVCacheGroupSpec(["layer.0"], spec)]
        ),
        "kv_transfer_config": None,
        "scheduler_config": t.SchedulerConfig(max_num_batched_tokens=scenario.max_num_batched_tokens),
        "model_config": None,
        "speculative_config": None,
        "parallel_config": t.ParallelConfig(),
        "is_pooling": False,
    }


class Runner(PrefixCacheRunnerMixin):
    """A model runner reduced to the calls it makes into the mixin, in vLLM's order."""

    def __init__(self, order: str, output: str, tokens: dict[str, list[int]] = TOKENS) -> None:
        self.tokens = tokens
        self.order = order
        self.output = output
        self.received: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.errors: list[BaseException] = []
        self._pending: tuple[int, list[str]] | None = None
        self._inbox: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if output == "thread":
            self._inbox = queue.Queue()
            self._thread = threading.Thread(target=self._output_worker, name="output-builder")
            self._thread.start()

    def row_order(self, so: Any, step_no: int) -> list[str]:
        ids = [*so.scheduled_cached_reqs.req_ids, *(r.req_id for r in so.scheduled_new_reqs)]
        if self.order == "shuffled":
            random.Random(step_no).shuffle(ids)
        return ids

    def forward(self, so: Any, req_ids: list[str], computed: dict[str, int]) -> tuple[torch.Tensor, dict]:
        rows, codes = [], []
        for req_id in req_ids:
            start = computed[req_id]
            for pos in range(start, start + so.num_scheduled_tokens[req_id]):
                rows.append(hidden_row(self.tokens[req_id], pos))
                codes.append(1000 * pos + self.tokens[req_id][pos])
        return padded_step(rows, codes)

    def consume(self, step_id: int, req_ids: list[str]) -> None:
        out = self.pcache_materialize(step_id, req_ids)
        for req_id in req_ids:
            self.received.setdefault(req_id, []).append((out.hidden[req_id], out.mm["codes"][req_id]))

    def _output_worker(self) -> None:
        assert self._inbox is not None
        while (item := self._inbox.get()) is not None:
            try:
                self.consume(*item)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
                return

    def hand_off(self, item: tuple[int, list[str]]) -> None:
        if self._inbox is not None:
            self._inbox.put(item)
        else:
            self.consume(*item)

    @torch.inference_mode()  # (as vLLM's runners run it: save then makes no inference tensors)
    def execute_model(self, so: Any, step_no: int, computed: dict[str, int]) -> None:
        self.pcache_begin_step(so)  # before the runner drops finished requests
        if so.total_num_scheduled_tokens == 0:
            return
        req_ids = self.row_order(so, step_no)
        hidden, mm = self.forward(so, req_ids, computed)
        step_id = self.pcache_save(hidden, mm, so, req_ids, num_tokens_padded=hidden.shape[0])
        if self.output == "late":  # async scheduling: the previous step's outputs now
            if self._pending is not None:
                self.hand_off(self._pending)
            self._pending = (step_id, req_ids)
        else:
            self.hand_off((step_id, req_ids))

    def warm_up(self, t: Any, scenario: Scenario) -> None:
        """A V2-style kernel warm-up inside ``pcache_warmup``: ``execute_model`` on hand-built
        SchedulerOutputs (here the scenario's first step, whose request ids the real steps use
        too, with junk rows, then their finish) whose outputs nobody consumes."""
        first = scenario.steps[0]
        with self.pcache_warmup():
            for step in (first, Step(finished={r.req_id for r in first.new})):
                so = scheduler_output(t, step, scenario)
                self.pcache_begin_step(so)
                if so.total_num_scheduled_tokens:
                    n, req_ids = so.total_num_scheduled_tokens, self.row_order(so, 0)
                    junk = torch.full((n, 4), -1.0, dtype=torch.float64), {"codes": torch.full((n,), -1)}
                    assert self.pcache_save(*junk, so, req_ids) is None, "a warm-up step has no step id"

    def finish(self) -> None:
        if self._pending is not None:
            self.hand_off(self._pending)
            self._pending = None
        if self._inbox is not None and self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
        if self.errors:
            raise self.errors[0]


def replay(
    t: Any,
    *,
    order: str = "scheduler",
    output: str = "inline",
    scenario: Scenario = RECORDED_SCENARIO,
    refused_before: dict[int, tuple[Step, type[BaseException], str]] | None = None,
    warm_up_before: frozenset[int] = frozenset(),
    init_options: dict[str, Any] | None = None,
) -> Runner:
    """Replays a scenario through a mixin runner with a real, threaded `PrefixCache`; asserts
    the slot mapping of every step and every request's concatenated rows. ``refused_before``
    maps a step number to a SchedulerOutput sent before it that ``pcache_begin_step`` must
    refuse (its error type and a message pattern) without changing the block tracker. A
    warm-up (`Runner.warm_up`) runs before each step number in ``warm_up_before``;
    ``init_options`` go to ``pcache_init``."""
    runner = Runner(order, output, scenario.tokens)
    runner.pcache_load_policy(CachePolicy(token_keys=frozenset({"codes"})))
    assert runner.pcache_init(
        **stage_configs(t, scenario), is_last_pipeline_stage=True, tensor_parallel_rank=0, **(init_options or {})
    )
    kv = KVModel(scenario)
    bs = scenario.block_size
    try:
        for step_no, step in enumerate(scenario.steps, start=1):
            if step_no in warm_up_before:
                runner.warm_up(t, scenario)
                if step_no == 1:
                    assert runner.pcache is None, "a warm-up before the first step builds no cache"
            if refused_before and step_no in refused_before:
                bad, error, message = refused_before[step_no]
                tracker = runner._pcache_state.tracker
                before = {r: None if b is None else list(b) for r, b in tracker._blocks.items()}
                with pytest.raises(error, match=message):
                    runner.pcache_begin_step(scheduler_output(t, bad, scenario))
                assert tracker._blocks == before, f"step {step_no}: a refused step changed the block tracker"
            so = scheduler_output(t, step, scenario)
            computed = kv.apply(step)
            runner.execute_model(so, step_no, computed)
            if so.total_num_scheduled_tokens:
                req_ids = runner.row_order(so, step_no)
                want = np.concatenate([kv.slots(r, computed[r], so.num_scheduled_tokens[r]) for r in req_ids]).astype(
                    np.int64
                )
                got = step_batch(so, runner._pcache_state.tracker, req_ids, bs).slot_mapping
                assert np.array_equal(got, want), f"step {step_no}: slot mapping {got.tolist()} != {want.tolist()}"
        runner.finish()
    finally:
        runner.pcache_shutdown()
    problems = []
    for req_id, count in scenario.expected_rows.items():
        parts = runner.received.get(req_id, [])
        hidden = torch.cat([h for h, _ in parts]) if parts else torch.empty(0, 4, dtype=torch.float64)
        codes = torch.cat([c for _, c in parts]) if parts else torch.empty(0, dtype=torch.int64)
        want_hidden, want_codes = full_rows(scenario.tokens[req_id], count)
        if not (torch.equal(hidden, want_hidden) and torch.equal(codes, want_codes)):
            got_pos = [(int(r[0]), int(r[1])) for r in hidden]
            problems.append(f"{req_id}: got (position, token) rows {got_pos}, expected positions 0..{count - 1}")
    assert not problems, "\n".join(problems)
    return runner


def standin_types() -> SimpleNamespace:
    import vllm_standins

    return SimpleNamespace(
        **{name: getattr(vllm_standins, name) for name in vllm_standins.__dict__ if name[0].isupper()}
    )


def record_engine_run(
    seed: int, *, v2: bool, num_requests: int = 40, num_blocks: int = 48, block_size: int = 4
) -> tuple[Scenario, dict[str, int]]:
    """Records the SchedulerOutputs of the embedded engine's scheduler (vLLM's rules: chained
    block hashes, same-step hits, chunked prefill, preemption, aborts) on a seeded mixed
    workload, as vLLM 0.33 would send them to a V1 runner (``v2=False``: resumed requests in
    ``resumed_req_ids``) or to a V2 runner (``v2=True``: resumed requests sent again as new).
    Returns the scenario and counters (steps, hits, preemptions, aborts)."""
    from omni_pcache.engine.kv_manager import KVCacheManager
    from omni_pcache.engine.request import Status
    from omni_pcache.engine.scheduler import Scheduler
    from omni_pcache.engine.workloads import make_workload

    requests = make_workload("mixed", num_requests, seed, abort_rate=0.15)
    by_id = {r.req_id: r for r in requests}
    kv = KVCacheManager(num_blocks, block_size, True)
    max_batched = 48
    sched = Scheduler(kv, max_batched, max_num_running=8, long_prefill_tokens=24)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    aborts: dict[int, list] = {}
    for r in requests:
        if r.abort_step is not None:
            aborts.setdefault(r.abort_step, []).append(r)

    def as_vllm(blocks: list[int]) -> list[int]:  # (vLLM's pool hands out ids from 1: block 0 is its null block)
        return [b + 1 for b in blocks]

    known: dict[str, int] = {}  # block-list length the worker has been sent
    computed_upto: dict[str, int] = {}
    steps: list[Step] = []
    preemptions = 0
    step_no = 0
    while pending or sched.has_work:
        assert step_no < 5000, "engine run did not finish"
        while pending and pending[0].arrival_step <= step_no:
            sched.add(pending.pop(0))
        for r in aborts.pop(step_no, []):
            sched.abort(r)
        before = {r.req_id: r.num_preemptions for r in sched.running}
        s = sched.schedule(step_no)
        preempted = {rid for rid, n in before.items() if by_id[rid].num_preemptions > n}
        preemptions += len(preempted)
        if not s.scheduled and not sched.running and sched.waiting:
            raise AssertionError("a request does not fit the pool; raise num_blocks")
        new_ids = {rid for rid, _, _ in s.new}
        resumed_ids = {rid for rid, _, _ in s.resumed}
        step = Step(finished=set(s.finished), preempted=preempted)
        running, resumed = [], []
        for req, n in s.scheduled:
            if req.req_id in new_ids or (v2 and req.req_id in resumed_ids):
                v2_resume = req.req_id in resumed_ids
                known_tokens = req.num_tokens if v2_resume else None
                step.new.append(New(req.req_id, as_vllm(req.blocks), req.num_computed, n, v2_resume, known_tokens))
            elif req.req_id in resumed_ids:
                known_tokens = req.num_tokens
                resumed.append(Cached(req.req_id, as_vllm(req.blocks), req.num_computed, n, True, known_tokens))
            else:
                added = as_vllm(req.blocks[known[req.req_id] :])
                running.append(Cached(req.req_id, added or None, req.num_computed, n))
            known[req.req_id] = len(req.blocks)
            computed_upto[req.req_id] = max(computed_upto.get(req.req_id, 0), req.num_computed + n)
        step.cached = running + resumed
        steps.append(step)
        sched.update(s)
        step_no += 1
    last = sched.schedule(step_no)
    if last.finished:
        steps.append(Step(finished=set(last.finished)))
    tokens = {r.req_id: r.prompt + r.outputs for r in requests}
    scenario = Scenario(
        steps,
        tokens,
        {r.req_id: list(r.prompt) for r in requests},
        {rid: n for rid, n in computed_upto.items()},
        block_size=block_size,
        num_blocks=num_blocks + 1,  # (and vLLM's null block)
        max_num_batched_tokens=max_batched,
    )
    counters = {
        "steps": len(steps),
        "hits": sum(1 for st in steps for n in st.new if n.num_computed and not n.v2_resume),
        "preemptions": preemptions,
        "aborted": sum(1 for r in requests if r.status is Status.ABORTED),
    }
    return scenario, counters
