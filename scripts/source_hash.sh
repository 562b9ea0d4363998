#!/usr/bin/env bash
# One hash of everything the wheel is built from (the Rust crates, Cargo.lock, the Python
# package's sources and the build configuration), from the working tree: `just gpu-wheels`
# stores it beside the wheel and scripts/gpu_check.sh refuses a wheel whose tree differs.
set -euo pipefail
cd "$(dirname "$0")/.."
find crates python/omni_pcache Cargo.toml Cargo.lock pyproject.toml -type f \
    \( -name '*.rs' -o -name '*.toml' -o -name '*.py' -o -name '*.pyi' -o -name Cargo.lock -o -name py.typed \) \
    -not -path '*/target/*' -not -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
