"""Per-token keys of any row shape and dtype, shape discovery, leftover mm and padding."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from typing import NamedTuple

import numpy as np
import pytest
import torch

from cachekit import describe, rows, slots_of, small_cache, small_cache_bytes
from omni_pcache import (
    CachePolicy,
    ConfigError,
    InvalidInputError,
    NewRequest,
    StepBatch,
    StepEvents,
    UnservableHitError,
)

BS = 4
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
ROW_SHAPES = [(), (5,), (2, 3)]


def encoded(start: int, count: int, row_shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rows whose every element encodes (position, salt), exact in every dtype used here."""
    numel = int(np.prod(row_shape)) if row_shape else 1
    pos = torch.arange(start, start + count).reshape(count, *([1] * len(row_shape)))
    inner = torch.arange(numel).reshape(row_shape) if row_shape else torch.tensor(0)
    return (pos * 8 + inner % 8 + salt * 64).to(dtype)


def two_requests(cache, key_fn, **save_kwargs):
    """a (fresh, 8 tokens) then b (hits a's first block, computes 3). Returns b's outputs."""
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    h, mm = key_fn(0, 8, salt=1)
    sid = cache.save(h, mm, StepBatch(["a"], [8], slots_of([0, 1], 0, 8, BS)), **save_kwargs)
    cache.materialize(sid, ["a"])
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
    h, mm = key_fn(4, 3, salt=2)
    sid = cache.save(h, mm, StepBatch(["b"], [3], slots_of([0, 2], 4, 3, BS)))
    return cache.materialize(sid, ["b"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_shape", ROW_SHAPES, ids=str)
def test_any_row_shape_and_dtype_round_trips_exactly(row_shape, dtype) -> None:
    def key_fn(start, count, salt):
        hidden = encoded(start, count, (6,), dtype, salt)
        return hidden, {"feat": encoded(start, count, row_shape, dtype, salt)}

    with small_cache() as cache:
        out = two_requests(cache, key_fn)
    want_feat = torch.cat([encoded(0, 4, row_shape, dtype, 1), encoded(4, 3, row_shape, dtype, 2)])
    want_hidden = torch.cat([encoded(0, 4, (6,), dtype, 1), encoded(4, 3, (6,), dtype, 2)])
    assert out.mm["feat"]["b"].dtype == dtype
    assert out.mm["feat"]["b"].shape == (7, *row_shape)
    assert torch.equal(out.mm["feat"]["b"], want_feat)
    assert torch.equal(out.hidden["b"], want_hidden)


def test_discovery_classifies_once_and_refuses_a_changed_row_shape_or_dtype() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.zeros(4, 2), {"feat": torch.zeros(4, 3)}, StepBatch(["a"], [4], np.arange(4)))
        cache.discard(sid)
        batch = StepBatch(["a"], [4], np.arange(4, 8))
        with pytest.raises(
            InvalidInputError, match=r"'feat' was classified as 'feat' rows \(3,\) float32.*rows \(5,\)"
        ):
            cache.save(torch.zeros(4, 2), {"feat": torch.zeros(4, 5)}, batch)
        with pytest.raises(InvalidInputError, match=r"rows \(3,\) float16"):
            cache.save(torch.zeros(4, 2), {"feat": torch.zeros(4, 3, dtype=torch.float16)}, batch)
        with pytest.raises(InvalidInputError, match=r"dim 0 must be the step's token count 4"):
            cache.save(torch.zeros(4, 2), {"feat": torch.zeros(9, 3)}, batch)
        with pytest.raises(InvalidInputError, match=r"hidden states was classified"):
            cache.save(torch.zeros(4, 7), {"feat": torch.zeros(4, 3)}, batch)
        assert cache.stats().steps_outstanding == [], "refused saves issue no step id"
        cache.discard(cache.save(torch.ones(4, 2), {"feat": torch.ones(4, 3)}, batch))


def test_reclassified_each_step_an_entry_is_per_token_only_in_steps_where_it_has_that_shape() -> None:
    # vLLM-Omni's rule: 2+ dims with a row per token, this step. "spk" has a row per request,
    # "flag" is 1-D (never cached), and "feat" changes width once (that step's leftover).
    with small_cache(policy=CachePolicy(reclassify_each_step=True)) as cache:
        # "a" (3 tokens) and "c" (1): "feat" is found; "spk" (2 rows for 4 tokens) is a leftover.
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("c", [5])]))
        spk = torch.tensor([[1.0], [2.0]])
        mm = {"spk": spk, "flag": torch.tensor([1, 0, 1, 1]), "feat": encoded(0, 4, (3,), torch.float32, 1)}
        sid = cache.save(rows(1, 0, 4), mm, StepBatch(["a", "c"], [3, 1], np.array([0, 1, 2, 20])))
        out = cache.materialize(sid, ["a", "c"])
        assert torch.equal(out.mm["spk"]["c"], spk) and out.mm["flag"]["c"].tolist() == [1]
        assert cache.stats().pool_bytes.keys() == {"hidden", "feat"}
        # One token each: "spk" has a row per token here too, but is no key seen in a step that
        # could tell (a step of one-row requests finds none); "feat", found before, is cached
        # (block 0 now holds a's "feat" rows in all four slots).
        cache.begin_step(StepEvents())
        mm = {"spk": spk, "feat": encoded(4, 2, (3,), torch.float32, 2)}
        sid = cache.save(rows(1, 4, 2), mm, StepBatch(["a", "c"], [1, 1], np.array([3, 21])))
        out = cache.materialize(sid, ["a", "c"])
        assert out.mm["spk"]["c"].tolist() == [[2.0]]  # (a leftover with a row per token: sliced)
        assert cache.stats().pool_bytes.keys() == {"hidden", "feat"}
        # "b" takes a's freed block 0 (a's "feat" rows in its slots) in a step of 7 tokens whose
        # "feat" is 5 wide: that step's leftover, passed whole (no error); the hidden states are
        # cached as ever, and b's step leaves block 0's slots without "feat" rows.
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 3])], finished=["a", "c"]))
        sid = cache.save(rows(2, 0, 7), {"feat": torch.zeros(7, 5)}, StepBatch(["b"], [7], slots_of([0, 3], 0, 7, BS)))
        out = cache.materialize(sid, ["b"])
        assert out.mm["feat"]["b"].shape == (7, 5) and torch.equal(out.hidden["b"], rows(2, 0, 7))
        # "d" hits b's first block with "feat" of another dtype (that step's leftover, sliced):
        # its hidden states are served. "f" gives "feat" rows again, so its hit on that block
        # reads them: unservable, never a's rows.
        cache.begin_step(StepEvents(new=[NewRequest("d", [0, 4], 4)]))
        feat64 = torch.zeros(2, 3, dtype=torch.float64)
        sid = cache.save(rows(3, 4, 2), {"feat": feat64}, StepBatch(["d"], [2], slots_of([0, 4], 4, 2, BS)))
        out = cache.materialize(sid, ["d"])
        assert torch.equal(out.hidden["d"], torch.cat([rows(2, 0, 4), rows(3, 4, 2)]))
        assert torch.equal(out.mm["feat"]["d"], feat64)
        cache.begin_step(StepEvents(new=[NewRequest("f", [0, 6], 4)]))
        feat = encoded(4, 1, (3,), torch.float32, 2)
        sid = cache.save(rows(4, 4, 1), {"feat": feat}, StepBatch(["f"], [1], slots_of([0, 6], 4, 1, BS)))
        with pytest.raises(UnservableHitError, match="'feat'"):
            cache.materialize(sid, ["f"])
        assert cache.stats().reads_pending == 0


