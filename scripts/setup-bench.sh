#!/usr/bin/env bash
# Idempotent setup of .venv-bench: a separate virtual environment holding vLLM-Omni 0.30.0 for
# the side-by-side benchmark (benches/step_overhead.py compares omni_pcache with vLLM-Omni's
# own prefix cache, `vllm_omni.core.prefix_cache`, which imports without vLLM).
#
# vllm-omni is installed with --no-deps: its declared tree pulls vLLM, diffusers, onnxruntime,
# ... and the prefix-cache modules import none of them (only torch, which is borrowed from
# .venv with numpy and omni_pcache, see scripts/side-venv.sh). Its
# package __init__ imports vLLM, so the bench loads the prefix-cache subpackage the way
# vLLM-Omni's own unit tests do (see benches/step_overhead.py). A second run takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-bench
no_deps="vllm-omni==0.30.0"

source scripts/side-venv.sh
side_venv setup-bench "$venv"
if side_venv_stale "$venv" "$no_deps"; then
    echo "setup-bench: installing vllm-omni 0.30.0 (--no-deps) into $venv (~8 MB, first run only)"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --no-deps $no_deps
    side_venv_stamp "$venv"
else
    echo "setup-bench: $venv is up to date"
fi
"$venv/bin/python" - <<'PY'
import sys
sys.path.insert(0, "benches")
from step_overhead import import_vllm_omni_prefix_cache
pc, why = import_vllm_omni_prefix_cache()
if pc is None or why:
    sys.exit(f"setup-bench: {why}")
PY
