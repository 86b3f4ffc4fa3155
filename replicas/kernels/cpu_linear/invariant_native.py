"""Linears whose every output row is summed in one fixed order, whatever else the batch holds
(invariant_gemm.cpp; what `engine.batch_invariant` runs every linear layer on).

oneDNN's packed linear and the int4 / int8 decode kernels choose their blocking of K, or their kernel, by the
number of rows: a token's logits then depend on how many other tokens its step carries
(`python -m bench.engine.invariance --linears`). The native kernel here sums each output over k in order
from zero, splits threads over outputs only, and is the same code for 1 row or 1,000, so a row's result is a
function of that row alone. Its reference is naive_packed_linear (naive.py): equal within float32 rounding.

`invariant_layout` says how the build packs weights (by the host's ISA: bf16 pairs for vdpbf16ps where
AVX512-BF16 is there, else float32-widened blocks of one vector); `pack_invariant_weight` packs them once.
A Q8_0 head (SmolLM2's) keeps its 8-bit groups on the same kernel (`InvariantInt8Linear`: the exact
weights, a quarter of float32's bytes). `native_invariant()` is None where the op cannot be built; the engine
then runs without batch invariance.
"""

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SOURCE = Path(__file__).with_name("invariant_gemm.cpp")


@functools.cache
def native_invariant():
    """torch.ops.tether (invariant_linear, invariant_layout), or None where it cannot be built."""
    from replicas.kernels.native_build import load_native, mutates_only

    return load_native("tether_invariant_gemm", [SOURCE],
                       {"invariant_linear": mutates_only, "invariant_int8_linear": mutates_only})


def pack_invariant_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 | float32 -> the kernel's flat layout (zero-padded to whole blocks):
    [N/B][K][B] (float32-widened form) or [N/16][K2/2][16][2] (bf16 pairs form, K2 = K rounded up to even)."""
    if native_invariant() is None:
        raise RuntimeError("the batch-invariant linear needs its native op (replicas/kernels/native_build.py)")
    block, pairs = torch.ops.tether.invariant_layout(weight.dtype == torch.bfloat16)
    n, k = weight.shape
    blocks = -(-n // block)
    if pairs:
        padded = F.pad(weight.detach(), (0, k % 2, 0, blocks * block - n))  # [blocks * B, K2]
        return padded.view(blocks, block, -1, 2).permute(0, 2, 1, 3).contiguous().view(-1)
    return _blocked(weight.detach(), block)


def _blocked(t: torch.Tensor, block: int) -> torch.Tensor:
    """[N, C] -> [N/B][C][B] flat, N zero-padded to whole blocks of B rows."""
    n, c = t.shape
    blocks = -(-n // block)
    return F.pad(t, (0, 0, 0, blocks * block - n)).view(blocks, block, c).transpose(1, 2).contiguous().view(-1)


def invariant_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    # x: [..., K] in packed's dtype -> [..., out_features]; bias: [N] float32 or None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    torch.ops.tether.invariant_linear(rows, packed, bias, out_features, out)
    return out.view(*x.shape[:-1], out_features)


class InvariantLinear(nn.Module):
    """nn.Linear's function on the batch-invariant kernel; `weight` is the packed flat tensor."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", pack_invariant_weight(linear.weight), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] in the weight's dtype -> [..., out_features]
        return invariant_linear(x, self.weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch-invariant {self.weight.dtype}"


class InvariantInt8Linear(nn.Module):
    """A bias-free linear over 8-bit groups (a GGUF Q8_0 head: q int8 [N, K], scale float32 [N, K/G], applied
    exactly as q * scale) on the fixed-order kernel: float32 in, float32 out, at every row count."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        block = torch.ops.tether.invariant_layout(False)[0]
        self.register_buffer("q", _blocked(q.to(torch.int8), block), persistent=False)
        self.register_buffer("scale", _blocked(scale.float(), block), persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor):
        """Over `weight` [N, K] float32 where it is 8-bit groups (int8_native.eight_bit_groups), else None."""
        from replicas.kernels.cpu_linear.int8_native import eight_bit_groups

        groups = eight_bit_groups(weight) if native_invariant() is not None else None
        return None if groups is None else cls(*groups)

    @property
    def weight(self) -> torch.Tensor:
        """A float32 tensor: the models cast the head's input to `lm_head.weight.dtype`."""
        return self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] float32 -> [T, out_features] float32
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        torch.ops.tether.invariant_int8_linear(rows, self.q, self.scale, self.group_size, self.out_features, out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 groups of " \
               f"{self.group_size}, batch-invariant"


def use_invariant_linears(model: nn.Module) -> int:
    """Replaces every bf16 / float32 nn.Linear of `model` (a CPU model) with an InvariantLinear; returns how many."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and module.weight.dtype in (torch.bfloat16, torch.float32)]
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, InvariantLinear(linear))
    return len(targets)
