"""Hit merge, partial matches, same-step hits and block reuse through the facade."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cachekit import batch, describe, rows, slots_of, small_cache, start_thread
from omni_pcache import NewRequest, StepBatch, StepEvents, UnservableHitError, WriteFailedError, outputs

BS = 4


def run_step(cache, new=(), finished=(), reqs=(), mm_fn=None, keep=None):
    """One begin_step + save. ``reqs``: (req_id, block_ids, start, count, writer). ``keep``: a
    dict that receives the step's input tensors (``hidden`` and the mm keys)."""
    cache.begin_step(StepEvents(new=list(new), finished=list(finished)))
    hidden = torch.cat([rows(w, s, c) for _, _, s, c, w in reqs])
    mm = {"codes": torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for _, _, s, c, w in reqs])}
    if mm_fn is not None:
        mm = mm_fn(reqs)
    if keep is not None:
        keep.update(mm, hidden=hidden)
    slot_lists = [slots_of(b, s, c, BS) for _, b, s, c, _ in reqs]
    return cache.save(hidden, mm, batch([(r, c) for r, _, _, c, _ in reqs], slot_lists))


def hold_writes(cache) -> threading.Event:
    """Makes the pool's writer wait, inside each batch, until the returned gate is set."""
    gate = threading.Event()
    write = cache._writer.write_batch

    def gated_write(groups):
        assert gate.wait(10), "test gate never opened"
        write(groups)

    cache._writer.write_batch = gated_write
    return gate


def expect(out, req: str, spans: list[tuple[int, int, int]]) -> None:
    """``spans``: (writer, start, count) pieces the request's rows must consist of."""
    want = torch.cat([rows(w, s, c) for w, s, c in spans])
    got = out.hidden[req]
    assert describe(got) == describe(want)
    assert torch.equal(got, want)
    want_codes = torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for w, s, c in spans])
    assert torch.equal(out.mm["codes"][req], want_codes)


def test_hit_gets_cached_prefix_then_step_rows_and_miss_gets_step_rows() -> None:
    with small_cache() as cache:
        sid = run_step(cache, [NewRequest("a", [0, 1, 2])], reqs=[("a", [0, 1, 2], 0, 10, 1)])
        expect(cache.materialize(sid, ["a"]), "a", [(1, 0, 10)])
        cache.flush()  # a's rows are in the pool before b's hit is planned
        sid = run_step(
            cache,
            [NewRequest("b", [0, 1, 5], 8), NewRequest("c", [6, 7])],
            reqs=[("b", [0, 1, 5], 8, 3, 2), ("c", [6, 7], 0, 5, 3)],
        )
        out = cache.materialize(sid, ["b", "c"])
        expect(out, "b", [(1, 0, 8), (2, 8, 3)])
        expect(out, "c", [(3, 0, 5)])
        stats = cache.stats()
        assert (stats.hits, stats.misses) == (1, 2)
        assert stats.rows_from_pool == 16  # 8 hidden + 8 codes rows


@pytest.mark.parametrize("earlier_finished", [False, True])
def test_partial_match_writes_its_divergent_block_without_touching_the_earlier_request(earlier_finished):
    with small_cache() as cache:
        sid = run_step(cache, [NewRequest("a", [0, 1, 2])], reqs=[("a", [0, 1, 2], 0, 12, 1)])
        cache.materialize(sid, ["a"])
        finished = ["a"] if earlier_finished else []
        sid = run_step(cache, [NewRequest("b", [0, 1, 3], 8)], finished=finished, reqs=[("b", [0, 1, 3], 8, 4, 2)])
        expect(cache.materialize(sid, ["b"]), "b", [(1, 0, 8), (2, 8, 4)])
        # A third request sharing all three of a's blocks still reads a's rows, and one sharing
        # b's third block reads b's.
        sid = run_step(
            cache,
            [NewRequest("c", [0, 1, 2, 4], 12), NewRequest("d", [0, 1, 3, 5], 12)],
            reqs=[("c", [0, 1, 2, 4], 12, 1, 3), ("d", [0, 1, 3, 5], 12, 1, 4)],
        )
        out = cache.materialize(sid, ["c", "d"])
        expect(out, "c", [(1, 0, 12), (3, 12, 1)])
        expect(out, "d", [(1, 0, 8), (2, 8, 4), (4, 12, 1)])


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["queued", "written-in-save"])
def test_same_step_hit_on_blocks_another_request_computes_now(inline_write_bytes: int) -> None:
    # Queued: b's read is planned on a's task in flight. Written in save: a's rows reach the
    # pool before b's read is planned, which then reads them from the pool.
    with small_cache(inline_write_bytes=inline_write_bytes) as cache:
        sid = run_step(
            cache,
            [NewRequest("a", [0, 1, 2]), NewRequest("b", [0, 1, 3], 8)],
            reqs=[("a", [0, 1, 2], 0, 9, 1), ("b", [0, 1, 3], 8, 2, 2)],
        )
        out = cache.materialize(sid, ["b", "a"])
        expect(out, "a", [(1, 0, 9)])
        expect(out, "b", [(1, 0, 8), (2, 8, 2)])
        stats = cache.stats()
        # (8 rows of 2 keys)
        assert (stats.rows_in_flight, stats.rows_from_pool) == ((16, 0) if inline_write_bytes == 0 else (0, 16))


