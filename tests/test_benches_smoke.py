"""Smoke runs of the Python benches' ``--quick`` modes: each finishes, exits 0 and writes its
JSON with the expected fields. No timing is asserted. The vLLM-Omni side of step_overhead
runs only where scripts/setup-bench.sh has built .venv-bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
BENCH_READY = ROOT / ".venv-bench" / ".packages.sha256"  # (written once its install finished)


def run_bench(name: str, out: Path, *extra: str, python: Path | str = sys.executable) -> dict:
    proc = subprocess.run(
        [str(python), str(ROOT / "benches" / f"{name}.py"), "--quick", "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    assert doc["machine"] and doc["command"]
    return doc


STEP_FIELDS = {"engine_thread_us", "materialize_us", "materialize_bytes", "materialize_gbps"}


def check_step_rows(doc: dict, theirs: bool) -> None:
    # Each size with no forward and with a 5 ms forward between begin and save.
    assert [(r["step_tokens"], r["forward_ms"]) for r in doc["results"]] == [(64, 0), (64, 5), (256, 0), (256, 5)]
    assert doc["malloc"] == "glibc defaults"
    for row in doc["results"]:
        assert STEP_FIELDS <= set(row["omni_pcache"])
        assert {"step_bytes_gbps", "materialize_bytes_gbps"} <= set(row["torch_copy"])
        # Both gather references return exactly the bytes materialize returns.
        for ref in ("torch_gather", "torch_gather_in_loop"):
            assert row[ref]["bytes"] == row["omni_pcache"]["materialize_bytes"]
            assert row[ref]["gbps"] > 0
        assert ("vllm_omni" in row) is theirs
        if theirs:
            assert STEP_FIELDS <= set(row["vllm_omni"])
            assert {"engine_thread", "materialize"} <= set(row["ratio_ours_over_theirs"])
            assert all(v > 0 for v in row["ratio_ours_over_theirs"].values())


def test_step_overhead_ours_only(tmp_path: Path) -> None:
    doc = run_bench("step_overhead", tmp_path / "s.json", "--no-theirs")
    assert doc["vllm_omni"]["compared"] is False and doc["vllm_omni"]["note"]
    check_step_rows(doc, theirs=False)


def test_step_overhead_reruns_itself_under_the_malloc_settings_it_names(tmp_path: Path) -> None:
    doc = run_bench(
        "step_overhead", tmp_path / "s.json", "--no-theirs", "--sizes", "64", "--forward-ms", "0", "--malloc-reuse"
    )
    assert doc["malloc"] == "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296"
    assert [(r["step_tokens"], r["forward_ms"]) for r in doc["results"]] == [(64, 0)]


@pytest.mark.skipif(not BENCH_READY.exists(), reason=".venv-bench absent or unfinished (bash scripts/setup-bench.sh)")
def test_step_overhead_vs_vllm_omni(tmp_path: Path) -> None:
    doc = run_bench("step_overhead", tmp_path / "s.json", python=BENCH_PYTHON)
    assert doc["vllm_omni"]["compared"] is True
    check_step_rows(doc, theirs=True)


def test_hashing(tmp_path: Path) -> None:
    res = run_bench("hashing", tmp_path / "h.json")["results"]
    assert res["prompt_tokens"] == 2048 and res["blocks_per_prompt"] == 128
    for key in (
        "vllm_sha256_pickle_python_ns_per_block",
        "omni_pcache_block_hashes_numpy_ns_per_block",
        "omni_pcache_hash_blocks_list_ns_per_block",
        "speedup_block_hashes",
        "speedup_hash_blocks",
        "omni_pcache_block_hashes_list_ns_per_block",
    ):
        assert res[key] > 0


def test_engine(tmp_path: Path) -> None:
    doc = run_bench("engine", tmp_path / "e.json")
    rows = {r["workload"]: r for r in doc["results"]}
    assert set(rows) == {"random", "chat", "fewshot"}
    assert rows["random"]["on"]["hit_tokens"] == 0
    assert {"off", "on", "kv_only", "wall_change_on_vs_off", "wall_change_on_vs_off_paired"} <= set(rows["random"])
    for name in ("chat", "fewshot"):
        assert rows[name]["on"]["hit_tokens"] > 0
        assert rows[name]["on"]["tokens_computed"] < rows[name]["off"]["tokens_computed"]
        assert {"wall_change_on_vs_off", "tokens_saved_fraction"} <= set(rows[name])


def test_cold_floor(tmp_path: Path) -> None:
    doc = run_bench("cold_floor", tmp_path / "c.json")
    assert [r["forward_ms"] for r in doc["results"]] == [5.0, 0.0]
    for row in doc["results"]:
        for variant in ("cache", "fewest_torch_calls", "views_only"):
            assert row[variant]["us_per_step"] > 0
        assert row["cache_over_fewest"] > 0


def test_save_overhead(tmp_path: Path) -> None:
    doc = run_bench("save_overhead", tmp_path / "s.json")
    assert len(doc["results"]) == 6
    for row in doc["results"]:
        assert row["engine_thread_us"] > 0
    assert doc["results"][3]["memcpy_us"] > 0 and doc["results"][5]["materialize_us"] > 0


def test_core_results_reads_criterions_estimates(tmp_path: Path) -> None:
    bench = tmp_path / "criterion" / "ledger" / "claim_commit_16k" / "new"
    bench.mkdir(parents=True)
    meta = {"full_id": "ledger/claim_commit_16k", "throughput": {"Elements": 16384}}
    median = {"point_estimate": 65536.0, "confidence_interval": {"lower_bound": 60000.0, "upper_bound": 70000.0}}
    (bench / "benchmark.json").write_text(json.dumps(meta))
    (bench / "estimates.json").write_text(json.dumps({"median": median}))
    out = tmp_path / "core.json"
    script = [sys.executable, str(ROOT / "benches" / "core_results.py"), "--out", str(out)]
    proc = subprocess.run([*script, "--criterion-dir", str(tmp_path / "criterion")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["machine"] and doc["command"] == "cargo bench -p pcache-core --bench core"
    assert doc["results"] == [
        {
            "bench": "ledger/claim_commit_16k",
            "median_ns": 65536.0,
            "median_ci95_ns": [60000.0, 70000.0],
            "elements": 16384,
            "ns_per_element": 4.0,
        }
    ]
    empty = subprocess.run([*script, "--criterion-dir", str(tmp_path / "none")], capture_output=True, text=True)
    assert empty.returncode == 1 and "no criterion estimates" in empty.stdout


def test_gpu_bench_without_cuda_exits_zero(tmp_path: Path) -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("has CUDA: `just gpu-check` runs the real bench")
    out = tmp_path / "g.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "gpu.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "no CUDA" in proc.stdout
    assert not out.exists()


def test_gpu_bench_logic_on_cpu(tmp_path: Path) -> None:
    doc = run_bench("gpu", tmp_path / "g.json", "--device", "cpu")
    assert [r["step_tokens"] for r in doc["save_path"]] == [64, 256]
    for row in doc["save_path"]:
        assert {"raw_pinned_copy_gbps", "save_path_d2h_gbps", "engine_thread_save_us"} <= set(row)
    assert {"off_ms", "on_ms", "overhead"} <= set(doc["cache_on_vs_off_0pct_hits"][0])
