"""How far the cache's calls are from the fewest torch calls that do a step's work, when they
run cold after a forward pass.

The step is the embedded engine's 0%-hit step (benches/engine.py's ``random`` workload): 16
new requests x 6 tokens, hidden width 64 fp32 plus one per-token mm key of width 4, on a KV
cache of 512 blocks of 16; every request finishes at the next step and its block goes to a
later one. Each step first runs ``--forward-ms`` of torch work over ~6 MiB, more than a core's
L2 holds (`save_overhead.busy_forward`), as a forward does, then times on the same
thread:

- ``cache``: begin_step + save + materialize of the step before (one step late, as the engine
  does), i.e. what the engine thread spends in the cache per step;
- ``fewest_torch_calls``: the same work in the fewest torch calls — per key, scatter the
  step's rows into a pool tensor at their slots (``index_copy_``), copy them out and split the
  copy into per-request views — with no bookkeeping at all (no hit could ever be served);
- ``views_only``: the per-request views alone, what an engine without the cache hands out.

With ``--forward-ms 0`` the same calls run hot, back to back. The gap between ``cache`` and
``fewest_torch_calls`` is the bookkeeping and the extra calls; ``fewest_torch_calls`` itself is
a floor no cache that returns copies can go under.

Run: ``.venv/bin/python benches/cold_floor.py`` (``--quick``: a few steps). Writes
benches/results/cold_floor.json. Medians; nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write
from omni_pcache import CacheConfig, NewRequest, PrefixCache, StepBatch, StepEvents
from save_overhead import busy_forward

BLOCK = 16
NUM_BLOCKS = 512
REQUESTS = 16
TOKENS = 6
HIDDEN_WIDTH = 64
PROJ_WIDTH = 4


def step_inputs(step: int) -> tuple[list[str], list[list[int]], np.ndarray, torch.Tensor, torch.Tensor]:
    """Step ``step``'s request ids, block tables, slot mapping and rows (one fresh block each)."""
    req_ids = [f"s{step}r{r}" for r in range(REQUESTS)]
    blocks = [[(step * REQUESTS + r) % NUM_BLOCKS] for r in range(REQUESTS)]
    slots = np.concatenate([b[0] * BLOCK + np.arange(TOKENS) for b in blocks]).astype(np.int64)
    n = REQUESTS * TOKENS
    hidden = torch.full((n, HIDDEN_WIDTH), float(step)) + torch.arange(n, dtype=torch.float32)[:, None]
    proj = torch.full((n, PROJ_WIDTH), -float(step))
    return req_ids, blocks, slots, hidden, proj


def run_cache(steps: int, forward_ms: float) -> list[float]:
    """Seconds per step in begin_step + save + materialize (one step late); checks the rows."""
    config = CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, staging_capacity_tokens=256)
    times = []
    with PrefixCache(config) as cache:
        previous: tuple[int, list[str], torch.Tensor] | None = None
        finished: list[str] = []
        for step in range(steps):
            req_ids, blocks, slots, hidden, proj = step_inputs(step)
            events = StepEvents(new=[NewRequest(r, b) for r, b in zip(req_ids, blocks, strict=True)], finished=finished)
            batch = StepBatch(req_ids, [TOKENS] * REQUESTS, slots)
            busy_forward(forward_ms)
            start = time.perf_counter()
            cache.begin_step(events)
            step_id = cache.save(hidden, {"proj": proj}, batch)
            out = cache.materialize(previous[0], previous[1]) if previous else None
            times.append(time.perf_counter() - start)
            if out is not None:
                assert previous is not None
                got = torch.cat([out.hidden[r] for r in previous[1]])
                assert torch.equal(got, previous[2]), f"step {step - 1}: materialized rows differ"
            previous, finished = (step_id, req_ids, hidden), req_ids
        if previous is not None:
            cache.discard(previous[0])
    return times


def run_fewest(steps: int, forward_ms: float, copy: bool = True) -> list[float]:
    """Seconds per step in the fewest torch calls that write the pool and return copies
    (``copy``), or in the per-request views alone."""
    pools = {
        "hidden": torch.zeros(NUM_BLOCKS * BLOCK, HIDDEN_WIDTH),
        "proj": torch.zeros(NUM_BLOCKS * BLOCK, PROJ_WIDTH),
    }
    counts = [TOKENS] * REQUESTS
    times = []
    for step in range(steps):
        _, _, slots, hidden, proj = step_inputs(step)
        rows = {"hidden": hidden, "proj": proj}
        busy_forward(forward_ms)
        start = time.perf_counter()
        if copy:
            index = torch.from_numpy(slots)
            out = {}
            for name, value in rows.items():
                pools[name].index_copy_(0, index, value)
                out[name] = torch.split_with_sizes(value.clone(), counts)
        else:
            out = {name: torch.split_with_sizes(value, counts) for name, value in rows.items()}
        times.append(time.perf_counter() - start)
        assert torch.equal(torch.cat(out["hidden"]), hidden)
    return times


def median_us(times: list[float]) -> float:
    return statistics.median(times[len(times) // 10 :]) * 1e6


def measure(steps: int, forward_ms: float, rounds: int) -> dict[str, Any]:
    """Median µs per step of each variant, alternating them ``rounds`` times."""
    runners: dict[str, Callable[[], list[float]]] = {
        "cache": lambda: run_cache(steps, forward_ms),
        "fewest_torch_calls": lambda: run_fewest(steps, forward_ms),
        "views_only": lambda: run_fewest(steps, forward_ms, copy=False),
    }
    per_round: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            per_round[name].append(median_us(run()))
    row: dict[str, Any] = {"forward_ms": forward_ms, "steps": steps, "rounds": rounds}
    for name, values in per_round.items():
        row[name] = {"us_per_step": statistics.median(values), "rounds_us": values}
    row["cache_over_fewest"] = row["cache"]["us_per_step"] / row["fewest_torch_calls"]["us_per_step"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, one round (smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 400)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    parser.add_argument("--forward-ms", type=float, action="append", default=None, help="default: 5 and 0")
    parser.add_argument("--out", type=Path, default=RESULTS / "cold_floor.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (12 if args.quick else 400)
    rounds = args.rounds or (1 if args.quick else 3)
    results = []
    for forward_ms in args.forward_ms or [5.0, 0.0]:
        row = measure(steps, forward_ms, rounds)
        results.append(row)
        print(
            f"forward {forward_ms:g} ms: cache {row['cache']['us_per_step']:.0f} us per step, "
            f"fewest torch calls {row['fewest_torch_calls']['us_per_step']:.0f} us "
            f"({row['cache_over_fewest']:.1f}x), views only {row['views_only']['us_per_step']:.0f} us",
            flush=True,
        )
    shape = {"requests": REQUESTS, "tokens_per_request": TOKENS, "hidden_width": HIDDEN_WIDTH, "proj_width": PROJ_WIDTH}
    write(
        args.out,
        {
            "bench": "cold_floor",
            "machine": machine(),
            "torch_threads": torch.get_num_threads(),
            "command": command(),
            "quick": args.quick,
            "step": shape,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