def test_reclassified_each_step_a_deferred_key_is_found_in_a_step_of_one_row_requests() -> None:
    # (named by the policy, so no tensor with a row per request to fear: its rows are cached
    # from the first step, and a hit over them is served)
    policy = CachePolicy(reclassify_each_step=True, deferred_keys={"codes"})
    with small_cache(policy=policy) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("c", [5])]))
        codes = encoded(0, 2, (2,), torch.int64, 1)
        cache.discard(cache.save(rows(1, 0, 2), {"codes": codes}, StepBatch(["a", "c"], [1, 1], np.array([0, 20]))))
        more = encoded(1, 3, (2,), torch.int64, 1)
        cache.discard(cache.save(rows(1, 1, 3), {"codes": more}, StepBatch(["a"], [3], np.arange(1, 4))))
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1], 4)], finished=["a", "c"]))
        step = encoded(4, 2, (2,), torch.int64, 2)
        sid = cache.save(rows(2, 4, 2), {"codes": step}, StepBatch(["b"], [2], np.arange(4, 6)))
        got = cache.materialize(sid, ["b"]).mm["codes"]["b"]
        assert torch.equal(got, torch.cat([codes[:1], more, step]))


def test_reclassified_each_step_a_deferred_key_without_rows_this_step_is_a_leftover() -> None:
    policy = CachePolicy(reclassify_each_step=True, deferred_keys={"codes"})
    with small_cache(policy=policy) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(rows(1, 0, 4), {"codes": torch.zeros(4, 2)}, StepBatch(["a"], [4], np.arange(4))))
        codes = torch.ones(3, 2)
        sid = cache.save(rows(1, 4, 4), {"codes": codes}, StepBatch(["a"], [4], np.arange(4, 8)))
        assert torch.equal(cache.materialize(sid, ["a"]).mm["codes"]["a"], codes)  # (vLLM-Omni's: a leftover)


