"""Small layers shared by the model families: RMSNorm, rotary embedding, merged projections, SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # Normalise in float32 as transformers does, cast to the weights' dtype (the next matmul's
        # input) or to `out_dtype`, then scale. x may be a float32 residual stream.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        dtype = out_dtype or self.weight.dtype
        return self.weight.to(dtype) * normed.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half convention (transformers' Llama).

    The tables hold each position's cos and signed sin over the full rotary width, so that
    rotate(x) = x * cos + swap_halves(x) * sin: [x1 cos - x2 sin, x2 cos + x1 sin], as transformers
    computes it (a - b and a + (-b) round alike), in five ops instead of ten."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)  # [P, D]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        cos, sin = self.tables(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin at `positions`: [T, 1, D] each; once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] in float32, cast back. cos, sin: [T, 1, D] (RotaryEmbedding.tables)."""
    x_float = x.float()
    out = x_float * cos
    out += x_float.roll(x.shape[-1] // 2, dims=-1).mul_(sin)  # [x2, x1] * [-sin, sin]
    return out.to(x.dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input as one matmul (q/k/v, gate/up): fewer, larger kernels.

    `shards` names the checkpoint's projections in output order with their sizes; the loader
    copies `<parent>.<shard>.weight` into rows [offset, offset + size).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self, shard: str) -> slice:
        offset = 0
        for name, size in self.shards.items():
            if name == shard:
                return slice(offset, offset + size)
            offset += size
        raise KeyError(shard)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        # silu(gate) * up in float32, one rounding at the end; in place: two fewer [T, I] temporaries.
        product = F.silu(gate.float(), inplace=True).mul_(up)
        return self.down_proj(product.to(x.dtype))