@pytest.mark.parametrize("chunk_rows", [1, 4, 9, 10_000])
@pytest.mark.parametrize("late", [False, True], ids=["in-place", "after-the-next-begin-step"])
def test_outputs_built_in_chunks_are_each_requests_rows_and_its_own_to_write(monkeypatch, chunk_rows, late) -> None:
    # The widest key ("codes": 2 int64) has 16-byte rows: a chunk holds up to chunk_rows rows
    # of requests (1: each request alone; 10,000: the whole step in one chunk). ``late``:
    # materialized after the next begin_step, when the caller has overwritten its inputs, from
    # the staging page (every step handed to the committer: a small step save wrote itself
    # would be read from its own copies instead).
    monkeypatch.setattr(outputs, "OUTPUT_CHUNK_BYTES", chunk_rows * 16)
    inputs = {}  # the step's inputs, kept to check that no output aliases them

    with small_cache(**({"inline_write_bytes": 0} if late else {})) as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1, 2])], reqs=[("a", [0, 1, 2], 0, 12, 1)]), ["a"])
        cache.flush()
        reqs = [
            ("b", [0, 1, 5], 8, 3, 2),  # a hit, then a miss, a zero-row miss, a miss, a hit, a miss
            ("c", [6, 7], 0, 5, 3),
            ("z", [11], 0, 0, 8),
            ("d", [8], 0, 2, 4),
            ("e", [0, 9], 4, 2, 5),
            ("f", [10], 0, 3, 6),
        ]
        new = [NewRequest(r, b, s) for r, b, s, _, _ in reqs]
        sid = run_step(cache, new, reqs=reqs, keep=inputs)
        if late:
            cache.begin_step(StepEvents())
            for tensor in inputs.values():  # (the caller's again after begin_step)
                tensor.fill_(-7)
        want = {
            "b": [(1, 0, 8), (2, 8, 3)],
            "c": [(3, 0, 5)],
            "d": [(4, 0, 2)],
            "e": [(1, 0, 4), (5, 4, 2)],
            "f": [(6, 0, 3)],
        }
        out = cache.materialize(sid, ["f", "b", "c", "z", "d", "e"])  # (not the batch order)
        for req, spans in want.items():
            expect(out, req, spans)
        assert out.hidden["z"].shape == (0, 3) and out.mm["codes"]["z"].shape == (0, 2)
        written = set()
        for req in want:  # each request's tensors are its own: writing them changes no other's
            out.hidden[req].fill_(-1)
            out.mm["codes"][req].fill_(-1)
            written.add(req)
            for other, spans in want.items():
                if other not in written:
                    expect(out, other, spans)
        # ... nor the step's inputs, nor the pool: a later hit on a's prefix still reads a's rows.
        if late:
            assert all(bool((tensor == -7).all()) for tensor in inputs.values())
        else:
            assert torch.equal(inputs["codes"][:3], rows(2, 8, 3, width=2, dtype=torch.int64))
            assert torch.equal(inputs["hidden"][:3], rows(2, 8, 3))
        sid = run_step(cache, [NewRequest("g", [0, 12], 4)], reqs=[("g", [0, 12], 4, 1, 7)])
        expect(cache.materialize(sid, ["g"]), "g", [(1, 0, 4), (7, 4, 1)])


@pytest.mark.parametrize("chunk_rows", [1, 3, 5, 10_000])
def test_a_step_without_hits_comes_back_in_chunks_of_its_rows(monkeypatch, chunk_rows) -> None:
    # The no-hit path: every request asked in batch order, each chunk one copy of a span of the
    # step's rows; zero-row requests at chunk edges. (16-byte "codes" rows are the widest.)
    monkeypatch.setattr(outputs, "OUTPUT_CHUNK_BYTES", chunk_rows * 16)
    with small_cache() as cache:
        reqs = [("p", [0], 0, 2, 1), ("q", [1], 0, 0, 2), ("r", [2], 0, 3, 3), ("s", [3], 0, 0, 4), ("t", [4], 0, 1, 5)]
        sid = run_step(cache, [NewRequest(r, b) for r, b, _, _, _ in reqs], reqs=reqs)
        out = cache.materialize(sid, [r for r, *_ in reqs])
        for req, _, _, count, writer in reqs:
            if count:
                expect(out, req, [(writer, 0, count)])
            else:
                assert out.hidden[req].shape == (0, 3) and out.mm["codes"][req].shape == (0, 2)
        out.hidden["p"].fill_(-1)  # each request's rows are its own
        expect(out, "r", [(3, 0, 3)])
        expect(out, "t", [(5, 0, 1)])


