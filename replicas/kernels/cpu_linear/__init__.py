"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU).

`F.linear` on CPU reorders a bfloat16 weight into oneDNN's layout on every call;
at decode sizes that reorder is most of the matmul's time (`bench/cpu_linear.py` at
SmolLM2's shapes, 2 threads: 53 vs 147 us for a [1, 576] x [576, 3072] product,
1.8 vs 4.7 ms for the [576, 49152] head in bf16, 5.0 vs 10.4 ms in float32). `pack_linears` swaps each `nn.Linear` of a model for a
`PackedLinear` that holds the reordered weight and calls the same oneDNN kernel:
bfloat16 results are bitwise those of `F.linear`, float32 ones equal within
rounding (~1e-6). The ops are private (`torch.ops.mkldnn`, what inductor uses for
frozen CPU graphs): where they are missing or refuse a weight, the layer stays as it was.
"""

import torch
import torch.nn.functional as F
from torch import nn


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


def can_pack(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                      "_reorder_linear_weight")


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` (a CPU model) with a PackedLinear that gives the same
    output on a probe batch; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is not PackedLinear
               and isinstance(module, nn.Linear)]
    packed = 0
    for name, linear in targets:
        try:
            replacement = PackedLinear(linear)
            probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
            if not torch.allclose(replacement(probe).float(), F.linear(probe, linear.weight, linear.bias).float(),
                                  rtol=1e-3, atol=1e-3):
                continue
        except RuntimeError:  # this build's oneDNN refuses the dtype or shape: keep F.linear
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
        packed += 1
    return packed
