"""The cpu_linear ops' references in plain PyTorch: what each native kernel and packed layer computes, from the
unpacked weights (the spec tests/kernels/test_cpu_linear.py holds them to).

    dequantize_int4(q, scale, offset) -> w [N, K] float32      w = q * scale + offset per group (int4_gemv.cpp)
    dequantize_int8(q, scale) -> w [N, K] float32              w = q * scale per group (int8_gemv.cpp)
    naive_int4_linear(x, q, scale, offset, out_float32=False)  x [M, K] @ w.T -> [M, N] x's dtype or float32
    naive_int8_linear(x, q, scale)                             x [M, K] @ w.T -> [M, N] float32
    naive_expert_linear(x, w, expert_ids)                      row p = w[expert_ids[p]] @ x[p] -> [P, N] float32
    naive_packed_linear(x, weight, bias)                       F.linear: what PackedLinear computes
    naive_gguf_linear(x, rows, qtype, cols)                    x [M, K] @ the gguf package's dequantize(rows).T

q is unpacked ([N, K], int4_native.pack_int4 packs it for the kernel), and a group is K / scale.shape[1]
weights. The math is the kernels': weights rebuilt in float32 (an int4 weight rounded once, an int8 one
exact), float32 sums (in another order than the kernels'), the output rounded once to its dtype.
"""

import torch
import torch.nn.functional as F


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, scale / offset [N, K/G] float32 or float16 -> w [N, K] float32: each weight
    q * scale + offset rounded once to float32, as the kernel's FMA rounds it."""
    rows, cols = q.shape
    groups = q.reshape(rows, scale.shape[1], -1).double()  # [N, K/G, G]
    return (groups * scale.double()[..., None] + offset.double()[..., None]).float().view(rows, cols)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8, scale [N, K/G] float32 -> w [N, K] float32 = q * scale (exact for GGUF Q8_0 groups)."""
    rows, cols = q.shape
    return (q.reshape(rows, scale.shape[1], -1).float() * scale[..., None]).view(rows, cols)


def naive_int4_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                      out_float32: bool = False) -> torch.Tensor:
    """x [M, K] float32 | bf16 -> x @ dequantize_int4(q, scale, offset).T [M, N] in float32 math, float32 if
    out_float32 else x's dtype (int4_native.int4_linear)."""
    out = x.float() @ dequantize_int4(q, scale, offset).T
    return out if out_float32 else out.to(x.dtype)


def naive_int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 | bf16 -> x @ dequantize_int8(q, scale).T [M, N] float32 (int8_native.int8_linear)."""
    return x.float() @ dequantize_int8(q, scale).T


def naive_expert_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [P, K], w [E, N, K], expert_ids [P] -> [P, N] float32: a batched matmul over each pair's gathered
    expert, in float32 (expert_native.expert_linear)."""
    return torch.bmm(w[expert_ids].float(), x.float().unsqueeze(-1)).squeeze(-1)


def naive_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N] in x's dtype: F.linear, which PackedLinear equals (bf16
    bit for bit, float32 to rounding)."""
    return F.linear(x, weight, bias)


def naive_gguf_linear(x: torch.Tensor, rows, qtype, cols: int) -> torch.Tensor:
    """x [M, K] -> [M, N] float32: x @ w.T with w [N, K = cols] the GGUF tensor's rows [N, row bytes] (uint8, as
    the file holds them) dequantized by the gguf package (gguf_blocks.GGUFLinear's reference)."""
    import numpy as np
    from gguf.quants import dequantize

    weight = torch.from_numpy(np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(-1, cols))
    return F.linear(x.float(), weight)
