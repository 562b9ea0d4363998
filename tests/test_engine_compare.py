"""The differential harness can fail: each check `engine.compare` and the engine's leftover
verification make, shown to catch the wrong run it exists for (the cache's own bugs are the
differential's business; these keep its checks from weakening unnoticed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from omni_pcache.engine import Engine, EngineConfig, make_workload
from omni_pcache.engine.compare import compare
from omni_pcache.engine.engine import ROW_INFO
from omni_pcache.engine.model import ForwardBatch, PrefixHashModel, TinyTransformer
from omni_pcache.engine.request import Status

CONFIG = EngineConfig(num_blocks=512, model="prefix-hash", seed=3)
ABORTING = EngineConfig(num_blocks=64, model="prefix-hash", seed=0)


def runs(config: EngineConfig = CONFIG, workload: str = "chat", num_requests: int = 30, abort_rate: float = 0.0):
    """A cached run and its reference (prefix caching off, every request to the end)."""
    seed = config.seed
    cached = Engine(config).run(make_workload(workload, num_requests, seed, abort_rate=abort_rate))
    reference = Engine(replace(config, enable_prefix_caching=False)).run(make_workload(workload, num_requests, seed))
    assert compare(cached, reference, 0.0).ok
    return cached, reference


def test_one_value_off_in_any_key_row_or_column_fails_the_run() -> None:
    for key, step, row, column in (("proj", 0, 0, 0), ("proj", -1, -1, -1), ("hidden", -1, -1, -1)):
        cached, reference = runs()
        out = next(o for o in cached.outputs.values() if getattr(o, key)[step].shape[0] > 0)
        pieces = getattr(out, key)
        pieces[step] = pieces[step].clone()
        pieces[step][row, column] += 1
        assert not compare(cached, reference, 0.0).ok, (key, step, row, column)


def test_the_tolerance_is_atol_itself() -> None:
    cached, reference = runs()
    out = next(o for o in cached.outputs.values() if o.hidden[0].shape[0] > 0)
    out.hidden[0] = out.hidden[0] + 1e-4
    assert compare(cached, reference, 1e-3).ok and not compare(cached, reference, 1e-5).ok


def test_missing_short_and_extra_rows_fail_the_run() -> None:
    cached, reference = runs()
    del cached.outputs[next(r for r, q in cached.requests.items() if q.status is Status.FINISHED)]
    assert not compare(cached, reference, 0.0).ok
    cached, reference = runs()
    out = next(iter(cached.outputs.values()))
    out.hidden.append(out.hidden[-1][-1:])
    out.proj.append(out.proj[-1][-1:])
    assert not compare(cached, reference, 0.0).ok
    # An aborted request: one row short, or one correct row past what its saved steps covered.
    cached, reference = runs(ABORTING, "mixed", 60, 0.3)
    aborted = [
        r
        for r, q in cached.requests.items()
        if q.status is Status.ABORTED and 1 < q.saved_upto < reference.outputs[r].hidden[0].shape[0]
    ]
    assert len(aborted) >= 2
    short, extra = cached.outputs[aborted[0]], cached.outputs[aborted[-1]]
    short.hidden[-1], short.proj[-1] = short.hidden[-1][:-1], short.proj[-1][:-1]
    upto = cached.requests[aborted[-1]].saved_upto
    want_hidden, want_proj = reference.outputs[aborted[-1]].rows()
    extra.hidden.append(want_hidden[upto : upto + 1])
    extra.proj.append(want_proj[upto : upto + 1])
    mismatches = compare(cached, reference, 0.0).mismatches
    assert {m.split(":")[0] for m in mismatches} == {aborted[0], aborted[-1]}, mismatches


def test_a_cached_run_cut_short_fails_against_the_whole_reference() -> None:
    cached = Engine(replace(CONFIG, max_steps=3)).run(make_workload("chat", 30, CONFIG.seed))
    reference = Engine(replace(CONFIG, enable_prefix_caching=False)).run(make_workload("chat", 30, CONFIG.seed))
    assert any("neither finished nor aborted" in m for m in compare(cached, reference, 0.0).mismatches)


def test_rows_checked_counts_every_row_of_every_request() -> None:
    cached, reference = runs(ABORTING, "mixed", 60, 0.3)
    result = compare(cached, reference, 0.0)
    want = sum(q.full_sequence_len() if q.status is Status.FINISHED else q.saved_upto for q in cached.requests.values())
    assert result.rows_checked == want > 0


def runs_with_altered_leftover(name: str, alter):
    """A cached run whose materialize hands each request ``alter(value)`` for leftover
    ``name``, and its reference."""
    engine = Engine(CONFIG)
    materialize = engine.cache.materialize

    def altered(step_id, req_ids):
        out = materialize(step_id, req_ids)
        for req_id in req_ids:
            out.mm[name][req_id] = alter(out.mm[name][req_id])
        return out

    engine.cache.materialize = altered
    cached = engine.run(make_workload("chat", 30, CONFIG.seed))
    reference = Engine(replace(CONFIG, enable_prefix_caching=False)).run(make_workload("chat", 30, CONFIG.seed))
    return cached, reference


@pytest.mark.parametrize(
    "alter",
    [
        lambda info: {**info, "rows_per_request": info["rows_per_request"] + 1},  # a tensor entry
        lambda info: {**info, "num_requests": info["num_requests"] + 1},  # a plain value
        lambda info: {k: v for k, v in info.items() if k != "num_requests"},  # an entry missing
    ],
    ids=["tensor", "value", "missing"],
)
def test_a_leftover_unequal_to_the_models_is_counted_and_fails_the_run(alter) -> None:
    cached, reference = runs_with_altered_leftover("step_info", alter)
    assert all(o.leftover_wrong == o.leftover_seen > 0 for o in cached.outputs.values())
    assert not compare(cached, reference, 0.0).ok


@pytest.mark.parametrize(
    "alter",
    [lambda rows: rows + 1, lambda rows: rows[1:], lambda rows: torch.cat([rows, rows[-1:] + 1])],
    ids=["shifted", "short", "long"],
)
def test_a_per_row_leftover_not_ending_with_the_returned_positions_fails_the_run(alter) -> None:
    # The engine's per-row leftover (each row's position) must hold exactly this step's rows
    # the cached keys returned: the positions the request's returned rows end with.
    cached, reference = runs_with_altered_leftover(ROW_INFO, lambda rows: alter(rows) if rows.shape[0] else rows)
    assert any(o.leftover_wrong for o in cached.outputs.values())
    assert not compare(cached, reference, 0.0).ok


def test_every_prefix_hash_row_depends_on_the_whole_prefix() -> None:
    # (what makes a row served from another request's prefix show: both runs use this model)
    def forward(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(tokens)
        batch = ForwardBatch(
            torch.tensor(tokens), torch.arange(n), np.arange(n, dtype=np.int64), [(0, n, [0, 1, 2, 3], n)]
        )
        out = PrefixHashModel(64, 16).forward(batch)
        return out.hidden, out.mm["proj"]

    tokens = list(range(5, 45))
    hidden, proj = forward(tokens)
    other_hidden, other_proj = forward([6, *tokens[1:]])  # only token 0 differs
    assert ((hidden != other_hidden).any(1) & (proj != other_proj).any(1)).all()


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        ("staging_holders", [[("step", 7)], []], "1 staging pages held"),
        ("steps_outstanding", [7], "1 step ids outstanding"),
        ("tasks_live", 2, "2 write tasks live"),
        ("preserved_entries", 3, "3 preserved rows kept"),
        ("reads_pending", 146, "146 hit reads pending"),
        ("requests_live", 1, "1 requests live"),
        ("device_bytes", 64, "64 device bytes held"),
        ("deferred_open", 1, "1 deferred records open"),
    ],
)
def test_a_cache_not_idle_at_the_end_fails_the_run(field, value, line) -> None:
    # (the demo compares with `compare` alone: a leak of reads or pages made it print PASS)
    cached, reference = runs()
    cached.cache_stats = replace(cached.cache_stats, **{field: value})
    result = compare(cached, reference, 0.0)
    assert result.mismatches == [f"cache not idle at the end: {line}"]


def test_cache_counters_that_disagree_with_the_engine_fail_the_run() -> None:
    cached, reference = runs()
    stats = cached.cache_stats
    assert cached.new_hits > 0 and cached.prefix_rows_returned > 0, "the run must have hits"
    assert (stats.hits, stats.misses) == (cached.new_hits, cached.new_misses)
    assert compare(cached, reference, 0.0).ok
    cached.cache_stats = replace(stats, misses=stats.misses + 1)  # (a resumed request counted as new)
    assert compare(cached, reference, 0.0).mismatches == [
        f"cache counted {stats.hits} hits / {stats.misses + 1} misses; the scheduler admitted "
        f"{cached.new_hits} new requests with a prefix hit / {cached.new_misses} without"
    ]
    cached.cache_stats = replace(stats, rows_preserved=stats.rows_preserved + 2)  # (one row, both keys)
    [line] = compare(cached, reference, 0.0).mismatches
    assert line.endswith(
        f"materialize returned {cached.prefix_rows_returned} rows ahead of their steps' own, for 2 cached keys"
    )
    pool_or_in_flight = stats.rows_from_pool + stats.rows_in_flight
    cached.cache_stats = replace(stats, rows_prefetched=pool_or_in_flight + 1)
    assert compare(cached, reference, 0.0).mismatches == [
        f"cache counted {pool_or_in_flight + 1} hit rows served from prefetches, more than the "
        f"{pool_or_in_flight} it served from the pool and in-flight writes"
    ]
    # (a preserved copy is never a prefetch's: rows moved from the pool to preserved copies, the
    # same total, leave fewer a prefetch may have served)
    cached.cache_stats = replace(
        stats,
        rows_from_pool=stats.rows_from_pool - 2,
        rows_preserved=stats.rows_preserved + 2,
        rows_prefetched=pool_or_in_flight,
    )
    assert compare(cached, reference, 0.0).mismatches == [
        f"cache counted {pool_or_in_flight} hit rows served from prefetches, more than the "
        f"{pool_or_in_flight - 2} it served from the pool and in-flight writes"
    ]


def test_rows_of_another_dtype_fail_the_run_even_when_equal_in_value() -> None:
    cached, reference = runs()
    out = next(o for o in cached.outputs.values() if o.proj[0].shape[0] > 0)
    out.proj[0] = out.proj[0].double()  # (compared as doubles, the values are the same)
    result = compare(cached, reference, 0.0)
    assert len(result.mismatches) == 1 and "rows of torch.float32 / torch.float64" in result.mismatches[0]


@pytest.mark.parametrize("scribble", [True, False])
def test_returned_rows_that_share_the_caches_storage_fail_the_run(monkeypatch, scribble) -> None:
    # The engine overwrites every row tensor it is handed (keeping a copy). A materialize that
    # handed out views of the cache's own storage instead of copies (here: of the deferred
    # key's device clone, which is written to the pool when its request finishes) then has
    # later hits serve the overwritten rows; without the overwrite the run would pass.
    from omni_pcache import outputs
    from omni_pcache.deferred import Clone

    clones: set[int] = set()  # the clones' storages
    make_clone, copy = Clone.of, outputs.host_copy

    def of(cls, rows, holders, budget):
        clone = make_clone(rows, holders, budget)
        clones.add(clone.tensor.untyped_storage().data_ptr())
        return clone

    monkeypatch.setattr(Clone, "of", classmethod(of))
    monkeypatch.setattr(
        outputs, "host_copy", lambda rows: rows if rows.untyped_storage().data_ptr() in clones else copy(rows)
    )
    monkeypatch.setattr(Engine, "verify_leftovers", scribble)
    config = replace(CONFIG, deferred_proj=True)
    cached = Engine(config).run(make_workload("chat", 30, config.seed))
    reference = Engine(replace(config, enable_prefix_caching=False)).run(make_workload("chat", 30, config.seed))
    result = compare(cached, reference, 0.0)
    assert result.ok is not scribble, result.mismatches[:3]


def logged_calls(engine: Engine) -> list[tuple[str, int]]:
    """The engine's cache calls from now on, as ("save" or "materialize", step id) in order."""
    log: list[tuple[str, int]] = []
    save, materialize = engine.cache.save, engine.cache.materialize

    def logged_save(*args):
        step_id = save(*args)
        log.append(("save", step_id))
        return step_id

    def logged_materialize(step_id, req_ids):
        log.append(("materialize", step_id))
        return materialize(step_id, req_ids)

    engine.cache.save, engine.cache.materialize = logged_save, logged_materialize
    return log


