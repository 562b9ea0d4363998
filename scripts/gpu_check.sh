#!/usr/bin/env bash
# The GPU check, as one script for a machine with CUDA and torch but no registry access:
# installs the carried abi3 wheel offline, runs the cuda-marked tests (the differential harness
# over OMNI_PCACHE_CUDA_SEEDS seeds per scenario among them), then the copy check and
# the GPU benchmark, then, when GPU_CHECK_SUITE_S gives it a box, the rest of the default suite
# with CUDA present, where host buffers are pinned. Build the wheel first with `just gpu-wheels` (into dist/gpu).
# A failing step does not stop the later ones; the exit status says whether any failed. Every
# step is time-boxed (SIGINT first, so pytest still prints its summary), and a stale wheel
# (Python sources that differ from this tree's) stops the run before it measures old code.
# Where $OUT is set (the device tool), the log is written there as it goes and each result
# file this run wrote is copied there as soon as its step ends (a run cut short keeps them).
#
# The GPU image's python3 lives in a virtual environment that already holds torch, numpy,
# pytest, pytest-timeout, hypothesis and rich; a venv made from it would not see them, so the
# wheel goes into a target folder on PYTHONPATH instead, without its dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-}
failed=0
started=$(mktemp)  # results written after this are this run's (the committed ones are older)
step() {  # step SECONDS command...: runs it time-boxed; rc 124 is reported as the box reached (a failure)
    local box=$1
    shift
    echo "=== $* ($(date +%T), box ${box} s)"
    timeout -s INT -k 10 "$box" "$@"
    local rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # (137: SIGINT did not stop it, the KILL 10 s later did)
        echo "=== TIME BOX REACHED (${box} s): $*"
        failed=1  # (what it did not reach was not checked)
    elif [ "$rc" != 0 ]; then
        echo "=== FAILED (rc $rc): $*"
        failed=1
    fi
    keep
}
keep() {  # copies the result files written since the start to $OUT (the device tool's folder)
    [ -z "$out" ] || find benches/results -maxdepth 1 -name '*.json' -newer "$started" -exec cp {} "$out/" \;
}
{
    # (a wheel is a zip: where the image's python3 has no pip, unpacking it installs it as well)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/omni-site \
        dist/gpu/omni_pcache-*.whl || python3 -m zipfile -e dist/gpu/omni_pcache-*.whl /tmp/omni-site || exit 1
    export PYTHONPATH=/tmp/omni-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    # The wheel must be built from this tree, Rust included (a wheel built before the last change
    # would test and measure old code): `just gpu-wheels` right before carrying dist/gpu.
    [ "$(cat dist/gpu/SOURCE_HASH 2>/dev/null)" = "$(bash scripts/source_hash.sh)" ] \
        && diff -rq -x '*.so' -x __pycache__ python/omni_pcache /tmp/omni-site/omni_pcache \
        || { echo "=== STALE WHEEL: rebuild it with 'just gpu-wheels' and carry dist/gpu again"; exit 1; }
    python3 -c '
import importlib, omni_pcache, torch
versions = []
for name in ("numpy", "pytest", "pytest_timeout", "hypothesis", "rich"):
    try:
        versions.append(name + " " + str(getattr(importlib.import_module(name), "__version__", "?")))
    except ImportError:
        versions.append(name + " MISSING")
print("omni_pcache", omni_pcache.__file__, "torch", torch.__version__, "cuda", torch.cuda.is_available(), "|", ", ".join(versions))
raise SystemExit(0 if torch.cuda.is_available() else 2)
' || { echo "=== omni_pcache does not import, or torch sees no CUDA device: nothing here would test the GPU"; exit 1; }
    # The cuda tests, then the differential harness with the engine's outputs in CUDA buffers, in
    # two steps: --timeout-method=thread (a test stuck in a CUDA synchronize cannot take a
    # signal) ends the whole pytest process at a stuck test, so one hang loses only its own file.
    step 90 python3 -m pytest -q -m cuda -p no:cacheprovider --timeout 60 --timeout-method=thread tests/test_cuda.py
    OMNI_PCACHE_CUDA_SEEDS=${OMNI_PCACHE_CUDA_SEEDS:-8} step 150 python3 -m pytest -q -m cuda -p no:cacheprovider \
        --timeout 90 --timeout-method=thread tests/test_engine_differential.py
    # (the committed results are an older GPU's: a bench that fails must not leave them to look new)
    rm -f benches/results/copy_check.json benches/results/gpu.json
    step 90 python3 benches/copy_check.py
    step 150 python3 benches/gpu.py
    # The default suite with CUDA present (~950 tests; 2 min on this project's 2-core VM without
    # CUDA) runs only when GPU_CHECK_SUITE_S gives it a box (240, say): by default the boxes
    # above add up to 480 s, so a run fits one device call (600 s) with the install and start;
    # with the suite they would not (what reached $OUT survives a cut call).
    [ "${GPU_CHECK_SUITE_S:-0}" = 0 ] || step "${GPU_CHECK_SUITE_S}" python3 -m pytest -q -m "not slow and not cuda" -p no:cacheprovider \
        --timeout 60 tests/ --ignore=tests/test_vllm_real.py --ignore=tests/test_vllm_omni_smoke.py
    echo "=== done ($(date +%T)), failed=$failed"
    exit $failed
} 2>&1 | tee ${out:+"$out/gpu_check.log"}
rc=${PIPESTATUS[0]}
keep
rm -f "$started"
exit "$rc"
