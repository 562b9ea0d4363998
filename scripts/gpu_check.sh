#!/usr/bin/env bash
# The GPU check, as one script for a machine with CUDA and torch but no registry access:
# installs the carried abi3 wheel offline, runs the cuda-marked tests (the differential harness
# over OMNI_PCACHE_CUDA_SEEDS seeds per scenario among them), then the copy check and
# the GPU benchmark, then (time-boxed) the rest of the default suite with CUDA present, where
# host buffers are pinned. Build the wheel first with `just gpu-wheels` (into dist/gpu).
# A failing step does not stop the later ones; the exit status says whether any failed.
# Where $OUT is set (the device tool), the log and the result files this run wrote are copied there.
#
# The GPU image's python3 lives in a virtual environment that already holds torch, numpy,
# pytest, pytest-timeout, hypothesis and rich; a venv made from it would not see them, so the
# wheel goes into a target folder on PYTHONPATH instead, without its dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-}
failed=0
started=$(mktemp)  # results written after this are this run's (the committed ones are older)
step() {
    echo "=== $* ($(date +%T))"
    "$@" || { echo "=== FAILED (rc $?): $*"; failed=1; }
}
{
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/omni-site \
        dist/gpu/omni_pcache-*.whl || exit 1
    export PYTHONPATH=/tmp/omni-site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    python3 -c 'import omni_pcache, torch; print("omni_pcache", omni_pcache.__file__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
    # The cuda tests, and the differential harness with the engine's outputs in CUDA buffers.
    OMNI_PCACHE_CUDA_SEEDS=${OMNI_PCACHE_CUDA_SEEDS:-8} step python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/test_cuda.py tests/test_engine_differential.py
    step python3 benches/copy_check.py
    step python3 benches/gpu.py
    # GPU_CHECK_SUITE_S=0 skips this step.
    [ "${GPU_CHECK_SUITE_S:-150}" = 0 ] || step timeout "${GPU_CHECK_SUITE_S:-150}" python3 -m pytest -q -m "not slow and not cuda" -p no:cacheprovider \
        --timeout 60 tests/ --ignore=tests/test_vllm_real.py --ignore=tests/test_vllm_omni_smoke.py
    echo "=== done ($(date +%T)), failed=$failed"
    exit $failed
} 2>&1 | tee ${out:+"$out/gpu_check.log"}
rc=${PIPESTATUS[0]}
if [ -n "$out" ]; then
    find benches/results -maxdepth 1 -name '*.json' -newer "$started" -exec cp {} "$out/" \;
fi
rm -f "$started"
exit "$rc"
