"""The embedded engine follows vLLM's prefix-caching and scheduling rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_pcache.engine import Engine, EngineConfig, make_workload
from omni_pcache.engine.block_pool import BlockPool
from omni_pcache.engine.compare import compare
from omni_pcache.engine.engine import EngineCapacityError
from omni_pcache.engine.kv_manager import KVCacheManager
from omni_pcache.engine.request import Request, Status
from omni_pcache.engine.scheduler import Scheduler

BS = 4


def req(name: str, prompt: list[int], outputs=(1, 2)) -> Request:
    return Request(name, list(prompt), list(outputs))


def test_freed_blocks_stay_cached_until_reused_lru_and_tail_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    pool.free(blocks)  # tail first: 2, 1, 0 join the free queue after 3
    assert [pool.cached_block(100 + i) for i in range(3)] == blocks
    assert pool.allocate(2) == [3, blocks[2]], "the never-cached block goes first, then the tail block"
    assert pool.cached_block(102) is None and pool.num_evictions == 1
    assert pool.cached_block(100) == blocks[0]


def test_freed_blocks_without_a_hash_are_reused_first_in_the_order_freed() -> None:
    # vLLM's free_blocks: non-cached blocks are prepended (LIFO, reused by the very next
    # allocation), cached ones appended (LRU); both groups in the order freed, tail first.
    pool = BlockPool(8)
    blocks = pool.allocate(4)  # 0..3; the free queue holds 4..7
    pool.cache_block(blocks[0], 100)
    pool.cache_block(blocks[1], 101)
    pool.free(blocks)  # tail first: 3 and 2 (no hash) to the head, then 1 and 0 (cached) to the tail
    assert pool.allocate(8) == [blocks[3], blocks[2], 4, 5, 6, 7, blocks[1], blocks[0]]
    assert pool.num_evictions == 2


def test_longest_prefix_match_never_covers_the_last_token() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = req("a", list(range(12)))
    assert kv.allocate(a, 12)
    b = req("b", list(range(12)))  # identical prompt: 3 full blocks cached, but only 2 may hit
    assert kv.match_prefix(b) == a.blocks[:2]
    c = req("c", [*range(8), 99, 98, 97, 96, 95])
    assert kv.match_prefix(c) == a.blocks[:2]
    assert KVCacheManager(16, BS, enable_prefix_caching=False).match_prefix(b) == []


def test_same_step_hit_on_blocks_scheduled_earlier_in_the_step() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    sched.add(req("a", list(range(10))))
    sched.add(req("b", [*range(8), 50, 51, 52]))
    step = sched.schedule(0)
    assert [(r, n) for r, _, n in step.new] == [("a", 0), ("b", 8)], "b hits a's blocks in the same step"
    assert step.new[1][1][:2] == step.new[0][1][:2]


def test_the_scheduler_counts_first_admissions_with_and_without_a_hit() -> None:
    # (what `compare` checks the cache's hits and misses against; a one-block hit counts)
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    sched.add(req("a", list(range(1, 9))))
    sched.update(sched.schedule(0))
    sched.add(req("b", [1, 2, 3, 4, 50, 51]))
    assert [n for _, _, n in sched.schedule(1).new] == [BS]
    assert (sched.num_new_hits, sched.num_new_misses) == (1, 1)


def test_chunked_prefill_decode_and_finish() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=16, max_num_running=8, long_prefill_tokens=6)
    r = req("a", list(range(10)), outputs=(7, 8, 9))
    sched.add(r)
    counts = []
    for step in range(10):
        s = sched.schedule(step)
        counts.append([n for _, n in s.scheduled])
        sched.update(s)
        if r.status is Status.FINISHED:
            break
    assert counts == [[6], [4], [1], [1]], "two prefill chunks, then one token per step"
    assert r.tokens == [*range(10), 7, 8, 9] and r.full_sequence_len() == 12
    assert kv.pool.num_free == 32


def two_requests_for_a_pool_of_one() -> tuple[Scheduler, Request, Request]:
    """A scheduler whose 6 blocks of 4 cannot hold both of its requests (11 prompt + 8 output
    tokens each) to their end: b, scheduled last, is preempted."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    a, b = req("a", list(range(11)), outputs=(1,) * 8), req("b", list(range(100, 111)), outputs=(1,) * 8)
    sched.add(a)
    sched.add(b)
    return sched, a, b


