"""The one build helper of Tether's native CPU ops: C++ sources -> a library of torch ops, through
torch.utils.cpp_extension, once per host.

    load_native(name, sources, fakes) -> torch.ops.tether | None

Every library registers its ops in the one namespace `tether` (TORCH_LIBRARY_FRAGMENT), so they go through
torch's dispatcher like any aten op: torch.profiler sees them, and with their fake implementations (`fakes`:
op name -> a function of the same arguments returning empty outputs of the right shapes, registered here
once) torch.compile can trace a model that calls them.

Every source compiles with INCLUDE_DIR (replicas/kernels/include: tether_vec.h, the vector layer the kernels
share) on its include path. A build lands in <cache_dir>/native/<name>-<ISA level>-torch<version>-<digest>, where
the digest (12 hex of SHA-1) covers the sources' paths and bytes, the shared headers' bytes and the compiler
flags, so an edited source or header, another ISA cap (TETHER_CPU_ISA, replicas/cpu_isa.py) or another torch
builds afresh and never loads a stale module. A file lock serialises processes that start at once on one host;
the first builds (tens of seconds, logged once with its time), the others wait and load. A library already in
the cache loads as it is, with no compiler or ninja needed (an image's prebuilt ops: docker/Dockerfile). Nothing
builds at import time: only load_native does.

None (and one warning with the reason) where the op cannot be had: TETHER_NATIVE=0, a baseline ISA (the
flags need AVX2 + FMA), no C++ compiler or ninja, or a failed build. Callers then keep their PyTorch path.
"""

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from core.env import cache_dir, native_disabled
from replicas.cpu_isa import compiler_flags, cpu_isa

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log
INCLUDE_DIR = Path(__file__).with_name("include")  # headers shared by every native op


def mutates_only(*args) -> None:
    """The fake of an op that writes into its arguments and returns nothing."""


def load_native(name: str, sources: list[Path], fakes: dict[str, Callable] | None = None):
    """torch.ops.tether once the library `name` of `sources` is built and loaded, or None (see module doc)."""
    return _load_native(name, tuple(Path(source).resolve() for source in sources), tuple((fakes or {}).items()))


@functools.cache  # per process: one build check, one warning, one registration of the fakes
def _load_native(name: str, sources: tuple[Path, ...], fakes: tuple[tuple[str, Callable], ...]):
    reason = _unavailable_reason()
    if reason:
        (logger.info if reason.startswith("TETHER_NATIVE") else logger.warning)(
            "native op %s not used: %s; keeping the PyTorch path", name, reason)
        return None
    import torch
    from filelock import FileLock

    # -fopenmp: at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h); without it every op runs on one thread.
    # The GOMP symbols resolve to torch's own libgomp, through libtorch_cpu, so the ops share torch's thread pool.
    flags = ["-O3", "-fopenmp", *compiler_flags()]
    build_dir = cache_dir() / "native" / _build_tag(name, sources, flags)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(build_dir / "tether-build.lock"):
            library = build_dir / f"{name}.so"
            if not (library.exists() and _load_built(library)):
                _build(name, sources, flags, build_dir)  # loads the library too: its ops register
        for op, fake in fakes:
            torch.library.register_fake(f"tether::{op}")(fake)
        return torch.ops.tether
    except Exception as e:  # compiler error, missing headers, unwritable cache: keep the PyTorch path
        detail = str(e).strip()
        logger.warning("native op %s not used: it could not be built (%s): %s; keeping the PyTorch path", name,
                       build_dir, detail[-2000:])
        return None


def _build_tag(name: str, sources: tuple[Path, ...], flags: list[str]) -> str:
    """<name>-<ISA level>-torch<version>-<digest of the sources' paths and bytes, the headers and the flags>."""
    import torch

    digest = hashlib.sha1()
    for source in sources:
        # The path too: ninja rebuilds where the same bytes sit at another path (two checkouts on one host would
        # take turns rebuilding one directory).
        digest.update(str(source.resolve()).encode())
        digest.update(source.read_bytes())
    for header in sorted(INCLUDE_DIR.glob("*.h")):  # the shared headers are part of every op
        digest.update(header.read_bytes())
    digest.update(" ".join(flags).encode())
    return f"{name}-{cpu_isa()}-torch{torch.__version__}-{digest.hexdigest()[:12]}"


def _load_built(library: Path) -> bool:
    """Loads a library built earlier (an image's prebuilt ops need no compiler, nor the ninja that built them:
    the tag already says the sources and flags are the same). False where it does not load: built again."""
    import torch

    try:
        torch.ops.load_library(str(library))
        return True
    except Exception as e:  # a build cut short, another libstdc++
        logger.warning("native library %s did not load (%s); building it again", library, e)
        return False


def _build(name: str, sources: tuple[Path, ...], flags: list[str], build_dir: Path) -> None:
    """Compiles the library into `build_dir` (needs a C++ compiler and ninja) and loads it."""
    from torch.utils import cpp_extension

    missing = _missing_tool()
    if missing:
        raise RuntimeError(missing)
    logger.info("building native op %s for ISA %s (once per host, into %s)", name, cpu_isa(), build_dir)
    start = time.perf_counter()
    cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=flags,
                       extra_include_paths=[str(INCLUDE_DIR)], build_directory=str(build_dir),
                       verbose=False, is_python_module=False)
    logger.info("built native op %s in %.1f s", name, time.perf_counter() - start)


def _unavailable_reason() -> str | None:
    if native_disabled():
        return "TETHER_NATIVE=0"
    if cpu_isa() == "baseline":
        return "the CPU ISA level is baseline (the native build needs AVX2 + FMA)"
    return None


def _missing_tool() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "no ninja (pip install ninja)"
    return None
