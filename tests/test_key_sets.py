"""Steps whose cached keys differ: a step that leaves out a key earlier steps gave has no rows
of it for its positions, so a later hit over them is refused, never served the slot's previous
tenant's rows; deferred keys that change between a request's steps go to separate records."""

from __future__ import annotations

import pytest

from cachekit import batch, describe, rows, slots_of, small_cache
from omni_pcache import CachePolicy, NewRequest, StepEvents, UnservableHitError

BS = 4
POLICIES = {
    "discovered": None,
    "explicit": CachePolicy(token_keys=frozenset({"codes"})),
    "deferred": CachePolicy(token_keys=frozenset({"codes"}), deferred_keys=frozenset({"codes"})),
}


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["queued", "written-in-save"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_hit_over_positions_whose_step_left_a_key_out_is_refused_for_that_key(policy, inline_write_bytes) -> None:
    with small_cache(inline_write_bytes=inline_write_bytes, policy=policy) as cache:
        # a writes block 0 with codes; it finishes and b reuses block 0 without giving codes.
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        sid = cache.save(rows(1, 0, 4), {"codes": rows(1, 0, 4)}, batch([("a", 4)], [slots_of([0], 0, 4, BS)]))
        cache.materialize(sid, ["a"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0])], finished=["a"]))
        sid = cache.save(rows(2, 0, 4), {}, batch([("b", 4)], [slots_of([0], 0, 4, BS)]))
        assert list(cache.materialize(sid, ["b"]).mm) == []
        # c hits b's block: b's hidden rows are served, a's codes rows are not (b's step had none).
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1], 4)], finished=["b"]))
        sid = cache.save(rows(3, 4, 1), {"codes": rows(3, 4, 1)}, batch([("c", 1)], [slots_of([0, 1], 4, 1, BS)]))
        with pytest.raises(UnservableHitError, match=r"'c'.*4 rows of 'codes'.*did not give this key"):
            cache.materialize(sid, ["c"])
        stats = cache.stats()  # (the refused step id is consumed: its page and hit reads let go)
        assert all(("step", sid) not in holders for holders in stats.staging_holders) and stats.reads_pending == 0
        # Without codes in the step, c's hidden prefix is b's.
        cache.begin_step(StepEvents(new=[NewRequest("d", [0, 2], 4)], finished=["c"]))
        sid = cache.save(rows(4, 4, 1), {}, batch([("d", 1)], [slots_of([0, 2], 4, 1, BS)]))
        assert describe(cache.materialize(sid, ["d"]).hidden["d"]) == [(2, 0), (2, 1), (2, 2), (2, 3), (4, 4)]
        cache.begin_step(StepEvents(finished=["d"]))
        cache.flush()
        cache.begin_step(StepEvents())  # (forgets the written tasks)
        stats = cache.stats()
        assert stats.steps_outstanding == [] and stats.tasks_live == 0 and stats.preserved_entries == 0


@pytest.mark.parametrize("inline_write_bytes", [0, 1 << 20], ids=["queued", "written-in-save"])
def test_a_read_planned_before_a_step_leaves_the_key_out_still_gets_its_rows(inline_write_bytes) -> None:
    with small_cache(inline_write_bytes=inline_write_bytes) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        sid = cache.save(rows(1, 0, 4), {"codes": rows(1, 0, 4)}, batch([("a", 4)], [slots_of([0], 0, 4, BS)]))
        cache.materialize(sid, ["a"])
        cache.flush()
        # c hits a's block; its step is materialized only after block 0 went to b, whose step
        # has no codes: the rows c's read captured are kept aside for it.
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1], 4)], finished=["a"]))
        late = cache.save(rows(3, 4, 1), {"codes": rows(3, 4, 1)}, batch([("c", 1)], [slots_of([0, 1], 4, 1, BS)]))
        cache.begin_step(StepEvents(new=[NewRequest("b", [0])], finished=["c"]))
        sid = cache.save(rows(2, 0, 4), {}, batch([("b", 4)], [slots_of([0], 0, 4, BS)]))
        cache.materialize(sid, ["b"])
        out = cache.materialize(late, ["c"])
        want = [(1, 0), (1, 1), (1, 2), (1, 3), (3, 4)]
        assert describe(out.hidden["c"]) == want and describe(out.mm["codes"]["c"]) == want
        stats = cache.stats()
        assert stats.rows_preserved == 8 and stats.preserved_entries == 0


