#!/usr/bin/env bash
# The GPU check, as one script for a machine with CUDA and torch but no registry access:
# installs the carried abi3 wheel offline, runs the cuda-marked tests, then the copy check and
# the GPU benchmark. Build the wheel first with `just gpu-wheels` (into dist/gpu).
#
# The GPU image's python3 lives in a virtual environment that already holds torch, numpy,
# pytest, pytest-timeout, hypothesis and rich; a venv made from it would not see them, so the
# wheel goes into a target folder on PYTHONPATH instead, without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/omni-site \
    dist/gpu/omni_pcache-*.whl
export PYTHONPATH=/tmp/omni-site PYTHONUNBUFFERED=1
python3 -c 'import omni_pcache, torch; print("omni_pcache", omni_pcache.__file__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
python3 benches/copy_check.py
python3 benches/gpu.py
