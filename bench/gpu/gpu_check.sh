#!/usr/bin/env bash
# On a CUDA machine, by hand (never in CI): kernel parity tests, kernel timings (hybrid layers, paged decode
# attention, sampling) and ~1B decode-step timings; --skip-engine leaves the last out. See bench/gpu/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
HF_HUB_OFFLINE=1 "$PY" -m bench.gpu.gpu_check "$@"
