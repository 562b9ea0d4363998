"""The core's criterion results as benches/results/core.json, like every other bench's.

`cargo bench -p pcache-core --bench core` leaves criterion's estimates under
``target/criterion/<group>/<bench>/new/``; this reads the median (with its 95% confidence
interval) of each bench of that run and, where the bench declares a throughput, the time per
element (slot, transition, task, block). It measures nothing itself: run it right after the
cargo bench (`just bench` does), on the machine that ran it.

Run: ``.venv/bin/python benches/core_results.py`` (``--criterion-dir``, ``--out``). Exits 1,
naming what is missing, when no estimates are there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, machine, write

ROOT = Path(__file__).resolve().parent.parent
CARGO_COMMAND = "cargo bench -p pcache-core --bench core"


def read_bench(directory: Path) -> dict[str, Any]:
    """One bench's median and per-element time from its ``new/`` estimates."""
    meta = json.loads((directory / "benchmark.json").read_text())
    median = json.loads((directory / "estimates.json").read_text())["median"]
    row: dict[str, Any] = {
        "bench": meta["full_id"],
        "median_ns": median["point_estimate"],
        "median_ci95_ns": [median["confidence_interval"]["lower_bound"], median["confidence_interval"]["upper_bound"]],
    }
    elements = (meta.get("throughput") or {}).get("Elements")
    if elements:
        row["elements"] = elements
        row["ns_per_element"] = median["point_estimate"] / elements
    return row


def collect(criterion_dir: Path) -> list[dict[str, Any]]:
    """Every bench with estimates under ``criterion_dir``, sorted by id."""
    found = sorted(p.parent for p in criterion_dir.glob("*/*/new/estimates.json"))
    return [read_bench(d) for d in found if (d / "benchmark.json").exists()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--criterion-dir", type=Path, default=ROOT / "target" / "criterion")
    parser.add_argument("--out", type=Path, default=RESULTS / "core.json")
    args = parser.parse_args(argv)
    rows = collect(args.criterion_dir)
    if not rows:
        print(f"core_results: no criterion estimates under {args.criterion_dir}; run `{CARGO_COMMAND}` first")
        return 1
    for row in rows:
        per = f"  ({row['ns_per_element']:.1f} ns per element)" if "ns_per_element" in row else ""
        print(f"{row['bench']:<32} median {row['median_ns'] / 1e3:>9.2f} us{per}")
    write(args.out, {"bench": "core", "machine": machine(), "command": CARGO_COMMAND, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
