"""The fused CPU ops' references: what the PyTorch layers compute (replicas/models/layers.py), op by op.

    naive_rms_norm(x, weight, eps, out_dtype)          x: [T, C] -> [T, C] out_dtype
    naive_add_rms_norm(residual, h, weight, eps, dt)   residual [T, C] float32 += h; -> norm(residual)
    naive_rotary_embedding(qk, positions, cos, sin)    qk: [T, heads, D] -> rotated copy
    naive_silu_and_mul(gate_up, out_dtype)             gate_up: [T, 2I] -> [T, I]
    naive_apply_token_bitmask(logits, bitmask, rows)   logits: [R, V] -> masked copy
"""

import torch
import torch.nn.functional as F


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    # Normalise in float32, cast to the output dtype, then scale by the weight in that dtype (transformers' order).
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight.to(out_dtype) * normed.to(out_dtype)


def naive_add_rms_norm(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    residual += h.float()
    return naive_rms_norm(residual, weight, eps, out_dtype)


def naive_rotary_embedding(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32. cos, sin: [P, D] with sin's first half negated (RotaryEmbedding's tables)."""
    x = qk.float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]
    out = x * c
    out += x.roll(x.shape[-1] // 2, dims=-1) * s
    return out.to(qk.dtype)


def naive_silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(out_dtype)


def naive_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit b of bitmask[r, w] allows token 32 w + b of row r (xgrammar's layout); in the listed rows every other
    token's logit becomes -inf. logits: [R, V] float32; bitmask: [>= R, ceil(V / 32)] int32."""
    vocab = logits.shape[1]
    bits = (bitmask[rows].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [n, W, 32]
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(bits.reshape(len(rows), -1)[:, :vocab] == 0, float("-inf"))
    return out
