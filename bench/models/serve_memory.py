"""What a GGUF costs a replica under `serve run`: cold start time, peak RSS while loading, steady RSS after a
request, against the file's size plus the configured KV bytes.

    python -m bench.models.serve_memory FILE.gguf [--kv-gib 1] [--port 8000]

Writes a one-replica config (both cores, dtype auto, the given paged-KV bytes) beside the file's prepared
directory, runs `serve run` on it, and polls the ModelReplica process's /proc/<pid>/status (VmRSS, VmHWM) every
0.2 s until /health answers 200 (a replica serves); then sends one chat request (64 tokens) and reads them again. The
replica's peak (VmHWM) covers everything it allocated: imports, weights, KV cache, the compiled step. Prints
the numbers and the ratios (peak - KV) / file and (steady - KV) / file.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from bench.common import host_line


def status_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}


def replica_pid() -> int | None:
    for proc in psutil.process_iter(["cmdline"]):
        if "ServeReplica:tether:ModelReplica" in " ".join(proc.info["cmdline"] or []):
            return proc.pid
    return None


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def chat(base: str) -> dict:
    body = dict(model="x", messages=[{"role": "user", "content": "Write a story about a lighthouse."}],
                max_tokens=64, temperature=0)
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read())


def config_yaml(model: Path, kv_bytes: int, port: int) -> str:
    return f"""proxy_location: Disabled
applications:
  - name: tether
    route_prefix: /
    import_path: serve_app.app:build_app
    args:
      model: {model}
      served_model_name: x
      num_replicas: 1
      replica_num_cpus: 2
      dtype: auto
      ingress: {{http_port: {port}, http_host: 127.0.0.1}}
      engine: {{kv_cache_bytes: {kv_bytes}, max_num_seqs: 8, max_num_batched_tokens: 512}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    kv_bytes = int(args.kv_gib * 2 ** 30)
    print(host_line(), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="serve-memory-"))
    (workdir / "config.yaml").write_text(config_yaml(args.gguf.resolve(), kv_bytes, args.port))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    with open(workdir / "serve.log", "w") as log:
        serve = Path(sys.executable).with_name("serve")  # the venv's, beside its python
        server = subprocess.Popen([str(serve), "run", str(workdir / "config.yaml")], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    base, pid, peak_seen = f"http://127.0.0.1:{args.port}", None, 0
    try:
        while not answers(base + "/health"):  # 200 once a replica serves (the Ingress answers /v1/models alone)
            if server.poll() is not None:
                raise SystemExit(f"serve run exited {server.returncode}; log: {workdir / 'serve.log'}")
            pid = pid or replica_pid()
            if pid:
                peak_seen = max(peak_seen, status_kib(pid)["VmRSS"])
            time.sleep(0.2)
        ready_s = time.perf_counter() - start
        at_ready = status_kib(pid)
        reply = chat(base)
        after = status_kib(pid)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=120)
    size = args.gguf.stat().st_size
    gib = lambda kib: kib / 2 ** 20  # noqa: E731
    print(f"file {args.gguf.name}: {size / 2 ** 30:.2f} GiB; KV configured {kv_bytes / 2 ** 30:.2f} GiB")
    print(f"cold start (serve run -> /health answers 200): {ready_s:.1f} s")
    print(f"replica peak RSS while loading (VmHWM at ready): {gib(at_ready['VmHWM']):.2f} GiB; "
          f"(peak - KV) / file = {(at_ready['VmHWM'] * 1024 - kv_bytes) / size:.2f}")
    print(f"replica RSS after a 64-token chat request: {gib(after['VmRSS']):.2f} GiB (peak {gib(after['VmHWM']):.2f}); "
          f"(steady - KV) / file = {(after['VmRSS'] * 1024 - kv_bytes) / size:.2f}")
    print(f"reply: {reply['usage']}")


if __name__ == "__main__":
    main()