REFUSALS = {
    # A leftover that cannot be copied, in a step whose keys all look new.
    "uncopyable leftover": (
        None,
        {},
        lambda: (
            torch.zeros(4, 2, dtype=torch.float64),
            {"feat": torch.zeros(4, 5), "later": torch.zeros(2), "lock": threading.Lock()},
        ),
    ),
    # Deferred rows over the device budget (128 bytes for 64).
    "deferred rows over the device budget": (
        CachePolicy(deferred_keys={"feat"}),
        {"device_budget_bytes": 64},
        lambda: (torch.zeros(4, 2, dtype=torch.float64), {"feat": torch.zeros(4, 8), "later": torch.zeros(2)}),
    ),
    # A key whose pool cannot be allocated (2**36 floats a row), after hidden's was: its storage
    # is freed and the keys are classified afresh. (A budget past any host's lets the
    # allocation be tried: by default the host's memory refuses it first, as below.)
    "a row too wide to allocate": (
        None,
        {"host_budget_bytes": 2**62},
        lambda: (
            torch.zeros(4, 2, dtype=torch.float64),
            {"feat": torch.zeros(4, 1).expand(4, 2**36), "later": torch.zeros(2)},
        ),
    ),
    # Keys whose storage would pass the host budget, which holds the retry's keys exactly:
    # refused before anything is allocated.
    "keys past the host budget": (
        None,
        {"host_budget_bytes": small_cache_bytes({"hidden": 8, "feat": 8, "later": 4})},
        lambda: (torch.zeros(4, 2, dtype=torch.float64), {"feat": torch.zeros(4, 5), "later": torch.zeros(2)}),
    ),
    # The same too-wide row under the default budget, this host's memory.
    "a row past the host's memory": (
        None,
        {},
        lambda: (
            torch.zeros(4, 2, dtype=torch.float64),
            {"feat": torch.zeros(4, 1).expand(4, 2**36), "later": torch.zeros(2)},
        ),
    ),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_refused_save_classifies_nothing_so_a_corrected_retry_is_cached(refusal: str) -> None:
    """A save refused for its input registers none of its keys or leftover names: the retry, with
    other row shapes, dtypes and a name that was leftover there now per-token, is cached as it
    is, and a later hit gets those rows back; the refused step's keys get no pool storage."""
    policy, overrides, refused_step = REFUSALS[refusal]
    with small_cache(policy=policy, **overrides) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        batch = StepBatch(["a"], [4], slots_of([0, 1], 0, 4, BS))
        hidden, mm = refused_step()
        with pytest.raises(ConfigError if "host" in refusal else InvalidInputError):
            cache.save(hidden, mm, batch)
        stats = cache.stats()
        assert (stats.pool_bytes, stats.steps_outstanding, stats.tasks_live) == ({}, [], 0)
        assert (stats.staging_bytes, stats.bytes_written) == ({}, {}), "no staging or key left by the refusal"
        rows = {"hidden": encoded(0, 4, (2,), torch.float32, 1), "feat": encoded(0, 4, (2,), torch.float32, 2)}
        later = encoded(0, 4, (), torch.int32, 3)
        sid = cache.save(rows["hidden"], {"feat": rows["feat"], "later": later}, batch)
        out = cache.materialize(sid, ["a"])
        assert torch.equal(out.hidden["a"], rows["hidden"]) and torch.equal(out.mm["feat"]["a"], rows["feat"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], num_computed_tokens=4)], finished=["a"]))
        b_hidden, b_feat, b_later = (
            encoded(4, 1, (2,), torch.float32, 4),
            encoded(4, 1, (2,), torch.float32, 5),
            encoded(4, 1, (), torch.int32, 6),
        )
        sid = cache.save(
            b_hidden, {"feat": b_feat, "later": b_later}, StepBatch(["b"], [1], slots_of([0, 2], 4, 1, BS))
        )
        out = cache.materialize(sid, ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([rows["hidden"], b_hidden]))
        assert torch.equal(out.mm["feat"]["b"], torch.cat([rows["feat"], b_feat]))
        assert torch.equal(out.mm["later"]["b"], torch.cat([later, b_later]))
        assert sorted(cache.stats().pool_bytes) == ["feat", "hidden", "later"]
        assert cache._ledger.num_keys == 3, "the refused step's ledger key ids were reused, not leaked"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (lambda: torch.zeros(4, 2).to_sparse(), "hidden states is a sparse_coo tensor"),
        (lambda: torch.quantize_per_tensor(torch.ones(4, 2), 0.1, 0, torch.qint8), "hidden states is a quantized"),
    ],
    ids=["sparse", "quantized"],
)
def test_rows_that_are_not_dense_are_refused_and_change_nothing(rows, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with warnings.catch_warnings():  # (torch deprecates quantized tensors)
            warnings.simplefilter("ignore")
            bad = rows()
        with pytest.raises(InvalidInputError, match=message):
            cache.save(bad, {}, batch)
        sid = cache.save(torch.ones(4, 2), {}, batch)
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], torch.ones(4, 2))


def test_a_meta_tensor_leftover_is_refused() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match="leftover mm 'x' holds a meta tensor"):
            cache.save(torch.ones(4, 2), {"x": {"inner": torch.empty(5, device="meta")}}, batch)
        assert cache.stats().steps_outstanding == []


def test_a_key_first_seen_as_leftover_stays_leftover() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        first = {"lens": torch.tensor([1, 2, 3])}  # dim 0 != 4: leftover
        cache.discard(cache.save(torch.zeros(4, 2), first, StepBatch(["a"], [4], np.arange(4))))
        # Later its dim 0 happens to equal the token count: still leftover, never cached.
        out_id = cache.save(
            torch.zeros(3, 2), {"lens": torch.tensor([7, 8, 9])}, StepBatch(["a"], [3], np.arange(4, 7))
        )
        out = cache.materialize(out_id, ["a"])
        assert torch.equal(out.mm["lens"]["a"], torch.tensor([7, 8, 9]))
        assert "lens" not in cache.stats().pool_bytes


