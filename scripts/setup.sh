#!/usr/bin/env bash
# Idempotent developer/CI setup: a virtual environment in .venv with every Python tool the
# project needs (torch included). A second run with unchanged requirements takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    python3 -m venv "$venv"
fi

stamp="$venv/.requirements.sha256"
want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "setup: installing requirements-dev.txt into $venv (torch is large; first run only)"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -r requirements-dev.txt
    echo "$want" > "$stamp"
else
    echo "setup: $venv is up to date"
fi
