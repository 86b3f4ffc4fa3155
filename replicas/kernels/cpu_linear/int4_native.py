"""The native int4 linear kernel (int4_gemv.cpp): 4-bit weight groups x float32 / bf16 activations in
float32 math, for decode-sized batches (1-8 rows per pass over the weights; more rows take more passes).

Weights are `w[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]` with q in 0..15 (G = 32 for
GGUF Q4), rebuilt in registers at float32 precision: one pass, exact to float32 rounding, streaming
0.5 byte per weight plus 8 bytes of float32 scale / offset per group (0.75 byte per weight at G = 32, a
fifth of float32's). Scales and offsets that float16 holds exactly (`exact_half_scales`; GGUF stores
them as float16, and every group of SmolLM2's checkpoint recovered by `four_bit_groups` is one) can be
passed as float16: 4 bytes a group, 0.625 byte per weight, the same weights applied.
`four_bit_groups` (int4.py) gives (q, step, zero): scale = step, offset = zero - 8 * step.

Built once per host ISA with replicas/cpu_isa.py's flags (AVX-512, AVX2+FMA, or scalar) by
replicas/kernels/native_build.py; `native_int4()` is None where it cannot be built.
"""

import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int4_gemv.cpp")


def _fake_pack(q):
    # q [N, K] -> uint8 [N rounded up to 4, K/2]
    return q.new_empty(((q.shape[0] + 3) // 4 * 4, q.shape[1] // 2), dtype=torch.uint8)


def _fake_int4_linear(x, packed, scale, offset, group_size, out_float32):
    # x [M, K] -> [M, N]: float32, or x's dtype
    return x.new_empty((x.shape[0], scale.shape[0]), dtype=torch.float32 if out_float32 else x.dtype)


@functools.cache
def native_int4():
    """torch.ops.tether (int4_pack, int4_linear), or None where no compiler / build is available."""
    from replicas.kernels.native_build import load_native

    return load_native("tether_int4_gemv", [SOURCE], {"int4_pack": _fake_pack, "int4_linear": _fake_int4_linear})


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int32 in 0..15 (K a multiple of 32) -> packed uint8 [N rounded up to 4, K/2]: each run of
    32 weights of a row is 16 bytes, byte j = q[32b + j] | q[32b + 16 + j] << 4, and rows go in quads,
    block b of 4 rows side by side (int4_gemv.cpp has the byte order)."""
    return torch.ops.tether.int4_pack(q.to(torch.int32))


def exact_half_scales(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scale, offset [N, K/G] float32 -> float16 copies where float16 holds every value exactly, else
    the float32 tensors unchanged (the kernel applies the same weights either way)."""
    half = scale.half(), offset.half()
    if torch.equal(half[0].float(), scale) and torch.equal(half[1].float(), offset):
        return half[0].contiguous(), half[1].contiguous()
    return scale.contiguous(), offset.contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int = 32, out_float32: bool = False) -> torch.Tensor:
    """x [M, K] float32 | bf16, packed uint8 (pack_int4 of q [N, K]), scale / offset [N, K/G] float32
    (or both float16, see exact_half_scales) -> x @ w.T [M, N], float32 if out_float32 else x's dtype.
    x of any leading shape [..., K] is flattened to rows and the output reshaped back to [..., N]."""
    if x.dim() == 2:  # the decode path: straight to C++ (~1 us a call; Python reshapes cost ~2 more)
        return torch.ops.tether.int4_linear(x, packed, scale, offset, group_size, out_float32)
    out = torch.ops.tether.int4_linear(x.reshape(-1, x.shape[-1]), packed, scale, offset, group_size, out_float32)
    return out.view(*x.shape[:-1], scale.shape[0])