def test_output_chunks_group_consecutive_requests_up_to_the_chunk_bytes(monkeypatch) -> None:
    monkeypatch.setattr(outputs, "OUTPUT_CHUNK_BYTES", 4 * 8)  # 4 rows of 8 bytes
    assert outputs.output_chunks([], 8) == []
    assert outputs.output_chunks([1, 2, 1], 8) == [(0, 3)]  # everything fits: one chunk
    assert outputs.output_chunks([2, 2, 1], 8) == [(0, 2), (2, 3)]  # a chunk filled to exactly its bytes
    # A request larger than a chunk gets one of its own; none is split.
    assert outputs.output_chunks([1, 2, 3, 5, 1, 0, 4], 8) == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    assert outputs.output_chunks([9, 9], 0) == [(0, 2)]  # rows of no bytes
    assert outputs.output_chunks([1, 1, 1], 64) == [(0, 1), (1, 2), (2, 3)]  # a row wider than a chunk


def test_request_groups_chunk_the_others_as_if_the_requests_with_tensors_of_their_own_were_not_there(
    monkeypatch,
) -> None:
    monkeypatch.setattr(outputs, "OUTPUT_CHUNK_BYTES", 4 * 8)  # 4 rows of 8 bytes
    assert outputs.request_groups([2, 5, 2], 8) == [[0], [1], [2]]
    # (request 1 has its own tensor, a hit's prefetched one: 0 and 2 share a chunk, 1 comes after them)
    assert outputs.request_groups([2, 5, 2], 8, [1]) == [[0, 2], [1]]
    assert outputs.request_groups([2, 5, 2, 1], 8, [0]) == [[1], [2, 3], [0]]


def test_after_reuse_hits_read_the_new_tenant() -> None:
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        # a finished; block 0 gets a new tenant.
        sid = run_step(cache, [NewRequest("b", [0, 2])], finished=["a"], reqs=[("b", [0, 2], 0, 6, 2)])
        cache.materialize(sid, ["b"])
        sid = run_step(cache, [NewRequest("c", [0, 3], 4)], reqs=[("c", [0, 3], 4, 2, 3)])
        expect(cache.materialize(sid, ["c"]), "c", [(2, 0, 4), (3, 4, 2)])


def steps_with_rows_kept_aside(cache) -> tuple[int, int]:
    """a writes blocks 0-1; b's step hits a's block 0 (not consumed); c's step reuses block 0,
    so a's rows of it are kept aside for b's read. Returns b's and c's step ids."""
    cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
    hit_step = run_step(cache, [NewRequest("b", [0, 2], 4)], finished=["a"], reqs=[("b", [0, 2], 4, 3, 2)])
    reuse_step = run_step(cache, [NewRequest("c", [0, 3])], finished=["b"], reqs=[("c", [0, 3], 0, 5, 3)])
    return hit_step, reuse_step


def test_close_drops_the_rows_kept_aside_for_steps_never_consumed() -> None:
    cache = small_cache()
    steps_with_rows_kept_aside(cache)
    assert cache.stats().preserved_entries > 0
    cache.close()
    assert cache.stats().preserved_entries == 0


@pytest.mark.parametrize("both", [False, True], ids=["hit-step-under-way", "both-under-way"])
def test_close_keeps_the_rows_kept_aside_for_materializes_under_way(both: bool) -> None:
    # close lands while b's materialize (and c's) is under way, its step taken: b's read is
    # still served a's rows from the copy kept aside, not dropped with the unconsumed steps'.
    cache = small_cache()
    hit_step, reuse_step = steps_with_rows_kept_aside(cache)
    build, go, entered = cache._outputs.build, threading.Event(), threading.Semaphore(0)

    def gated_build(*args):
        entered.release()
        assert go.wait(10)
        return build(*args)

    cache._outputs.build = gated_build
    out: dict = {}
    readers = [start_thread(lambda: out.update(b=cache.materialize(hit_step, ["b"])))]
    assert entered.acquire(timeout=10)
    if both:
        readers.append(start_thread(lambda: out.update(c=cache.materialize(reuse_step, ["c"]))))
        assert entered.acquire(timeout=10)
    cache.close()
    go.set()
    for thread, errors in readers:
        thread.join(10)
        assert not errors, errors
    expect(out["b"], "b", [(1, 0, 4), (2, 4, 3)])
    if both:
        expect(out["c"], "c", [(3, 0, 5)])
    assert cache.stats().preserved_entries == 0