def test_deferred_keys_that_change_between_a_requests_steps_are_each_served_where_given() -> None:
    policy = CachePolicy(token_keys=frozenset({"codes", "feat"}), deferred_keys=frozenset({"codes", "feat"}))
    with small_cache(policy=policy) as cache:
        # a: step 1 gives codes and feat, step 2 codes only, step 3 feat only, then finishes.
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1, 2])]))
        given = [("codes", "feat"), ("codes",), ("feat",)]
        for step, names in enumerate(given):
            if step:
                cache.begin_step(StepEvents())
            mm = {name: rows(10 * (step + 1) + i, 4 * step, 4) for i, name in enumerate(names)}
            sid = cache.save(rows(step + 1, 4 * step, 4), mm, batch([("a", 4)], [slots_of([0, 1, 2], 4 * step, 4, BS)]))
            out = cache.materialize(sid, ["a"])
            assert sorted(out.mm) == sorted(names)
        cache.begin_step(StepEvents(finished=["a"]))
        cache.flush()
        # b hits a's first block: both keys were given there.
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 3], 4)]))
        sid = cache.save(
            rows(5, 4, 1),
            {"codes": rows(6, 4, 1), "feat": rows(7, 4, 1)},
            batch([("b", 1)], [slots_of([0, 3], 4, 1, BS)]),
        )
        out = cache.materialize(sid, ["b"])
        assert describe(out.mm["codes"]["b"]) == [(10, 0), (10, 1), (10, 2), (10, 3), (6, 4)]
        assert describe(out.mm["feat"]["b"]) == [(11, 0), (11, 1), (11, 2), (11, 3), (7, 4)]
        # c hits a's first two blocks: feat was not given for the second one.
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1, 4], 8)], finished=["b"]))
        sid = cache.save(
            rows(5, 8, 1),
            {"codes": rows(6, 8, 1), "feat": rows(7, 8, 1)},
            batch([("c", 1)], [slots_of([0, 1, 4], 8, 1, BS)]),
        )
        with pytest.raises(UnservableHitError, match=r"'c'.*8 rows of 'feat', but 4 were never written"):
            cache.materialize(sid, ["c"])
        # d hits all three blocks with codes only: codes was not given for the third.
        cache.begin_step(StepEvents(new=[NewRequest("d", [0, 1, 2, 5], 12)], finished=["c"]))
        sid = cache.save(
            rows(5, 12, 1), {"codes": rows(6, 12, 1)}, batch([("d", 1)], [slots_of([0, 1, 2, 5], 12, 1, BS)])
        )
        with pytest.raises(UnservableHitError, match=r"'d'.*12 rows of 'codes', but 4 were never written"):
            cache.materialize(sid, ["d"])
        cache.begin_step(StepEvents(finished=["d"]))
        cache.flush()
        cache.begin_step(StepEvents())  # (forgets the written tasks)
        stats = cache.stats()
        assert stats.device_bytes == 0 and stats.deferred_open == 0 and stats.tasks_live == 0


def test_a_key_set_seen_before_a_new_key_still_leaves_that_key_out() -> None:
    # z's step (hidden only) comes before codes is a key; a's brings codes; b's step is z's key
    # set again: it must leave codes out of block 0 (its slots absent), not keep a's codes there.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("z", [5])]))
        cache.materialize(cache.save(rows(9, 0, 4), {}, batch([("z", 4)], [slots_of([5], 0, 4, BS)])), ["z"])
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])], finished=["z"]))
        sid = cache.save(rows(1, 0, 4), {"codes": rows(1, 0, 4)}, batch([("a", 4)], [slots_of([0], 0, 4, BS)]))
        cache.materialize(sid, ["a"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0])], finished=["a"]))
        cache.materialize(cache.save(rows(2, 0, 4), {}, batch([("b", 4)], [slots_of([0], 0, 4, BS)])), ["b"])
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1], 4)], finished=["b"]))
        sid = cache.save(rows(3, 4, 1), {"codes": rows(3, 4, 1)}, batch([("c", 1)], [slots_of([0, 1], 4, 1, BS)]))
        with pytest.raises(UnservableHitError, match=r"'c'.*4 rows of 'codes'.*did not give this key"):
            cache.materialize(sid, ["c"])


def test_a_step_that_gives_no_cached_key_still_leaves_every_key_out() -> None:
    # b's step caches nothing at all (no hidden states by policy, no codes): its slots must
    # still lose a's codes, so c's hit over them is refused rather than served a's rows.
    with small_cache(policy=CachePolicy(cache_hidden=False, token_keys=frozenset({"codes"}))) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        cache.materialize(
            cache.save(None, {"codes": rows(1, 0, 4)}, batch([("a", 4)], [slots_of([0], 0, 4, BS)])), ["a"]
        )
        cache.begin_step(StepEvents(new=[NewRequest("b", [0])], finished=["a"]))
        cache.materialize(cache.save(None, {}, batch([("b", 4)], [slots_of([0], 0, 4, BS)])), ["b"])
        cache.begin_step(StepEvents(new=[NewRequest("c", [0, 1], 4)], finished=["b"]))
        sid = cache.save(None, {"codes": rows(3, 4, 1)}, batch([("c", 1)], [slots_of([0, 1], 4, 1, BS)]))
        with pytest.raises(UnservableHitError, match=r"'c'.*4 rows of 'codes'.*did not give this key"):
            cache.materialize(sid, ["c"])