def test_steps_consumed_at_once_are_materialized_right_after_their_save() -> None:
    config = EngineConfig(num_blocks=24, max_num_batched_tokens=96, consume_lag=0, inline_write_bytes=0)
    engine = Engine(replace(config, model="prefix-hash"))
    assert engine.cache is not None and engine.cache.config.inline_write_bytes == 0
    log = logged_calls(engine)
    engine.run(make_workload("chat", 10, 0))
    saves = [i for i, (call, _) in enumerate(log) if call == "save"]
    assert saves and all(log[i + 1] == ("materialize", log[i][1]) for i in saves), log[:6]


def test_steps_consumed_three_late_keep_three_ids_outstanding() -> None:
    config = replace(CONFIG, consume_lag=3)
    cached, _ = runs(config)
    assert cached.cache_stats is not None and cached.cache_stats.steps_outstanding == []
    with pytest.raises(ValueError, match="consume_lag must be from 0 to the cache's staging_depth - 1, got 4"):
        Engine(replace(CONFIG, consume_lag=4))


# ---- checks a second mutation audit found untested ----------------------------------------------


@pytest.mark.parametrize("lag", [1, 3])
def test_each_step_is_materialized_after_consume_lag_later_saves(lag) -> None:
    engine = Engine(replace(CONFIG, consume_lag=lag))
    log = logged_calls(engine)
    engine.run(make_workload("chat", 10, 0))
    saves = [step_id for call, step_id in log if call == "save"]
    assert [step_id for call, step_id in log if call == "materialize"] == saves
    saved_before = [
        sum(call == "save" for call, _ in log[:i]) for i, (call, _) in enumerate(log) if call == "materialize"
    ]
    assert saved_before == [min(k + 1 + lag, len(saves)) for k in range(len(saves))]


