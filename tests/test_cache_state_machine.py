"""A hypothesis state machine driving the `PrefixCache` facade against a pure-Python model.

The model is the pool as the engine sees it: for every slot, the row of its latest write
(claimed at save; the newest tenant wins). Rules add new requests (hitting blocks that the
model says were fully written since their last allocation, or missing), save steps of
scheduled chunks (a request finishes when its last chunk is saved), abort requests, reuse
freed blocks for new tenants, and materialize or discard outstanding step ids in any order.

Every row is a stamp ``[key, slot, writer, step]`` (tests/rowcodec.py); every materialize
must return exactly the model's rows, captured when the step was saved: a late read of a
block reused since then must still see the old tenant's rows. At teardown everything is
consumed, a last request hits every full block (what the pool holds in the end), and the
cache must be back to idle: no staging page held, no live task, no preserved entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omni_pcache import CacheConfig, CachePolicy, NewRequest, PrefixCache, StepBatch, StepEvents
from rowcodec import Stamp, describe, row_diff, stamps

BLOCK_SIZE = 2
NUM_BLOCKS = 6
STAGING_DEPTH = 4
MAX_FRESH_BLOCKS = 3
HIDDEN_KEY, WHO_KEY = 0, 1


@dataclass
class Req:
    req_id: str
    writer: int
    block_ids: list[int]
    num_tokens: int
    num_hit_tokens: int
    num_done: int  # positions hit or scheduled so far
    scheduled: bool = False

    def slot(self, position: int) -> int:
        return self.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


@dataclass
class SavedStep:
    step: int
    req_ids: list[str]
    expected: dict[str, list[tuple[int, int, int]]]  # req -> (slot, writer, step) per row
    num_hit_rows: dict[str, int]


class CacheMachine(RuleBasedStateMachine):
    THREADED = False
    INLINE_WRITE_BYTES = 0  # (threaded only) steps under this many bytes are written inside save

    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(
            NUM_BLOCKS,
            BLOCK_SIZE,
            staging_depth=STAGING_DEPTH,
            staging_capacity_tokens=64,
            claim_timeout_s=10.0,
            threaded=self.THREADED,
            inline_write_bytes=self.INLINE_WRITE_BYTES,
        )
        self.cache = PrefixCache(config, CachePolicy(token_keys=frozenset({"who"})))
        self.m_rows: dict[int, tuple[int, int]] = {}  # slot -> (writer, step) of its latest write
        self.m_filled: list[set[int]] = [set() for _ in range(NUM_BLOCKS)]  # offsets since allocation
        self.m_refs = [0] * NUM_BLOCKS
        self.m_free: list[int] = list(range(NUM_BLOCKS))
        self.m_live: dict[str, Req] = {}
        self.m_new: list[str] = []
        self.m_finished: list[str] = []
        self.m_outstanding: dict[int, SavedStep] = {}
        self.m_hits = self.m_misses = 0
        self.step = 0
        self.next_writer = 0

    # ---- model helpers -------------------------------------------------------------------------

    def _full_blocks(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if len(self.m_filled[b]) == BLOCK_SIZE]

    def _add_request(self, hits: list[int], fresh: list[int], last_block_tokens: int) -> Req:
        for block in hits:
            if self.m_refs[block] == 0:
                self.m_free.remove(block)
            self.m_refs[block] += 1
        for block in fresh:
            self.m_free.remove(block)
            self.m_filled[block] = set()  # a new tenant
            self.m_refs[block] = 1
        writer = self.next_writer
        self.next_writer += 1
        num_hit = len(hits) * BLOCK_SIZE
        num_tokens = (len(hits) + len(fresh) - 1) * BLOCK_SIZE + last_block_tokens
        req = Req(f"r{writer}", writer, hits + fresh, num_tokens, num_hit, num_hit)
        self.m_live[req.req_id] = req
        self.m_new.append(req.req_id)
        return req

    def _finish(self, req_id: str) -> None:
        req = self.m_live.pop(req_id)
        for block in req.block_ids:
            self.m_refs[block] -= 1
            if self.m_refs[block] == 0:
                self.m_free.append(block)
        self.m_finished.append(req_id)

    def _save(self, order: list[tuple[Req, int]], pad: int) -> int:
        """begin_step + save of one step scheduling ``count`` tokens of each request."""
        step = self.step
        self.step += 1
        new = [NewRequest(r, list(self.m_live[r].block_ids), self.m_live[r].num_hit_tokens) for r in self.m_new]
        events = StepEvents(new=new, finished=list(self.m_finished))
        self.m_hits += sum(1 for r in new if r.num_computed_tokens)
        self.m_misses += sum(1 for r in new if not r.num_computed_tokens)
        slots: list[int] = []
        rows: list[tuple[int, int, int]] = []
        for req, count in order:
            for position in range(req.num_done, req.num_done + count):
                slot = req.slot(position)
                slots.append(slot)
                rows.append((slot, req.writer, step))
                self.m_rows[slot] = (req.writer, step)
                self.m_filled[slot // BLOCK_SIZE].add(slot % BLOCK_SIZE)
        # Hits are planned after the step's claims: the expected rows are the model's now.
        expected, num_hit_rows = {}, {}
        for req, count in order:
            lo = 0 if not req.scheduled else req.num_done
            expected[req.req_id] = [(req.slot(p), *self.m_rows[req.slot(p)]) for p in range(lo, req.num_done + count)]
            num_hit_rows[req.req_id] = req.num_done - lo
            req.num_done += count
            req.scheduled = True
        n = len(slots)
        hidden = torch.cat([stamps([Stamp(HIDDEN_KEY, *r) for r in rows], torch.float64), torch.full((pad, 4), -1.0)])
        who = torch.cat([stamps([Stamp(WHO_KEY, *r) for r in rows]), torch.full((pad, 4), -1, dtype=torch.int64)])
        mapping = np.array(slots + [-1] * pad, dtype=np.int64)
        batch = StepBatch([r.req_id for r, _ in order], [c for _, c in order], mapping, n + pad if pad else None)
        self.cache.begin_step(events)
        step_id = self.cache.save(hidden, {"who": who, "note": f"step {step}"}, batch)
        assert step_id not in self.m_outstanding
        self.m_outstanding[step_id] = SavedStep(step, [r.req_id for r, _ in order], expected, num_hit_rows)
        self.m_new.clear()
        self.m_finished.clear()
        for req, _ in order:
            if req.num_done == req.num_tokens:  # prefill done: it finishes, reported next step
                self._finish(req.req_id)
        return step_id

    def _check(self, step_id: int, req_ids: list[str]) -> None:
        saved = self.m_outstanding.pop(step_id)
        out = self.cache.materialize(step_id, req_ids)
        assert out.hidden is not None and set(out.hidden) == set(req_ids)
        assert set(out.mm) == {"who", "note"} and set(out.mm["who"]) == set(req_ids)
        problems = []
        for req_id in req_ids:
            rows = saved.expected[req_id]
            got_who = out.mm["who"][req_id]
            exp_who = stamps([Stamp(WHO_KEY, *r) for r in rows])

            def explain(p: int, got_who=got_who, exp_who=exp_who, hit=saved.num_hit_rows[req_id]) -> str:
                got = got_who[p] if p < got_who.shape[0] else None
                part = "hit" if p < hit else "this step"
                return (
                    f"({part}) came from [{describe(got, BLOCK_SIZE)}], expected [{describe(exp_who[p], BLOCK_SIZE)}]"
                )

            where = f"step {saved.step} (id {step_id}) request {req_id}"
            exp_hidden = stamps([Stamp(HIDDEN_KEY, *r) for r in rows], torch.float64)
            for label, got, want in (("hidden", out.hidden[req_id], exp_hidden), ("who", got_who, exp_who)):
                diff = row_diff(f"{where} {label}", got, want, explain)
                if diff:
                    problems.append(diff)
            if out.mm["note"][req_id] != f"step {saved.step}":
                problems.append(f"{where}: leftover note {out.mm['note'][req_id]!r}")
        assert not problems, "\n".join(problems)

    # ---- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.m_new) < 3 and self.m_free)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """A new request: fresh blocks from the free list (reusing freed ones: a new tenant),
        optionally after hit blocks the model says are fully written."""
        fresh = data.draw(
            st.lists(st.sampled_from(self.m_free), min_size=1, max_size=MAX_FRESH_BLOCKS, unique=True),
            label="fresh",
        )
        hittable = [b for b in self._full_blocks() if b not in fresh]
        hits = data.draw(st.lists(st.sampled_from(hittable), max_size=3, unique=True), label="hits") if hittable else []
        self._add_request(hits, fresh, data.draw(st.integers(1, BLOCK_SIZE), label="last_block_tokens"))

    @precondition(lambda self: len(self.m_new) < 3 and any(b in self.m_free for b in self._full_blocks()))
    @rule(data=st.data())
    def reuse_freed_block(self, data: st.DataObject) -> None:
        """A new tenant for a freed block that still holds fully written rows (which reads
        planned earlier, and not yet materialized, may still need)."""
        block = data.draw(st.sampled_from([b for b in self._full_blocks() if b in self.m_free]))
        self._add_request([], [block], data.draw(st.integers(1, BLOCK_SIZE), label="last_block_tokens"))

    @precondition(
        lambda self: (
            len(self.m_outstanding) <= STAGING_DEPTH - 3
            and len(self.m_free) >= 2
            and any(b in self.m_free for b in self._full_blocks())
        )
    )
    @rule(data=st.data())
    def hit_then_reuse(self, data: st.DataObject) -> None:
        """The late-read scenario in one rule: a request hits a freed block, is saved and
        finishes; the block gets a new tenant, saved in the next step, while the hit's step
        id is still unconsumed (a later materialize must serve the old tenant's rows)."""
        block = data.draw(st.sampled_from([b for b in self._full_blocks() if b in self.m_free]), label="block")
        fresh = data.draw(st.sampled_from([b for b in self.m_free if b != block]), label="fresh")
        more = [b for b in self._full_blocks() if b not in (block, fresh)]
        extra = data.draw(st.lists(st.sampled_from(more), max_size=2, unique=True), label="extra") if more else []
        self._add_request([block, *extra], [fresh], 1)
        self._save([(self.m_live[r], self.m_live[r].num_tokens - self.m_live[r].num_done) for r in self.m_new], 0)
        assert block in self.m_free
        self._add_request([], [block], data.draw(st.integers(1, BLOCK_SIZE), label="last_block_tokens"))
        self._save([(self.m_live[r], self.m_live[r].num_tokens - self.m_live[r].num_done) for r in self.m_new], 0)

    @precondition(lambda self: any(r.scheduled for r in self.m_live.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """A request is aborted with tokens left; its blocks are freed (reported next step)."""
        req_id = data.draw(st.sampled_from(sorted(r.req_id for r in self.m_live.values() if r.scheduled)))
        self._finish(req_id)

    @precondition(
        lambda self: (
            len(self.m_outstanding) < STAGING_DEPTH - 1
            and (self.m_new or any(r.scheduled and r.num_done < r.num_tokens for r in self.m_live.values()))
        )
    )
    @rule(data=st.data())
    def save_step(self, data: st.DataObject) -> None:
        """One step: every new request and some running ones, each a chunk of its remaining tokens."""
        running = [r for r in self.m_live.values() if r.scheduled and r.num_done < r.num_tokens]
        chosen = [self.m_live[r] for r in self.m_new] + [r for r in running if data.draw(st.booleans())]
        if not chosen:
            chosen = [running[0]]
        chosen = data.draw(st.permutations(chosen), label="order")
        order = [(r, data.draw(st.integers(1, r.num_tokens - r.num_done))) for r in chosen]
        self._save(order, data.draw(st.sampled_from([0, 0, 1, 3]), label="pad"))

    @precondition(lambda self: self.m_outstanding)
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        """Materializes (for all, some or none of its requests, in any order) or discards any
        outstanding step id, oldest or not."""
        step_id = data.draw(st.sampled_from(sorted(self.m_outstanding)), label="step_id")
        if data.draw(st.integers(0, 4), label="discard") == 0:
            del self.m_outstanding[step_id]
            self.cache.discard(step_id)
            return
        req_ids = self.m_outstanding[step_id].req_ids
        subset = data.draw(
            st.just(req_ids) | st.permutations(req_ids) | st.lists(st.sampled_from(req_ids), unique=True),
            label="req_ids",
        )
        self._check(step_id, list(subset))

    @invariant()
    def counters_agree(self) -> None:
        stats = self.cache.stats()
        assert stats.steps_outstanding == sorted(self.m_outstanding)
        assert (stats.hits, stats.misses) == (self.m_hits, self.m_misses)

    # ---- teardown ------------------------------------------------------------------------------

    def _wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.cache.begin_step(StepEvents())  # reaps completions
            stats = self.cache.stats()
            if not any(stats.staging_holders) and stats.tasks_live == 0:
                return
            assert time.monotonic() < deadline, (
                f"not idle after {timeout_s} s: holders {stats.staging_holders}, tasks {stats.tasks_live}"
            )
            time.sleep(0.002)

    def teardown(self) -> None:
        try:
            for step_id in sorted(self.m_outstanding):
                self._check(step_id, self.m_outstanding[step_id].req_ids)
            for req_id in [r for r in self.m_live if self.m_live[r].scheduled]:
                self._finish(req_id)
            # What the pool holds in the end: a last request hits every fully written block.
            full = self._full_blocks()
            spare = [b for b in self.m_free if b not in full] or [b for b in self.m_free if b in full]
            if spare:
                last = self._add_request([b for b in full if b != spare[0]], spare[:1], 1)
                todo = [self.m_live[r] for r in self.m_new]
                step_id = self._save([(r, r.num_tokens - r.num_done) for r in todo], 0)
                assert last.req_id in self.m_outstanding[step_id].req_ids
                self._check(step_id, self.m_outstanding[step_id].req_ids)
            for req_id in list(self.m_live):
                self._finish(req_id)
            self.cache.begin_step(StepEvents(finished=list(self.m_finished)))
            self._wait_idle()
            stats = self.cache.stats()
            assert stats.steps_outstanding == []
            assert stats.preserved_entries == 0, stats
            assert stats.staging_holders == [[] for _ in range(STAGING_DEPTH)]
        finally:
            self.cache.close()


class ThreadedCacheMachine(CacheMachine):
    THREADED = True


class MixedCacheMachine(CacheMachine):
    """Threaded, with steps of under 8 rows (64 bytes each) written inside save while the
    committer is idle, and larger ones handed to it: both writers, never at once."""

    THREADED = True
    INLINE_WRITE_BYTES = 8 * 64


TestCacheStateMachineInline = CacheMachine.TestCase
TestCacheStateMachineThreaded = ThreadedCacheMachine.TestCase
TestCacheStateMachineMixed = MixedCacheMachine.TestCase
