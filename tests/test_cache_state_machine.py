"""A hypothesis state machine driving the `PrefixCache` facade against a pure-Python model.

The model is the pool as the engine sees it: for every slot, the row of its latest write
(claimed at save; the newest tenant wins). Rules add new requests (hitting blocks that the
model says were fully written since their last allocation, or missing), save steps of
scheduled chunks (a request finishes when its last chunk is saved), abort requests, reuse
freed blocks for new tenants, rewind a running request within its last block as if the
engine dropped its latest rows (sent again as new with `StepEvents.dropped`: those positions
are returned again), and materialize or discard outstanding step ids in any order.
With ``RESUME``, running requests are also preempted (their blocks freed, to be reused by
others) and resumed with a new block table: a whole-block hit on their own blocks that are
still fully written and not reused, on any other fully written blocks, or none (recompute);
some resume with their latest saved steps' outputs dropped (`StepEvents.dropped_saves`, as
after vLLM's reset with steps in flight): what those steps returned is returned again.
With ``DEFERRED``, a second mm key is deferred (kept on the device until its request finishes
or a tight device budget forces a flush). Some steps leave a cached mm key out ("who", or the
deferred "codes"): its rows at their slots are then never written, so a later hit over them must raise
`UnservableHitError` (never the slots' previous rows), while a read that captured those rows
before still gets them. Every step also passes a per-row leftover "extra" (not cached), which
each request gets its own rows of, the ones it returns. With ``THREADED``, two outstanding
steps are also materialized at once, on two threads.

What a request's consumer gets is modelled as the contract says: across all its steps, its
whole sequence exactly once. ``delivered`` is the end of what its saves returned (a discarded
step counts: its rows were handed out); a (re)scheduled request with ``H`` computed tokens gets
rows ``[delivered, H)`` read from the pool at its new block table (a prefix hit, or a resume hit
past what it delivered), then this step's rows past ``delivered`` (recomputed rows already
delivered are not returned again).

Every row is a stamp ``[key, slot, writer, step]`` (tests/rowcodec.py); every materialize
must return exactly the model's rows, captured when the step was saved: a late read of a
block reused since then must still see the old tenant's rows. At teardown everything is
consumed, a last request hits every full block (what the pool holds in the end), and the
cache must be back to idle: no staging page held, no live task, no preserved entry, no open
deferred record, no device bytes, no live request and no pending hit read.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omni_pcache import (
    CacheConfig,
    CachePolicy,
    NewRequest,
    PrefixCache,
    ResumedRequest,
    StepBatch,
    StepEvents,
    UnservableHitError,
)
from rowcodec import Stamp, describe, row_diff, stamps

BLOCK_SIZE = 2
NUM_BLOCKS = 6
STAGING_DEPTH = 4
MAX_FRESH_BLOCKS = 3
HIDDEN_KEY, WHO_KEY, CODES_KEY, EXTRA_KEY = 0, 1, 2, 3
# Deferred rows are stamps of int64: the largest step (every slot once) fills the budget alone.
DEVICE_BUDGET_BYTES = NUM_BLOCKS * BLOCK_SIZE * 4 * 8


@dataclass
class Req:
    req_id: str
    writer: int
    block_ids: list[int]
    num_tokens: int
    num_hit_tokens: int
    num_done: int  # positions hit or scheduled so far (the next position to compute)
    scheduled: bool = False  # saved at least once
    delivered: int = 0  # positions [0, delivered) were returned by its saves
    before_saves: list[int] = field(default_factory=list)  # ``delivered`` before each of its saves
    read_from: int | None = None  # due with its next save: pool rows [read_from, num_done)
    preempted: bool = False  # holds no blocks until resumed
    kept: tuple[tuple[int, int], ...] = ()  # (preempted) (block, generation) of blocks it fully computed
    old_blocks: tuple[int, ...] = ()  # (preempted) its block table before

    def slot(self, position: int) -> int:
        return self.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


@dataclass
class SavedStep:
    step: int
    req_ids: list[str]
    expected: dict[str, list[tuple[int, int, int]]]  # req -> (slot, writer, step) per row
    num_read_rows: dict[str, int]  # leading rows read from the pool
    keys: dict[str, int]  # the cached mm keys the step gave (name -> stamp key)
    # Per request and key the step gave, the slots of its pool rows that no step wrote (a step
    # since left the key out there): materializing it must raise UnservableHitError.
    absent: dict[str, dict[str, list[int]]]


class CacheMachine(RuleBasedStateMachine):
    THREADED = False
    INLINE_WRITE_BYTES = 0  # (threaded only) steps under this many bytes are written by save itself
    RESUME = False  # preempt and resume running requests
    DEFERRED = False  # cache a deferred key "codes" too, under a tight device budget
    PREFETCH = None  # CacheConfig.prefetch_hits (None: by the rows' device, CPU here: off)

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
            prefetch_hits=self.PREFETCH,
            **({"device_budget_bytes": DEVICE_BUDGET_BYTES} if self.DEFERRED else {}),
        )
        if self.DEFERRED:
            policy = CachePolicy(token_keys=frozenset({"who", "codes"}), deferred_keys=frozenset({"codes"}))
        else:
            policy = CachePolicy(token_keys=frozenset({"who"}))
        self.cache = PrefixCache(config, policy)
        self.keys = {"who": WHO_KEY, **({"codes": CODES_KEY} if self.DEFERRED else {})}
        self.m_rows: dict[int, tuple[int, int]] = {}  # slot -> (writer, step) of its latest write
        self.m_absent: dict[str, set[int]] = {name: set() for name in self.keys}  # slots last written without it
        self.m_filled: list[set[int]] = [set() for _ in range(NUM_BLOCKS)]  # offsets since allocation
        self.m_gen = [0] * NUM_BLOCKS  # allocations to a new tenant so far
        self.m_refs = [0] * NUM_BLOCKS
        self.m_free: list[int] = list(range(NUM_BLOCKS))
        self.m_live: dict[str, Req] = {}
        self.m_new: list[str] = []
        self.m_resumed: list[str] = []
        # Running requests the engine rewound, dropping their saved rows from this position on
        # (vLLM's drop_stale_output), sent again as new from it: StepEvents.dropped.
        self.m_dropped: dict[str, int] = {}
        # Resumed requests whose latest saved steps' outputs the engine dropped (vLLM's reset with
        # its running requests and steps in flight), how many: StepEvents.dropped_saves.
        self.m_dropped_saves: dict[str, int] = {}
        self.m_finished: list[str] = []
        self.m_outstanding: dict[int, SavedStep] = {}
        self.m_hits = self.m_misses = 0
        self.step = 0
        self.next_writer = 0

    # ---- model helpers -------------------------------------------------------------------------

    def _absent_in(self, block: int) -> bool:
        return any(block * BLOCK_SIZE + i in absent for absent in self.m_absent.values() for i in range(BLOCK_SIZE))

    def _full_blocks(self) -> list[int]:
        return [b for b in range(NUM_BLOCKS) if len(self.m_filled[b]) == BLOCK_SIZE]

    def _pending(self) -> list[Req]:
        """New and resumed requests: each is scheduled in the next step."""
        return [self.m_live[r] for r in self.m_new + self.m_resumed]

    def _running(self) -> list[Req]:
        """Scheduled requests with tokens left that the next step may or may not schedule."""
        return [
            r
            for r in self.m_live.values()
            if r.scheduled
            and not r.preempted
            and r.num_done < r.num_tokens
            and r.req_id not in self.m_resumed
            and r.req_id not in self.m_dropped
        ]

    def _allocate(self, hits: list[int], fresh: list[int]) -> None:
        for block in hits:
            if self.m_refs[block] == 0:
                self.m_free.remove(block)
            self.m_refs[block] += 1
        for block in fresh:
            self.m_free.remove(block)
            self.m_filled[block] = set()  # a new tenant
            self.m_gen[block] += 1
            self.m_refs[block] = 1

    def _release(self, req: Req) -> None:
        for block in req.block_ids:
            self.m_refs[block] -= 1
            if self.m_refs[block] == 0:
                self.m_free.append(block)
        req.block_ids = []

    def _add_request(self, hits: list[int], fresh: list[int], last_block_tokens: int) -> Req:
        self._allocate(hits, fresh)
        writer = self.next_writer
        self.next_writer += 1
        num_hit = len(hits) * BLOCK_SIZE
        num_tokens = (len(hits) + len(fresh) - 1) * BLOCK_SIZE + last_block_tokens
        req = Req(f"r{writer}", writer, hits + fresh, num_tokens, num_hit, num_hit, read_from=0 if num_hit else None)
        self.m_live[req.req_id] = req
        self.m_new.append(req.req_id)
        return req

    def _finish(self, req_id: str) -> None:
        req = self.m_live.pop(req_id)
        if not req.preempted:
            self._release(req)
        if req_id in self.m_resumed:  # aborted before its resume reached the cache
            self.m_resumed.remove(req_id)
        self.m_dropped_saves.pop(req_id, None)
        if self.m_dropped.pop(req_id, None) is not None:  # aborted before its continuation did
            self.m_new.remove(req_id)
        self.m_finished.append(req_id)

    def _save(self, order: list[tuple[Req, int]], pad: int, omit: frozenset[str] = frozenset()) -> int:
        """begin_step + save of one step scheduling ``count`` tokens of each request, without
        the cached mm keys named in ``omit``."""
        step = self.step
        self.step += 1
        new = [
            NewRequest(r, list(self.m_live[r].block_ids), self.m_dropped.get(r, self.m_live[r].num_hit_tokens))
            for r in self.m_new
        ]
        resumed = [ResumedRequest(r, list(self.m_live[r].block_ids), self.m_live[r].num_done) for r in self.m_resumed]
        events = StepEvents(
            new=new,
            resumed=resumed,
            finished=list(self.m_finished),
            dropped=dict(self.m_dropped),
            dropped_saves=dict(self.m_dropped_saves),
        )
        fresh = [r for r in new if r.req_id not in self.m_dropped]  # (a continuation is neither hit nor miss)
        self.m_hits += sum(1 for r in fresh if r.num_computed_tokens)
        self.m_misses += sum(1 for r in fresh if not r.num_computed_tokens)
        slots: list[int] = []
        rows: list[tuple[int, int, int]] = []
        for req, count in order:
            for position in range(req.num_done, req.num_done + count):
                slot = req.slot(position)
                slots.append(slot)
                rows.append((slot, req.writer, step))
                self.m_rows[slot] = (req.writer, step)
                self.m_filled[slot // BLOCK_SIZE].add(slot % BLOCK_SIZE)
        for name, absent in self.m_absent.items():
            if name in omit:
                absent.update(slots)
            else:
                absent.difference_update(slots)
        given = {name: key for name, key in self.keys.items() if name not in omit}
        # Reads are planned after the step's claims: the expected rows are the model's now.
        expected, num_read_rows, absent = {}, {}, {}
        for req, count in order:
            start, end = req.num_done, req.num_done + count
            positions: list[int] = []
            req.before_saves.append(req.delivered)
            if req.read_from is not None:  # a hit (or a resume past what it delivered): from the pool
                positions += range(req.read_from, start)
                req.delivered = max(req.delivered, start)
                req.read_from = None
            num_read_rows[req.req_id] = len(positions)
            missing = {name: [req.slot(p) for p in positions if req.slot(p) in self.m_absent[name]] for name in given}
            absent[req.req_id] = {name: slots for name, slots in missing.items() if slots}
            positions += range(max(start, req.delivered), end)  # recomputed rows are not returned twice
            expected[req.req_id] = [(req.slot(p), *self.m_rows[req.slot(p)]) for p in positions]
            req.delivered = max(req.delivered, end)
            req.num_done = end
            req.scheduled = True
        n = len(slots)

        def stamped(key: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.cat([stamps([Stamp(key, *r) for r in rows], dtype), torch.full((pad, 4), -1, dtype=dtype)])

        mm = {name: stamped(key, torch.int64) for name, key in given.items()}
        mm["extra"] = stamped(EXTRA_KEY, torch.int64)  # a per-row leftover: sliced per request, not cached
        mapping = np.array(slots + [-1] * pad, dtype=np.int64)
        batch = StepBatch([r.req_id for r, _ in order], [c for _, c in order], mapping, n + pad if pad else None)
        self.cache.begin_step(events)
        step_id = self.cache.save(stamped(HIDDEN_KEY, torch.float64), {**mm, "note": f"step {step}"}, batch)
        assert step_id not in self.m_outstanding
        self.m_outstanding[step_id] = SavedStep(
            step, [r.req_id for r, _ in order], expected, num_read_rows, given, absent
        )
        self.m_new.clear()
        self.m_resumed.clear()
        self.m_dropped.clear()
        self.m_dropped_saves.clear()
        self.m_finished.clear()
        for req, _ in order:
            if req.num_done == req.num_tokens:  # prefill done: it finishes, reported next step
                self._finish(req.req_id)
        return step_id

    def _save_pending(self) -> int:
        """A step scheduling every pending request to its end."""
        return self._save([(r, r.num_tokens - r.num_done) for r in self._pending()], 0)

    def _check(self, step_id: int, req_ids: list[str]) -> None:
        saved = self.m_outstanding.pop(step_id)
        self._verify(saved, step_id, req_ids, lambda: self.cache.materialize(step_id, req_ids))
        self._count(saved, req_ids)

    @staticmethod
    def _count(saved: SavedStep, req_ids: list[str]) -> None:
        """Records what a checked materialize covered (`--hypothesis-show-statistics`; on the
        test's thread: hypothesis refuses events from others)."""
        for name in sorted({name for r in req_ids for name in saved.absent.get(r, {})}):
            event(f"materialize: a hit over {name!r} rows never written, refused")
        if any(saved.num_read_rows[r] and len(saved.expected[r]) > saved.num_read_rows[r] for r in req_ids):
            event("materialize: a hit and rows of this step in one request (its 'extra' rows sliced)")

    def _verify(self, saved: SavedStep, step_id: int, req_ids: list[str], materialize) -> None:
        """Runs ``materialize`` (of ``req_ids`` of the step) and checks what it returns, or that
        it raises `UnservableHitError` when a requested hit covers rows of a key never written
        (any thread)."""
        absent = {(r, name): slots for r in req_ids for name, slots in saved.absent.get(r, {}).items()}
        if absent:
            with pytest.raises(UnservableHitError, match="never written") as raised:
                materialize()
            message = str(raised.value)
            named = [at for at in absent if f"request {at[0]!r}" in message and f"of {at[1]!r}" in message]
            assert len(named) == 1, (message, absent)
            req_id, name = named[0]
            slots = absent[named[0]]
            assert f"hits {saved.num_read_rows[req_id]} rows of {name!r}" in message, message
            assert f"{len(slots)} were never written" in message, (message, slots)
            return
        out = materialize()
        assert out.hidden is not None and set(out.hidden) == set(req_ids)
        assert set(out.mm) == {*saved.keys, "note", "extra"}
        problems = []
        for req_id in req_ids:
            rows = saved.expected[req_id]
            where = f"step {saved.step} (id {step_id}) request {req_id}"
            own = rows[saved.num_read_rows[req_id] :]  # (a leftover has this step's rows only: those returned)
            wanted = [("hidden", out.hidden[req_id], HIDDEN_KEY, torch.float64, rows)]
            wanted += [(name, out.mm[name][req_id], key, torch.int64, rows) for name, key in saved.keys.items()]
            wanted.append(("extra", out.mm["extra"][req_id], EXTRA_KEY, torch.int64, own))
            for label, got, key, dtype, want_rows in wanted:
                want = stamps([Stamp(key, *r) for r in want_rows], dtype)

                read = saved.num_read_rows[req_id] if label != "extra" else 0

                def explain(p: int, got=got, want=want, read=read) -> str:
                    row = got[p] if p < got.shape[0] else None
                    part = "from the pool" if p < read else "this step"
                    came, due = describe(row, BLOCK_SIZE), describe(want[p], BLOCK_SIZE)
                    return f"({part}) came from [{came}], expected [{due}]"

                diff = row_diff(f"{where} {label}", got, want, explain)
                if diff:
                    problems.append(diff)
            if out.mm["note"][req_id] != f"step {saved.step}":
                problems.append(f"{where}: leftover note {out.mm['note'][req_id]!r}")
        assert not problems, "\n".join(problems)

    # ---- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self._pending()) < 3 and self.m_free)
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

    @precondition(lambda self: len(self._pending()) < 3 and any(b in self.m_free for b in self._full_blocks()))
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
        self._save_pending()
        assert block in self.m_free
        self._add_request([], [block], data.draw(st.integers(1, BLOCK_SIZE), label="last_block_tokens"))
        self._save_pending()

    @precondition(lambda self: len(self._pending()) < 3 and any(r.num_done > 0 for r in self._running()))
    @rule(data=st.data())
    def drop_and_continue(self, data: st.DataObject) -> None:
        """The engine drops a running request's latest saved rows after all (vLLM's
        drop_stale_output when a streaming turn ends with a step in flight) and sends it again as
        new, rewound to a position at or below what it computed: its consumer never got the rows
        from there, which must come again as they are recomputed (`StepEvents.dropped`)."""
        req = data.draw(st.sampled_from(sorted((r for r in self._running() if r.num_done > 0), key=lambda r: r.writer)))
        # (within its last block, as vLLM's rewind to the rows delivered: a full block before it
        # may be another request's hit, whose rows are never recomputed)
        at = data.draw(st.integers(req.num_done - req.num_done % BLOCK_SIZE, req.num_done), label="rewound_to")
        req.num_done = at
        req.delivered = min(req.delivered, at)
        self.m_dropped[req.req_id] = at
        self.m_new.append(req.req_id)
        event("a running request rewound, its rows dropped, sent again as new")

    @precondition(lambda self: any(r.scheduled for r in self.m_live.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """A request is aborted with tokens left (running, preempted, or resumed but not yet
        scheduled again); its blocks are freed (reported next step)."""
        req_id = data.draw(st.sampled_from(sorted(r.req_id for r in self.m_live.values() if r.scheduled)))
        self._finish(req_id)

    def _preempt(self, req: Req) -> None:
        req.kept = tuple((b, self.m_gen[b]) for b in req.block_ids[: req.num_done // BLOCK_SIZE])
        req.old_blocks = tuple(req.block_ids)
        self._release(req)
        req.preempted = True

    @precondition(lambda self: self.RESUME and self._running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """A running request is preempted: it stops being scheduled and its blocks are freed
        (other requests may hit or reuse them meanwhile). Its outstanding steps stay valid."""
        self._preempt(data.draw(st.sampled_from(sorted(self._running(), key=lambda r: r.writer)), label="preempted"))

    def _resume_plan(self, req: Req, max_hits: int | None = None) -> tuple[int, int] | None:
        """(most hit blocks, how many of its hit blocks must be held by others for its fresh
        blocks to fit the free list), or None when it cannot resume now. With h hit blocks of
        which k are held, it takes ``nblocks - h`` of the ``free - (h - k)`` free blocks that are
        not hits: it fits when ``free + k >= nblocks``."""
        nblocks = -(-req.num_tokens // BLOCK_SIZE)
        most = (req.num_tokens - 1) // BLOCK_SIZE  # it computes at least one token
        most = most if max_hits is None else min(most, max_hits)
        held = sum(1 for b in self._full_blocks() if self.m_refs[b] > 0)
        need_held = max(0, nblocks - len(self.m_free))
        if need_held > min(most, held):
            return None
        return most, need_held

    def _resumable(self) -> list[Req]:
        if len(self._pending()) >= 3:
            return []
        return [r for r in self.m_live.values() if r.preempted and self._resume_plan(r) is not None]

    def _resume(self, req: Req, data: st.DataObject, max_hits: int | None = None) -> None:
        """Resumes ``req`` with a new block table: a whole-block hit (its own blocks still fully
        written and not reused, or any fully written blocks: another request computed the same
        prefix, maybe past what it delivered) or none, then fresh blocks from the free list
        (maybe its own old ones: it recomputes into them)."""
        plan = self._resume_plan(req, max_hits)
        assert plan is not None
        most, need_held = plan
        own = self._own_prefix(req)[:most]
        others = [b for b in self._full_blocks() if b not in own]
        how = data.draw(st.sampled_from(["recompute", "own", "past_own"]), label="resume_hit")
        if how == "recompute" or not own:
            hits = []
        else:  # some or all of its own blocks
            hits = own[: data.draw(st.integers(1, len(own)), label="num_own_hits")] if how == "own" else own
        if how == "past_own" and len(hits) < most and others:  # another request computed more of it
            more = st.lists(st.sampled_from(others), min_size=1, max_size=most - len(hits), unique=True)
            hits = hits + data.draw(more, label="other_hits")
        # As many hits on blocks held by others as the free list needs (the plan says they exist).
        held = [b for b in self._full_blocks() if self.m_refs[b] > 0 and b not in hits]
        while sum(1 for b in hits if self.m_refs[b] > 0) < need_held:
            if len(hits) < most:
                hits.append(held.pop(0))
            else:
                at = max(i for i, b in enumerate(hits) if self.m_refs[b] == 0)
                hits[at] = held.pop(0)
        self._resume_with(req, hits, data)

    def _resume_with(self, req: Req, hits: list[int], data: st.DataObject) -> None:
        """Resumes ``req`` with these hit blocks, then fresh blocks from the free list."""
        nblocks = -(-req.num_tokens // BLOCK_SIZE)
        free = data.draw(st.permutations([b for b in self.m_free if b not in hits]), label="free")
        if data.draw(st.booleans(), label="same_blocks"):  # its old blocks first (the free ones)
            old = [b for b in req.old_blocks[len(hits) : nblocks] if b in free]
            free = old + [b for b in free if b not in old]
        fresh = free[: nblocks - len(hits)]
        self._allocate(hits, fresh)
        req.block_ids = hits + fresh
        req.num_done = len(hits) * BLOCK_SIZE
        dropped = data.draw(st.integers(0, min(3, len(req.before_saves))), label="dropped_saves")
        if dropped:
            # The outputs of its latest saves never reached its consumer: what they returned
            # comes again (from the pool below the resume point, else as it is recomputed).
            req.delivered = min(req.delivered, req.before_saves[-dropped])
            self.m_dropped_saves[req.req_id] = dropped
            event(f"a resumed request's {dropped} latest saved outputs dropped")
        req.read_from = req.delivered if req.num_done > req.delivered else None
        req.preempted = False
        req.kept = req.old_blocks = ()
        self.m_resumed.append(req.req_id)

    @precondition(lambda self: self.RESUME and self._resumable())
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """A preempted request is scheduled again (see `_resume`)."""
        req = data.draw(st.sampled_from(sorted(self._resumable(), key=lambda r: r.writer)), label="resumed")
        self._resume(req, data)

    def _own_prefix(self, req: Req) -> list[int]:
        """The leading blocks a preempted request fully computed that are not reused since."""
        own: list[int] = []
        for block, gen in req.kept:
            if self.m_gen[block] != gen:
                break
            own.append(block)
        return own

    def _computed_blocks(self, req: Req) -> list[int]:
        """Blocks a running or preempted request fully computed (and still holds, or that are not
        reused since)."""
        return self._own_prefix(req) if req.preempted else req.block_ids[: req.num_done // BLOCK_SIZE]

    def _sharable(self) -> list[Req]:
        candidates = self._running() + [r for r in self.m_live.values() if r.preempted]
        return [r for r in candidates if self._computed_blocks(r)]

    @precondition(
        lambda self: (
            self.RESUME
            and len(self.m_outstanding) <= STAGING_DEPTH - 3
            and len(self._pending()) < 3
            and self.m_free
            and self._sharable()
        )
    )
    @rule(data=st.data())
    def hit_then_recompute(self, data: st.DataObject) -> None:
        """The late-read scenario with a resume: a new request hits blocks a running (or
        preempted) request computed (their deferred rows may still be on the device, in its open
        record), is saved and finishes; the other one is preempted and resumed below those
        blocks, maybe recomputing into them (or past them, on the new request's block: rows it
        never delivered come from the pool), and saved while the hit's step id is still
        unconsumed (a later materialize must serve the rows the hit captured)."""
        req = data.draw(st.sampled_from(sorted(self._sharable(), key=lambda r: r.writer)), label="computed_by")
        computed = self._computed_blocks(req)
        num_shared = data.draw(st.sampled_from([len(computed)]) | st.integers(1, len(computed)), label="num_shared")
        free = [b for b in self.m_free if b not in computed[:num_shared]]
        if not free:  # (the free list holds only the shared blocks of a preempted request)
            return
        fresh = data.draw(st.sampled_from(free), label="fresh")
        last_block_tokens = data.draw(st.sampled_from(range(BLOCK_SIZE, 0, -1)), label="last_block_tokens")
        self._add_request(computed[:num_shared], [fresh], last_block_tokens)
        self._save_pending()
        if not req.preempted:
            self._preempt(req)
        # Resumed past what it delivered, on rows the new request computed: they come from the pool.
        past = [*computed[:num_shared], fresh]
        nblocks = -(-req.num_tokens // BLOCK_SIZE)
        if (
            len(self.m_filled[fresh]) == BLOCK_SIZE
            and len(past) * BLOCK_SIZE < req.num_tokens
            and len([b for b in self.m_free if b not in past]) >= nblocks - len(past)
            and data.draw(st.booleans(), label="resume_past")
        ):
            self._resume_with(req, past, data)
        else:
            below = data.draw(st.integers(0, num_shared - 1), label="hits_below")
            if self._resume_plan(req, below) is None:
                below = num_shared - 1  # (hits on blocks held by others make room)
                if self._resume_plan(req, below) is None:
                    return  # it stays preempted
            self._resume(req, data, below)
        order = []
        for r in self._pending():
            left = r.num_tokens - r.num_done
            order.append((r, left if data.draw(st.booleans(), label="to_end") else data.draw(st.integers(1, left))))
        self._save(order, 0)

    def _draw_step(self, data: st.DataObject) -> tuple[list[tuple[Req, int]], int, frozenset[str]]:
        """A step's schedule: every new or resumed request and some running ones, each a chunk
        of its remaining tokens, in any order; its padding; the cached mm keys it leaves out."""
        running = self._running()
        chosen = self._pending() + [r for r in running if data.draw(st.booleans())]
        if not chosen:
            chosen = [running[0]]
        chosen = data.draw(st.permutations(chosen), label="order")
        order = [(r, data.draw(st.integers(1, r.num_tokens - r.num_done))) for r in chosen]
        omit = frozenset(name for name in self.keys if data.draw(st.integers(0, 5), label=f"omit {name}") == 0)
        for name in sorted(omit):
            event(f"save: a step without {name!r}")
        return order, data.draw(st.sampled_from([0, 0, 1, 3]), label="pad"), omit

    @precondition(lambda self: len(self.m_outstanding) < STAGING_DEPTH - 1 and (self._pending() or self._running()))
    @rule(data=st.data())
    def save_step(self, data: st.DataObject) -> None:
        """One step (`_draw_step`)."""
        self._save(*self._draw_step(data))

    @precondition(
        lambda self: (
            self.THREADED
            and self.m_outstanding
            and len(self.m_outstanding) < STAGING_DEPTH - 1
            and (self._pending() or self._running())
        )
    )
    @rule(data=st.data())
    def save_while_consuming(self, data: st.DataObject) -> None:
        """One step (`_draw_step`) saved while another thread materializes an outstanding step:
        the save's claims may overwrite rows that step's hits read, and its reader may have to
        wait for the rows the save keeps aside for it. Whatever the interleaving, the rows are
        the model's, captured when that step was saved."""
        step_id = data.draw(st.sampled_from(sorted(self.m_outstanding)), label="step_id")
        schedule = self._draw_step(data)
        saved = self.m_outstanding.pop(step_id)
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                start.wait(10)
                self._verify(saved, step_id, saved.req_ids, lambda: self.cache.materialize(step_id, saved.req_ids))
            except BaseException as exc:  # (raised on the test's thread below)
                errors.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        try:
            start.wait(10)
            self._save(*schedule)
        finally:
            thread.join(30)
        assert not thread.is_alive(), "a materialize did not return in 30 s"
        if errors:
            raise errors[0]
        event("a step saved while another is materialized")
        self._count(saved, saved.req_ids)

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

    @precondition(lambda self: self.THREADED and len(self.m_outstanding) >= 2)
    @rule(data=st.data())
    def consume_two_at_once(self, data: st.DataObject) -> None:
        """Materializes two outstanding step ids at once, each on a thread of its own (neither
        the saving thread: both read the staging pages, or wait for their copies)."""
        picked = data.draw(st.lists(st.sampled_from(sorted(self.m_outstanding)), min_size=2, max_size=2, unique=True))
        saved = {step_id: self.m_outstanding.pop(step_id) for step_id in picked}
        start = threading.Barrier(len(picked))
        errors: list[BaseException] = []

        def consume(step_id: int) -> None:
            req_ids = saved[step_id].req_ids
            try:
                start.wait(10)
                self._verify(saved[step_id], step_id, req_ids, lambda: self.cache.materialize(step_id, req_ids))
            except BaseException as exc:  # (raised on the test's thread below)
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(step_id,)) for step_id in picked]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "a materialize did not return in 30 s"
        if errors:
            raise errors[0]
        event("two steps materialized at once")
        for step_id in picked:
            self._count(saved[step_id], saved[step_id].req_ids)

    @invariant()
    def counters_agree(self) -> None:
        stats = self.cache.stats()
        assert stats.steps_outstanding == sorted(self.m_outstanding)
        assert (stats.hits, stats.misses) == (self.m_hits, self.m_misses)
        assert stats.device_bytes <= DEVICE_BUDGET_BYTES or not self.DEFERRED, stats.device_bytes

    # ---- teardown ------------------------------------------------------------------------------

    def _wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.cache.begin_step(StepEvents())  # reaps completions
            stats = self.cache.stats()
            if not any(stats.staging_holders) and stats.tasks_live == 0 and stats.device_bytes == 0:
                return
            assert time.monotonic() < deadline, (
                f"not idle after {timeout_s} s: holders {stats.staging_holders}, tasks {stats.tasks_live}, "
                f"device bytes {stats.device_bytes}"
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
            # (blocks a step wrote without a key since are left out: their hit would be refused)
            hit = [b for b in full if b not in spare[:1] and not self._absent_in(b)]
            if spare:
                last = self._add_request(hit, spare[:1], 1)
                step_id = self._save_pending()
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
            assert stats.deferred_open == 0 and stats.device_bytes == 0, stats
            assert stats.requests_live == 0 and stats.reads_pending == 0, stats
        finally:
            self.cache.close()


class ThreadedCacheMachine(CacheMachine):
    THREADED = True


class MixedCacheMachine(CacheMachine):
    """Threaded, with steps of under 8 rows (64 bytes each) written inside save while the
    committer is idle, and larger ones handed to it: both writers, never at once."""

    THREADED = True
    INLINE_WRITE_BYTES = 8 * 64


class ResumeCacheMachine(MixedCacheMachine):
    """Mixed writers, with requests preempted and resumed, and each new hit's committed rows
    gathered by the committer between begin_step and save (the hit prefetch)."""

    RESUME = True
    PREFETCH = True


class DeferredCacheMachine(CacheMachine):
    """Preempt and resume, with a deferred key under a device budget that one full step fills:
    open records are flushed early (oldest first), and a request that comes back has its open
    record queued before it recomputes."""

    RESUME = True
    DEFERRED = True


class DeferredThreadedCacheMachine(DeferredCacheMachine):
    """The deferred machine with both writers: the committer writes flushed records while
    reads are served from their clones; hits are prefetched."""

    THREADED = True
    INLINE_WRITE_BYTES = 8 * 64
    PREFETCH = True


TestCacheStateMachineInline = CacheMachine.TestCase
TestCacheStateMachineThreaded = ThreadedCacheMachine.TestCase
TestCacheStateMachineMixed = MixedCacheMachine.TestCase
TestCacheStateMachineResume = ResumeCacheMachine.TestCase
TestCacheStateMachineDeferred = DeferredCacheMachine.TestCase
TestCacheStateMachineDeferredThreaded = DeferredThreadedCacheMachine.TestCase
