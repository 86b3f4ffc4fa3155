"""Fused small ops of a decoder layer on CPU (cpu_fused.cpp, torch.ops.tether): RMSNorm (with the
residual add), rotary embedding in place, SiLU-and-mul. Each replaces 4-8 PyTorch ops per call; a one-stream
decode step of SmolLM2 makes ~30 layers x 4 of these calls. References: naive.py.

`fused_ops()` builds the library once per host (replicas/kernels/native_build.py) and returns its op
namespace, or None where it cannot be built (the layers then keep their PyTorch code).
"""

import functools
from pathlib import Path

import torch

from replicas.kernels.native_build import load_native, mutates_only

SOURCES = [Path(__file__).with_name("cpu_fused.cpp")]


FAKES = {op: mutates_only for op in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul",
                                      "apply_token_bitmask")}


@functools.cache
def fused_ops():
    """torch.ops.tether (with these ops), or None."""
    return load_native("tether_fused", SOURCES, FAKES)


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float, out_dtype: torch.dtype,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, C] -> [T, C] out_dtype. With `residual` ([T, C] float32): residual += x in place first, and
    the norm is of the sum. weight_f32: the weight as `out_dtype` would round it, in float32."""
    out = torch.empty(x.shape, dtype=out_dtype)
    if residual is None:
        torch.ops.tether.rms_norm(out, x, weight_f32, eps)
    else:
        torch.ops.tether.add_rms_norm(out, residual, x, weight_f32, eps)
    return out


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up [T, I] in out_dtype."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=out_dtype)
    torch.ops.tether.silu_and_mul(out, gate_up)
    return out


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [R, V] float32, in place: in each listed row, the tokens whose bit is clear in bitmask [>= R,
    ceil(V / 32)] int32 (xgrammar's layout) become -inf. xgrammar's own CPU kernel takes ~180 us a row where few
    tokens are allowed (SmolLM2's 49152); this one ~2."""
    torch.ops.tether.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))


def rotary_embedding_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates qk [T, heads, D] (a view into the qkv projection) in place; cos, sin: [P, D] float32."""
    torch.ops.tether.rotary_embedding(qk, positions, cos, sin)
