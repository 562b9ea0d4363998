"""The counters as a log line (`CacheStats.summary`, `StatsLog`, and the vLLM mixin's
``log_stats_interval_s``): each line counts what happened since the one before, and says what
the cache holds now."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from cachekit import slots_of, small_cache
from omni_pcache import CacheStats, ConfigError, NewRequest, PrefixCache, StepBatch, StepEvents
from omni_pcache.host_memory import size_text
from omni_pcache.stats_log import StatsLog
from vllm_replay import RECORDED, Runner, replay, scheduler_output, stage_configs, standin_types

BS = 4  # (small_cache: blocks of 4 slots)
T = standin_types()


def miss_then_hit(cache):
    """Step 1: "a" misses, 8 rows. Step 2: "b" hits a's first block (4 rows from the pool) and
    computes 2 rows. Yields after each step (its rows materialized)."""
    cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
    cache.materialize(cache.save(torch.randn(8, 4), {}, StepBatch(["a"], [8], slots_of([0, 1], 0, 8, BS))), ["a"])
    cache.flush()
    yield
    cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], num_computed_tokens=4)], finished=["a"]))
    cache.materialize(cache.save(torch.randn(2, 4), {}, StepBatch(["b"], [2], slots_of([0, 2], 4, 2, BS))), ["b"])
    cache.flush()
    yield


def test_a_summary_counts_since_an_earlier_snapshot_and_says_what_the_cache_holds() -> None:
    with small_cache() as cache:
        steps = miss_then_hit(cache)
        next(steps)
        first = cache.stats()
        next(steps)
        now = cache.stats()
        held = size_text(sum(now.pool_bytes.values()) + sum(now.staging_bytes.values()))
        assert now.summary().startswith(
            "new requests 2, prefix hits 1 (50.0%), hit rows served 4 (from the pool 100.0%, in flight 0.0%, "
            "preserved 0.0%; prefetched 0.0%), waits 0. "
        )
        assert now.summary(first).startswith("new requests 1, prefix hits 1 (100.0%), hit rows served 4 (")
        assert first.summary().startswith("new requests 1, prefix hits 0 (0.0%), hit rows served 0, waits 0. ")
        assert now.summary(now).startswith("new requests 0, prefix hits 0 (0.0%), hit rows served 0, waits 0. ")
        reserved = size_text(now.host_reserved_bytes)
        assert now.host_reserved_bytes > 0
        assert now.summary().endswith(
            f". Now: host memory {held} allocated, {reserved} reserved (budget {size_text(now.host_budget_bytes)}), "
            "live requests 1, "
            "step ids not consumed 0, writes not in the pool 0"
        )


def test_every_figure_of_a_summary_counts_since_the_earlier_snapshot() -> None:
    """Snapshots made by hand: each count is the difference, each share of the rows served is
    of this interval's rows, and what is held is the later snapshot's."""
    earlier = CacheStats(hits=1, misses=1, rows_from_pool=10, rows_prefetched=10, num_waits=1, wait_time_s=0.25)
    later = CacheStats(
        hits=4,
        misses=2,
        rows_from_pool=60,
        rows_in_flight=30,
        rows_preserved=10,
        rows_prefetched=35,
        num_waits=3,
        wait_time_s=1.0,
        pool_bytes={"hidden": 3 << 20},
        staging_bytes={"hidden": 1 << 20},
        steps_outstanding=[7, 8],
        tasks_live=5,
        device_bytes=2 << 30,
        requests_live=9,
        host_budget_bytes=16 << 30,
        host_reserved_bytes=1 << 30,
    )
    assert later.summary(earlier) == (
        "new requests 4, prefix hits 3 (75.0%), hit rows served 90 (from the pool 55.6%, in flight 33.3%, "
        "preserved 11.1%; prefetched 27.8%), waits 2 (0.750 s). Now: host memory 4.0 MiB allocated, 1.0 GiB "
        "reserved (budget 16.0 GiB), "
        "live requests 9, step ids not consumed 2, writes not in the pool 5, deferred rows on the device 2.0 GiB"
    )


def test_the_log_writes_a_line_per_interval_counting_since_the_last(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    log = StatsLog(10.0, clock=lambda: clock[0])

    def tick(at: float) -> list[str]:
        clock[0] = at
        caplog.clear()
        log.tick(cache)
        return [r.getMessage() for r in caplog.records if r.name == "omni_pcache"]

    with small_cache() as cache, caplog.at_level(logging.INFO, logger="omni_pcache"):
        steps = miss_then_hit(cache)
        next(steps)
        assert tick(105.0) == []
        (line,) = tick(110.0)
        assert line.startswith("omni_pcache: last 10.0 s: new requests 1, prefix hits 0 (0.0%), hit rows served 0")
        next(steps)
        assert tick(115.0) == []
        (line,) = tick(121.5)
        assert line.startswith("omni_pcache: last 11.5 s: new requests 1, prefix hits 1 (100.0%), hit rows served 4 (")
        (line,) = tick(131.5)
        assert line.startswith("omni_pcache: last 10.0 s: new requests 0, prefix hits 0 (0.0%), hit rows served 0")


LINE = re.compile(r"omni_pcache: last [\d.]+ s: new requests (\d+), prefix hits (\d+) ")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def vllm_log():
    """vLLM's own logging set-up in a worker: its "vllm" logger at INFO with a handler of its
    own, not propagating, and nothing set up for other loggers (``omni_pcache`` stays at the
    root's WARNING). Yields the lines that reach vLLM's handler."""
    log, handler = logging.getLogger("vllm"), Lines()
    before = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield handler.lines
    log.removeHandler(handler)
    log.level, log.propagate = before


@pytest.mark.parametrize("output", ["inline", "late"])
def test_the_vllm_output_rank_logs_its_counters_where_vllm_logs(vllm_log: list[str], output: str) -> None:
    """With ``log_stats_interval_s=0`` the output rank logs a line at every step, through
    vLLM's handler, and the lines' counts add up to the cache's; the default is every 10 s."""
    runner = replay(T, output=output, init_options={"log_stats_interval_s": 0})
    lines = [LINE.match(line) for line in vllm_log if "last" in line]
    assert len(lines) == len(RECORDED) and all(lines)
    stats = runner.pcache_stats()
    assert sum(int(m[1]) for m in lines) == stats.hits + stats.misses > stats.hits == sum(int(m[2]) for m in lines) > 0
    vllm_log.clear()
    runner = replay(T, output=output)
    assert runner._pcache_state.log_interval_s == 10.0 and runner._pcache_state.stats_log is not None
    assert not [line for line in vllm_log if "last" in line]  # (a replay takes well under 10 s)


def test_no_line_is_made_where_its_logger_does_not_show_info(vllm_log: list[str], monkeypatch) -> None:
    """With vLLM's level at WARNING the counters are not even read for a line."""
    logging.getLogger("vllm").setLevel(logging.WARNING)
    read = []
    monkeypatch.setattr(
        PrefixCache, "stats", lambda self, read=read, stats=PrefixCache.stats: read.append(1) or stats(self)
    )
    replay(T, init_options={"log_stats_interval_s": 0})
    assert read == [] and not [line for line in vllm_log if "last" in line]


def test_other_ranks_log_nothing_and_a_bad_interval_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    runner = Runner("scheduler", "inline")
    with caplog.at_level(logging.INFO, logger="omni_pcache"):
        assert runner.pcache_init(
            **stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=1, log_stats_interval_s=0
        )
        runner.pcache_begin_step(scheduler_output(T, RECORDED[0]))
    assert not [r for r in caplog.records if "last" in r.getMessage()]
    runner.pcache_shutdown()
    for bad in (-1, "10", True, float("nan")):
        with pytest.raises(ConfigError, match=r"log_stats_interval_s must be None or a number of seconds >= 0, got"):
            runner.pcache_init(
                **stage_configs(T), is_last_pipeline_stage=True, tensor_parallel_rank=0, log_stats_interval_s=bad
            )