def test_a_late_read_of_a_reused_block_serves_the_old_tenant_from_a_preserved_copy() -> None:
    with small_cache() as cache:
        # b hits a's block 0 in step 1; step 1 is materialized only after step 2 reused block 0.
        hit_step, reuse_step = steps_with_rows_kept_aside(cache)
        result = {}
        t = threading.Thread(target=lambda: result.update(out=cache.materialize(hit_step, ["b"])))
        t.start()
        t.join()
        expect(result["out"], "b", [(1, 0, 4), (2, 4, 3)])
        assert cache.stats().rows_preserved == 8  # 4 hidden + 4 codes rows
        expect(cache.materialize(reuse_step, ["c"]), "c", [(3, 0, 5)])


def test_a_late_read_of_a_partly_reused_prefix_counts_each_row_where_it_came_from() -> None:
    # b hits a's two blocks; only block 0 is reused before b's step is materialized: its rows
    # come from preserved copies, block 1's from the pool, and the stats say so per row.
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        cache.flush()
        hit_step = run_step(cache, [NewRequest("b", [0, 1, 2], 8)], finished=["a"], reqs=[("b", [0, 1, 2], 8, 3, 2)])
        reuse_step = run_step(cache, [NewRequest("c", [0, 3])], finished=["b"], reqs=[("c", [0, 3], 0, 5, 3)])
        expect(cache.materialize(hit_step, ["b"]), "b", [(1, 0, 8), (2, 8, 3)])
        stats = cache.stats()
        # (per key: 4 rows of block 0 preserved, 4 of block 1 from the pool; hidden and codes)
        assert (stats.rows_preserved, stats.rows_from_pool, stats.rows_in_flight) == (8, 8, 0)
        expect(cache.materialize(reuse_step, ["c"]), "c", [(3, 0, 5)])


def test_a_late_read_keeps_its_preserved_rows_while_another_thread_consumes_the_newer_step() -> None:
    # Thread T materializes the hit step; while its read is being served, the engine thread
    # discards the step that reused the block. The copy T needs must outlive that discard
    # (it was dropped once no step id was outstanding, though T's read was still under way).
    with small_cache() as cache:
        hit_step, reuse_step = steps_with_rows_kept_aside(cache)
        # (and a newer step still outstanding: the oldest step any read still needs is T's)
        later = run_step(cache, [NewRequest("e", [5])], reqs=[("e", [5], 0, 2, 4)])
        serving, go = threading.Event(), threading.Event()
        serve = cache._reader.serve

        def paused_serve(*args, **kwargs):
            serving.set()
            assert go.wait(10), "test gate never opened"
            return serve(*args, **kwargs)

        cache._reader.serve = paused_serve
        result = {}
        t = threading.Thread(target=lambda: result.update(out=cache.materialize(hit_step, ["b"])))
        t.start()
        assert serving.wait(10)
        cache.discard(reuse_step)
        go.set()
        t.join()
        expect(result["out"], "b", [(1, 0, 4), (2, 4, 3)])
        cache.discard(later)
        assert cache.stats().preserved_entries == 0, "dropped once the late read was done"


def reused_while_in_flight(cache):
    """b hits block 0 while a computes it (one step); c reuses block 0 at the next, a's write
    still held back. Returns the writes' gate and both step ids."""
    gate = hold_writes(cache)
    step = run_step(
        cache,
        [NewRequest("a", [0, 1]), NewRequest("b", [0, 2], 4)],
        reqs=[("a", [0, 1], 0, 6, 1), ("b", [0, 2], 4, 2, 2)],
    )
    reuse = run_step(cache, [NewRequest("c", [0])], finished=["a", "b"], reqs=[("c", [0], 0, 4, 3)])
    return gate, step, reuse


def test_a_late_read_of_a_block_reused_while_its_write_was_in_flight() -> None:
    # b hits block 0 while a is computing it (same step); block 0 is reused by c before a's
    # write lands. a skips the stolen slots, so b's preserved copy must come from a's staging
    # rows, and c's rows must win in the pool.
    with small_cache(inline_write_bytes=0) as cache:
        gate, step, reuse = reused_while_in_flight(cache)
        gate.set()
        expect(cache.materialize(step, ["b"]), "b", [(1, 0, 4), (2, 4, 2)])
        assert cache.stats().rows_preserved == 8
        cache.discard(reuse)
        sid = run_step(cache, [NewRequest("d", [0, 3], 4)], finished=["c"], reqs=[("d", [0, 3], 4, 1, 4)])
        expect(cache.materialize(sid, ["d"]), "d", [(3, 0, 4), (4, 4, 1)])


