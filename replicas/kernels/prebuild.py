"""Build every native op for this host at once, in parallel processes, into the cache (replicas/kernels/native_build.py):

    python -m replicas.kernels.prebuild [--jobs 2]

An op otherwise builds when it is first needed, one after another (eight libraries, minutes on 2 cores from a cold
cache). The test suite starts this in the background at session start (tests/conftest.py), so the builds share
the cores; an image build can run it once so its replicas never compile. A process that needs an op while it is
building here waits on the build's file lock and loads the result. Honors TETHER_NATIVE and TETHER_CPU_ISA.
"""

import argparse
import subprocess
import sys

# module -> its getter, which builds (or loads) the library; the slowest builds first
GETTERS = [("replicas.kernels.cpu_linear.int4_native", "native_int4"),
           ("replicas.kernels.cpu_linear.int8_native", "native_int8"),
           ("replicas.kernels.fused_cpu", "fused_ops"),
           ("replicas.kernels.cpu_linear.invariant_native", "native_invariant"),
           ("replicas.kernels.cpu_linear.gguf_blocks", "native_gguf"),
           ("replicas.kernels.cpu_linear.expert_native", "native_experts"),
           ("replicas.kernels.gated_delta_rule.cpu_native", "native_gated_delta"),
           ("replicas.kernels.paged_attention.cpu_native", "native_ops")]


def build(getters: list[tuple[str, str]]) -> None:
    import importlib

    for module, getter in getters:
        getattr(importlib.import_module(module), getter)()


def start(jobs: int = 2) -> list[subprocess.Popen]:
    """`jobs` background processes, each building every jobs-th library; returns them (not waited for)."""
    return [subprocess.Popen([sys.executable, "-c", f"from replicas.kernels.prebuild import GETTERS, build; "
                              f"build(GETTERS[{i}::{jobs}])"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i in range(jobs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    codes = [process.wait() for process in start(args.jobs)]
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