def test_a_leftover_name_stays_leftover_after_a_refused_step_that_carried_it() -> None:
    # The refused step registered its keys before its pool storage failed; undoing that forgets
    # only what it added ("feat"), not "lens", which an earlier step classified as leftover.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        first = {"lens": torch.tensor([1, 2, 3])}  # dim 0 != 4: leftover
        cache.discard(cache.save(torch.zeros(4, 2), first, StepBatch(["a"], [4], np.arange(4))))
        too_wide = torch.zeros(4, 1).expand(4, 2**36)  # (a pool of 2**36 floats a row: past the host's memory)
        with pytest.raises(ConfigError, match="past this host's memory"):
            cache.save(torch.zeros(4, 2), {**first, "feat": too_wide}, StepBatch(["a"], [4], np.arange(4, 8)))
        out_id = cache.save(
            torch.zeros(3, 2), {"lens": torch.tensor([7, 8, 9])}, StepBatch(["a"], [3], np.arange(4, 7))
        )
        assert torch.equal(cache.materialize(out_id, ["a"]).mm["lens"]["a"], torch.tensor([7, 8, 9]))
        assert "lens" not in cache.stats().pool_bytes and "feat" not in cache.stats().pool_bytes


@pytest.mark.parametrize(
    ("mm", "message"),
    [
        ({5: torch.ones(4, 2)}, "mm keys must be str, got 5"),
        ({("a",): torch.ones(4, 2)}, r"mm keys must be str, got \('a',\)"),
        ({b"codes": "a leftover"}, "mm keys must be str, got b'codes'"),
    ],
)
def test_an_mm_key_that_is_not_a_str_is_refused_and_changes_nothing(mm, message) -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], np.arange(4))
        with pytest.raises(InvalidInputError, match=message):
            cache.save(torch.ones(4, 2), mm, batch)
        stats = cache.stats()
        assert (stats.steps_outstanding, stats.pool_bytes, stats.tasks_live) == ([], {}, 0)
        out = cache.materialize(cache.save(torch.ones(4, 2), {"codes": torch.ones(4, 2)}, batch), ["a"])
        assert list(out.mm) == ["codes"] and torch.equal(out.mm["codes"]["a"], torch.ones(4, 2))


def test_explicit_token_keys_turn_discovery_off() -> None:
    policy = CachePolicy(token_keys={"codes"})
    with small_cache(policy=policy) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2])]))
        mm = {"codes": torch.arange(6), "coincidence": torch.arange(100, 106)}
        sid = cache.save(torch.zeros(6, 2), mm, StepBatch(["a", "b"], [4, 2], np.array([0, 1, 2, 3, 8, 9])))
        out = cache.materialize(sid, ["a", "b"])
        assert set(cache.stats().pool_bytes) == {"hidden", "codes"}
        # Not cached, but sliced per request since its dim 0 equals the token count.
        assert torch.equal(out.mm["coincidence"]["b"], torch.tensor([104, 105]))
        with pytest.raises(InvalidInputError, match=r"mm key 'codes' must be a tensor"):
            cache.save(torch.zeros(2, 2), {"codes": [1, 2]}, StepBatch(["a"], [2], np.array([4, 5])))
        # A padded step: a leftover of the padded count is sliced per request like one of the count.
        mm = {"codes": torch.arange(4), "coincidence": torch.arange(200, 204)}
        sid = cache.save(torch.zeros(4, 2), mm, StepBatch(["a"], [2], np.array([4, 5]), 4))
        assert torch.equal(cache.materialize(sid, ["a"]).mm["coincidence"]["a"], torch.tensor([200, 201]))


class Span(NamedTuple):
    bounds: torch.Tensor
    unit: str


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a single str is iterable: its characters must not be read as the key names
        ({"token_keys": "codes"}, "CachePolicy.token_keys must be a collection of key names, got the single 'codes'"),
        ({"deferred_keys": "codes"}, "CachePolicy.deferred_keys must be a collection of key names, got the single"),
        ({"token_keys": b"codes"}, "CachePolicy.token_keys must be a collection of key names, got the single b'codes'"),
        ({"token_keys": 5}, "CachePolicy.token_keys must be a collection of key names, got 5"),
        ({"token_keys": {"codes", 7}}, r"CachePolicy.token_keys holds key names \(str\), got 7"),
        ({"cache_hidden": "no"}, "CachePolicy.cache_hidden must be a bool, got 'no'"),
        ({"token_keys": {"hidden"}}, "'hidden' is reserved for hidden states; use cache_hidden"),
        (
            {"token_keys": {"codes"}, "deferred_keys": {"codes", "audio", "hidden"}},
            r"deferred_keys \['audio'\] are not in token_keys",
        ),
        (
            {"cache_hidden": False, "deferred_keys": {"hidden"}},
            "deferred_keys names 'hidden', but cache_hidden=False caches no hidden states",
        ),
        ({"reclassify_each_step": 1}, "reclassify_each_step must be a bool, got 1"),
        (
            {"reclassify_each_step": True, "token_keys": {"codes"}},
            "reclassify_each_step applies to discovered keys: it needs token_keys=None",
        ),
    ],
)
def test_a_policy_of_the_wrong_shape_is_refused(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        CachePolicy(**kwargs)


def test_a_policy_takes_any_collection_of_key_names_and_keeps_them_frozen() -> None:
    # (a list or a generator of names is as good as a frozenset; the policy keeps its own
    # frozen copy, so it compares equal to one built from frozensets and can be hashed)
    policy = CachePolicy(token_keys=["codes", "codes"], deferred_keys=(k for k in ["codes"]))
    assert policy.token_keys == frozenset({"codes"}) and isinstance(policy.token_keys, frozenset)
    assert policy == CachePolicy(token_keys=frozenset({"codes"}), deferred_keys=frozenset({"codes"}))
    assert {policy: 1}[CachePolicy(token_keys={"codes"}, deferred_keys={"codes"})] == 1


@pytest.mark.parametrize("token_keys", [None, frozenset({"codes"})], ids=["discovered", "named"])
def test_deferred_hidden_states_are_served_from_their_clone_then_the_pool(token_keys) -> None:
    # "hidden" in deferred_keys keeps the hidden states on the device until the request
    # finishes, whether the mm keys are discovered or named.
    policy = CachePolicy(token_keys=token_keys, deferred_keys=frozenset({"hidden"}))
    with small_cache(policy=policy) as cache:
        hidden, codes = torch.randn(8, 4), torch.arange(8)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.materialize(cache.save(hidden, {"codes": codes}, StepBatch(["a"], [8], np.arange(8))), ["a"])
        assert cache.stats().deferred_open == 1  # a's hidden rows: still on the device (its clone)
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))  # b hits a's first block
        sid = cache.save(torch.randn(1, 4), {"codes": codes[:1]}, StepBatch(["b"], [1], np.array([8])))
        out = cache.materialize(sid, ["b"])
        assert torch.equal(out.hidden["b"][:4], hidden[:4]) and torch.equal(out.mm["codes"]["b"][:4], codes[:4])
        cache.begin_step(StepEvents(finished=["a", "b"]))
        cache.flush()
        cache.begin_step(StepEvents(new=[NewRequest("c", [0], 4)]))  # from the pool now
        sid = cache.save(torch.randn(0, 4), {"codes": codes[:0]}, StepBatch(["c"], [0], np.empty(0, np.int64)))
        assert torch.equal(cache.materialize(sid, ["c"]).hidden["c"], hidden[:4])
        stats = cache.stats()
        assert (stats.deferred_open, stats.device_bytes, stats.tasks_live) == (0, 0, 0), stats


