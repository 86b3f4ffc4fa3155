"""The native MoE expert kernel (expert_gemv.cpp): each (token, expert) pair times its own expert's weights,
float32 math, for decode-sized batches; its PyTorch reference is naive.py's `naive_expert_linear`.

Built once per host ISA by replicas/kernels/native_build.py; `native_experts()` is None where it cannot be
built (moe.py then keeps its grouped matmul).
"""

import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("expert_gemv.cpp")


@functools.cache
def native_experts():
    """torch.ops.tether (expert_linear), or None where no compiler / build is available."""
    from replicas.kernels.native_build import load_native, mutates_only

    return load_native("tether_expert_gemv", [SOURCE], {"expert_linear": mutates_only})


def expert_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [P, K] float32 | bf16, w [E, N, K] contiguous float32 | bf16, expert_ids [P] int64
    -> [P, N] float32, row p = w[expert_ids[p]] @ x[p]."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    torch.ops.tether.expert_linear(x, w, expert_ids, out)
    return out
