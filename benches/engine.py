"""The embedded engine (transformer model) with the cache on vs prefix caching off.

- ``random`` (0% hits): the cache's overhead — wall time with the cache vs the same engine
  with prefix caching off (goal: within 2%). A third run, KV prefix caching on without the
  output cache (``kv_only``, possible only because nothing hits), splits that overhead into
  the engine's own block hashing and the cache.
- ``chat`` and ``fewshot`` (shared prefixes): tokens computed and wall time saved by turning
  prefix caching on (which needs the cache, or the hits would lose their outputs).

The "off" engine hands each request its step's rows as views of the forward's output (what an
engine without the cache delivers); the cache-on engine materializes full-sequence rows as
usual. For the cache-on runs it also reports the engine thread's time inside the cache's calls
per step (begin_step, save, materialize). Runs alternate on/off ``--repeat`` times per
workload (default 9); medians, and the median of each round's on/off ratio (a round's runs are
back to back, so its ratio cancels a shared machine's slow drift). One torch thread
(``torch.set_num_threads(1)``); the cache's committer thread may use the second core.

Run: ``.venv/bin/python benches/engine.py`` (``--quick``: 12 requests, one repeat). Writes
benches/results/engine.json. Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from omni_pcache.engine import Engine, EngineConfig, make_workload
from omni_pcache.engine.engine import RequestOutput

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write


class BenchEngine(Engine):
    """The embedded engine without the differential harness's per-row reference recording or
    leftover checks: with the cache off, each request gets its rows as views of the forward's
    output. (With the cache on it still notes each step's first positions and counts the
    prefix rows returned, for `compare`'s counter check: about a microsecond per step.)"""

    verify_leftovers = False

    def __init__(self, config: EngineConfig, output_cache: bool = True) -> None:
        super().__init__(config)
        if not output_cache and self.cache is not None:
            self.cache.close()
            self.cache = None
        self.cache_seconds: dict[str, float] = {}
        if self.cache is not None:
            for name in ("begin_step", "save", "materialize"):
                self._time_calls(name)

    def _time_calls(self, name: str) -> None:
        """Adds the wall time of every ``cache.<name>`` call on the engine thread to
        ``cache_seconds[name]`` (two perf_counter reads per call)."""
        call = getattr(self.cache, name)
        self.cache_seconds[name] = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.cache_seconds[name] += time.perf_counter() - start

        setattr(self.cache, name, timed)

    def _record_reference(self, sched: Any, hidden: torch.Tensor, proj: torch.Tensor) -> None:
        row = 0
        for req, count in sched.scheduled:
            rec = self.outputs.setdefault(req.req_id, RequestOutput())
            rec.hidden.append(hidden[row : row + count])
            rec.proj.append(proj[row : row + count])
            row += count

    def _outputs_from_reference(self) -> None:
        pass


def run_once(workload: str, mode: str, num_requests: int, seed: int) -> dict[str, Any]:
    config = EngineConfig(enable_prefix_caching=mode != "off", seed=seed)
    engine = BenchEngine(config, output_cache=mode == "on")
    result = engine.run(make_workload(workload, num_requests, seed))
    return {
        "wall_s": result.wall_s,
        "steps": result.steps,
        "tokens_computed": result.tokens_computed,
        "hit_tokens": result.hit_tokens,
        "cache_ms_per_step": {k: v / result.steps * 1e3 for k, v in engine.cache_seconds.items()},
    }


def measure(workload: str, modes: tuple[str, ...], num_requests: int, repeat: int, seed: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(repeat):
        for mode in modes:  # alternate, so drift on a shared machine hits every mode alike
            runs[mode].append(run_once(workload, mode, num_requests, seed))
    out: dict[str, Any] = {"workload": workload, "requests": num_requests, "repeat": repeat}
    for mode, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        out[mode] = {
            "wall_s": wall,
            "wall_s_all": [r["wall_s"] for r in rs],
            "steps": rs[0]["steps"],
            "ms_per_step": wall / rs[0]["steps"] * 1e3,
            "tokens_computed": rs[0]["tokens_computed"],
            "hit_tokens": rs[0]["hit_tokens"],
        }
        if rs[0]["cache_ms_per_step"]:  # engine-thread time inside the cache's calls
            out[mode]["cache_ms_per_step"] = {
                k: statistics.median(r["cache_ms_per_step"][k] for r in rs) for k in rs[0]["cache_ms_per_step"]
            }
    on, off = out["on"], out["off"]
    out["wall_change_on_vs_off"] = on["wall_s"] / off["wall_s"] - 1
    # Each round's on/off pair ran back to back, so its ratio cancels slow drift of a shared
    # machine; the median over rounds is the steadier overhead figure.
    paired = [a["wall_s"] / b["wall_s"] - 1 for a, b in zip(runs["on"], runs["off"], strict=True)]
    out["wall_change_on_vs_off_paired"] = {"median": statistics.median(paired), "all": paired}
    out["tokens_saved_fraction"] = 1 - on["tokens_computed"] / off["tokens_computed"]
    if "kv_only" in out:
        out["wall_change_kv_only_vs_off"] = out["kv_only"]["wall_s"] / off["wall_s"] - 1
        out["wall_change_on_vs_kv_only"] = on["wall_s"] / out["kv_only"]["wall_s"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 requests, one repeat (smoke test)")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default 120)")
    parser.add_argument("--repeat", type=int, default=None, help="on/off pairs per workload (default 9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    num_requests = args.requests or (12 if args.quick else 120)
    repeat = args.repeat or (1 if args.quick else 9)

    results = []
    for workload, modes in (("random", ("off", "on", "kv_only")), ("chat", ("off", "on")), ("fewshot", ("off", "on"))):
        row = measure(workload, modes, num_requests, repeat, args.seed)
        results.append(row)
        line = (
            f"{workload:<8} off {row['off']['wall_s'] * 1e3:7.0f} ms, on {row['on']['wall_s'] * 1e3:7.0f} ms "
            f"({row['wall_change_on_vs_off']:+.1%} wall; paired median"
            f" {row['wall_change_on_vs_off_paired']['median']:+.1%}),"
            f" tokens computed {row['off']['tokens_computed']} -> "
            f"{row['on']['tokens_computed']} ({row['tokens_saved_fraction']:.1%} saved), "
            f"hit tokens {row['on']['hit_tokens']}"
        )
        if "kv_only" in row:
            line += f"; kv-only {row['kv_only']['wall_s'] * 1e3:.0f} ms ({row['wall_change_on_vs_kv_only']:+.1%} cache)"
        per_step = row["on"].get("cache_ms_per_step", {})
        line += (
            "\n"
            + " " * 9
            + "engine thread in the cache per step: "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in per_step.items())
        )
        print(line, flush=True)
    write(
        args.out,
        {
            "bench": "engine",
            "machine": machine(),
            "torch_threads": torch.get_num_threads(),
            "command": command(),
            "quick": args.quick,
            "model": "transformer",
            "engine_config": {
                k: v for k, v in vars(EngineConfig()).items() if k not in ("enable_prefix_caching", "seed")
            },
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