def test_preemption_frees_the_last_running_request_and_it_resumes_with_a_rematch() -> None:
    sched, a, b = two_requests_for_a_pool_of_one()
    resumed = []
    for step in range(40):
        s = sched.schedule(step)
        resumed += s.resumed
        sched.update(s)
        if not sched.has_work:
            break
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1
    assert resumed and resumed[0][0] == "b" and resumed[0][2] > 0, "b re-matched its cached prefix"
    assert a.status is Status.FINISHED and b.status is Status.FINISHED


def test_abort_frees_blocks_and_reports_finished_next_step() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    a = req("a", list(range(6)))
    sched.add(a)
    sched.update(sched.schedule(0))
    sched.abort(a)
    sched.abort(a)  # (a second abort changes nothing: a workload abort may follow `abort_preempted`'s)
    assert a.status is Status.ABORTED and kv.pool.num_free == 8
    assert sched.schedule(1).finished == ["a"]
    assert sched.schedule(2).finished == [], "reported once"


def test_an_abort_of_a_request_never_scheduled_is_reported_too() -> None:
    # As vLLM's scheduler frees it: every aborted id goes to finished_req_ids, waiting or not.
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    a = req("a", list(range(6)))
    sched.add(a)
    sched.abort(a)
    assert a.status is Status.ABORTED
    assert sched.schedule(0).finished == ["a"]


def test_requests_preempted_in_a_step_are_listed_and_may_be_aborted_while_they_wait() -> None:
    sched, _, b = two_requests_for_a_pool_of_one()
    for step in range(40):
        s = sched.schedule(step)
        if s.preempted:
            assert s.preempted == [b] and b.preempted and b not in sched.running
            break
        sched.update(s)
    else:
        raise AssertionError("nothing was preempted")
    sched.abort(b)  # (what EngineConfig.abort_preempted does, a step later)
    assert b.status is Status.ABORTED and sched.schedule(step + 1).finished == ["b"]
    config = EngineConfig(num_blocks=20, max_num_batched_tokens=128, model="prefix-hash", abort_preempted=1.0)
    result = Engine(config).run(make_workload("mixed", 30, 0))
    preempted = [r for r in result.requests.values() if r.num_preemptions]
    assert preempted and all(r.status is Status.ABORTED for r in preempted)


def test_a_hash_held_by_two_blocks_stays_cached_while_either_does() -> None:
    # Two requests with the same block-aligned 8-token prompt: the last prompt token is always
    # recomputed, so b writes its own copy of the second block. When a's copy is handed to a
    # new tenant, b's copy still holds the hash and a later request hits it (as in vLLM, which
    # keeps every block of a hash; the stand-in used to drop the hash with the first copy).
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 9))
    a, b = Request("a", prompt, [99]), Request("b", prompt, [99])
    assert kv.allocate(a, 8, kv.match_prefix(a))
    hit = kv.match_prefix(b)
    assert hit == [a.blocks[0]]
    assert kv.allocate(b, 4, hit)
    a_blocks, b_blocks = list(a.blocks), list(b.blocks)
    assert a_blocks[1] != b_blocks[1]
    kv.free(a)
    kv.free(b)
    x = Request("x", list(range(200, 224)), [1])
    assert kv.allocate(x, 24)  # six blocks from the LRU head: a's copy of the second block is one
    assert a_blocks[1] in x.blocks and b_blocks[1] not in x.blocks
    c = Request("c", [*prompt, 50, 51, 52, 53], [1])
    assert kv.match_prefix(c) == [a_blocks[0], b_blocks[1]]


