"""Small layers shared by the model families: RMSNorm, rotary embedding, merged projections, SwiGLU MLP.

RMSNorm and SwiGLU run the fused CPU ops (replicas/kernels/fused_cpu) where the loader sets their `native`
(`use_native_ops`); their PyTorch code is the reference those ops are tested against and the fallback.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels import fused_cpu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.native = False
        self._native_weights: dict[torch.dtype, torch.Tensor] = {}  # out dtype -> weight as it rounds, float32

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        # Normalise in float32 as transformers does, cast to the weights' dtype (the next matmul's
        # input) or to `out_dtype`, then scale. x may be a float32 residual stream.
        # residual ([T, hidden] float32): residual += x in place, and the norm is of the sum.
        dtype = out_dtype or self.weight.dtype
        if self.native and x.dim() == 2:
            return fused_cpu.rms_norm(x, self._native_weight(dtype), self.eps, dtype, residual)
        if residual is not None:
            x = residual.add_(x)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight.to(dtype) * normed.to(dtype)

    def _native_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._native_weights:
            self._native_weights[dtype] = self.weight.detach().to(dtype).float().contiguous()
        return self._native_weights[dtype]


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

    def step_rope(self, positions: torch.Tensor, native: bool) -> "StepRope":
        """What every layer of one step rotates with: the native op reads the whole tables at `positions`;
        the PyTorch path gathers them once per step."""
        return StepRope(positions, self.cos, self.sin, None if native else self.tables(positions))


@dataclass(slots=True)
class StepRope:
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # [P, D] float32
    sin: torch.Tensor  # [P, D] float32, signed (RotaryEmbedding)
    gathered: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [T, 1, D]; None where the native op rotates

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated; in place (x returned) on the native path."""
        if self.gathered is None:
            fused_cpu.rotary_embedding_(x, self.positions, self.cos, self.sin)
            return x
        return rotate(x, *self.gathered)


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
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2:
            return self.down_proj(fused_cpu.silu_and_mul(self.gate_up_proj(x), x.dtype))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        # silu(gate) * up in float32, one rounding at the end; in place: two fewer [T, I] temporaries.
        product = F.silu(gate.float(), inplace=True).mul_(up)
        return self.down_proj(product.to(x.dtype))


def use_native_ops(model: nn.Module) -> int:
    """Turns on the fused CPU ops in every layer that has them, where they are built; returns how many layers."""
    if fused_cpu.fused_ops() is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLU))]
    for module in layers:
        module.native = True
    return len(layers)
