#!/usr/bin/env bash
# The fast test suite against the installed wheel under another CPython (`just test-python
# PYTHON`): builds the abi3 wheel, installs it with the newest torch and numpy that interpreter
# gets from PyPI (torch is several GB: first run only) into .venv-py<version>, and runs the
# suite from a copy of tests/ outside the source tree, so the wheel, not python/, is what the
# tests import. A second run reinstalls only the wheel.
#
#   bash scripts/test-python.sh python3.12                  # any interpreter >= 3.10
#   bash scripts/test-python.sh ~/.pyenv/versions/3.10.13/bin/python "numpy<2"   # extra pins
set -euo pipefail
cd "$(dirname "$0")/.."

python=${1:?usage: scripts/test-python.sh PYTHON [EXTRA_REQUIREMENT...]}
shift
extra=("$@")
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "test-python: $python is Python $version; omni_pcache needs >= 3.10" >&2
    exit 1
}
venv=.venv-py$version

[ -x .venv/bin/maturin ] || bash scripts/setup.sh  # (maturin builds the wheel)
wheels=$(mktemp -d)
copy=$(mktemp -d)
trap 'rm -rf "$wheels" "$copy"' EXIT
.venv/bin/maturin build --quiet --release --out "$wheels"

if [ ! -x "$venv/bin/python" ]; then
    echo "test-python: creating $venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want=$(printf '%s\n' "${extra[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "test-python: installing omni_pcache's dependencies and the test tools into $venv (torch is large)"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir "$wheels"/*.whl pytest pytest-timeout hypothesis \
        xxhash "${extra[@]}"
    echo "$want" > "$stamp"
fi
"$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$wheels"/*.whl
"$venv/bin/python" -c 'import sys, numpy, torch
print(f"test-python: CPython {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")'

cp -r tests benches README.md pyproject.toml "$copy"/
cd "$copy"
"$OLDPWD/$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests
