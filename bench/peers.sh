#!/usr/bin/env bash
# Tether vs llama.cpp vs vLLM-CPU on SmolLM2-135M-Instruct (see bench/peers.py). Arguments go to bench/peers.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec python bench/peers.py "$@"
