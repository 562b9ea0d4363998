#!/usr/bin/env bash
# The GPU check, as one script for a machine with CUDA and torch but no registry access:
# installs the carried abi3 wheel (and carried test wheels) offline, runs the cuda-marked
# tests, then the small copy benchmark. Build what it needs first with `just gpu-wheels`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --system-site-packages /tmp/gpu-venv
/tmp/gpu-venv/bin/pip install --quiet --no-index --find-links dist/gpu omni_pcache pytest pytest-timeout hypothesis
/tmp/gpu-venv/bin/python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
/tmp/gpu-venv/bin/python benches/copy_check.py
/tmp/gpu-venv/bin/python benches/gpu.py
