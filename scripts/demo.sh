#!/usr/bin/env bash
# Runs the main job on a fresh machine: sets up .venv (idempotent), builds, then
# `omni-pcache demo` with any options given (see `omni-pcache demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/just demo "$@"