def test_a_deferred_key_is_listed_from_its_first_save_and_holds_no_staging_page() -> None:
    # bytes_written lists every key the cache has seen, at 0 until written (a deferred key's
    # rows are written when its request finishes); only immediate keys have staging pages.
    policy = CachePolicy(token_keys={"codes"}, deferred_keys={"hidden"})
    with small_cache(policy=policy) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(torch.randn(6, 3), {"codes": torch.arange(6)}, StepBatch(["a"], [6], np.arange(6)))
        cache.materialize(sid, ["a"])
        stats = cache.stats()
        assert stats.bytes_written["hidden"] == 0 and stats.deferred_open == 1, stats
        assert set(stats.pool_bytes) == {"hidden", "codes"} and set(stats.staging_bytes) == {"codes"}, stats
        cache.begin_step(StepEvents(finished=["a"]))
        cache.flush()
        stats = cache.stats()
        assert stats.bytes_written == {"hidden": 6 * 3 * 4, "codes": 6 * 8} and set(stats.staging_bytes) == {"codes"}
        assert (stats.deferred_open, stats.tasks_live, stats.requests_live) == (0, 0, 0), stats


def test_a_leftover_that_requires_grad_is_snapshotted_out_of_the_graph() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        weights = torch.ones(3, requires_grad=True)
        scores = weights * 2  # part of an autograd graph
        sid = cache.save(torch.zeros(2, 2), {"scores": scores}, StepBatch(["a"], [2], np.array([0, 1])))
        kept = cache.materialize(sid, ["a"]).mm["scores"]["a"]
        assert torch.equal(kept, torch.full((3,), 2.0))
        assert not kept.requires_grad and kept.grad_fn is None


def test_leftover_is_a_snapshot_sliced_or_passed_whole() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        ref = torch.arange(10.0)
        per_tok = torch.arange(5.0) * 10  # dim 0 == n: discovered as per-token and cached
        nested = {"spk": torch.ones(2), "names": ["x", "y"], "deep": {"t": torch.zeros(3)}}
        span = Span(torch.tensor([3, 9]), "word")
        mm = {"ref": ref, "nested": nested, "count": 7, "ids": [1, 2, 3], "per_tok": per_tok, "span": span}
        sid = cache.save(torch.zeros(5, 2), mm, StepBatch(["a", "b"], [2, 3], np.array([0, 1, 4, 5, 6])))
        ref.add_(1000)  # the caller reuses its buffers after save
        nested["spk"].mul_(-1)
        nested["deep"]["t"].fill_(5)
        nested["names"].append("z")
        span.bounds.zero_()
        out = cache.materialize(sid, ["a", "b"])
        for req in ("a", "b"):
            assert torch.equal(out.mm["ref"][req], torch.arange(10.0))
            assert torch.equal(out.mm["nested"][req]["spk"], torch.ones(2))
            assert torch.equal(out.mm["nested"][req]["deep"]["t"], torch.zeros(3))
            assert out.mm["nested"][req]["names"] == ["x", "y"]
            assert out.mm["count"][req] == 7 and out.mm["ids"][req] == [1, 2, 3]
            kept = out.mm["span"][req]
            assert isinstance(kept, Span) and kept.unit == "word" and torch.equal(kept.bounds, torch.tensor([3, 9]))
        assert torch.equal(out.mm["per_tok"]["b"], torch.tensor([20.0, 30.0, 40.0]))