def test_discarding_a_late_read_whose_old_tenant_was_in_flight_keeps_no_rows_aside() -> None:
    # As above, but nobody reads b's hit: discarding its step drops its copy-on-write
    # obligations, so a's write landing afterwards must not keep the rows aside again (kept,
    # they would count against max_preserved_rows for good).
    with small_cache(inline_write_bytes=0) as cache:
        gate, step, reuse = reused_while_in_flight(cache)
        cache.discard(step)
        cache.discard(reuse)
        assert cache.stats().preserved_entries == 0
        gate.set()
        cache.flush()
        stats = cache.stats()
        assert (stats.preserved_entries, stats.tasks_live, stats.reads_pending) == (0, 0, 0), stats


def test_blocks_of_two_requests_of_one_step_reused_while_their_writes_are_in_flight() -> None:
    # As above, for two requests computing in one step (two write tasks of one step record):
    # each task keeps aside its own rows for its own reader, whatever batches the writes land in.
    with small_cache(inline_write_bytes=0) as cache:
        gate = hold_writes(cache)
        step = run_step(
            cache,
            [NewRequest("a", [0, 1]), NewRequest("e", [2, 3]), NewRequest("b", [0, 4], 4), NewRequest("f", [2, 5], 4)],
            reqs=[("a", [0, 1], 0, 6, 1), ("e", [2, 3], 0, 6, 5), ("b", [0, 4], 4, 2, 2), ("f", [2, 5], 4, 2, 6)],
        )
        reuse = run_step(
            cache,
            [NewRequest("c", [0]), NewRequest("g", [2])],
            finished=["a", "b", "e", "f"],
            reqs=[("c", [0], 0, 4, 3), ("g", [2], 0, 4, 7)],
        )
        gate.set()
        out = cache.materialize(step, ["f", "b"])
        expect(out, "b", [(1, 0, 4), (2, 4, 2)])
        expect(out, "f", [(5, 0, 4), (6, 4, 2)])
        assert cache.stats().rows_preserved == 16
        cache.discard(reuse)
        sid = run_step(cache, [NewRequest("d", [2, 6], 4)], finished=["c", "g"], reqs=[("d", [2, 6], 4, 1, 4)])
        expect(cache.materialize(sid, ["d"]), "d", [(7, 0, 4), (4, 4, 1)])


def test_a_slot_buffer_refilled_after_begin_step_does_not_change_a_saved_step() -> None:
    # The caller may refill its slot_mapping buffer once the next begin_step returns (vLLM
    # reuses one); a write still in transit then owes b's preserved rows and must find them by
    # the slots it was saved with, not by what the buffer holds now.
    buffer = np.zeros(64, dtype=np.int64)

    def save(cache, reqs):
        slots = np.concatenate([slots_of(b, s, c, BS) for _, b, s, c, _ in reqs])
        buffer[: slots.size] = slots
        hidden = torch.cat([rows(w, s, c) for _, _, s, c, w in reqs])
        codes = torch.cat([rows(w, s, c, width=2, dtype=torch.int64) for _, _, s, c, w in reqs])
        return cache.save(hidden, {"codes": codes}, StepBatch([r for r, *_ in reqs], [c for *_, c, _ in reqs], buffer))

    with small_cache(inline_write_bytes=0) as cache:
        gate = threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda records: (gate.wait(10), write(records))
        first = [("a", [0, 1], 0, 6, 1), ("b", [0, 2], 4, 2, 2)]
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [0, 2], 4)]))
        step = save(cache, first)
        # c reuses a's block 0 while a's write is held back; e first, so the buffer's front changes
        second = [("e", [5], 0, 4, 5), ("c", [0], 0, 4, 3)]
        cache.begin_step(StepEvents(new=[NewRequest("e", [5]), NewRequest("c", [0])], finished=["a", "b"]))
        reuse = save(cache, second)
        gate.set()
        expect(cache.materialize(step, ["b"]), "b", [(1, 0, 4), (2, 4, 2)])
        cache.discard(reuse)
        cache.flush()


