"""Int4Linear (replicas/kernels/cpu_linear/int4.py) against F.linear with the checkpoint's float32 weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replicas.cpu_isa import cpu_isa
from replicas.kernels.cpu_linear import int4, int4_native
from replicas.kernels.cpu_linear.int4 import Int4Linear, can_use_int4, find_four_bit_linears, four_bit_groups

pytestmark = pytest.mark.skipif(not can_use_int4(torch.device("cpu")), reason="this torch has no int4 CPU kernel")


def four_bit_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """What a dequantized GGUF Q4_1 tensor is: each run of 32 weights = d * q + m, q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer's min and max: every group spans its range
    d = torch.rand(rows, cols // 32, 1, generator=g).half().float() * 0.02 + 1e-3
    m = -torch.rand(rows, cols // 32, 1, generator=g).half().float() * 0.1
    return (q * d + m).view(rows, cols)


def test_four_bit_groups_rebuild_the_weight_and_refuse_other_weights():
    weight = four_bit_weight(48, 96)
    q, scale, zero = four_bit_groups(weight)
    assert q.dtype == torch.int32 and q.min() >= 0 and q.max() <= 15
    rebuilt = ((q.view(48, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(48, 96)
    assert torch.allclose(rebuilt, weight, rtol=0, atol=1e-6)
    assert four_bit_groups(torch.randn(48, 96)) is None  # not 4-bit: never quantized here
    assert four_bit_groups(torch.randn(48, 40)) is None  # not a whole number of groups


@pytest.mark.parametrize("float_output", [False, True])
def test_decode_rows_match_the_float32_weights_and_larger_batches_take_the_dense_layer(float_output):
    weight = four_bit_weight(208, 128, seed=1)
    dense = nn.Linear(128, 208, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(weight)
    layer = Int4Linear(dense, *four_bit_groups(weight), float_output=float_output)
    x = torch.randn(int4.INT4_MAX_ROWS, 128).to(torch.bfloat16)
    exact = x.float() @ weight.t()  # the checkpoint's weights, applied in float32
    out = layer(x)
    assert out.dtype == (torch.float32 if float_output else torch.bfloat16)
    # the two passes apply the weights to ~16 bits; what is left is the bf16 rounding of an output
    assert (out.float() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
    without_rest = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scale_zero).float()
    assert (out.float() - exact).norm() < (without_rest - exact).norm()  # the second pass is worth its time
    big = torch.randn(int4.INT4_MAX_ROWS + 1, 128).to(torch.bfloat16)
    assert torch.equal(layer(big), dense(big))


@pytest.mark.skipif(int4_native.native_int4() is None, reason=f"native ops not built here (ISA {cpu_isa()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int4_linear_applies_the_checkpoint_weights_in_one_pass(dtype):
    """The native path (any activation dtype, the AVX2 host's float32 included): the exact weights in float32
    math, up to its row limit; the dense layer above it."""
    weight = four_bit_weight(96, 128, seed=3)
    dense = nn.Linear(128, 96, bias=False).to(dtype)
    with torch.no_grad():
        dense.weight.copy_(weight)
    layer = Int4Linear(dense, *four_bit_groups(weight), float_output=True, native=True)
    assert layer.max_rows == int4.NATIVE_MAX_ROWS[dtype]
    x = torch.randn(layer.max_rows, 128).to(dtype)
    exact = x.double() @ weight.double().t()
    out = layer(x)
    assert out.dtype == torch.float32
    assert (out.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    big = torch.randn(layer.max_rows + 1, 128).to(dtype)
    assert torch.equal(layer(big), dense(big))


def test_find_four_bit_linears_skips_the_head_and_dense_weights():
    model = nn.Module()
    model.down_proj = nn.Linear(64, 32, bias=False)
    model.noisy = nn.Linear(64, 32, bias=False)
    model.lm_head = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        model.down_proj.weight.copy_(four_bit_weight(32, 64))
        model.lm_head.weight.copy_(four_bit_weight(32, 64, seed=2))
    found = find_four_bit_linears(model)
    assert set(found) == {"down_proj"}
    model.to(torch.bfloat16)
    assert int4.use_int4_linears(model, found) == 1
    assert isinstance(model.down_proj, Int4Linear) and model.down_proj.float_output
    x = torch.randn(1, 64).to(torch.bfloat16)
    exact = F.linear(x.float(), four_bit_weight(32, 64))
    assert (model.down_proj(x) - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
    model.odd = nn.Linear(64, 24, bias=False)  # 24 output rows: not whole 16-row tiles for the kernel
    with torch.no_grad():
        model.odd.weight.copy_(four_bit_weight(24, 64))
    assert "odd" not in find_four_bit_linears(model.float())


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
