"""Linear layers whose checkpoint weights are 4-bit groups, run at decode sizes on those groups: the native
kernel where it builds (int4_native.py), else torch's int4 CPU kernel in bfloat16.

A GGUF Q4_0 / Q4_1 checkpoint (the default SmolLM2 is Q4_1) stores each run of 32 input weights of a
row as `d * q + m` with q in 0..15. Dequantized to float32 the groups keep that form exactly, so
`four_bit_groups` recovers (q, scale, zero) and proves it by rebuilding the weight; nothing that is
not already 4-bit is quantized here. At decode sizes a step streams every weight once and the
4-bit copy is a quarter of the bf16 one: one pass of `torch.ops.aten._weight_int4pack_mm_for_cpu`
(what gpt-fast / torchao use) beats the packed bf16 matmul up to ~8 rows, the two passes below up to
2 (INT4_MAX_ROWS; `python -m bench.engine.engine_ab int4`). Larger batches (prefill chunks) keep the dense
bf16 path, where the int4 kernel is 2x slower.
The kernel takes bf16 activations and bf16 scale / zero, and rounds its output to bf16. Rounding each
group's scale and offset to bf16 moved SmolLM2's decode logprobs by up to 0.069 from float32's (the
dense bf16 path, which rounds each weight: 0.052). So each layer runs the kernel twice over the same
4-bit weights, with the bf16 scale / zero and with their bf16 remainders (the second pass reads weights
the first just brought into cache): the weights applied are the checkpoint's to ~16 bits, and what is
left is the bf16 rounding of the first pass's output. Layers whose output feeds float32 math (the
residual stream, SwiGLU's float32 product) add the two passes in float32 rather than rounding again.
SmolLM2's worst decode logprob gap to float32 is then 0.039 (tests/parity/test_llama_parity.py).

Where the native int4 kernel builds (int4_native.py: any AVX2 or newer host, replicas/cpu_isa.py), it
replaces both passes: one pass over the same 4-bit groups with float32 scale / offset and float32 math,
for float32 activations (AVX2 hosts, where torch's kernel is ~13x slower than a dense float32 matmul) as
for bf16 ones, up to NATIVE_MAX_ROWS rows.
"""

import torch
from torch import nn

from replicas.kernels.cpu_linear import int4_native

GROUP_SIZE = 32  # GGUF's Q4 block
# Layers whose output is only consumed in float32: the residual stream, SwiGLU's float32 product.
FLOAT_OUTPUT_LAYERS = ("o_proj", "out_proj", "down_proj", "gate_up_proj")
INT4_MAX_ROWS = 2  # rows up to which the two int4 passes beat the packed bf16 matmul (2 cores, SmolLM2 shapes)
# Rows up to which the native kernel beats the packed dense matmul of each dtype (bench/kernels/int4_gemv.py,
# model-sized; bf16: bench/engine/profile_step.py at 8 streams, 18.8 ms packed vs 21.4 ms int4 per step).
NATIVE_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 8}


def four_bit_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    """-> (q [N, K] int32 in 0..15, scale [N, K/G], zero [N, K/G]) with weight == (q - 8) * scale + zero
    to float32 rounding, or None where `weight` [N, K] float32 is not made of 4-bit groups."""
    rows, cols = weight.shape
    if cols % group_size or weight.dtype != torch.float32:
        return None
    groups = weight.view(rows, cols // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    q = ((groups - low) / torch.where(step > 0, step, 1)).round().clamp_(0, 15)
    error = (q * step + low - groups).abs().amax()
    if error > 1e-6 * max(groups.abs().amax().item(), 1e-12):
        return None
    zero = low + 8 * step  # the kernel's form: (q - 8) * scale + zero
    return q.to(torch.int32).view(rows, cols), step.squeeze(-1), zero.squeeze(-1)


class Int4Linear(nn.Module):
    """A linear layer with two copies of its weight: the int4 groups for batches of up to `max_rows` rows,
    `dense` (a PackedLinear or nn.Linear) for larger ones. No bias (Q4 checkpoints have none here).
    native: the native kernel (any activation dtype), else torch's two passes (bf16 activations)."""

    def __init__(self, dense: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 float_output: bool = False, native: bool = False):
        super().__init__()
        self.dense = dense
        self.float_output = float_output  # the int4 path's output in float32 (a layer feeding float32 math)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group_size = self.in_features // scale.shape[1]
        self.native = native
        self.max_rows = NATIVE_MAX_ROWS.get(dense.weight.dtype, 8) if native else INT4_MAX_ROWS
        if native:  # w = q * scale + offset, [N, K/G] each: float16 where it holds them exactly, else float32
            scale, offset = int4_native.exact_half_scales(scale.float(), (zero - 8 * scale).float())
            self.register_buffer("packed", int4_native.pack_int4(q), persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            self.register_buffer("offset", offset, persistent=False)
            return
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8), persistent=False)
        # [K/G, N, 2]: each group's scale and zero in bf16 (the activations' dtype), and what bf16 left out
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        high = scale_zero.to(torch.bfloat16)
        self.register_buffer("scale_zero", high, persistent=False)
        self.register_buffer("scale_zero_rest", (scale_zero - high.float()).to(torch.bfloat16), persistent=False)

    def int4_buffers(self) -> list[torch.Tensor]:
        """What one int4 call reads: the 4-bit weights and their group scales."""
        names = ("packed", "scale", "offset") if self.native else ("packed", "scale_zero", "scale_zero_rest")
        return [getattr(self, name) for name in names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features] in x's dtype (float32 from the int4 path with float_output)
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return self.dense(x)
        if self.native:
            return int4_native.int4_linear(x, self.packed, self.scale, self.offset, self.group_size,
                                           self.float_output)
        high = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)
        rest = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero_rest)
        return high.float().add_(rest) if self.float_output else high.add_(rest)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of " \
               f"{self.group_size}, {'native' if self.native else 'torch'} up to {self.max_rows} rows"


def int4_backend(device: torch.device, dtype: torch.dtype, native: bool) -> str | None:
    """'native', 'torch' or None: the int4 path a model of `dtype` takes on `device`. torch's kernel is fast
    with bf16 activations only; the native one with either, where it builds (an AVX2 or newer x86 host)."""
    if device.type != "cpu":
        return None
    if native and int4_native.native_int4() is not None:
        return "native"
    return "torch" if dtype == torch.bfloat16 and can_use_int4(device) else None


def can_use_int4(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def find_four_bit_linears(model: nn.Module) -> dict[str, tuple]:
    """The float32 model's bias-free linear layers whose weights are 4-bit groups -> their groups.
    Call before the cast to bf16 (which would round the weights)."""
    found = {}
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) and module.bias is None and name != "lm_head"  # the head stays float32
                and module.out_features % 16 == 0):  # the kernel's packing needs whole 16-row tiles
            groups = four_bit_groups(module.weight.detach())
            if groups is not None:
                found[name] = groups
    return found


def use_int4_linears(model: nn.Module, four_bit: dict[str, tuple], native: bool = False) -> int:
    """Wraps each layer named in `four_bit` (after the cast and packing) in an Int4Linear; returns how many."""
    for name, (q, scale, zero) in four_bit.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, Int4Linear(getattr(owner, child), q, scale, zero, child in FLOAT_OUTPUT_LAYERS,
                                         native))
    return len(four_bit)
