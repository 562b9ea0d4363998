"""The GPU check's benchmark (``bash scripts/gpu_check.sh``): the save path on a CUDA device.

Uses step_overhead.py's workload (block 16, 4,096 blocks, 8 requests per step, half hitting
512-token shared prefixes, bf16 hidden width 2,048 + one fp32 per-token mm key width 128) with
the step's rows on the GPU, at 512, 2,048 and 8,192 tokens per step:

1. device→host GB/s of the save path (``save`` until its side-stream copy has landed, i.e.
   ``save(); torch.cuda.synchronize()``, wall clock) vs a raw pinned ``copy_(non_blocking=True)``
   of the same bytes (goal ≥ 90%); and the same two in device time (CUDA timing events around
   the save's side-stream copies, and around the raw copy), which leaves out save's host-side
   bookkeeping;
2. engine-thread time per step: ``save`` alone and ``begin_step + save`` (goal: save ≤ 50 µs
   at every size; it only launches the copy);
3. cache on vs off at 0% hits: per-step wall of a GPU stand-in forward (a 24-layer width-2,048
   transformer's bf16 matmuls, ~1.2B parameters' worth; `stand_in_forward`) plus
   output delivery — off: the step's rows copied to host for the output path; on:
   ``begin_step`` + forward + ``save`` + ``materialize`` of the previous step (one step late,
   as an async output path does). Same rows, no request hits;
4. decode steps of 64 and 256 live requests x 1 token (save_overhead's `decode_step_us` with
   the rows on the GPU): engine-thread begin_step + save, and materialize.

The save-path steps (1 and 2) are materialized and checked against the expected full-sequence
rows on a few steps; runs 3 and 4 are timed only (the CPU suite checks those paths).
Without CUDA it prints a message and exits 0 (``--device cpu`` runs the same code on the CPU
to check the script itself; its figures mean nothing). Writes benches/results/gpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write
from save_overhead import decode_step_us
from step_overhead import MM_DTYPE, MM_WIDTH, NUM_PREFIXES, Ours, Rows, Step, check, expected, make_steps


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class DeviceRows:
    """step_overhead's rows, with a device copy of each step's slice for the save."""

    def __init__(self, rows: Rows, device: str) -> None:
        self.cpu = rows
        self.hidden = rows.hidden.to(device)
        self.mm = rows.mm.to(device)

    def step(self, st: Step) -> tuple[torch.Tensor, torch.Tensor]:
        n = st.n
        return self.hidden[st.row_offset : st.row_offset + n], self.mm[st.row_offset : st.row_offset + n]


def raw_copy_s(h: torch.Tensor, m: torch.Tensor, device: str, repeat: int) -> tuple[float, float | None]:
    """Median seconds of a raw pinned non-blocking copy of the same two tensors: wall clock
    (launch to synchronize) and, on CUDA, device time between events around the copies."""
    cuda = device == "cuda"
    ph = torch.empty(h.shape, dtype=h.dtype, pin_memory=cuda)
    pm = torch.empty(m.shape, dtype=m.dtype, pin_memory=cuda)
    times, device_times = [], []
    for _ in range(repeat + 2):
        sync(device)
        if cuda:
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        ph.copy_(h, non_blocking=True)
        pm.copy_(m, non_blocking=True)
        if cuda:
            done.record()
        sync(device)
        times.append(time.perf_counter() - t0)
        if cuda:
            device_times.append(start.elapsed_time(done) / 1e3)
    return statistics.median(times[2:]), (statistics.median(device_times[2:]) if cuda else None)


def copy_device_s(cache: Any) -> float | None:
    """Device time of the save's side-stream copies since the last call (timing events; the
    step's copies have completed), or None when none were timed (CPU rows)."""
    timed, cache._copies.timed = cache._copies.timed, []
    if not timed:
        return None
    return sum(start.elapsed_time(done) for start, done in timed) / 1e3


