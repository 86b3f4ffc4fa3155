#!/usr/bin/env bash
# On a CUDA machine, by hand (never in CI): kernel parity tests + hybrid-layer timings. See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HF_HUB_OFFLINE=1 "$PY" bench/gpu_check.py "$@"
