"""`omni-pcache demo`: a PASS on a small run, and one-line errors for bad options;
`omni-pcache reservations`: the live caches on this host and what each holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from omni_pcache import cli
from omni_pcache.cli import main
from omni_pcache.engine.engine import EngineCapacityError
from omni_pcache.host_memory import host_memory_limit


def run_cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from omni_pcache.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_demo_json_passes_on_a_small_run(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--requests", "24", "--num-blocks", "20", "--model", "prefix-hash", "--json", "--seed", "3"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["passed"] is True
    assert summary["requests"] == 24 and summary["rows_checked"] > 0
    assert summary["tokens_computed"] < summary["tokens_computed_reference"]
    assert summary["mismatches"] == [] and summary["max_abs_diff"] == 0.0


def test_demo_options_reach_the_runs_and_the_summary_reports_the_cached_one(monkeypatch, capsys) -> None:
    # Each option reaches the engine; the reference run differs only in prefix caching off (and
    # no aborts); the prefix-hash model is compared exactly; the summary is the cached run's.
    from omni_pcache.engine import Engine

    runs, atols = [], []

    class Recorded(Engine):
        def run(self, requests, progress=None):
            runs.append((self.config, requests, super().run(requests, progress)))
            return runs[-1][2]

    real_compare = cli.compare
    monkeypatch.setattr(cli, "Engine", Recorded)
    monkeypatch.setattr(
        cli, "compare", lambda cached, ref, atol: (atols.append(atol), real_compare(cached, ref, atol))[1]
    )
    argv = ["demo", "--requests", "8", "--num-blocks", "24", "--block-size", "16", "--seed", "5"]
    argv += ["--abort-rate", "0.5", "--model", "prefix-hash", "--output-thread", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    (config, requests, cached), (ref_config, ref_requests, _) = runs
    assert (config.num_blocks, config.block_size, config.seed, config.model) == (24, 16, 5, "prefix-hash")
    assert config.output_thread and config.enable_prefix_caching and atols == [0.0]
    assert ref_config == replace(config, enable_prefix_caching=False)
    assert any(r.abort_step is not None for r in requests) and all(r.abort_step is None for r in ref_requests)
    aborted = sum(1 for r in cached.requests.values() if r.status.value == "aborted")
    prompt_tokens = sum(len(r.prompt) for r in cached.requests.values())
    assert summary["aborted"] == aborted > 0 and (summary["seed"], summary["requests"]) == (5, 8)
    assert summary["prefix_hit_rate"] == cached.hit_tokens / prompt_tokens > 0


def test_demo_defaults_are_the_documented_ones() -> None:
    args = cli.build_parser().parse_args(["demo"])
    assert (args.workload, args.seed, args.requests, args.block_size, args.num_blocks) == ("mixed", 0, 120, 16, 512)
    assert (args.abort_rate, args.model, args.output_thread, args.json) == (0.05, "transformer", False, False)


def test_demo_table_shows_the_verdict() -> None:
    out = run_cli("demo", "--requests", "12", "--workload", "chat")
    assert out.returncode == 0, out.stderr
    assert "PASS: full-sequence outputs equal the reference" in out.stdout
    assert "prefix hit rate" in out.stdout and "host bytes per key" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--requests", "0"], "argument --requests: expected a positive integer, got 0"),
        (["demo", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
        (["demo", "--abort-rate", "2"], "expected a number in [0, 1], got 2.0"),
        (["demo", "--num-blocks", "4"], "must hold at least 256 tokens"),
        # (were tracebacks with exit 1, which means FAIL: a seed torch cannot take, a KV too big)
        (["demo", "--seed", "99999999999999999999"], "argument --seed: expected an integer in [0, 2**63)"),
        (["demo", "--seed", "-1"], "argument --seed: expected an integer in [0, 2**63), got -1"),
        (["demo", "--num-blocks", "100000000"], "must be at most 1,048,576 tokens"),
        (["demo", "--num-blocks", "16", "--workload", "fewshot", "--block-size", "16", "--requests", "3"], None),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_options_get_one_line_errors(args: list[str], message: str | None) -> None:
    out = run_cli(*args)
    if message is None:  # a valid but tight configuration (exactly the 256 tokens asked for) runs and passes
        assert out.returncode == 0, out.stderr
        assert "PASS: full-sequence outputs equal the reference" in out.stdout
        return
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    prefix = "omni-pcache demo: error: " if args else "omni-pcache: error: "  # (one prefix per command)
    assert lines[0].startswith(prefix), lines[0]


def test_the_demos_check_fails_on_wrong_leftovers_short_aborted_rows_and_a_cut_run() -> None:
    # What a PASS rests on (each once let a wrong run pass): every returned leftover equal to
    # the model's; an aborted request's rows exactly the positions its saved steps covered;
    # every request finished or aborted.
    from omni_pcache.engine import Engine, EngineConfig, make_workload
    from omni_pcache.engine.compare import compare

    config = EngineConfig(num_blocks=32, model="prefix-hash")
    cached = Engine(config).run(make_workload("mixed", 30, 1, abort_rate=0.5))
    reference = Engine(EngineConfig(num_blocks=32, model="prefix-hash", enable_prefix_caching=False)).run(
        make_workload("mixed", 30, 1)
    )
    assert compare(cached, reference, 0.0).ok
    aborted = next(r for r, req in cached.requests.items() if req.status.value == "aborted" and req.saved_upto)
    out = cached.outputs[aborted]
    out.hidden[-1], out.proj[-1] = out.hidden[-1][:-1], out.proj[-1][:-1]  # its last row lost
    out.leftover_wrong += 1
    mismatches = compare(cached, reference, 0.0).mismatches
    assert any(m.startswith(f"{aborted}: 1 leftovers unequal") for m in mismatches), mismatches
    assert any(m.startswith(f"{aborted}: ") and "its saved steps covered" in m for m in mismatches), mismatches
    short = Engine(EngineConfig(num_blocks=32, model="prefix-hash", max_steps=3)).run(make_workload("mixed", 30, 1))
    assert any("neither finished nor aborted" in m for m in compare(short, reference, 0.0).mismatches)


def test_demo_json_is_strict_json_when_the_diff_is_infinite(monkeypatch, capsys) -> None:
    # (compare turns a NaN diff into inf: tested with the engine differential; here JSON has no inf)
    from omni_pcache.engine import compare as compare_module

    real = compare_module.compare

    def nan_rows(cached, reference, atol):
        result = real(cached, reference, atol)
        result.max_abs_diff, result.mismatches = float("inf"), ["x: rows differ"]
        return result

    monkeypatch.setattr("omni_pcache.cli.compare", nan_rows)
    rc = main(["demo", "--requests", "6", "--model", "prefix-hash", "--json"])
    summary = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert rc == 1 and summary["passed"] is False and summary["max_abs_diff"] == "inf"


def test_demo_table_lists_the_mismatches_of_a_failing_run(monkeypatch, capsys) -> None:
    from omni_pcache.engine import compare as compare_module

    real = compare_module.compare

    def wrong_rows(cached, reference, atol):
        result = real(cached, reference, atol)
        result.mismatches = ["r1: row 3 differs", "r2: 2 leftovers unequal"]
        return result

    monkeypatch.setattr("omni_pcache.cli.compare", wrong_rows)
    rc = main(["demo", "--requests", "6", "--model", "prefix-hash", "--abort-rate", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "mismatch r1: row 3 differs" in out and "mismatch r2: 2 leftovers unequal" in out
    assert "FAIL: full-sequence outputs differ from the reference" in out
    assert "(0 aborted)" in out  # (--abort-rate 0 reached the workload)


def test_demo_json_lists_the_first_20_mismatches(monkeypatch, capsys) -> None:
    from omni_pcache.engine import compare as compare_module

    real = compare_module.compare
    wrong = [f"r{i}: row 0 differs" for i in range(25)]

    def wrong_rows(cached, reference, atol):
        result = real(cached, reference, atol)
        result.mismatches = list(wrong)
        return result

    monkeypatch.setattr("omni_pcache.cli.compare", wrong_rows)
    assert main(["demo", "--requests", "6", "--model", "prefix-hash", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["mismatches"] == wrong[:20]


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # (argparse's own refusals)
        return int(exc.code)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["demo", "--seed", str(2**63)], 2),
        (["demo", "--seed", str(2**63 - 1)], 0),
        (["demo", "--abort-rate", "1"], 0),
        (["demo", "--num-blocks", "255", "--block-size", "1"], 2),
        (["demo", "--num-blocks", "256", "--block-size", "1"], 0),
        (["demo", "--num-blocks", str(1 << 16), "--block-size", "16"], 0),  # (2**20 slots: the most)
        (["demo", "--num-blocks", str((1 << 16) + 1), "--block-size", "16"], 2),
    ],
)
def test_options_on_their_bounds_are_taken_and_just_past_them_refused(monkeypatch, argv, code) -> None:
    monkeypatch.setattr(cli, "run_demo", lambda args: 0)  # (the checks only)
    assert exit_code(argv) == code


@pytest.mark.parametrize(("error", "code"), [(EngineCapacityError("too big"), 2), (KeyboardInterrupt(), 130)])
def test_a_run_the_engine_cannot_hold_is_a_usage_error_and_an_interrupt_is_130(monkeypatch, capsys, error, code):
    def run(args):
        raise error

    monkeypatch.setattr(cli, "run_demo", run)
    assert main(["demo"]) == code  # (not 1: FAIL means the rows were wrong)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---- omni-pcache reservations ---------------------------------------------------------------


def test_reservations_lists_the_live_caches_with_what_each_holds(own_reservations_dir, capsys) -> None:
    """Two live caches of this process: both listed, largest first, with the bytes their files
    say and the total; a closed cache is no longer listed; the table names each process."""
    from test_host_reservations import reserving_cache, save_rows

    with reserving_cache(0.2) as small, reserving_cache(0.3) as large:
        save_rows(small, "a")
        save_rows(large, "a")
        files = [json.loads(p.read_text())["bytes"] for p in Path(own_reservations_dir).glob("*.json")]
        assert main(["reservations", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [c["bytes"] for c in listed["caches"]] == sorted(files, reverse=True)
        assert {c["pid"] for c in listed["caches"]} == {os.getpid()} and listed["total_bytes"] == sum(files)
        assert listed["directory"] == own_reservations_dir and listed["host_bytes"] == host_memory_limit()
        small.close()
        assert main(["reservations"]) == 0
        table = capsys.readouterr().out
        assert str(os.getpid()) in table and f"{max(files):,} bytes" in table and f"{min(files):,} bytes" not in table
    assert main(["reservations"]) == 0
    assert capsys.readouterr().out.startswith("no live cache shares")


def test_reservations_where_none_can_be_read_is_a_one_line_error(own_reservations_dir, monkeypatch, capsys) -> None:
    os.makedirs(own_reservations_dir, mode=0o700)
    os.chmod(own_reservations_dir, 0o777)
    assert main(["reservations"]) == 2
    assert capsys.readouterr().err == (
        f"omni-pcache reservations: error: {own_reservations_dir} cannot be read: another user owns it or may "
        f"write to it (uid {os.getuid()}, mode 777)\n"
    )
    monkeypatch.setenv("OMNI_PCACHE_RESERVATIONS_DIR", "")
    assert main(["reservations", "--json"]) == 2
    assert "is empty: caches share no reservations" in capsys.readouterr().err


def test_reservations_print_a_directory_name_as_it_is(tmp_path, monkeypatch, capsys) -> None:
    """A directory whose name reads as rich markup is printed as named, not parsed."""
    from test_host_reservations import reserving_cache, save_rows

    directory = tmp_path / "res[/x][bold]y"
    monkeypatch.setenv("OMNI_PCACHE_RESERVATIONS_DIR", str(directory))
    with reserving_cache(0.1) as cache:
        save_rows(cache, "a")
        assert main(["reservations"]) == 0
    assert f"live caches sharing {directory}: " in capsys.readouterr().out
