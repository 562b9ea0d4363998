"""`omni-pcache`: the command line. `omni-pcache demo` runs the embedded engine with the cache
against the same engine with prefix caching off and checks the full-sequence contract.
`omni-pcache reservations` lists the host memory the live caches on this host have reserved
(this user's, in this container: `omni_pcache.host_reservations`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from omni_pcache.engine import WORKLOADS, Engine, EngineConfig, make_workload
from omni_pcache.engine.compare import Comparison, compare
from omni_pcache.engine.engine import MODELS, EngineCapacityError, EngineResult

MAX_DEMO_SLOTS = 1 << 20
"""The most KV slots the demo allocates (its models hold their KV for every slot up front)."""


class _Parser(argparse.ArgumentParser):
    """Bad options end with one line on stderr and exit status 2, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}") from None
    if not 0 <= value < 2**63:  # (torch's generator takes 64 bits)
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {value}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="omni-pcache", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="run the embedded engine with and without the cache and compare")
    demo.add_argument("--workload", choices=WORKLOADS, default="mixed", help="request mix (default: mixed)")
    demo.add_argument("--seed", type=_seed, default=0, help="workload and model seed (default: 0)")
    demo.add_argument("--requests", type=_positive, default=120, help="number of requests (default: 120)")
    demo.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default: 16)")
    demo.add_argument(
        "--num-blocks",
        type=_positive,
        default=512,
        help="KV blocks; small values force eviction and preemption (default: 512)",
    )
    demo.add_argument("--abort-rate", type=_rate, default=0.05, help="fraction of requests aborted (default: 0.05)")
    demo.add_argument("--model", choices=MODELS, default="transformer", help="(default: transformer)")
    demo.add_argument("--output-thread", action="store_true", help="materialize on a separate thread")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    held = sub.add_parser("reservations", help="list the host memory the live caches on this host have reserved")
    held.add_argument("--json", action="store_true", help="print the list as JSON")
    return parser


def _summary(args, cached: EngineResult, reference: EngineResult, check: Comparison) -> dict:
    prompt_tokens = sum(len(r.prompt) for r in cached.requests.values())
    sequence_tokens = sum(r.num_tokens for r in cached.requests.values())
    stats = cached.cache_stats
    return {
        "workload": args.workload,
        "seed": args.seed,
        "model": args.model,
        "requests": len(cached.requests),
        "aborted": sum(1 for r in cached.requests.values() if r.status.value == "aborted"),
        "steps": cached.steps,
        "sequence_tokens": sequence_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_hit_rate": cached.hit_tokens / max(prompt_tokens, 1),
        "tokens_computed": cached.tokens_computed,
        "tokens_computed_reference": reference.tokens_computed,
        "preemptions": cached.preemptions,
        "evictions": cached.evictions,
        "wall_s": cached.wall_s,
        "wall_s_reference": reference.wall_s,
        "host_bytes_per_key": stats.pool_bytes if stats else {},
        "rows_checked": check.rows_checked,
        "requests_checked": check.requests_checked,
        "max_abs_diff": check.max_abs_diff,
        "mismatches": check.mismatches[:20],
        "cache": asdict(stats) if stats else None,
        "passed": check.ok,
    }


