"""A small device→host copy check for `just gpu-check`: a raw pinned non-blocking copy of a
bf16 step against the cache's whole step on the same bytes (``save_step_gbps``: begin_step,
save, its device→host copy, discard, and the committer's pool write awaited by ``flush``, so a
second, host-side copy is in it), and the engine thread's time in ``save`` alone. For the save
path's own copy bandwidth see `benches/gpu.py` (CUDA events around its side-stream copies).
Prints one line per size and writes benches/results/copy_check.json (``--out``), with the
machine, device and command. Times are medians of wall-clock per step."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from omni_pcache import CacheConfig, NewRequest, PrefixCache, StepBatch, StepEvents

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write


def median_time(fn, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(tokens: int, width: int = 2048) -> dict[str, float]:
    """One size: raw pinned copy vs the cache's whole step (pool write included) for a bf16 step
    of ``tokens`` rows, and the median engine-thread time of its ``save`` calls."""
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16, device="cuda")
    nbytes = hidden.numel() * hidden.element_size()
    pinned = torch.empty(tokens, width, dtype=torch.bfloat16, pin_memory=True)
    raw = median_time(lambda: pinned.copy_(hidden, non_blocking=True))
    blocks_per_step = tokens // 16
    config = CacheConfig(num_blocks=4096, block_size=16, staging_depth=4, staging_capacity_tokens=8192)
    engine_s: list[float] = []
    counter = iter(range(10**9))
    with PrefixCache(config) as cache:

        def one_step() -> None:
            i = next(counter)
            first_block = (i * blocks_per_step) % (4096 - blocks_per_step)
            blocks = list(range(first_block, first_block + blocks_per_step))
            cache.begin_step(StepEvents(new=[NewRequest(f"r{i}", blocks)], finished=[f"r{i - 1}"]))
            slots = (np.asarray(blocks)[:, None] * 16 + np.arange(16)).reshape(-1)
            t0 = time.perf_counter()
            sid = cache.save(hidden, {}, StepBatch([f"r{i}"], [tokens], slots))
            engine_s.append(time.perf_counter() - t0)
            cache.discard(sid)
            cache.flush()

        one_step()  # allocates the pool and the pinned staging pages
        engine_s.clear()
        step = median_time(one_step)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "raw_pinned_copy_gbps": nbytes / raw / 1e9,
        "save_step_gbps": nbytes / step / 1e9,
        "engine_thread_save_us": statistics.median(engine_s) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "copy_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_check: no CUDA device; nothing to measure")
        return 0
    results = []
    for tokens in (512, 2048, 8192):
        row = measure(tokens)
        results.append(row)
        print(
            f"{tokens:>5} tokens: raw pinned copy {row['raw_pinned_copy_gbps']:.1f} GB/s, "
            f"whole save step (pool write included) {row['save_step_gbps']:.1f} GB/s, "
            f"engine-thread save {row['engine_thread_save_us']:.0f} us"
        )
    doc = {
        "bench": "copy_check",
        "machine": machine(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": command(),
        "results": results,
    }
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