def test_a_leftover_passed_whole_is_one_snapshot_shared_by_the_steps_requests() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        ref, meta = torch.arange(10.0), {"lang": "en"}
        sid = cache.save(torch.zeros(5, 2), {"ref": ref, "meta": meta}, StepBatch(["a", "b"], [2, 3], np.arange(5)))
        out = cache.materialize(sid, ["a", "b"])
        snap = out.mm["ref"]["a"]
        assert snap is out.mm["ref"]["b"], "one snapshot for every request of the step"
        assert snap.data_ptr() != ref.data_ptr() and torch.equal(snap, torch.arange(10.0))
        assert out.mm["meta"]["a"] is out.mm["meta"]["b"] and out.mm["meta"]["a"] == meta


def test_padded_step_caches_only_the_scheduled_rows() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        hidden = torch.arange(8.0).reshape(8, 1).repeat(1, 2)  # 6 real rows + 2 padding rows
        codes = torch.arange(6) + 100  # a per-token mm key left unpadded on a padded step
        sid = cache.save(hidden, {"codes": codes}, StepBatch(["a"], [6], np.array([0, 1, 2, 3, 4, 5, -1, -1]), 8))
        out = cache.materialize(sid, ["a"])
        assert torch.equal(out.hidden["a"], hidden[:6])
        assert torch.equal(out.mm["codes"]["a"], codes)
        cache.flush()
        assert cache.stats().bytes_written == {"hidden": 6 * 2 * 4, "codes": 6 * 8}
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4)]))
        sid = cache.save(
            torch.full((4, 2), 9.0),
            {"codes": torch.tensor([7, 7, 0, 0])},
            StepBatch(["b"], [2], np.array([8, 9]), 4),
        )
        out = cache.materialize(sid, ["b"])
        assert torch.equal(out.hidden["b"][:4], hidden[:4])
        assert torch.equal(out.mm["codes"]["b"], torch.tensor([100, 101, 102, 103, 7, 7]))
        assert out.hidden["b"].shape == (6, 2), "never a padded or short tensor"