def test_a_leftover_off_the_host_is_counted_and_fails_the_run() -> None:
    cached, reference = runs_with_altered_leftover(
        "step_info", lambda info: {**info, "on_device": torch.empty(1, device="meta")}
    )
    assert all(o.leftover_off_host == o.leftover_seen > 0 for o in cached.outputs.values())
    cached, reference = runs()
    req_id, out = next(iter(cached.outputs.items()))
    out.leftover_off_host = 1  # (every leftover equal to the model's)
    assert compare(cached, reference, 0.0).mismatches == [
        f"{req_id}: 0 leftovers unequal to the model's, 1 not on the host (of {out.leftover_seen})"
    ]


def test_a_diff_of_exactly_atol_passes() -> None:
    cached, reference = runs()
    out = next(o for o in cached.outputs.values() if o.hidden[0].shape[0] > 0)
    out.hidden[0] = out.hidden[0] + 0.25  # (exact: the prefix-hash rows are multiples of 2**-16 below 1)
    assert compare(cached, reference, 0.25).ok and not compare(cached, reference, 0.2).ok


def test_proj_rows_short_of_the_hidden_rows_fail_the_run() -> None:
    cached, reference = runs()
    req_id, out = next((r, o) for r, o in cached.outputs.items() if sum(p.shape[0] for p in o.proj) > 2)
    hidden, proj = out.rows()
    out.hidden, out.proj = [hidden], [proj[:-1]]
    [line] = compare(cached, reference, 0.0).mismatches
    assert line.startswith(f"{req_id}: ") and "proj rows" in line


