"""Small layers shared by the model families: RMSNorms, merged projections, the gated MLP (SwiGLU / GeGLU).

RMSNorm and SwiGLU run the fused CPU ops (replicas/kernels/fused_cpu) where the loader sets their `native`
(`use_native_ops`); their PyTorch code is the reference those ops are tested against and the fallback.
"""

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels import fused_cpu
from replicas.models.rope import RotaryEmbedding


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


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then cast: Gemma's and Qwen3.5's RMSNorm (checkpoints store
    weight ~ 0)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


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
    """down(act(gate(x)) * up(x)); act: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2 and self.activation == "silu":
            return self.down_proj(fused_cpu.silu_and_mul(self.gate_up_proj(x), x.dtype))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        # act(gate) * up in float32, one rounding at the end; in place: fewer [T, I] temporaries.
        product = ACTIVATIONS[self.activation](gate.float()).mul_(up)
        return self.down_proj(product.to(x.dtype))


ACTIVATIONS = {"silu": lambda x: F.silu(x, inplace=True), "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def use_native_ops(model: nn.Module) -> int:
    """Turns on the fused CPU ops (norm, activation, rotary) in every layer that has them, where they are built; returns how many layers."""
    if fused_cpu.fused_ops() is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLU, RotaryEmbedding))]
    for module in layers:
        module.native = True
    return len(layers)