@pytest.mark.parametrize("max_preserved_rows", [0, 7, 8])
def test_a_late_read_is_served_only_if_every_row_it_lost_fit_the_preserved_bound(max_preserved_rows) -> None:
    # The late read of block 0 needs 8 preserved rows (4 hidden + 4 codes).
    with small_cache(max_preserved_rows=max_preserved_rows) as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        hit_step = run_step(cache, [NewRequest("b", [0, 2], 4)], finished=["a"], reqs=[("b", [0, 2], 4, 3, 2)])
        reuse_step = run_step(cache, [NewRequest("c", [0, 3])], reqs=[("c", [0, 3], 0, 5, 3)])
        if max_preserved_rows < 8:
            with pytest.raises(UnservableHitError, match=r"overwritten by a newer tenant.*no copy was preserved"):
                cache.materialize(hit_step, ["b"])
        else:
            expect(cache.materialize(hit_step, ["b"]), "b", [(1, 0, 4), (2, 4, 3)])
        # Either way the step id is consumed and the cache stays usable: the next one works.
        expect(cache.materialize(reuse_step, ["c"]), "c", [(3, 0, 5)])
        assert cache.stats().steps_outstanding == []


def test_a_hit_on_rows_never_written_raises_instead_of_zeros() -> None:
    with small_cache() as cache:
        sid = run_step(cache, [NewRequest("b", [5, 6], 4)], reqs=[("b", [5, 6], 4, 2, 2)])
        # (block 5's slots 20..23, at offsets 0..3 of the span read)
        never = (
            r"'b'.*4 were never written \(first offsets into the span read \[0, 1, 2, 3\], slots \[20, 21, 22, 23\]\)"
        )
        with pytest.raises(UnservableHitError, match=never):
            cache.materialize(sid, ["b"])


def test_mm_key_missing_from_the_hit_prefix_raises() -> None:
    # 'extra' is first seen after block 0 was written without it: a hit cannot be served.
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])

        def with_extra(reqs):
            n = sum(c for _, _, _, c, _ in reqs)
            return {"codes": torch.zeros(n, 2, dtype=torch.int64), "extra": torch.ones(n)}

        sid = run_step(cache, [NewRequest("b", [0, 2], 4)], reqs=[("b", [0, 2], 4, 2, 2)], mm_fn=with_extra)
        with pytest.raises(UnservableHitError, match="'extra'"):
            cache.materialize(sid, ["b"])


def test_outputs_are_host_tensors_whatever_the_callers_default_device() -> None:
    # A runner may set a default device (torch.set_default_device / `with torch.device(...)`);
    # outputs still come back on the host, on every path: a hit, and misses asked out of order.
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        cache.flush()
        sid = run_step(
            cache,
            [NewRequest("b", [0, 2], 4), NewRequest("c", [3]), NewRequest("d", [4])],
            reqs=[("b", [0, 2], 4, 2, 2), ("c", [3], 0, 3, 3), ("d", [4], 0, 2, 4)],
        )
        with torch.device("meta"):
            out = cache.materialize(sid, ["d", "c", "b"])
        assert {t.device.type for t in [*out.hidden.values(), *out.mm["codes"].values()]} == {"cpu"}
        expect(out, "b", [(1, 0, 4), (2, 4, 2)])
        expect(out, "c", [(3, 0, 3)])
        expect(out, "d", [(4, 0, 2)])


def test_preserved_rows_go_once_their_late_read_is_served() -> None:
    # (not when the step that reused the block is consumed: they count against max_preserved_rows)
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0])], reqs=[("a", [0], 0, 4, 1)]), ["a"])
        late = run_step(cache, [NewRequest("c", [0, 1], 4)], finished=["a"], reqs=[("c", [0, 1], 4, 1, 3)])
        reuse = run_step(cache, [NewRequest("b", [0])], finished=["c"], reqs=[("b", [0], 0, 4, 2)])
        assert cache.stats().preserved_entries == 8  # (4 slots of hidden and codes)
        expect(cache.materialize(late, ["c"]), "c", [(1, 0, 4), (3, 4, 1)])
        assert cache.stats().preserved_entries == 0, "no read needs them, though `reuse` is outstanding"
        expect(cache.materialize(reuse, ["b"]), "b", [(2, 0, 4)])


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["queued", "written-in-save"])
def test_a_late_read_gets_its_rows_after_the_block_was_reused_twice(inline_write_bytes) -> None:
    with small_cache(inline_write_bytes=inline_write_bytes, staging_depth=4) as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0])], reqs=[("a", [0], 0, 4, 1)]), ["a"])
        cache.flush()
        late = run_step(cache, [NewRequest("c", [0, 1], 4)], finished=["a"], reqs=[("c", [0, 1], 4, 1, 3)])
        for tenant, writer, before in (("b", 2, "c"), ("d", 4, "b")):
            sid = run_step(cache, [NewRequest(tenant, [0])], finished=[before], reqs=[(tenant, [0], 0, 4, writer)])
            cache.materialize(sid, [tenant])
            cache.flush()
        expect(cache.materialize(late, ["c"]), "c", [(1, 0, 4), (3, 4, 1)])
        assert cache.stats().preserved_entries == 0


