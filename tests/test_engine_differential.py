"""The differential harness: the engine with the cache against the same engine with prefix
caching off, over seeds and workload mixes that exercise eviction, preemption, aborts,
same-step hits, chunked prefill and one-step-late materialize on another thread.

Per request, the concatenation of its outputs across steps must equal the reference rows of
its full sequence: exactly with the prefix-hash model, within 1e-5 with the transformer.
`just soak` runs many more seeds (``OMNI_PCACHE_SOAK_SEEDS``) and prints what it checked.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from omni_pcache.engine import Engine, EngineConfig, make_workload
from omni_pcache.engine.compare import compare
from omni_pcache.engine.request import Status
from omni_pcache.prefetch import HitPrefetcher

SOAK_SEEDS = int(os.environ.get("OMNI_PCACHE_SOAK_SEEDS", "0"))
SOAK_FIRST = int(os.environ.get("OMNI_PCACHE_SOAK_FIRST", "0"))  # (later runs can go past the seeds already soaked)
CUDA_SEEDS = int(os.environ.get("OMNI_PCACHE_CUDA_SEEDS", "2"))  # `just gpu-check` runs more

# (name, engine config, workload, requests, abort rate)
SCENARIOS = [
    ("plenty-of-blocks", EngineConfig(num_blocks=512), "mixed", 60, 0.0),
    ("eviction-and-preemption", EngineConfig(num_blocks=20, max_num_batched_tokens=128), "chat", 50, 0.0),
    ("aborts", EngineConfig(num_blocks=64), "mixed", 60, 0.3),
    (
        "chunked-prefill",
        EngineConfig(num_blocks=96, long_prefill_tokens=24, max_num_batched_tokens=64),
        "fewshot",
        40,
        0.1,
    ),
    # (rows in a shuffled order of the step's requests, as vLLM's input batch reorders them)
    ("output-thread", EngineConfig(num_blocks=32, output_thread=True, shuffle_batch=True), "mixed", 60, 0.15),
    ("small-blocks", EngineConfig(num_blocks=96, block_size=4), "chat", 40, 0.1),
    # (a block size that is not a power of two: the ledger divides to find a slot's block)
    ("odd-blocks", EngineConfig(num_blocks=80, block_size=6), "fewshot", 40, 0.1),
    (
        "deferred-preemption-heavy",
        EngineConfig(num_blocks=20, max_num_batched_tokens=128, deferred_proj=True, device_budget_bytes=6000),
        "mixed",
        50,
        0.1,
    ),
    # Long prompts in chunks of 16 on a small pool: requests preempted mid-prefill resume with
    # a hit past what their consumer was given (blocks another request filled meanwhile).
    (
        "resume-past-delivered",
        EngineConfig(
            num_blocks=20, max_num_batched_tokens=128, long_prefill_tokens=16, output_thread=True, shuffle_batch=True
        ),
        "mixed",
        40,
        0.0,
    ),
    # Half the preempted requests aborted while they wait to resume, their blocks reused.
    (
        "aborts-of-preempted",
        EngineConfig(
            num_blocks=20, max_num_batched_tokens=128, deferred_proj=True, device_budget_bytes=6000, abort_preempted=0.5
        ),
        "mixed",
        50,
        0.1,
    ),
    (
        "deferred-abort-heavy",
        EngineConfig(num_blocks=40, deferred_proj=True, device_budget_bytes=10000, output_thread=True),
        "chat",
        50,
        0.4,
    ),
    # Each step id consumed right after its save (vLLM's sync scheduling): on the engine thread,
    # which reads the step's own rows from the caller's tensors before the next begin_step (every
    # step handed to the committer: one save writes itself is read from its own copies)...
    (
        "sync-consumer",
        EngineConfig(num_blocks=24, max_num_batched_tokens=96, consume_lag=0, inline_write_bytes=0),
        "chat",
        50,
        0.1,
    ),
    # ...and on the output thread, racing the next begin_step (its fence, the buffers' reuse)
    # and the committer's write of that very step.
    (
        "output-thread-at-once",
        EngineConfig(num_blocks=24, consume_lag=0, output_thread=True, shuffle_batch=True, deferred_proj=True),
        "mixed",
        50,
        0.1,
    ),
    # Each step id consumed three steps late (pipeline stages, a lagging output thread): reads
    # of blocks reused meanwhile are served from the rows kept aside for them, steps apart.
    (
        "late-consumer",
        EngineConfig(
            num_blocks=20,
            max_num_batched_tokens=128,
            long_prefill_tokens=16,
            consume_lag=3,
            output_thread=True,
            shuffle_batch=True,
        ),
        "mixed",
        40,
        0.0,
    ),
]


def run_pair(config: EngineConfig, workload: str, num_requests: int, seed: int, abort_rate: float):
    config = replace(config, seed=seed)
    cached = Engine(config).run(make_workload(workload, num_requests, seed, abort_rate=abort_rate))
    reference = Engine(replace(config, enable_prefix_caching=False, abort_preempted=0.0)).run(
        make_workload(workload, num_requests, seed)
    )
    return cached, reference


def check(config, workload, num_requests, seed, abort_rate):
    cached, reference = run_pair(config, workload, num_requests, seed, abort_rate)
    atol = 0.0 if config.model == "prefix-hash" else 1e-5
    result = compare(cached, reference, atol)  # (rows and leftovers, and the cache idle at the end)
    assert result.ok, "\n".join(result.mismatches[:10])
    assert cached.cache_stats is not None
    return cached, result


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_prefix_hash_rows_equal_the_reference_exactly(name, config, workload, num_requests, abort_rate, seed) -> None:
    config = replace(config, model="prefix-hash")
    cached, result = check(config, workload, num_requests, seed, abort_rate)
    assert result.rows_checked > 0
    if name in ("eviction-and-preemption", "deferred-preemption-heavy"):
        assert cached.evictions > 0 and cached.preemptions > 0, "the scenario must force both"
    if name == "aborts":
        assert any(r.status.value == "aborted" for r in cached.requests.values())


@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"),
    [SCENARIOS[1], SCENARIOS[4]],
    ids=[SCENARIOS[1][0], SCENARIOS[4][0]],
)
def test_transformer_rows_equal_the_reference_within_tolerance(name, config, workload, num_requests, abort_rate):
    cached, result = check(replace(config, model="transformer"), workload, 30, 7, abort_rate)
    assert 0.0 <= result.max_abs_diff <= 1e-5
    assert cached.hit_tokens > 0


@pytest.mark.parametrize("inline_copy_bytes", [None, 0], ids=["default-copies", "every-copy-handed-over"])
@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_saved_from_reused_output_buffers_equal_the_reference(
    monkeypatch, name, config, workload, num_requests, abort_rate, inline_copy_bytes
):
    # The engine copies each step's outputs into the same padded buffers, overwritten right
    # after the next begin_step: the cache must have its own copy by then. These steps are
    # small, so save copies them itself; with INLINE_COPY_BYTES=0 every copy is handed to the
    # committer and finished at the latest by the next begin_step.
    if inline_copy_bytes is not None:
        monkeypatch.setattr("omni_pcache.copy_engine.INLINE_COPY_BYTES", inline_copy_bytes)
    config = replace(config, model="prefix-hash", output_device="cpu")
    cached, result = check(config, workload, num_requests, 0, abort_rate)
    assert result.rows_checked > 0 and cached.hit_tokens > 0


@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_with_keys_found_each_step_equal_the_reference(name, config, workload, num_requests, abort_rate):
    # `CachePolicy.reclassify_each_step` (the vLLM-Omni mixin's default): "proj" is found by its
    # shape at every step, and the 1-D per-row leftover stays a leftover (its rows checked too).
    cached, result = check(
        replace(config, model="prefix-hash", reclassify_keys=True), workload, num_requests, 2, abort_rate
    )
    assert result.rows_checked > 0 and cached.hit_tokens > 0
    assert cached.cache_stats.pool_bytes.keys() == {"hidden", "proj"}


@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_returned_in_one_chunk_per_request_equal_the_reference(
    monkeypatch, name, config, workload, num_requests, abort_rate
):
    # Materialize returns slices of one tensor per key for a step's requests, in chunks of
    # OUTPUT_CHUNK_BYTES; at 1 byte every request gets a chunk of its own, so hits, misses,
    # drops of already-delivered rows, late reads and leftovers all go through chunk bounds.
    monkeypatch.setattr("omni_pcache.outputs.OUTPUT_CHUNK_BYTES", 1)
    cached, result = check(replace(config, model="prefix-hash"), workload, num_requests, 1, abort_rate)
    assert result.rows_checked > 0 and cached.hit_tokens > 0


def _prefetches_done_before_the_forward(monkeypatch) -> None:
    """Makes each begin_step wait until the committer has run the prefetch it started, so some
    hit rows come from prefetches whatever the committer's timing (left to itself, a committer
    slowed by `just test-perturbed`, or by a loaded machine, reaches a job only after the
    step's materialize has cancelled it)."""
    start = HitPrefetcher.start

    def start_and_wait(self, planned):
        start(self, planned)
        for job in {id(entry.job): entry.job for entry in self._entries.values()}.values():
            assert job.wait(30.0), "a prefetch job did not finish within 30 s"

    monkeypatch.setattr(HitPrefetcher, "start", start_and_wait)


