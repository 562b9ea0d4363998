# omni_pcache developer workflows. `just` lists them. Every recipe uses the project's .venv
# (created by `just setup`, which the test recipe runs first, so a fresh clone works).

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv"
export VIRTUAL_ENV := venv
export PATH := venv / "bin" + ":" + env_var("PATH")

# List the recipes.
default:
    @just --list --unsorted

# Create/refresh .venv with torch, maturin, pytest, hypothesis, ruff (idempotent; seconds when done).
setup:
    bash scripts/setup.sh

# Build the native module into .venv (release build, editable Python sources). PIP_QUIET:
# maturin's pip step otherwise lists every already-installed dependency (~40 lines).
develop:
    PIP_QUIET=1 maturin develop --quiet --release

# Run every test: Rust unit/property tests, then the Python suite (slow cases excluded).
test: setup
    cargo test -p pcache-core --quiet --locked
    just develop
    python -m pytest -m "not slow" -q

# Run the slow cases too (larger hypothesis and proptest budgets, longer soaks).
test-slow: setup develop
    PROPTEST_CASES=20000 cargo test -p pcache-core --release --quiet --test prop_ledger --test prop_task_state
    HYPOTHESIS_PROFILE=slow python -m pytest -q

# The fast suite once per timing perturbation (tests/perturb.py: the committer's writes slowed,
# its wake-ups late, the CPU copies slowed): a test that races the committer fails here every
# time instead of once in a while under load (~9 min on 2 cores).
test-perturbed: setup develop
    for kind in slow-write late-wake slow-copy; do echo "perturbed: $kind"; OMNI_PCACHE_PERTURB=$kind python -m pytest -m "not slow" -q; done

# The main job: the embedded engine with and without the cache, checked against each other.
[positional-arguments]
demo *ARGS: setup develop
    omni-pcache demo "$@"

# The differential harness over many seeds (>= 100), from seed FIRST (a later run can soak seeds
# no run has); prints how many requests and rows it checked, and names the seed of a failure.
# (One test of any length: the suite's 300 s per-test timeout is off for it.)
soak SEEDS="120" FIRST="0": setup develop
    OMNI_PCACHE_SOAK_SEEDS={{SEEDS}} OMNI_PCACHE_SOAK_FIRST={{FIRST}} python -m pytest -q -s --timeout 0 tests/test_engine_differential.py -k soak

# ~1.5 h on 2 cores for the core's ~940 mutants, report in mutants.out/ (a change's own:
# `cargo mutants -p pcache-core --in-diff FILE`, minutes). Survivors in code that only the
# Python suite reaches (the bindings' callers) need a look with `just test` before they count.
# Mutation testing of the Rust core with its own tests (cargo-mutants, installed on first use).
mutants:
    command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
    cargo mutants -p pcache-core -j 2 --timeout 60

# Exhaustive loom models of the task state machine and the copy queue.
loom:
    RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p pcache-core --release --test loom_models -- --nocapture

# The step workload side by side with vLLM-Omni 0.30.0 (.venv-bench, built once by
# scripts/setup-bench.sh) runs between the core's criterion benches and the other Python
# benches; each writes benches/results/<name>.json and nothing asserts a time.
# Every benchmark in one run, side by side with vLLM-Omni's prefix cache.
bench: setup develop
    bash scripts/setup-bench.sh
    cargo bench -p pcache-core --bench core
    python benches/core_results.py
    python benches/save_overhead.py
    .venv-bench/bin/python benches/step_overhead.py --first ours --out benches/results/step_overhead_ours_first.json
    .venv-bench/bin/python benches/step_overhead.py --first theirs  # (each row in both orders: the README's ranges span both)
    .venv-bench/bin/python benches/step_overhead.py --sizes 8192 --malloc-reuse  # (writes benches/results/step_overhead_malloc_reuse.json)
    .venv-bench/bin/python benches/step_overhead.py --first theirs --no-prefetch --out benches/results/step_overhead_no_prefetch.json  # (ours as a cache with CPU outputs runs by default)
    python benches/hashing.py
    python benches/engine.py
    python benches/cold_floor.py

# Only the Python benchmark of the cache's engine-thread cost (benches/results/save_overhead.json).
bench-py: setup develop
    python benches/save_overhead.py

# Build the abi3 wheel into dist/ (what `pip install .` builds).
wheel: setup
    maturin build --release --out dist

# cargo fmt --check, clippy -D warnings, ruff.
lint: setup
    cargo fmt --all --check
    cargo clippy --workspace --all-targets -- -D warnings
    ruff check python tests benches
    ruff format --check python tests benches

# Format Rust and Python.
fmt: setup
    cargo fmt --all
    ruff check --fix python tests benches
    ruff format python tests benches

# Build what the GPU machine needs offline: the abi3 wheel, in dist/gpu (its image has torch and the test tools).
gpu-wheels: setup
    rm -rf dist/gpu && mkdir -p dist/gpu
    maturin build --release --out dist/gpu
    bash scripts/source_hash.sh > dist/gpu/SOURCE_HASH

# On a GPU machine: the cuda-marked tests and the copy benchmark, as one script (see scripts/gpu_check.sh;
# where `just` is not installed, as on the lent machine, run `bash scripts/gpu_check.sh`).
gpu-check:
    bash scripts/gpu_check.sh

# The fast suite against the wheel under another CPython >= 3.10 (just test-python python3.12;
# extra pins after it, e.g. "numpy<2"): see scripts/test-python.sh.
[positional-arguments]
test-python PYTHON *EXTRA: setup
    bash scripts/test-python.sh "$@"

# The real-scheduler harness over many seeds (two runs each: every axis at once, and sessions
# under pipelines with preemption): just soak-vllm 3000 [FIRST seed] (~1.5 min per 1,000; one
# test of any length: the suite's 300 s per-test timeout is off for it).
soak-vllm SEEDS="2000" FIRST="0": setup develop
    bash scripts/setup-vllm.sh
    VLLM_TARGET_DEVICE=cpu OMNI_PCACHE_REQUIRE_VLLM=1 OMNI_PCACHE_VLLM_SOAK_SEEDS={{SEEDS}} OMNI_PCACHE_VLLM_SOAK_FIRST={{FIRST}} .venv-vllm/bin/python -m pytest -q -s --timeout 0 tests/test_vllm_scheduler.py -k test_soak

# The same soak, the runner calling the cache through vLLM-Omni's hooks (VllmOmniPrefixCacheMixin).
soak-vllm-omni SEEDS="2000" FIRST="0": setup develop
    bash scripts/setup-vllm.sh
    VLLM_TARGET_DEVICE=cpu OMNI_PCACHE_REQUIRE_VLLM=1 OMNI_PCACHE_VLLM_SOAK_SEEDS={{SEEDS}} OMNI_PCACHE_VLLM_SOAK_FIRST={{FIRST}} .venv-vllm/bin/python -m pytest -q -s --timeout 0 tests/test_vllm_omni_scheduler.py -k test_soak

# The vLLM adapter against vLLM 0.33's real types and its real scheduler, in a separate cached env (.venv-vllm: ~340 MB download once),
# the vLLM-Omni mixin under that scheduler, and its hooks checked against vLLM-Omni 0.30's source (.venv-bench: ~8 MB once).
test-vllm: setup develop
    bash scripts/setup-vllm.sh
    VLLM_TARGET_DEVICE=cpu OMNI_PCACHE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q tests/test_vllm_real.py tests/test_vllm_scheduler.py tests/test_vllm_omni_scheduler.py
    bash scripts/setup-bench.sh
    .venv-bench/bin/python -m pytest -q tests/test_vllm_omni_runner.py
