"""Every path Tether writes and every `TETHER_*` variable it reads, in one place.

The one cache directory holds what each host builds once: prepared model checkpoints (`models/`,
model_files/prepare.py), native ops (`native/`, replicas/kernels/native_build.py) and the peers the
benchmarks install (`peers/`, bench/peers/peers.py).

    TETHER_CACHE_DIR    the cache directory (default ~/.cache/tether)
    TETHER_CPU_ISA      caps the CPU ISA level every CPU path is chosen by (replicas/cpu_isa.py)
    TETHER_NATIVE       0: never build or load the native C++ ops (the PyTorch paths serve)
    TETHER_PEERS_DIR    the peers' venvs and builds (default <cache>/peers; bench/peers/peers.py)
    TETHER_FUZZ_TALLY   bench/reliability/fuzz.py: the file each fuzzed call is tallied to
    TETHER_ROLLED       set on a rolled-out replica by the migration scenarios (testing/migration.py),
                        so a rollout changes the replicas' code version
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TETHER_CACHE_DIR, else ~/.cache/tether."""
    return Path(os.environ.get("TETHER_CACHE_DIR") or Path.home() / ".cache" / "tether")


def peers_dir() -> Path:
    """$TETHER_PEERS_DIR, else <cache>/peers."""
    return Path(os.environ.get("TETHER_PEERS_DIR") or cache_dir() / "peers")


def cpu_isa_cap() -> str:
    """TETHER_CPU_ISA, lower-cased; empty when unset."""
    return os.environ.get("TETHER_CPU_ISA", "").strip().lower()


def native_disabled() -> bool:
    """TETHER_NATIVE=0."""
    return os.environ.get("TETHER_NATIVE", "").strip() == "0"


def fuzz_tally() -> str | None:
    return os.environ.get("TETHER_FUZZ_TALLY")


FUZZ_TALLY = "TETHER_FUZZ_TALLY"
ROLLED = "TETHER_ROLLED"