def test_blocks_that_fill_in_later_steps_are_published_and_again_after_a_reallocation() -> None:
    """A block is published when it becomes full, in whichever step that is (a later prefill
    chunk, decode), once per tenancy: after the request's blocks are freed and it is allocated
    anew (preemption), its new blocks are published under the same hashes."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = req("a", list(range(10)), outputs=(10, 11, 12))
    assert kv.allocate(a, 6)  # block 0 full, block 1 half
    assert kv.match_prefix(req("x", list(range(13)))) == a.blocks[:1]
    a.num_computed = 6
    assert kv.allocate(a, 4)  # the rest of the prompt: block 1 full, block 2 half
    a.num_computed = 10
    a.tokens.extend([10, 11])  # decode: two generated tokens fill block 2
    assert kv.allocate(a, 2)
    assert kv.match_prefix(req("y", list(range(13)))) == a.blocks[:3], "blocks full by chunk and by decode hit"
    kv.free(a)  # preempted: its blocks stay cached until reused
    for block in kv.pool.allocate(kv.pool.num_free):  # every free block reused: the old hashes are evicted
        kv.pool.free([block])
    assert kv.match_prefix(req("z", list(range(13)))) == []
    a.num_computed = 0
    assert kv.allocate(a, 12)  # resumed: recomputes everything into new blocks
    assert kv.match_prefix(req("w", list(range(13)))) == a.blocks[:3], "published again in its new tenancy"


def test_a_shuffled_batch_hands_the_cache_each_steps_rows_in_another_order() -> None:
    config = EngineConfig(num_blocks=64, model="prefix-hash", shuffle_batch=True)
    engine = Engine(config)
    scheduler_orders, batch_orders = [], []
    schedule, save = engine.scheduler.schedule, engine.cache.save

    def recording_schedule(step):
        out = schedule(step)
        scheduler_orders.append([r.req_id for r, _ in out.scheduled])
        return out

    def recording_save(hidden, mm, batch):
        batch_orders.append(list(batch.req_ids))
        return save(hidden, mm, batch)

    engine.scheduler.schedule, engine.cache.save = recording_schedule, recording_save
    cached = engine.run(make_workload("mixed", 30, 0))
    scheduler_orders = [o for o in scheduler_orders if o]
    assert [sorted(o) for o in batch_orders] == [sorted(o) for o in scheduler_orders]
    assert batch_orders != scheduler_orders, "some step's rows reordered"
    reference = Engine(replace(config, enable_prefix_caching=False)).run(make_workload("mixed", 30, 0))
    assert compare(cached, reference, 0.0).ok


def test_a_step_that_preempts_schedules_nothing_from_the_waiting_queue() -> None:
    # As vLLM: once a step preempted a request, no waiting request is scheduled in it. Here the
    # victim (r2, put back at the front of the queue) would rematch its freed blocks and resume
    # at once in step 2 otherwise (found by searching small configurations).
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_running=8, long_prefill_tokens=4)
    reqs = [
        req(f"r{i}", list(range(100 * i, 100 * i + n)), outputs=(1,) * o)
        for i, (n, o) in enumerate([(3, 2), (3, 8), (9, 8)])
    ]
    for r in reqs:
        sched.add(r)
    for step in range(40):
        s = sched.schedule(step)
        if s.preempted:
            assert step == 2 and [r.req_id for r in s.preempted] == ["r2"]
            assert s.new == [] and s.resumed == [] and reqs[2] in sched.waiting
            break
        sched.update(s)
    else:
        raise AssertionError("nothing was preempted")


def test_an_abort_after_the_request_finished_changes_nothing() -> None:
    # A client may cancel a request the engine has just finished: it stays finished, reported once.
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_running=8)
    a = req("a", list(range(6)), outputs=(7,))
    sched.add(a)
    step = 0
    while a.status is not Status.FINISHED:
        sched.update(sched.schedule(step))
        step += 1
    assert sched.schedule(step).finished == ["a"]
    free = kv.pool.num_free
    sched.abort(a)
    assert a.status is Status.FINISHED and kv.pool.num_free == free
    assert sched.schedule(step + 1).finished == []


# ---- vLLM rules a mutation audit found untested ---------------------------------------------------


def test_a_hit_takes_the_first_block_still_holding_the_hash() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a, b = req("a", range(1, 9)), req("b", range(1, 9))
    assert kv.allocate(a, 8, kv.match_prefix(a))
    assert kv.allocate(b, 4, kv.match_prefix(b))  # b computes its own copy of the second block
    assert kv.match_prefix(req("c", [*range(1, 9), 50])) == a.blocks[:2]


def test_the_prefix_match_stops_at_the_first_block_not_cached() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = req("a", range(12))
    assert kv.allocate(a, 12)
    blocks = list(a.blocks)
    kv.free(a)
    kv.pool.touch([blocks[1]])  # block 1 stays cached; block 0 gets a new tenant
    kv.pool.allocate(kv.pool.num_free)
    assert kv.pool.cached_block(a.hashes[0]) is None and kv.pool.cached_block(a.hashes[1]) == blocks[1]
    assert kv.match_prefix(req("b", range(13))) == []


def test_no_request_is_scheduled_for_zero_tokens_or_past_the_budget() -> None:
    sched = Scheduler(KVCacheManager(64, BS, True), max_num_batched_tokens=8, max_num_running=8)
    for i in range(3):
        sched.add(req(f"r{i}", range(100 * i, 100 * i + 8), outputs=(1,) * 3))
    for step in range(30):
        s = sched.schedule(step)
        assert all(n > 0 for _, n in s.scheduled) and s.num_tokens <= 8, (step, s.scheduled)
        sched.update(s)
    sched = Scheduler(KVCacheManager(64, BS, True), max_num_batched_tokens=12, max_num_running=8, long_prefill_tokens=4)
    for i in range(3):
        sched.add(req(f"r{i}", range(100 * i, 100 * i + 20)))
    sched.update(sched.schedule(0))  # all three running, 4 tokens each
    sched.budget = 8  # (the first two running requests use it all)
    assert [(r.req_id, n) for r, n in sched.schedule(1).scheduled] == [("r0", 4), ("r1", 4)]


def test_long_prefill_caps_every_chunk_of_a_prompt() -> None:
    sched = Scheduler(KVCacheManager(32, BS, True), max_num_batched_tokens=16, max_num_running=8, long_prefill_tokens=6)
    sched.add(req("a", range(14)))
    counts = []
    for step in range(3):
        s = sched.schedule(step)
        counts.append([n for _, n in s.scheduled])
        sched.update(s)
    assert counts == [[6], [6], [2]]


def test_at_most_max_num_running_requests_run() -> None:
    sched = Scheduler(KVCacheManager(64, BS, True), max_num_batched_tokens=64, max_num_running=2)
    for i in range(3):
        sched.add(req(f"r{i}", range(100 * i, 100 * i + 5)))
    assert [r for r, _, _ in sched.schedule(0).new] == ["r0", "r1"] and len(sched.running) == 2


def test_a_preempted_request_goes_back_to_the_front_of_the_queue() -> None:
    sched = Scheduler(KVCacheManager(6, BS, True), max_num_batched_tokens=64, max_num_running=8)
    a, b, c = (req(n, range(k, k + 11), outputs=(1,) * 8) for n, k in (("a", 0), ("b", 100), ("c", 200)))
    for r in (a, b, c):
        sched.add(r)
    for step in range(40):
        s = sched.schedule(step)
        if s.preempted:
            assert list(sched.waiting) == [b, c]
            return
        sched.update(s)
    raise AssertionError("nothing was preempted")


# ---- rules a second mutation audit found untested -----------------------------------------------


def test_hit_tokens_count_the_rematch_of_resumed_requests_too() -> None:
    # (as vLLM's prefix-cache stats count every admission's hit: the demo's prefix hit rate)
    sched, _, _ = two_requests_for_a_pool_of_one()
    hits = resumed_hits = 0
    for step in range(40):
        s = sched.schedule(step)
        hits += sum(n for _, _, n in s.new + s.resumed)
        resumed_hits += sum(n for _, _, n in s.resumed)
        sched.update(s)
        if not sched.has_work:
            break
    assert resumed_hits > 0 and sched.num_hit_tokens == hits


def test_a_finish_reported_in_a_step_that_schedules_nothing_reaches_the_cache() -> None:
    # a finishes, and the step that reports it schedules nothing (b arrives later): the cache
    # must still be told, or it holds a live request at the end.
    def requests() -> list[Request]:
        return [
            Request("a", list(range(1, 10)), [5, 6]),
            Request("b", list(range(20, 30)), [7], arrival_step=12),
        ]

    config = EngineConfig(num_blocks=16, block_size=4, model="prefix-hash")
    cached = Engine(config).run(requests())
    reference = Engine(replace(config, enable_prefix_caching=False)).run(requests())
    assert cached.steps > 12 and cached.cache_stats.requests_live == 0
    assert compare(cached, reference, 0.0).ok


def test_a_request_the_pool_cannot_hold_is_a_capacity_error() -> None:
    config = EngineConfig(num_blocks=2, block_size=4, model="prefix-hash", max_steps=200)
    for cfg in (config, replace(config, enable_prefix_caching=False)):
        with pytest.raises(EngineCapacityError, match="request a needs 3 KV blocks but the pool has 2"):
            Engine(cfg).run([req("a", range(10))])


def test_a_chat_turn_continues_the_previous_turn_with_its_reply() -> None:
    # (what makes later turns hit blocks filled during decode)
    reqs = make_workload("chat", 20, 0)
    continued = [
        (a.req_id, b.req_id)
        for a in reqs
        for b in reqs
        if len(b.prompt) > len(a.prompt) + len(a.outputs)
        and b.prompt[: len(a.prompt) + len(a.outputs)] == a.prompt + a.outputs
    ]
    assert len(continued) >= 5, continued


def test_an_unknown_workload_or_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'; choose from chat, fewshot, random, mixed"):
        make_workload("nope", 4, 0)
    with pytest.raises(ValueError, match="unknown model 'nope'; choose from transformer, prefix-hash"):
        Engine(EngineConfig(model="nope"))