def test_an_aborted_request_whose_saved_steps_covered_rows_must_have_returned_them() -> None:
    cached, reference = runs(ABORTING, "mixed", 60, 0.3)
    req_id = next(r for r, q in cached.requests.items() if q.status is Status.ABORTED and q.saved_upto > 0)
    del cached.outputs[req_id]
    assert compare(cached, reference, 0.0).mismatches == [f"{req_id}: aborted but no rows were returned"]


def test_a_request_without_reference_rows_fails_the_run() -> None:
    cached, reference = runs()
    req_id = next(iter(cached.requests))
    del reference.outputs[req_id]
    assert compare(cached, reference, 0.0).mismatches == [f"{req_id}: no reference rows"]


def test_a_request_the_cached_run_lost_fails_the_run() -> None:
    cached, reference = runs()
    req_id = next(iter(cached.requests))
    del cached.requests[req_id]
    cached.outputs.pop(req_id, None)
    assert compare(cached, reference, 0.0).mismatches == [
        f"1 requests of the reference missing from the cached run: [{req_id!r}]"
    ]


def test_a_run_cut_short_names_every_request_left_running_or_waiting() -> None:
    cached = Engine(replace(CONFIG, max_steps=3)).run(make_workload("chat", 30, CONFIG.seed))
    reference = Engine(replace(CONFIG, enable_prefix_caching=False)).run(make_workload("chat", 30, CONFIG.seed))
    left = {r: q.status for r, q in cached.requests.items() if not q.is_done}
    assert Status.RUNNING in left.values() and Status.WAITING in left.values()
    cut = {m.split(":")[0] for m in compare(cached, reference, 0.0).mismatches if "neither finished nor aborted" in m}
    assert cut == set(left)


