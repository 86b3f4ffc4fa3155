"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU).

`F.linear` on CPU reorders a weight into oneDNN's layout on every call (or, in float32, takes
a slower BLAS path); at decode sizes that is most of the matmul's time (`bench/kernels/cpu_linear.py` at
SmolLM2's shapes, 2 threads: 53 vs 147 us for a [1, 576] x [576, 3072] product in bf16,
1.8 vs 4.7 ms for the [576, 49152] head in bf16, 1.8 vs 6.7 ms in float32). Float32 weights pack on
any x86 host; bfloat16 ones only where oneDNN's bf16 reorder runs (`can_pack`; elsewhere it raises).
`pack_linears` swaps each `nn.Linear` of a model for a `PackedLinear` that holds the reordered weight and
calls the same oneDNN kernel: bfloat16 results are bitwise those of `F.linear`, float32 ones equal within
rounding (~1e-6). The ops are private (`torch.ops.mkldnn`, what inductor uses for
frozen CPU graphs): where they are missing or refuse a weight, the layer stays as it was.

The package's native kernels for quantized weights: int4.py / int4_native.py (4-bit groups), int8_native.py
(the 8-bit head), expert_native.py (MoE experts at decode sizes); their references, and PackedLinear's, are
naive.py.
"""

import torch
from torch import nn

from replicas import cpu_isa
from replicas.kernels.cpu_linear.naive import naive_packed_linear


class PackedLinear(nn.Module):
    """nn.Linear's function with a prepacked weight; `weight` is the opaque oneDNN tensor (its dtype
    and shape are the original's)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # The batch-size hint only tunes the layout: every batch size runs on it.
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] in the weight's dtype -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {self.weight.dtype}"


def can_pack(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packing on this CPU for weights of `dtype`: float32 on any x86 host; bfloat16 only where
    oneDNN's bf16 reorder runs (AVX512 BW/VL/DQ or AVX-NE-CONVERT: replicas/cpu_isa.py), else it raises."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or \
            not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or cpu_isa.bf16_weights_supported()


# Narrower outputs stay on F.linear: oneDNN's packed call costs ~13 us whatever the size, F.linear 3-4 us for a
# [1, 512] x [512, <= 8] product (an MoE router, Qwen3.5's per-head gates; 2 threads, bf16 and float32).
MIN_PACKED_OUT_FEATURES = 64


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` (a CPU model) of at least MIN_PACKED_OUT_FEATURES outputs with a
    PackedLinear that gives the same output on a probe batch; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is not PackedLinear
               and isinstance(module, nn.Linear) and module.out_features >= MIN_PACKED_OUT_FEATURES
               and can_pack(module.weight.device, module.weight.dtype)]
    packed = 0
    for name, linear in targets:
        try:
            replacement = PackedLinear(linear)
            probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
            expected = naive_packed_linear(probe, linear.weight, linear.bias)
            if not torch.allclose(replacement(probe).float(), expected.float(), rtol=1e-3, atol=1e-3):
                continue
        except RuntimeError:  # this build's oneDNN refuses the dtype or shape: keep F.linear
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
        packed += 1
    return packed
