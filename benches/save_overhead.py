"""Engine-thread cost of the cache on CPU: begin_step + save bookkeeping for 8 requests x 64
tokens (with the pool write on the committer, and with the default that writes a step this
small inside save), a large save against one memcpy of the same bytes, and decode steps of
64 and 256 live requests x 1 token (begin_step + save, and materialize).

Run: `.venv/bin/python benches/save_overhead.py` (or `just bench-py`). Prints a table and
writes benches/results/save_overhead.json. Medians over many steps; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from _common import command, machine, write
from omni_pcache import CacheConfig, NewRequest, PrefixCache, StepBatch, StepEvents

BLOCK = 16


# A layer's worth of activations and weights (~6 MiB): more than a core's L2 holds (1 MiB on
# the project's VM), as a real forward's working set is; less than its 32 MiB L3, which a
# large model's forward sweeps too.
_ACTIVATIONS = torch.randn(256, 1024)
_WEIGHTS = torch.randn(1024, 1024)


def busy_forward(ms: float) -> None:
    """Stands in for the forward pass: torch work that keeps the core busy and releases the
    GIL (as a real forward does), so the committer can run meanwhile, and that sweeps more
    memory than a core's L2 holds (not the L3), so the cache's calls after it run out of L1
    and L2, as they do after a real forward."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        torch.mm(_ACTIVATIONS, _WEIGHTS)


