#!/usr/bin/env bash
# Idempotent developer/CI setup: a virtual environment in .venv with every Python tool the
# project needs (torch included). A second run with unchanged requirements takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
python=${PYTHON:-python3}
# A venv left without a working interpreter or pip (an interrupted first run, a missing
# python3-venv package, its base Python removed since) is made again rather than trusted.
if [ -e "$venv" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "setup: $venv is incomplete; making it again"
    rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
        echo "setup: $python is $("$python" --version 2>&1); omni_pcache needs Python >= 3.10 (set PYTHON=...)" >&2
        exit 1
    }
    echo "setup: creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi

stamp="$venv/.requirements.sha256"
# (the interpreter's version too: a venv made again with another Python installs again)
want=$({ cat requirements-dev.txt; "$venv/bin/python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "setup: installing requirements-dev.txt into $venv (torch is large; first run only)"
    # torch's CUDA wheels take about 6 GiB installed; say so up front when the disk is short,
    # since pip's own report of it ("[Errno 28] No space left on device") names no cause.
    free_kib=$(df -Pk "$venv" | awk 'NR == 2 { print $4 }')
    if [ -n "$free_kib" ] && [ "$free_kib" -lt $((7 * 1024 * 1024)) ]; then
        echo "setup: warning: only $((free_kib / 1024)) MiB free under $venv; torch needs about 6 GiB there" >&2
    fi
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
    "$venv/bin/python" -m pip install --quiet --no-cache-dir -r requirements-dev.txt
    echo "$want" > "$stamp"
else
    echo "setup: $venv is up to date"
fi