def _finite(value):
    """``value`` with every non-finite float as a string ("inf", "nan"): strict JSON has none
    (a NaN row makes the largest difference infinite)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"omni-pcache demo: {summary['workload']} workload, seed {summary['seed']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in summary["host_bytes_per_key"].items()}
    rows = [
        ("requests", f"{summary['requests']} ({summary['aborted']} aborted), {summary['steps']} steps"),
        ("tokens", f"{summary['sequence_tokens']} in sequences, {summary['prompt_tokens']} in prompts"),
        ("prefix hit rate", f"{summary['prefix_hit_rate']:.1%} of prompt tokens"),
        (
            "tokens computed",
            f"{summary['tokens_computed']} vs {summary['tokens_computed_reference']} with prefix caching off "
            f"({1 - summary['tokens_computed'] / max(summary['tokens_computed_reference'], 1):.1%} saved)",
        ),
        ("wall time", f"{summary['wall_s']:.2f} s vs {summary['wall_s_reference']:.2f} s with prefix caching off"),
        ("preemptions / evictions", f"{summary['preemptions']} / {summary['evictions']}"),
        ("host bytes per key", ", ".join(f"{k}: {v}" for k, v in mib.items()) or "-"),
        ("rows checked", f"{summary['rows_checked']} rows of {summary['requests_checked']} requests"),
        ("max |diff| vs reference", f"{summary['max_abs_diff']:.3g}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for line in summary["mismatches"]:
        console.print(f"[red]mismatch[/red] {line}")
    verdict = "[bold green]PASS[/bold green]" if summary["passed"] else "[bold red]FAIL[/bold red]"
    console.print(f"{verdict}: full-sequence outputs {'equal' if summary['passed'] else 'differ from'} the reference")


def run_demo(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import Progress

    torch.set_num_threads(1)
    config = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        model=args.model,
        output_thread=args.output_thread,
        seed=args.seed,
    )
    atol = 0.0 if args.model == "prefix-hash" else 1e-5
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("with the cache", total=args.requests)
        cached = Engine(config).run(
            make_workload(args.workload, args.requests, args.seed, abort_rate=args.abort_rate),
            lambda done, total: progress.update(task, completed=done),
        )
        task = progress.add_task("prefix caching off (reference)", total=args.requests)
        reference = Engine(EngineConfig(**{**asdict(config), "enable_prefix_caching": False})).run(
            make_workload(args.workload, args.requests, args.seed),
            lambda done, total: progress.update(task, completed=done),
        )
    summary = _summary(args, cached, reference, compare(cached, reference, atol))
    if args.json:
        print(json.dumps(_finite(summary), indent=2, allow_nan=False))
    else:
        _print_summary(summary)
    return 0 if summary["passed"] else 1


def run_reservations(args: argparse.Namespace) -> int:
    """Lists the live caches' reservations (`host_reservations.live_reservations`), their total
    and this host's memory; exit status 2 where the directory cannot be read."""
    from omni_pcache.host_memory import host_memory_limit, size_text
    from omni_pcache.host_reservations import ENV_DIR, live_reservations, reservations_dir

    directory = reservations_dir()
    if directory is None:
        print(f"omni-pcache reservations: error: {ENV_DIR} is empty: caches share no reservations", file=sys.stderr)
        return 2
    try:
        found = sorted(live_reservations(directory), key=lambda r: (-r.nbytes, r.pid))
    except TimeoutError:
        print(
            f"omni-pcache reservations: error: {directory} is locked by a cache admitting keys; try again",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(f"omni-pcache reservations: error: {directory} cannot be read: {exc}", file=sys.stderr)
        return 2
    limit, total = host_memory_limit(), sum(r.nbytes for r in found)
    if args.json:
        caches = [{"pid": r.pid, "process": r.name, "bytes": r.nbytes} for r in found]
        print(json.dumps({"directory": str(directory), "caches": caches, "total_bytes": total, "host_bytes": limit}))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    host = "unknown" if limit is None else f"{size_text(limit)} ({total / limit:.1%} reserved)"
    place = escape(str(directory))
    if not found:
        console.print(f"no live cache shares {place}", soft_wrap=True)
        return 0
    table = Table()
    for column in ("pid", "process", "reserved"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for r in found:
        table.add_row(str(r.pid), escape(r.name), f"{size_text(r.nbytes)} ({r.nbytes:,} bytes)")
    console.print(f"live caches sharing {place}: {size_text(total)} reserved; host memory {host}", soft_wrap=True)
    console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "reservations":
        return run_reservations(args)
    if args.command == "demo":
        if args.num_blocks * args.block_size < 256:
            print("omni-pcache demo: error: --num-blocks x --block-size must hold at least 256 tokens", file=sys.stderr)
            return 2
        if args.num_blocks * args.block_size > MAX_DEMO_SLOTS:  # (the model's KV is allocated up front)
            print(
                f"omni-pcache demo: error: --num-blocks x --block-size must be at most {MAX_DEMO_SLOTS:,} tokens",
                file=sys.stderr,
            )
            return 2
        try:
            return run_demo(args)
        except EngineCapacityError as exc:
            print(f"omni-pcache demo: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("omni-pcache demo: interrupted", file=sys.stderr)
            return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