@pytest.mark.parametrize(
    ("seed", "waited"), [(0, True), (1, False)], ids=["prefetches-waited-for", "committer-timing-as-it-comes"]
)
@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_served_from_hit_prefetches_equal_the_reference(
    monkeypatch, name, config, workload, num_requests, abort_rate, seed, waited
):
    # The committer gathers each new hit's committed rows during the forward (what a cache
    # with CUDA outputs does by itself); only rows the ledger vouches for may be served. With
    # the committer's own timing a prefetch may run during the step's writes, or be cancelled
    # by materialize; waited for, some rows must come from prefetches.
    if waited:
        _prefetches_done_before_the_forward(monkeypatch)
    config = replace(config, model="prefix-hash", prefetch_hits=True)
    cached, result = check(config, workload, num_requests, seed, abort_rate)
    assert result.rows_checked > 0 and cached.hit_tokens > 0
    if waited:
        assert cached.cache_stats.rows_prefetched > 0, "no hit row came from a prefetch"


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_from_cuda_buffers_returned_in_one_chunk_per_request_equal_the_reference(
    monkeypatch, name, config, workload, num_requests, abort_rate
):
    # As above with the step's rows (and deferred keys' clones) on the device: this step's
    # rows are copied device -> host run by run into each request's chunk.
    monkeypatch.setattr("omni_pcache.outputs.OUTPUT_CHUNK_BYTES", 1)
    config = replace(config, model="prefix-hash", output_device="cuda")
    _, result = check(config, workload, num_requests, 0, abort_rate)
    assert result.rows_checked > 0


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(CUDA_SEEDS))
@pytest.mark.parametrize(
    ("name", "config", "workload", "num_requests", "abort_rate"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_rows_saved_from_cuda_buffers_equal_the_reference(name, config, workload, num_requests, abort_rate, seed):
    # The CUDA path end to end: side-stream copies out of persistent device buffers that the
    # next step refills after a GPU delay, deferred keys cloned on the device, leftovers
    # snapshotted to the host, materialize a step late (on another thread in some scenarios).
    model = "transformer" if seed % 4 == 3 else "prefix-hash"
    config = replace(config, model=model, output_device="cuda")
    _, result = check(config, workload, num_requests, seed, abort_rate)
    assert result.rows_checked > 0


def test_a_broken_cache_is_caught_by_the_harness() -> None:
    """The harness can fail: serving a stale pool row must show up as a mismatch."""
    config = replace(SCENARIOS[0][1], model="prefix-hash")
    cached, reference = run_pair(config, "chat", 30, 3, 0.0)
    victim = next(r for r in cached.outputs.values() if r.hidden and r.hidden[0].shape[0] > 1)
    victim.hidden[0] = victim.hidden[0].flip(0)
    assert not compare(cached, reference, 0.0).ok


def test_a_nan_row_is_caught_by_the_harness() -> None:
    """NaN compares false with everything: a NaN row must still count as a mismatch."""
    config = replace(SCENARIOS[0][1], model="prefix-hash")
    cached, reference = run_pair(config, "chat", 30, 3, 0.0)
    victim = next(r for r in cached.outputs.values() if r.hidden)
    victim.hidden[0] = victim.hidden[0].clone()
    victim.hidden[0][0, 0] = float("nan")
    result = compare(cached, reference, 1e-5)
    assert len(result.mismatches) == 1 and "first bad position 0" in result.mismatches[0]
    assert result.max_abs_diff == float("inf")


@pytest.mark.skipif(SOAK_SEEDS == 0, reason="soak: run `just soak`")
def test_soak() -> None:
    requests = rows = 0
    seeds = range(SOAK_FIRST, SOAK_FIRST + SOAK_SEEDS)
    for seed in seeds:
        name, config, workload, num_requests, abort_rate = SCENARIOS[seed % len(SCENARIOS)]
        model = "transformer" if seed % 10 == 9 else "prefix-hash"
        config = replace(config, model=model, prefetch_hits=seed % 2 == 1)  # (every other seed prefetches hits)
        try:
            _, result = check(config, workload, num_requests, seed, abort_rate)
        except Exception as exc:  # (which case failed, to rerun it alone)
            case = f"seed {seed}, scenario {name!r}, model {model}, prefetch_hits={config.prefetch_hits}"
            what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            raise AssertionError(f"soak: {case}: {what}") from exc
        requests += result.requests_checked
        rows += result.rows_checked
    print(
        f"\nsoak: seeds {seeds.start}..{seeds.stop - 1} ({SOAK_SEEDS}), {requests} requests and {rows} rows checked,"
        " 0 mismatches"
    )


def test_a_request_aborted_while_it_recomputes_after_a_preemption_is_checked_on_every_row_it_got() -> None:
    # Here mi5's steps covered 32 positions; preempted, it resumed from position 0 (its blocks
    # reused meanwhile) and was aborted at 16: its consumer holds all 32 rows, and compare must
    # expect them all (what the request's saved steps covered never goes back on a resume).
    config = EngineConfig(num_blocks=20, max_num_batched_tokens=128, long_prefill_tokens=16, model="prefix-hash")
    cached, reference = run_pair(config, "mixed", 40, 4, 0.3)
    behind = [
        r
        for r, q in cached.requests.items()
        if q.status is Status.ABORTED and q.num_preemptions and q.num_computed < q.saved_upto
    ]
    assert behind, "the run must abort a request before it recomputed what its steps covered"
    result = compare(cached, reference, 0.0)
    assert result.ok, "\n".join(result.mismatches[:10])