class _DeviceCopies:
    """Stands in for the side stream on CPU: leftover snapshots land only when the step's
    handle synchronizes its device event, as CUDA snapshots do."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def synchronize(self) -> None:
        for dst, src in self.pending:
            dst.copy_(src)
        self.pending.clear()

    def query(self) -> bool:
        return not self.pending


@pytest.mark.parametrize("policy", [CachePolicy(), CachePolicy(cache_hidden=False)], ids=["hidden", "no-cached-key"])
def test_a_device_leftover_is_read_after_its_copy_lands(monkeypatch: pytest.MonkeyPatch, policy) -> None:
    # Materialize on the saving thread before the next begin_step reads this step's rows from the
    # caller's CPU tensors, without waiting the step's copies; the leftover's device snapshot
    # must be waited all the same (it was skipped when no cached key or a CPU hidden was saved).
    from omni_pcache.copy_engine import CopyHandle, StepCopy

    device = _DeviceCopies()

    def snapshot(self, src):
        dst = torch.empty_like(src)
        device.pending.append((dst, src.clone()))
        return dst

    def finish(self):
        return CopyHandle(device if device.pending else None, None)

    monkeypatch.setattr(StepCopy, "snapshot", snapshot)
    monkeypatch.setattr(StepCopy, "finish", finish)
    with small_cache(
        policy=policy, inline_write_bytes=0
    ) as cache:  # (a step save writes itself waits its copies whole)
        gate = threading.Event()  # the committer would wait the handle too: hold it back
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda records: (gate.wait(10), write(records))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        speaker = torch.arange(6.0)
        sid = cache.save(torch.ones(4, 2), {"speaker": speaker}, StepBatch(["a"], [4], np.arange(4)))
        out = cache.materialize(sid, ["a"])
        gate.set()
        assert torch.equal(out.mm["speaker"]["a"], torch.arange(6.0))
        assert not device.pending


def test_a_leftover_that_cannot_be_copied_fails_the_save_and_holds_nothing() -> None:
    with small_cache(staging_depth=1, claim_timeout_s=0.2) as cache:
        for step in range(3):  # one staging page: a leaked hold would time the next save out
            cache.begin_step(StepEvents(new=[NewRequest(f"r{step}", [step])]))
            batch = StepBatch([f"r{step}"], [4], slots_of([step], 0, 4, BS))
            with pytest.raises(InvalidInputError, match=r"leftover mm 'handle' holds a lock, which cannot be copied"):
                cache.save(torch.zeros(4, 2), {"handle": threading.Lock()}, batch)
            stats = cache.stats()
            assert stats.steps_outstanding == [] and stats.staging_holders == [[]] and stats.tasks_live == 0
        cache.begin_step(StepEvents(new=[NewRequest("ok", [5])]))
        sid = cache.save(torch.ones(4, 2), {}, StepBatch(["ok"], [4], slots_of([5], 0, 4, BS)))
        assert torch.equal(cache.materialize(sid, ["ok"]).hidden["ok"], torch.ones(4, 2))


def test_a_leftover_that_holds_itself_is_refused_and_holds_nothing() -> None:
    cyclic: list = [torch.ones(2)]
    cyclic.append(cyclic)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match=r"leftover mm 'meta' holds itself, or is nested too deeply"):
            cache.save(torch.zeros(4, 2), {"meta": cyclic}, batch)
        assert cache.stats().steps_outstanding == []
        sid = cache.save(torch.zeros(4, 2), {"meta": [1]}, batch)
        assert cache.materialize(sid, ["a"]).mm["meta"]["a"] == [1]


def test_an_empty_leftover_in_a_step_without_tokens_does_not_become_a_key() -> None:
    # (its dim 0 is the step's 0 tokens: taken for a per-token key, every later save passing
    # the name as a leftover of another shape would be refused)
    with small_cache() as cache:
        cache.begin_step(StepEvents())
        empty = StepBatch([], [], np.zeros(0, np.int64))
        cache.discard(cache.save(torch.zeros(0, 2), {"scores": torch.zeros(0, 3)}, empty))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        scores = torch.arange(5.0)  # one per-step leftover, not per token
        sid = cache.save(torch.ones(4, 2), {"scores": scores}, StepBatch(["a"], [4], slots_of([0], 0, 4, BS)))
        assert torch.equal(cache.materialize(sid, ["a"]).mm["scores"]["a"], scores)


def test_a_key_whose_ledger_columns_fail_leaves_the_keys_before_it_unregistered() -> None:
    # "a refused save registers none of its keys": hidden states registered first, then the
    # mm key's columns fail; a corrected retry classifies the hidden states afresh.
    with small_cache() as cache:
        real, calls = cache._keys._add_key, []

        def add_key():
            calls.append(1)
            if len(calls) == 2:
                raise InvalidInputError("injected: no memory for the ledger columns")
            return real()

        cache._keys._add_key = add_key
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match=r"feat.*injected: no memory for the ledger columns"):
            cache.save(torch.zeros(4, 2), {"feat": torch.zeros(4, 3)}, batch)
        hidden = torch.arange(12.0).reshape(4, 3)  # (another width than the refused step's)
        out = cache.materialize(cache.save(hidden, {"feat": torch.zeros(4, 3)}, batch), ["a"])
        assert torch.equal(out.hidden["a"], hidden)


def test_a_step_without_tokens_classifies_nothing() -> None:
    # A step with no scheduled tokens (every mm entry then looks like a leftover) must not
    # remember its names as leftover: a later step's per-token "codes" is still cached.
    with small_cache() as cache:
        cache.begin_step(StepEvents())
        empty = cache.save(
            torch.zeros(0, 2), {"codes": torch.zeros(0, 2, dtype=torch.int64)}, StepBatch([], [], np.zeros(0, np.int64))
        )
        cache.discard(empty)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        codes = torch.arange(8).reshape(4, 2)
        cache.materialize(cache.save(torch.ones(4, 2), {"codes": codes}, StepBatch(["a"], [4], np.arange(4))), ["a"])
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1], 4)], finished=["a"]))
        sid = cache.save(
            torch.ones(1, 2), {"codes": torch.zeros(1, 2, dtype=torch.int64)}, StepBatch(["b"], [1], np.array([4]))
        )
        assert torch.equal(cache.materialize(sid, ["b"]).mm["codes"]["b"][:4], codes), "codes served from the pool"


def test_a_numpy_leftover_is_snapshotted_at_save() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        meta = np.arange(3)
        sid = cache.save(torch.ones(4, 2), {"meta": meta}, StepBatch(["a"], [4], np.arange(4)))
        meta[:] = 99  # the caller reuses its array once save returns
        cache.begin_step(StepEvents())
        assert np.array_equal(cache.materialize(sid, ["a"]).mm["meta"]["a"], np.arange(3))


class Rows(list):
    """A list subclass a caller may hand over as a leftover."""


class Interval(tuple):
    """A tuple subclass built from an iterable (not a namedtuple)."""


def test_container_subclasses_in_a_leftover_come_back_as_their_own_types() -> None:
    # An OrderedDict, a defaultdict (with its factory), a list or tuple subclass: handed back as
    # what was saved, holding copies (the caller's tensors are overwritten after save).
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        t = torch.arange(3.0)
        factory = defaultdict(list, {"x": t})
        meta = {
            "ordered": OrderedDict([("z", t), ("y", 1)]),
            "factory": factory,
            "rows": Rows([t]),
            "span": Interval([t, 2]),
        }
        sid = cache.save(torch.ones(4, 2), {"meta": meta}, StepBatch(["a"], [4], np.arange(4)))
        t.fill_(9.0)
        got = cache.materialize(sid, ["a"]).mm["meta"]["a"]
    assert type(got["ordered"]) is OrderedDict and list(got["ordered"]) == ["z", "y"]
    assert type(got["factory"]) is defaultdict and got["factory"].default_factory is list
    assert type(got["rows"]) is Rows and type(got["span"]) is Interval and got["span"][1] == 2
    for copied in (got["ordered"]["z"], got["factory"]["x"], got["rows"][0], got["span"][0]):
        assert torch.equal(copied, torch.arange(3.0))


class Spread(tuple):
    """A tuple subclass whose constructor takes its items as arguments (not an iterable)."""

    def __new__(cls, *items):
        return super().__new__(cls, items)


class Tagged(dict):
    """A dict subclass carrying an attribute of its own."""


class Boxed(tuple):
    """A tuple subclass whose constructor boxes the iterable it is given: as many items, not the same ones."""

    def __new__(cls, items):
        return super().__new__(cls, (list(items), "box"))


class Bounds(tuple):
    """A tuple subclass whose constructor takes exactly two arguments (neither an iterable nor ``*items``)."""

    def __new__(cls, low, high):
        return super().__new__(cls, (low, high))


class Frozen(dict):
    """A dict subclass that refuses item assignment (so a shallow copy of it cannot be filled)."""

    def __setitem__(self, key, value):
        raise TypeError("Frozen is read-only")


def test_container_subclasses_that_cannot_be_rebuilt_faithfully_come_back_plain() -> None:
    # A constructor of another signature would wrap the copies (Spread((a, b)) is one item),
    # and a shallow copy of an instance with attributes would share them with the caller, whose
    # tensors are overwritten after save: both come back as plain containers of copies.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        t = torch.arange(3.0)
        tagged = Tagged(x=t)
        tagged.extra = t
        # (Boxed rebuilt from the copies would box them again; Bounds cannot be called with one
        # iterable; a Frozen shallow copy cannot be filled)
        meta = {"spread": Spread(t, 2), "tagged": tagged, "boxed": Boxed([t, 2]), "bounds": Bounds(t, 5)}
        meta["frozen"] = Frozen(x=t)
        sid = cache.save(torch.ones(4, 2), {"meta": meta}, StepBatch(["a"], [4], slots_of([0], 0, 4, BS)))
        t.fill_(9.0)
        got = cache.materialize(sid, ["a"]).mm["meta"]["a"]
    assert type(got["spread"]) is tuple and len(got["spread"]) == 2 and got["spread"][1] == 2
    assert torch.equal(got["spread"][0], torch.arange(3.0))
    assert type(got["tagged"]) is dict and torch.equal(got["tagged"]["x"], torch.arange(3.0))
    assert type(got["boxed"]) is tuple and got["boxed"][1] == "box" and got["boxed"][0][1] == 2
    assert torch.equal(got["boxed"][0][0], torch.arange(3.0))
    assert type(got["bounds"]) is tuple and got["bounds"][1] == 5 and torch.equal(got["bounds"][0], torch.arange(3.0))
    assert type(got["frozen"]) is dict and torch.equal(got["frozen"]["x"], torch.arange(3.0))


Pair = namedtuple("Pair", ["first", "second"])


@pytest.mark.parametrize(
    "wrap",
    [lambda t: [torch.ones(2), t], lambda t: (torch.ones(2), t), lambda t: Pair(torch.ones(2), t)],
    ids=["list", "tuple", "namedtuple"],
)
def test_a_meta_tensor_inside_a_leftover_list_or_tuple_is_refused(wrap) -> None:
    # Each element of a list or tuple is snapshot as a value of its own: a meta tensor in one
    # is refused as it is at top level or in a dict, and the refused save holds nothing.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], np.arange(4))
        with pytest.raises(InvalidInputError, match="leftover mm 'x' holds a meta tensor"):
            cache.save(torch.ones(4, 2), {"x": wrap(torch.empty(5, device="meta"))}, batch)
        assert cache.stats().steps_outstanding == []
        step = cache.save(torch.ones(4, 2), {"x": wrap(torch.zeros(5))}, batch)
        out = cache.materialize(step, ["a"]).mm["x"]["a"]
        assert type(out) is type(wrap(torch.zeros(5))) and torch.equal(out[1], torch.zeros(5))


class _OutOfMemoryOnCopy:
    def __deepcopy__(self, memo):
        raise MemoryError("injected: no memory for the copy")


def test_running_out_of_memory_while_copying_a_leftover_raises_it_and_the_save_holds_nothing() -> None:
    # A MemoryError is not a value that cannot be copied (InvalidInputError): it propagates as
    # it is, and the leftover is never handed back as something else (None).
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], np.arange(4))
        with pytest.raises(MemoryError, match="injected"):
            cache.save(torch.ones(4, 2), {"x": _OutOfMemoryOnCopy()}, batch)
        stats = cache.stats()
        assert (stats.steps_outstanding, stats.tasks_live) == ([], 0)


def test_a_save_refused_after_its_keys_got_storage_frees_their_pool_and_staging() -> None:
    # The step's first save: its keys get pool storage and staging pages, then the save is
    # refused (cloning its rows fails, as a device allocation can): neither the pool nor the
    # staging pages of those keys are left allocated, and a retry allocates them again.
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        batch = StepBatch(["a"], [4], slots_of([0, 1], 0, 4, 4))
        clone_step = cache._deferred.clone_step

        def out_of_memory(*args):
            raise RuntimeError("injected: out of memory")

        cache._deferred.clone_step = out_of_memory
        with pytest.raises(RuntimeError, match="injected"):
            cache.save(rows(1, 0, 4), {"codes": rows(7, 0, 4)}, batch)
        stats = cache.stats()
        assert (stats.pool_bytes, stats.staging_bytes, stats.bytes_written) == ({}, {}, {}), stats
        assert (stats.steps_outstanding, stats.staging_holders) == ([], [[], [], []]), stats
        cache._deferred.clone_step = clone_step
        out = cache.materialize(cache.save(rows(1, 0, 4), {"codes": rows(7, 0, 4)}, batch), ["a"])
        assert describe(out.mm["codes"]["a"]) == describe(rows(7, 0, 4))
        assert set(cache.stats().staging_bytes) == {"hidden", "codes"}