def test_requests_checked_counts_every_request() -> None:
    cached, reference = runs(ABORTING, "mixed", 60, 0.3)
    # (every request that returned rows, aborted ones included)
    assert any(q.status is Status.ABORTED for r, q in cached.requests.items() if r in cached.outputs)
    assert compare(cached, reference, 0.0).requests_checked == len(cached.outputs) > 0


def test_the_first_bad_position_is_the_first_row_that_differs() -> None:
    cached, reference = runs()
    req_id, out = next((r, o) for r, o in cached.outputs.items() if sum(h.shape[0] for h in o.hidden) > 6)
    hidden, proj = out.rows()
    hidden[[2, 5], 0] += 1
    out.hidden, out.proj = [hidden], [proj]
    [line] = compare(cached, reference, 0.0).mismatches
    assert line.startswith(f"{req_id}: ") and line.endswith("first bad position 2)")


def test_each_steps_leftover_holds_its_batchs_row_counts() -> None:
    # (what tells one step's leftover from another's: a leftover handed to the wrong step shows)
    slots = np.array([0, 1, 2, 16, 17, 18, 19], dtype=np.int64)
    batch = ForwardBatch(
        torch.arange(1, 8), torch.tensor([0, 1, 2, 0, 1, 2, 3]), slots, [(0, 3, [0], 3), (3, 4, [1], 4)]
    )
    for model in (PrefixHashModel(64, 16), TinyTransformer(64, 16)):
        info = model.forward(batch).mm["step_info"]
        assert info["num_requests"] == 2 and info["rows_per_request"].tolist() == [3, 4]
