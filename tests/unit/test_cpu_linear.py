"""PackedLinear (replicas/kernels/cpu_linear) against F.linear, its PyTorch reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replicas.cpu_isa import cpu_isa
from replicas.kernels.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="this torch has no oneDNN packing")
needs_bf16_packing = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                        reason="oneDNN's bf16 weights need avx512 (BW/VL/DQ) or AVX-NE-CONVERT; "
                                               f"this host's ISA is {cpu_isa()}")


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_bfloat16_equals_f_linear_bit_for_bit(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


def test_float32_matches_f_linear_and_keeps_leading_dims():
    torch.manual_seed(0)
    linear = nn.Linear(64, 320, bias=False)
    x = torch.randn(2, 7, 64)
    out = PackedLinear(linear)(x)
    assert out.shape == (2, 7, 320) and out.dtype == torch.float32
    assert torch.allclose(out, F.linear(x, linear.weight), rtol=0, atol=1e-5)


@needs_bf16_packing
def test_pack_linears_replaces_every_linear_and_keeps_the_output():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 96), nn.SiLU(), nn.Sequential(nn.Linear(96, 64, bias=False)),
                          nn.Linear(64, 8)).to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert [type(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))] == \
        [PackedLinear, PackedLinear, nn.Linear]  # the narrow one (an MoE router) stays on F.linear: cheaper
    assert torch.equal(model(x), expected)
    assert pack_linears(model) == 0  # already packed: nothing left to do


def test_pack_linears_packs_float32_on_any_host_and_bfloat16_only_where_supported():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 64).to(torch.bfloat16))
    x = torch.randn(3, 32)
    expected = model[0](x)
    assert pack_linears(model) == (2 if can_pack(torch.device("cpu"), torch.bfloat16) else 1)
    assert type(model[0]) is PackedLinear
    assert torch.allclose(model[0](x), expected, rtol=0, atol=1e-5)
    assert (type(model[1]) is PackedLinear) == can_pack(torch.device("cpu"), torch.bfloat16)
