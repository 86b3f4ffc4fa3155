"""llama.cpp's own C++ server (`llama-server`) as a bench/peers/peers.py peer, built from source.

The source is the llama.cpp that llama-cpp-python vendors (so both llama.cpp peers run the same code): pip downloads
the pinned sdist into <workdir>/sdist, it is unpacked into <workdir>/src, and CMake + Ninja build only the
`llama-server` and `llama-quantize` targets into <workdir>/build: Release, CPU only, -march=native (GGML_NATIVE), static, without the
web UI (its assets would be downloaded from Hugging Face) and without OpenSSL. The build is skipped when a marker
says the same version was built; its log is <workdir>/install.log.
"""

import os
import shutil
import sys
import time
from pathlib import Path

from bench.peers.peer_process import PEER_MODEL_NAME, Running, default_gguf, run_steps, serve_subprocess
from serve_app.local_server import free_port

VERSION = "0.3.36"
REQUIREMENT = f"llama-cpp-python=={VERSION}"
THREADS, SLOTS, CONTEXT = 2, 8, 16384  # slots split the context: 2,048 tokens each


def binary(workdir: Path, name: str = "llama-server") -> Path:
    return workdir / "build" / "bin" / name


def install_llama_server(workdir: Path, allowed: bool) -> float | None:
    """Builds llama-server unless the marker names this version; returns the seconds spent, None when skipped."""
    marker = workdir / "tether-peer-build.txt"
    built = all(binary(workdir, name).is_file() for name in ("llama-server", "llama-quantize"))
    if built and marker.is_file() and marker.read_text() == REQUIREMENT:
        return None
    if not allowed:
        raise RuntimeError(f"llama-server ({REQUIREMENT}) is not built in {workdir} (--skip-install)")
    start = time.perf_counter()
    for stale in ("sdist", "src", "build"):
        shutil.rmtree(workdir / stale, ignore_errors=True)
    (workdir / "src").mkdir(parents=True)
    run_steps(build_steps(workdir), {}, workdir / "install.log")
    marker.write_text(REQUIREMENT)
    return time.perf_counter() - start


def build_steps(workdir: Path) -> list[list[str]]:
    sdist, src, build = workdir / "sdist", workdir / "src", workdir / "build"
    source = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    return [
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", REQUIREMENT, "-d", str(sdist)],
        ["tar", "-xzf", str(sdist / f"llama_cpp_python-{VERSION}.tar.gz"), "-C", str(src)],
        ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
         "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF"],
        ["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count())],
    ]


def start_llama_server(workdir: Path, model: Path | None = None) -> Running:
    """llama-server on `model` (default: the default GGUF), 8 slots, continuous batching, 2 threads."""
    port = free_port()
    # --no-repack: with repacking on, the weights go to the AMX buffer type and the server segfaults in its
    # warm-up run on this AMX Xeon (as llama-cpp-python does: see bench/peers/peers.py).
    cmd = [str(binary(workdir)), "-m", str(model or default_gguf()), "--alias", PEER_MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS), "-tb", str(THREADS),
           "-np", str(SLOTS), "-cb", "-c", str(CONTEXT), "--no-repack"]
    return serve_subprocess(cmd, {}, workdir / "server.log", port,
                            f"GGUF {model.stem.rpartition('-')[2]}" if model else "Q4_1 (4-bit GGUF)")
