"""docker/Dockerfile: it runs the steps script beside it (build_image_steps.sh), every step in order; run here as
its RUN lines run them (installs skipped: the venv has the packages, and no network is needed), the steps leave a
cache from which a pod loads every native op without compiling.

The cache is the suite's own (TETHER_CACHE_DIR, else ~/.cache/tether) and the ISA level this host's suite runs
at, so the steps find the ops tests/conftest.py's background prebuild makes, and wait for it where it is still
building, instead of compiling all of them again. The pod's check runs with no C++ compiler at all (CXX names none):
an op it had to build would not load.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.env import cache_dir, native_disabled
from replicas.cpu_isa import LEVELS, cpu_isa

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SCRIPT = (ROOT / "docker" / "build_image_steps.sh").relative_to(ROOT).as_posix()  # as the RUN lines name it


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return out


def script_runs() -> list[list[str]]:
    """The steps each RUN passes to the script; a RUN that does not call it fails the test."""
    runs = []
    for keyword, args in instructions():
        if keyword == "RUN":
            words = shlex.split(args)
            assert words[:2] == ["bash", SCRIPT], f"a RUN outside {SCRIPT}: {args}"
            runs.append(words[2:])
    return runs


def script_steps() -> list[str]:
    line = next(line for line in (ROOT / SCRIPT).read_text().splitlines() if line.startswith("ALL_STEPS=("))
    return line.partition("(")[2].rstrip(")").split()


def test_the_dockerfile_runs_every_step_of_the_script_in_order():
    runs = script_runs()
    assert [step for run in runs for step in run] == script_steps() == \
        ["system", "torch", "package", "model", "native"]
    found = instructions()
    ray_pin = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if '"ray[serve]==' in line)
    version = ray_pin.split("==")[1].split('"')[0]
    assert ("FROM", f"rayproject/ray:{version}-py311-cpu") in found, "the base image is the Ray that pyproject pins"
    args = dict(arg.split("=", 1) for keyword, arg in found if keyword == "ARG")
    assert args["TETHER_CPU_ISA"] == "avx2" and args["TETHER_CPU_ISA"] in LEVELS
    envs = " ".join(arg for keyword, arg in found if keyword == "ENV")
    assert "TETHER_CPU_ISA=${TETHER_CPU_ISA}" in envs.split(), "pods must look the ops up at the level built"
    assert "TETHER_CACHE_DIR=/models" in envs.split()
    # The last RUN (package, model, native) runs where the whole source was copied: the path pods import.
    workdir = next(arg for keyword, arg in found if keyword == "WORKDIR")
    copies = [arg.split() for keyword, arg in found if keyword == "COPY"]
    assert any(copy[-2:] == [".", "./"] for copy in copies) and workdir.startswith("/home/ray/")
    order = [keyword for keyword, _ in found]
    assert order.index("ARG") > order.index("RUN"), "the ISA ARG after the torch layer keeps that layer cached"


POD = """
import importlib, json, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from replicas.kernels.prebuild import GETTERS
print(json.dumps({getter: getattr(importlib.import_module(module), getter)() is not None
                  for module, getter in GETTERS}))
"""


def test_the_image_steps_leave_nothing_for_a_pod_to_compile(tmp_path):
    if native_disabled() or cpu_isa() == "baseline":
        pytest.skip("no native ops on this host (TETHER_NATIVE=0 or a CPU without AVX2)")
    compiler = os.environ.get("CXX", "c++")
    real = shutil.which(compiler)
    if real is None or "/" in compiler:
        pytest.skip(f"needs the C++ compiler {compiler} by name on PATH")
    env = {**os.environ, "TETHER_SKIP_APT": "1", "TETHER_SKIP_PIP": "1", "PYTHON": sys.executable,
           "TETHER_CACHE_DIR": str(cache_dir()), "TETHER_CPU_ISA": cpu_isa()}
    for steps in script_runs():
        done = subprocess.run(["bash", SCRIPT, *steps], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0, f"{steps}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert f"native ops built for {cpu_isa()}" in done.stdout

    # The pod has no C++ compiler: an op that needed building would not load.
    pod_env = {**env, "CXX": "tether-no-such-compiler"}
    pod = subprocess.run([sys.executable, "-c", POD], cwd=tmp_path, env=pod_env, capture_output=True, text=True,
                         timeout=300)
    assert pod.returncode == 0, pod.stderr[-3000:]
    loaded = json.loads(pod.stdout.strip().splitlines()[-1])
    assert all(loaded.values()), f"native ops a pod could not load: {loaded}\n{pod.stderr[-3000:]}"
    assert "CPU ISA: " in pod.stderr, "the loader's log (logger ray.serve) must reach stderr to be read here"
    assert "building native op" not in pod.stderr, pod.stderr[-3000:]