def test_a_late_read_waits_for_rows_being_kept_aside_and_is_woken_when_they_are() -> None:
    # b's save (on its engine thread) has registered the copy of a's rows that c's pending read
    # needs, but not filled it yet; c's materialize on another thread waits for it, and the
    # fill wakes it (not its timeout: claim_timeout_s is 5 s here).
    with small_cache() as cache:
        cache.materialize(run_step(cache, [NewRequest("a", [0])], reqs=[("a", [0], 0, 4, 1)]), ["a"])
        late = run_step(cache, [NewRequest("c", [0, 1], 4)], finished=["a"], reqs=[("c", [0, 1], 4, 1, 3)])
        entered, go = threading.Event(), threading.Event()
        keep_aside = cache._claims.keep_aside

        def paused(*args):
            entered.set()
            assert go.wait(10), "test gate never opened"
            keep_aside(*args)

        cache._claims.keep_aside = paused
        saved = {}
        engine = threading.Thread(
            target=lambda: saved.update(sid=run_step(cache, [NewRequest("b", [0])], reqs=[("b", [0], 0, 4, 2)]))
        )
        engine.start()
        assert entered.wait(10)
        threading.Timer(0.2, go.set).start()
        start = time.monotonic()
        expect(cache.materialize(late, ["c"]), "c", [(1, 0, 4), (3, 4, 1)])
        assert 0.15 < time.monotonic() - start < 3, "waited for the fill, and was woken by it"
        engine.join(10)
        cache.discard(saved["sid"])


@pytest.mark.parametrize("block_0_in_pool", [False, True], ids=["all-in-transit", "block-0-in-pool"])
def test_a_late_read_partly_preserved_and_partly_in_flight_counts_each_row_where_it_came_from(
    block_0_in_pool: bool,
) -> None:
    # As above, but a's write is still in transit when b's read is planned and c reuses block 0:
    # block 0's rows are kept aside for the read, block 1's come from a's write. Or the other
    # way round: block 0 is in the pool then, and only block 1 in transit; the preserved rows
    # are the pool's, and what is left is in flight: the counts follow the rows, not their order.
    with small_cache(inline_write_bytes=0) as cache:
        if block_0_in_pool:
            cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 4, 1)]), ["a"])
            cache.flush()
            gate = hold_writes(cache)
            cache.materialize(run_step(cache, reqs=[("a", [0, 1], 4, 4, 1)]), ["a"])
        else:
            gate = hold_writes(cache)
            cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        hit_step = run_step(cache, [NewRequest("b", [0, 1, 2], 8)], reqs=[("b", [0, 1, 2], 8, 1, 2)])
        cache.discard(run_step(cache, [NewRequest("c", [0])], finished=["a"], reqs=[("c", [0], 0, 4, 3)]))
        gate.set()
        expect(cache.materialize(hit_step, ["b"]), "b", [(1, 0, 8), (2, 8, 1)])
        stats = cache.stats()
        # (per key: 4 rows of block 0 preserved, 4 of block 1 from a's write; hidden and codes)
        assert (stats.rows_preserved, stats.rows_in_flight, stats.rows_from_pool) == (8, 8, 0)


