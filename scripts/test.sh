#!/usr/bin/env bash
# Runs every test on a fresh machine: sets up .venv (idempotent), then `just test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/just test
