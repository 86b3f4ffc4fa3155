"""Linears whose every output row is summed in one fixed order, whatever else the batch holds
(invariant_gemm.cpp; what `engine.batch_invariant` runs every linear layer on).

oneDNN's packed linear and the int4 / int8 decode kernels choose their blocking of K, or their kernel, by the
number of rows: a token's logits then depend on how many other tokens its step carries
(`python -m bench.engine.invariance --linears`). The native kernel here sums each output over k in order
from zero, splits threads over outputs only, and is the same code for 1 row or 1,000, so a row's result is a
function of that row alone. Its reference is naive_packed_linear (naive.py): equal within float32 rounding.

`invariant_layout` says how the build packs weights (by the host's ISA: bf16 pairs for vdpbf16ps where
AVX512-BF16 is there, else float32-widened blocks of one vector); `pack_invariant_weight` packs them once.
A float32 layer whose weights are GGUF Q4 groups keeps them too, for decode-sized batches: the kernel rebuilds
each weight exactly, so the sums are the dense form's bit for bit. A Q8_0 head (SmolLM2's) keeps its 8-bit
groups on the same kernel (`InvariantInt8Linear`: the exact
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

    return load_native("tether_invariant_gemm", [SOURCE], {"invariant_linear": mutates_only,
                       "invariant_bf16_weight_linear": mutates_only, "invariant_int8_linear": mutates_only,
                       "invariant_int4_linear": mutates_only})


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


# Float32 rows up to which a 4-bit layer reads its 4-bit groups (0.75 byte a weight) rather than its dense
# float32 copy (4 bytes); both give the same bits (invariant_gemm.cpp), so the choice is speed only.
INT4_MAX_ROWS = 16


class InvariantLinear(nn.Module):
    """nn.Linear's function on the batch-invariant kernel; `weight` is the packed flat tensor. A float32 layer
    whose weight is 4-bit groups (`four_bit`: four_bit_groups' (q, step, zero)) that fma(q, scale, offset)
    rebuilds bit for bit also keeps them packed, for batches of up to INT4_MAX_ROWS rows: the same sums."""

    def __init__(self, linear: nn.Linear, four_bit: tuple | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", pack_invariant_weight(linear.weight), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        groups = _exact_int4(linear, four_bit) if four_bit is not None else None
        self.group_size = 0 if groups is None else self.in_features // groups[1].shape[1]
        block = torch.ops.tether.invariant_layout(False)[0]
        for name, tensor in zip(("q4", "scale4", "offset4"), groups or (None,) * 3):
            self.register_buffer(name, None if tensor is None else _blocked(tensor, block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] in the weight's dtype -> [..., out_features]
        if self.q4 is None:
            return invariant_linear(x, self.weight, self.bias, self.out_features)
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        # the op takes the 4-bit groups up to INT4_MAX_ROWS rows, the dense weight above
        torch.ops.tether.invariant_int4_linear(rows, self.q4, self.scale4, self.offset4, self.group_size,
                                               self.out_features, out, self.weight, INT4_MAX_ROWS)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        four_bit = f", 4-bit groups up to {INT4_MAX_ROWS} rows" if self.q4 is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, batch-invariant " \
               f"{self.weight.dtype}{four_bit}"


def _exact_int4(linear: nn.Linear, four_bit: tuple):
    """(q packed two per byte [N, K/2] uint8, scale [N, K/G], offset [N, K/G]) where `linear` is a bias-free
    float32 layer whose weight fma(q, scale, offset) rebuilds bit for bit, else None."""
    q, step, zero = four_bit
    weight = linear.weight.detach()
    if weight.dtype != torch.float32 or linear.bias is not None or q.shape != weight.shape or q.shape[1] % 2:
        return None
    scale, offset = step.float().contiguous(), (zero - 8 * step).float().contiguous()
    group = weight.shape[1] // scale.shape[1]
    # q * scale is exact in float64 and so is its sum with offset: one rounding to float32, as one fma
    rebuilt = (q.double() * scale.double().repeat_interleave(group, 1)
               + offset.double().repeat_interleave(group, 1)).float()
    if not torch.equal(rebuilt, weight):
        return None
    q8 = q.to(torch.uint8)
    return (q8[:, 0::2] | (q8[:, 1::2] << 4)).contiguous(), scale, offset


class Float32Head(nn.Module):
    """A float32-in, float32-out linear over weights kept in a narrower exact form (the heads below): what the
    models see of it is a float32 `weight` (they cast the head's input to `lm_head.weight.dtype`) and forward."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.dtype_probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] float32 -> [T, out_features] float32
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        self.apply_into(rows, out)
        return out.view(*x.shape[:-1], self.out_features)

    def apply_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError


class InvariantInt8Linear(Float32Head):
    """A bias-free linear over 8-bit groups (a GGUF Q8_0 head: q int8 [N, K], scale float32 [N, K/G], applied
    exactly as q * scale) on the fixed-order kernel: float32 in, float32 out, at every row count."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__(*q.shape)
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

    def apply_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.tether.invariant_int8_linear(rows, self.q, self.scale, self.group_size, self.out_features, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 groups of " \
               f"{self.group_size}, batch-invariant"


class InvariantBf16WeightLinear(Float32Head):
    """A float32 layer whose weights are all bf16 values (a bf16 checkpoint's head, which the loader keeps in
    float32): the weights stored in bf16, widened exactly in the kernel, so its outputs are the float32 copy's
    bit for bit (the widen form's sums) at half the bytes a decode step reads. Float32 in, float32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(*weight.shape)
        block = torch.ops.tether.invariant_layout(False)[0]
        self.register_buffer("packed", _blocked(weight.detach().to(torch.bfloat16), block), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Over `weight` [N, K] float32 where every value is a bf16 value, else None."""
        if native_invariant() is None or weight.dtype != torch.float32:
            return None
        return cls(weight, bias) if torch.equal(weight.to(torch.bfloat16).float(), weight) else None

    def apply_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.tether.invariant_bf16_weight_linear(rows, self.packed, self.bias, self.out_features, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 weights, float32 sums, " \
               f"batch-invariant"


def use_invariant_linears(model: nn.Module, four_bit: dict[str, tuple] | None = None) -> int:
    """Replaces every bf16 / float32 nn.Linear of `model` (a CPU model) with an InvariantLinear, those named in
    `four_bit` (find_four_bit_linears) with their 4-bit groups where they rebuild exactly; returns how many."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and module.weight.dtype in (torch.bfloat16, torch.float32)]
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                InvariantLinear(linear, (four_bit or {}).get(name)))
    return len(targets)