class _WaitSignals:
    """The cache's condition as `WriteRecords` sees it: ``waiting`` is set as a waiter waits."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond, self.waiting = cond, threading.Event()

    def __enter__(self):
        return self._cond.__enter__()

    def __exit__(self, *exc):
        return self._cond.__exit__(*exc)

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return self._cond.wait(timeout)

    def __getattr__(self, name: str):
        return getattr(self._cond, name)


def test_a_read_waiting_for_a_write_that_owed_rows_to_another_read_is_woken_when_it_lands() -> None:
    # b's read waits (on another thread) for a's write in transit, which owes c's reuse of
    # block 0 a copy for b: its writer commits, fills that copy, then marks the task done. b's
    # read, woken by the commit and the fill before the task is done, waits again: the task
    # marked done must wake it (no later write does: they are held until b is served).
    with small_cache(inline_write_bytes=0, claim_timeout_s=60.0) as cache:
        first, later = threading.Event(), threading.Event()
        write = cache._writer.write_batch
        batches = []

        def held_write(groups) -> None:
            batches.append(groups)
            assert (first if len(batches) == 1 else later).wait(10), "test gate never opened"
            write(groups)

        cache._writer.write_batch = held_write
        cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
        hit_step = run_step(cache, [NewRequest("b", [0, 1, 2], 8)], reqs=[("b", [0, 1, 2], 8, 1, 2)])
        cache.discard(run_step(cache, [NewRequest("c", [0])], finished=["a"], reqs=[("c", [0], 0, 4, 3)]))
        signals = cache._records._cond = _WaitSignals(cache._cond)
        fill = cache._preserved.fill

        def fill_then_wait_for_the_reader(*args) -> None:  # (the writer, between commit and done)
            fill(*args)
            with cache._cond:
                signals.waiting.clear()
                cache._cond.notify_all()
            assert signals.waiting.wait(10), "b's read stopped waiting before a's task was done"

        cache._preserved.fill = fill_then_wait_for_the_reader
        out: dict = {}
        reader, errors = start_thread(lambda: out.update(b=cache.materialize(hit_step, ["b"])))
        assert signals.waiting.wait(10), "b's read never waited for a's write"
        first.set()
        reader.join(10)  # (its own timeout is 60 s: only the task marked done wakes it before)
        woken = not reader.is_alive()
        later.set()
        reader.join(60)
        assert woken, "b's read was not woken when a's task was done"
        assert errors == []
        expect(out["b"], "b", [(1, 0, 8), (2, 8, 1)])


def _late_read_with_its_copy_held_back(cache, before_reuse=lambda: None):
    """b's step hits a's block 0 (in the pool); then (after ``before_reuse``) c's save reuses
    block 0 on another thread (the engine's, from then on) and is held inside the copy that
    keeps a's rows aside for b's read. Returns b's step id, the gate that lets c's save go on,
    and c's thread with its error list."""
    cache.materialize(run_step(cache, [NewRequest("a", [0, 1])], reqs=[("a", [0, 1], 0, 8, 1)]), ["a"])
    cache.flush()
    hit_step = run_step(cache, [NewRequest("b", [0, 2], 4)], reqs=[("b", [0, 2], 4, 1, 2)])
    before_reuse()
    gate, filling = threading.Event(), threading.Event()
    fill = cache._preserved.fill
    cache._preserved.fill = lambda *args: (filling.set(), gate.wait(10), fill(*args))[2]
    saver, errors = start_thread(
        lambda: cache.discard(run_step(cache, [NewRequest("c", [0])], finished=["a"], reqs=[("c", [0], 0, 4, 3)]))
    )
    assert filling.wait(10), "c's claim kept nothing aside for b's read"
    return hit_step, gate, saver, errors


def test_a_late_read_whose_preserved_copy_is_not_filled_in_time_raises_unservable_not_pool_rows() -> None:
    with small_cache(claim_timeout_s=0.3) as cache:
        hit_step, gate, saver, errors = _late_read_with_its_copy_held_back(cache)
        try:
            with pytest.raises(
                UnservableHitError, match=r"request 'b' \(step \d+\): preserved rows not filled in time"
            ):
                cache.materialize(hit_step, ["b"])
        finally:
            gate.set()
            saver.join(10)
        assert errors == []
        # The cache stays usable: a read planned now gets the block's new tenant.
        cache.flush()
        sid = run_step(cache, [NewRequest("d", [0, 3], 4)], reqs=[("d", [0, 3], 4, 1, 4)])
        expect(cache.materialize(sid, ["d"]), "d", [(3, 0, 4), (4, 4, 1)])


def test_a_failure_while_a_late_read_waits_for_its_preserved_copy_raises_the_failure() -> None:
    # As above, while b's read waits for the copy a queued write of another request fails: b's
    # read raises that failure at once, not a timeout's UnservableHitError after claim_timeout_s.
    with small_cache(claim_timeout_s=30.0, inline_write_bytes=0) as cache:
        fail_now = threading.Event()

        def failing_write(groups) -> None:
            assert fail_now.wait(10)
            raise RuntimeError("injected: pool write failed")

        def queue_a_write_that_fails() -> None:
            cache._writer.write_batch = failing_write
            cache.discard(run_step(cache, [NewRequest("x", [5])], reqs=[("x", [5], 0, 4, 9)]))

        hit_step, gate, saver, _ = _late_read_with_its_copy_held_back(cache, queue_a_write_that_fails)
        try:
            reader, raised = start_thread(cache.materialize, hit_step, ["b"])
            time.sleep(0.1)  # (lets b's read reach its wait; the test passes either way)
            fail_now.set()
            reader.join(10)
            assert not reader.is_alive()
            assert [type(exc) for exc in raised] == [WriteFailedError], raised
            assert "injected: pool write failed" in str(raised[0])
        finally:
            gate.set()
            saver.join(10)