def save_path(size: int, num_steps: int, rows: DeviceRows, device: str, num_blocks: int, prefix: int) -> dict:
    """Save-path D2H bandwidth and engine-thread times for one step size."""
    warm, steps = make_steps(size, num_steps, num_blocks, prefix, rows.cpu.hidden.shape[0] // 2)
    side = Ours(num_blocks, max(size, warm.n))
    begin_s, save_s, d2h_s, mat_s, copy_s = [], [], [], [], []
    check_at = {0, len(steps) // 2, len(steps) - 1}
    side.cache._copies.timing = True  # bench-only: timing events around each step's side-stream copies
    try:
        h, m = rows.step(warm)
        side.begin(warm)
        side.materialize(side.save(warm, h, m), warm)
        side.cache._copies.timed.clear()  # (the warm-up step's copies: not one of the measured steps)
        for i, st in enumerate(steps):
            h, m = rows.step(st)
            events, batch = side_events(st), side_batch(st)  # (the caller's own work: not timed)
            sync(device)
            t0 = time.perf_counter()
            side.cache.begin_step(events)
            t1 = time.perf_counter()
            sid = side.cache.save(h, {"mm.feat": m}, batch)
            t2 = time.perf_counter()
            sync(device)
            t3 = time.perf_counter()
            device_copy = copy_device_s(side.cache)
            if device_copy is not None:
                copy_s.append(device_copy)
            got_h, got_m = side.materialize(sid, st)
            t4 = time.perf_counter()
            begin_s.append(t1 - t0)
            save_s.append(t2 - t1)
            d2h_s.append(t3 - t1)
            mat_s.append(t4 - t3)
            if i in check_at:
                check("omni_pcache", st, expected(st, warm, rows.cpu), got_h, got_m)
    finally:
        side.close()
    skip = len(steps) // 5
    h, m = rows.step(steps[-1])
    nbytes = h.numel() * h.element_size() + m.numel() * m.element_size()
    raw, raw_device = raw_copy_s(h, m, device, repeat=20)
    d2h = statistics.median(d2h_s[skip:])
    copy_device = statistics.median(copy_s[skip:]) if copy_s[skip:] else None
    return {
        "step_tokens": size,
        "step_bytes": nbytes,
        "raw_pinned_copy_gbps": nbytes / raw / 1e9,
        "save_path_d2h_gbps": nbytes / d2h / 1e9,
        "save_path_vs_raw": raw / d2h,
        "raw_pinned_copy_device_gbps": nbytes / raw_device / 1e9 if raw_device else None,
        "save_copy_device_gbps": nbytes / copy_device / 1e9 if copy_device else None,
        "save_copy_vs_raw_device": raw_device / copy_device if raw_device and copy_device else None,
        "engine_thread_save_us": statistics.median(save_s[skip:]) * 1e6,
        "engine_thread_begin_plus_save_us": statistics.median(
            [b + s for b, s in zip(begin_s[skip:], save_s[skip:], strict=True)]
        )
        * 1e6,
        "materialize_us": statistics.median(mat_s[skip:]) * 1e6,
    }


def side_events(st: Step) -> Any:
    from omni_pcache import NewRequest, StepEvents

    return StepEvents(new=[NewRequest(r.req_id, r.blocks, r.hit) for r in st.reqs], finished=st.finished)


def side_batch(st: Step) -> Any:
    from omni_pcache import StepBatch

    return StepBatch([r.req_id for r in st.reqs], [r.count for r in st.reqs], st.slots)


def no_hit_steps(steps: list[Step]) -> list[Step]:
    """The same steps with every request fresh: blocks past the shared prefixes, no hits."""
    out = []
    for st in steps:
        reqs = []
        for r in st.reqs:
            fresh = r.blocks[r.hit // 16 :] if r.hit else r.blocks
            reqs.append(type(r)(r.req_id, fresh, 0, r.count))
        s2 = Step(reqs, st.finished, st.row_offset)
        s2.slots = st.slots
        out.append(s2)
    return out


def stand_in_forward(width: int, layers: int, dtype: torch.dtype, device: str):
    """A transformer's matmuls at ``width`` (no attention): per layer a fused QKV projection,
    the output projection and a 4x MLP, weights shared across layers (the FLOPs of a
    ``12 * layers * width**2``-parameter model; 24 layers at width 2,048: ~1.2B)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device=device, generator=gen) * (0.5 / rows**0.5)).to(dtype)

    qkv, out = weight(width, 3 * width), weight(width, width)
    up, down = weight(width, 4 * width), weight(4 * width, width)

    def forward(h: torch.Tensor) -> torch.Tensor:
        x = h
        for _ in range(layers):
            x = x + torch.mm(torch.mm(x, qkv)[:, :width], out)
            x = x + torch.mm(torch.relu(torch.mm(x, up)), down)
        return x

    return forward


def on_vs_off(
    size: int, num_steps: int, rows: DeviceRows, device: str, num_blocks: int, prefix: int, width: int, layers: int
):
    """Per-step wall at 0% hits: forward + delivery, with the cache vs without."""
    warm, steps = make_steps(size, num_steps, num_blocks, prefix, rows.cpu.hidden.shape[0] // 2)
    steps = no_hit_steps(steps)
    forward = stand_in_forward(width, layers, rows.hidden.dtype, device)

    def run(mode: str) -> float:
        times = []
        side = Ours(num_blocks, max(size, warm.n)) if mode == "on" else None
        pending = None
        # One sync before the loop, none between steps: a step's side-stream copy overlaps the
        # next forward, whose stream waits for it at begin_step's fence, as in an engine (a
        # sync per step would let each copy land outside the timed steps).
        sync(device)
        try:
            for st in steps:
                h, m = rows.step(st)  # (views: no device work)
                t0 = time.perf_counter()
                if side is not None:
                    side.cache.begin_step(side_events(st))
                out = forward(h)
                if side is not None:
                    sid = side.cache.save(h, {"mm.feat": m}, side_batch(st))
                    if pending is not None:
                        side.materialize(*pending)
                    pending = (sid, st)
                else:
                    h.to("cpu")
                    m.to("cpu")
                out.sum().item()  # the sampler's sync
                times.append(time.perf_counter() - t0)
            if side is not None and pending is not None:
                side.materialize(*pending)
        finally:
            if side is not None:
                side.close()
        return statistics.median(times[len(times) // 5 :])

    off, on = [], []
    for _ in range(3):
        off.append(run("off"))
        on.append(run("on"))
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"step_tokens": size, "off_ms": off_s * 1e3, "on_ms": on_s * 1e3, "overhead": on_s / off_s - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per size (default 40; quick 6)")
    parser.add_argument("--layers", type=int, default=None, help="stand-in forward's layers (default 24; quick 1)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu bench: no CUDA device; nothing to measure")
        return 0
    torch.set_num_threads(1)
    if args.quick:
        sizes, width, num_blocks, prefix, default_steps = (64, 256), 64, 256, 32, 6
    else:
        sizes, width, num_blocks, prefix, default_steps = (512, 2048, 8192), 2048, 4096, 512, 40
    num_steps = args.steps or default_steps
    layers = args.layers or (1 if args.quick else 24)
    max_tokens = max(max(sizes), NUM_PREFIXES * prefix)
    rows = DeviceRows(Rows(max_tokens, width), args.device)

    copies, overheads = [], []
    for size in sizes:
        row = save_path(size, num_steps, rows, args.device, num_blocks, prefix)
        copies.append(row)
        print(
            f"{size:>5} tok: raw pinned copy {row['raw_pinned_copy_gbps']:.1f} GB/s, save path "
            f"{row['save_path_d2h_gbps']:.1f} GB/s ({row['save_path_vs_raw']:.0%}), engine-thread save "
            f"{row['engine_thread_save_us']:.0f} us (begin+save {row['engine_thread_begin_plus_save_us']:.0f} us)",
            flush=True,
        )
        if row["save_copy_vs_raw_device"] is not None:
            print(
                f"{'':>9}device time: raw copy {row['raw_pinned_copy_device_gbps']:.1f} GB/s, save's side-stream "
                f"copies {row['save_copy_device_gbps']:.1f} GB/s ({row['save_copy_vs_raw_device']:.0%})",
                flush=True,
            )
    for size in sizes:
        row = on_vs_off(size, num_steps, rows, args.device, num_blocks, prefix, width, layers)
        overheads.append(row)
        print(
            f"{size:>5} tok, 0% hits: off {row['off_ms']:.2f} ms/step, on {row['on_ms']:.2f} ms/step "
            f"({row['overhead']:+.1%})",
            flush=True,
        )
    decode = []
    for num_reqs in (64, 256) if not args.quick else (8,):
        save_us, materialize_us = decode_step_us(num_reqs, width, rows.hidden.dtype, num_steps, device=args.device)
        decode.append({"requests": num_reqs, "engine_thread_us": save_us, "materialize_us": materialize_us})
        print(
            f"decode {num_reqs:>3} req x 1 tok: engine-thread begin_step+save {save_us:.0f} us, "
            f"materialize {materialize_us:.0f} us",
            flush=True,
        )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (script check only)"
    write(
        args.out,
        {
            "bench": "gpu",
            "device": device_name,
            "machine": machine(),
            "command": command(),
            "quick": args.quick,
            "workload": {
                "hidden": {"dtype": str(rows.hidden.dtype), "width": width},
                "mm": {"mm.feat": {"dtype": str(MM_DTYPE), "width": MM_WIDTH}},
                "num_blocks": num_blocks,
                "shared_prefix_tokens": prefix,
                "steps_per_size": num_steps,
                "stand_in_forward": {"layers": layers, "width": width, "params": 12 * layers * width**2},
            },
            "save_path": copies,
            "cache_on_vs_off_0pct_hits": overheads,
            "decode_steps": decode,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
