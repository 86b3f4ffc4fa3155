"""What several benchmarks share: the repository root, the prompts' texts, the line naming the host, a timing
helper, percentiles, the defaults of a local Ray and the JSON of a run's results.

Light on purpose (no torch, no Ray at import), so a script's `--help` answers before its heavy imports.
"""

import json
import os
import statistics
import time
from pathlib import Path

from testing.chat import chat_ids  # noqa: F401  (the scripts' prompts, as the tests render them)

ROOT = Path(__file__).resolve().parents[1]  # the repository root: subprocesses' cwd, Serve actors' PYTHONPATH

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis to a child.",
             "Write a short poem about autumn leaves.", "How do airplanes stay in the air?",
             "Give me three tips for learning a new language.", "What is the difference between a virus "
             "and a bacterium?", "Describe a perfect weekend.", "Why is the sky blue?"]
TOPICS = ["rivers", "bridges", "volcanoes", "orchards", "lighthouses", "glaciers", "markets", "comets"]


def user_turn(conversation: int, turn: int) -> str:
    """About 60 tokens of user text: turn `turn` (from 0) of conversation `conversation`."""
    topic = TOPICS[(conversation + turn) % len(TOPICS)]
    return (f"Conversation {conversation}, turn {turn + 1}. I am writing a short travel guide and need help with "
            f"a section about {topic}. Please describe two famous examples of {topic}, say where each one is, "
            f"why visitors like it, and one practical tip for a first visit, in plain and friendly words.")


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo ("?" where it has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def host_line() -> str:
    """The CPU, its cores, the ISA level Tether's CPU paths are chosen by and the flags behind it."""
    from replicas.cpu_isa import cpu_flags, cpu_isa

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    return f"{cpu_model()}, {os.cpu_count()} cores; ISA {cpu_isa()}; flags: {' '.join(flags)}"


def median_seconds(fn, samples: int = 5, iters: int = 1, warmup: int = 1) -> float:
    """Seconds per call of fn: the median of `samples` timings of `iters` calls each, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def percentile(values, q: float) -> float:
    """The value at rank q (0..1) of `values` (nearest rank, no interpolation); NaN for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def local_ray_defaults() -> None:
    """A local Ray for a benchmark: no token authentication, no usage stats (unless the caller set them)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def write_json(path, results) -> None:
    """A run's raw numbers, for the `--json PATH` of the scripts that take one."""
    Path(path).write_text(json.dumps(results, indent=1))