def engine_thread_step_us(
    num_reqs: int,
    tokens: int,
    width: int,
    dtype: torch.dtype,
    steps: int,
    forward_ms: float = 0.0,
    inline_write_bytes: int | None = None,
) -> float:
    """Median µs of begin_step + save per step (materialize runs on the same thread but is not
    timed); every other step's new requests hit the previous step's blocks. ``forward_ms`` of
    torch work per step stands in for the forward pass, during which a real engine thread
    leaves the GIL to the committer. ``inline_write_bytes``: the config's (None: default)."""
    blocks_per_req = tokens // BLOCK
    num_blocks = 4096
    config = CacheConfig(num_blocks=num_blocks, block_size=BLOCK, staging_depth=4, staging_capacity_tokens=8192)
    if inline_write_bytes is not None:
        config = dataclasses.replace(config, inline_write_bytes=inline_write_bytes)
    hidden = torch.randn(num_reqs * tokens, width).to(dtype)
    times = []
    with PrefixCache(config) as cache:
        prev: list[tuple[str, list[int]]] = []
        for step in range(steps):
            base = (step * num_reqs * blocks_per_req) % (num_blocks - num_reqs * blocks_per_req)
            reqs = []
            new = []
            for r in range(num_reqs):
                blocks = list(range(base + r * blocks_per_req, base + (r + 1) * blocks_per_req))
                req_id = f"s{step}r{r}"
                hit = 0
                if prev and r % 2 == 0:  # half the requests hit their predecessor's first block
                    blocks = [prev[r][1][0], *blocks[1:]]
                    hit = BLOCK
                new.append(NewRequest(req_id, blocks, hit))
                reqs.append((req_id, blocks, hit))
            slots = np.concatenate(
                [
                    (np.asarray(b)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[h : h + tokens - h]
                    for _, b, h in reqs
                ]
            )
            counts = [tokens - h for _, _, h in reqs]
            n = sum(counts)
            events = StepEvents(new=new, finished=[r for r, _ in prev])
            batch = StepBatch([r for r, _, _ in reqs], counts, slots)
            if forward_ms:
                busy_forward(forward_ms)
            t0 = time.perf_counter()
            cache.begin_step(events)
            sid = cache.save(hidden[:n], {}, batch)
            times.append(time.perf_counter() - t0)
            cache.materialize(sid, [r for r, _, _ in reqs])
            prev = [(r, b) for r, b, _ in reqs]
        cache.flush()
    return statistics.median(times[steps // 10 :]) * 1e6


def decode_step_us(
    num_reqs: int, width: int, dtype: torch.dtype, steps: int, forward_ms: float = 0.0, device: str = "cpu"
) -> tuple[float, float]:
    """Median µs per decode step of ``num_reqs`` live requests, one token each: begin_step +
    save, and materialize of the step (same thread, right after). The requests are prefilled
    with one block each first; every decode step is an empty `StepEvents` (nothing new or
    finished), as in a steady decode phase. Two rounds of requests decode over the same blocks,
    the second (new tenants of the first's blocks, as in a server) measured: its rows land on
    pool pages written before, not on fresh pages that fault in on first touch. ``device``:
    where the step's rows are (benches/gpu.py passes "cuda")."""
    blocks_per_req = -(-(BLOCK + steps) // BLOCK)
    config = CacheConfig(
        num_blocks=num_reqs * blocks_per_req,
        block_size=BLOCK,
        staging_depth=4,
        staging_capacity_tokens=num_reqs * BLOCK,
    )
    tables = np.arange(num_reqs * blocks_per_req, dtype=np.int64).reshape(num_reqs, blocks_per_req)
    hidden = torch.randn(num_reqs * BLOCK, width).to(dtype).to(device)
    save_s, materialize_s = [], []
    with PrefixCache(config) as cache:
        finished: list[str] = []
        for round_ in ("warmup", "measured"):
            ids = [f"{round_}{i}" for i in range(num_reqs)]
            new = [NewRequest(r, tables[i].tolist()) for i, r in enumerate(ids)]
            cache.begin_step(StepEvents(new=new, finished=finished))
            prefill = (tables[:, :1] * BLOCK + np.arange(BLOCK)).reshape(-1)
            cache.materialize(cache.save(hidden, {}, StepBatch(ids, [BLOCK] * num_reqs, prefill)), ids)
            for pos in range(BLOCK, BLOCK + steps):
                slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
                batch = StepBatch(ids, [1] * num_reqs, slots)
                if forward_ms:
                    busy_forward(forward_ms)
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                cache.begin_step(StepEvents())
                sid = cache.save(hidden[:num_reqs], {}, batch)
                t1 = time.perf_counter()
                cache.materialize(sid, ids)
                t2 = time.perf_counter()
                if round_ == "measured":
                    save_s.append(t1 - t0)
                    materialize_s.append(t2 - t1)
            finished = ids
        cache.flush()
    skip = steps // 10
    return statistics.median(save_s[skip:]) * 1e6, statistics.median(materialize_s[skip:]) * 1e6


def memcpy_us(tokens: int, width: int, dtype: torch.dtype, repeat: int = 30) -> float:
    src = torch.randn(tokens, width).to(dtype)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per case (smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="steps per case (default 300; quick 12)")
    parser.add_argument(
        "--forward-ms", type=float, default=0.0, help="torch work per step standing in for the forward (GIL released)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "save_overhead.json")
    args = parser.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 300)
    torch.set_num_threads(1)
    rows = []
    for label, width, dtype, inline_write_bytes in (
        # the committer writes the pool: what save itself costs
        ("bookkeeping (width 64 fp32)", 64, torch.float32, 0),
        # the default: a step this small (128 KiB) is written to the pool inside save
        ("width 64 fp32, pool write in save", 64, torch.float32, None),
        ("bf16 width 2048", 2048, torch.bfloat16, None),
    ):
        us = engine_thread_step_us(8, 64, width, dtype, args.steps, args.forward_ms, inline_write_bytes)
        rows.append({"case": f"8 req x 64 tok, {label}", "engine_thread_us": us})
    big_steps = 3 if args.quick else max(20, args.steps // 10)
    big = engine_thread_step_us(1, 8192, 2048, torch.bfloat16, big_steps, args.forward_ms)
    copy = memcpy_us(8192, 2048, torch.bfloat16, repeat=3 if args.quick else 30)
    rows.append({"case": "1 req x 8192 tok, bf16 width 2048", "engine_thread_us": big, "memcpy_us": copy})
    for num_reqs in (64, 256):
        decode_steps = 4 if args.quick else max(40, args.steps // 3)
        us, materialize = decode_step_us(num_reqs, 2048, torch.bfloat16, decode_steps, args.forward_ms)
        rows.append(
            {
                "case": f"decode {num_reqs} req x 1 tok, bf16 width 2048",
                "engine_thread_us": us,
                "materialize_us": materialize,
            }
        )
    for row in rows:
        extra = (
            f"  (one memcpy {row['memcpy_us']:.0f} us, ratio {row['engine_thread_us'] / row['memcpy_us']:.2f}x)"
            if "memcpy_us" in row
            else ""
        )
        if "materialize_us" in row:
            extra = f"  materialize {row['materialize_us']:>7.1f} us"
        print(f"{row['case']:<52} begin_step+save {row['engine_thread_us']:>9.1f} us{extra}")
    write(
        args.out,
        {
            "bench": "save_overhead",
            "machine": machine(),
            "torch_threads": torch.get_num_threads(),
            "command": command(),
            "quick": args.quick,
            "forward_ms": args.forward_ms,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
