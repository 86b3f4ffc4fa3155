"""Every path Tether writes and every `TETHER_*` variable it reads, in one place.

The one cache directory holds what each host builds once: prepared model checkpoints (`models/`,
model_files/prepare.py), native ops (`native/`, replicas/kernels/native_build.py), the compiled step's
Inductor code (`inductor/`, replicas/engine/compiled_step.py) and the peers the benchmarks install (`peers/`,
bench/peers/peers.py).

    TETHER_CACHE_DIR    the cache directory (default ~/.cache/tether)
    TETHER_CPU_ISA      caps the CPU ISA level every CPU path is chosen by (replicas/cpu_isa.py)
    TETHER_NATIVE       0: never build or load the native C++ ops (the PyTorch paths serve)
    TETHER_COMPILE_STEP 0: engine.compile_step defaults to false (tests/conftest.py sets it: compiling every
                        engine the suite starts would cost it ~200 s; the compiled step has its own tests)
    TETHER_PEERS_DIR    the peers' venvs and builds (default <cache>/peers; bench/peers/peers.py)
    TETHER_FUZZ_TALLY   bench/reliability/fuzz.py: the file each fuzzed call is tallied to
    TETHER_ROLLED       set on a rolled-out replica by the migration scenarios (testing/migration.py),
                        so a rollout changes the replicas' code version
"""

import functools
import os
from pathlib import Path


def cache_dir() -> Path:
    """$TETHER_CACHE_DIR, else ~/.cache/tether."""
    return Path(os.environ.get("TETHER_CACHE_DIR") or Path.home() / ".cache" / "tether")


def peers_dir() -> Path:
    """$TETHER_PEERS_DIR, else <cache>/peers."""
    return Path(os.environ.get("TETHER_PEERS_DIR") or cache_dir() / "peers")


@functools.cache
def inductor_cache_dir(host_key: str) -> Path:
    """Where Inductor keeps the compiled step for this host's kernels: <root>/<host_key>, exported as
    TORCHINDUCTOR_CACHE_DIR (which Inductor reads). The root: $TORCHINDUCTOR_CACHE_DIR where a user set it, else
    <cache>/inductor. (Torch writes its own default, /tmp/torchinductor_<user>, into the variable once anything
    asks it for the directory, and Ray passes the variable on to the replicas: that value counts as unset.)
    host_key names the ISA the native ops were built for: a graph compiled under another cap (make test-avx2's)
    and loaded here corrupted the heap on its first call."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root or os.path.abspath(root) == os.path.abspath(default_cache_dir()):
        root = str(cache_dir() / "inductor")
    path = Path(root) / host_key
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def cpu_isa_cap() -> str:
    """TETHER_CPU_ISA, lower-cased; empty when unset."""
    return os.environ.get("TETHER_CPU_ISA", "").strip().lower()


def native_disabled() -> bool:
    """TETHER_NATIVE=0."""
    return os.environ.get("TETHER_NATIVE", "").strip() == "0"


def compile_step_default() -> bool:
    """engine.compile_step's default: true unless TETHER_COMPILE_STEP=0."""
    return os.environ.get("TETHER_COMPILE_STEP", "").strip() != "0"


def fuzz_tally() -> str | None:
    return os.environ.get("TETHER_FUZZ_TALLY")


FUZZ_TALLY = "TETHER_FUZZ_TALLY"
ROLLED = "TETHER_ROLLED"
