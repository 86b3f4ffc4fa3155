"""What the host CPU can run: one probe that every CPU path asks before it is chosen.

Levels, each a superset of the one before:

    baseline      x86-64 without AVX2 (or not x86): PyTorch paths only
    avx2          AVX2 + FMA (+ F16C): the native kernels' portable build; no oneDNN bf16 weights
    avx512        AVX512 F/BW/VL/DQ: oneDNN's bf16 weight reorder works (emulated bf16 math, slow)
    avx512_bf16   + AVX512-BF16: native bf16 dot products; `dtype: auto` chooses bfloat16 from here
    amx           + AMX tiles (bf16)

`TETHER_CPU_ISA=<level>` caps the level below what the CPU has (never above it), so every path
chosen from here behaves as on an older host: `TETHER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 make test`
runs the AVX2 host's suite on an AVX-512 machine. (`ATEN_CPU_CAPABILITY` alone does not: oneDNN's
bf16 reorder and /proc/cpuinfo ignore it.)
"""

import functools
import logging

from core.env import cpu_isa_cap

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log

LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# The cpuinfo flags each level needs on top of the one below it.
REQUIRED_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
# g++ flags of the native kernels' build for each level (not -march=native: the override must hold).
COMPILER_FLAGS = {
    "baseline": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16"],
}
COMPILER_FLAGS["amx"] = COMPILER_FLAGS["avx512_bf16"]  # the kernels use no AMX instruction yet


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def detected_level(flags: set[str]) -> str:
    """The highest level whose flags (and every lower level's) are all in `flags`."""
    level = "baseline"
    for name in LEVELS[1:]:
        if not REQUIRED_FLAGS[name] <= flags:
            break
        level = name
    return level


@functools.cache
def cpu_isa() -> str:
    """The level every CPU path is chosen by: the detected one, capped by TETHER_CPU_ISA. Logged once."""
    detected = detected_level(cpu_flags())
    override = cpu_isa_cap()
    if override and override not in LEVELS:
        raise ValueError(f"TETHER_CPU_ISA={override!r} is not one of {', '.join(LEVELS)}")
    level = min(detected, override, key=LEVELS.index) if override else detected
    logger.info("CPU ISA: %s (detected %s%s)", level, detected, f", capped by TETHER_CPU_ISA={override}"
                if override else "")
    return level


def has_isa(level: str) -> bool:
    return LEVELS.index(cpu_isa()) >= LEVELS.index(level)


def bf16_weights_supported() -> bool:
    """oneDNN reorders and multiplies bf16 weights: it needs AVX512 BW/VL/DQ (or AVX-NE-CONVERT, which
    AVX2 hosts with it report; honoured only when no cap is set below avx512)."""
    if has_isa("avx512"):
        return True
    return "avx_ne_convert" in cpu_flags() and not cpu_isa_cap()


def fast_bf16() -> bool:
    """bf16 matmuls in hardware (AVX512-BF16 or AMX): where `dtype: auto` chooses bfloat16."""
    return has_isa("avx512_bf16")


def compiler_flags() -> list[str]:
    return list(COMPILER_FLAGS[cpu_isa()])
