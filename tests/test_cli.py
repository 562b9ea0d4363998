"""`omni-pcache demo`: a PASS on a small run, and one-line errors for bad options."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omni_pcache.cli import main


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
        (["demo", "--num-blocks", "16", "--workload", "fewshot", "--block-size", "16", "--requests", "3"], None),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_options_get_one_line_errors(args: list[str], message: str | None) -> None:
    out = run_cli(*args)
    if message is None:  # a valid but tight configuration still runs
        assert out.returncode in (0, 2), out.stderr
        assert "Traceback" not in out.stderr
        return
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
