"""Device, precision and threads: what the hardware under a replica decides."""

import logging
import os

import torch

from replicas import cpu_isa

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def has_fast_bf16(device: torch.device) -> bool:
    """CUDA, or a CPU with AMX or AVX512-BF16 (where oneDNN runs bf16 matmuls natively; replicas/cpu_isa.py,
    which TETHER_CPU_ISA caps)."""
    return device.type == "cuda" or cpu_isa.fast_bf16()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if has_fast_bf16(device) else torch.float32
    if dtype == "bfloat16" and not has_fast_bf16(device):
        logger.warning("dtype bfloat16 on a CPU without AVX512-BF16 / AMX (ISA %s): bf16 matmuls are emulated, "
                       "slower than float32 and further from it; dtype auto would choose float32", cpu_isa.cpu_isa())
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def resolve_threads(num_threads: int | None) -> int:
    """torch's intra-op threads for a replica: the configured number, else the CPUs Ray assigned, else
    the machine's (at least 1). Set them on the thread that runs the model (AsyncEngine does)."""
    if num_threads is None:
        num_threads = assigned_cpus() or os.cpu_count() or 1
    return max(1, int(num_threads))


def assigned_cpus() -> int | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        return max(1, int(cpus))
    except Exception:
        return None
