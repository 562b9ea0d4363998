#!/usr/bin/env bash
# Idempotent setup of .venv-vllm: a second virtual environment where vLLM 0.33's scheduler and
# config types import on a CPU machine, for the real-type adapter tests (`just test-vllm`).
#
# vLLM's full dependency tree is ~9 GB (a CUDA torch among it); this installs only the small
# set that ../shared/docs/VLLM.md found to be enough, with --no-deps, and borrows torch, numpy
# and omni_pcache from .venv (scripts/side-venv.sh). vLLM's compiled *.so files are
# deleted: these imports never load them. A second run with an unchanged list takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-vllm

# Installed with --no-deps: vLLM and the packages its scheduler/config/worker modules import.
no_deps="vllm==0.33.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7
anyio==4.16.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3
frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0
llguidance==1.7.6 msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 oss-harmony==0.0.11
partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4
psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 safetensors==0.8.0 starlette==1.10.0
tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2 truststore==0.10.5
typing_extensions==4.16.0 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1"
# Small pure-Python packages vLLM also imports (.venv lacks them); installed with their deps.
with_deps="pydantic regex requests PyYAML cloudpickle py-cpuinfo orjson attrs sniffio"

source scripts/side-venv.sh
side_venv setup-vllm "$venv"
if side_venv_stale "$venv" "$(printf '%s\n%s' "$no_deps" "$with_deps")"; then
    echo "setup-vllm: installing vLLM 0.33.0 and its import-time packages into $venv (~336 MB, first run only)"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --no-deps $no_deps
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts $with_deps
    find "$site/vllm" -name '*.so' -delete
    side_venv_stamp "$venv"
else
    echo "setup-vllm: $venv is up to date"
fi
