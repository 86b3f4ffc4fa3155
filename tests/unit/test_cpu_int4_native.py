"""The native int4 kernel (replicas/kernels/cpu_linear/int4_native.py) against x @ w.T with the
dequantized weight w = q * scale + offset, computed in float64."""

import pytest
import torch

from replicas.kernels.cpu_linear.int4 import four_bit_groups
from replicas.kernels.cpu_linear.int4_native import exact_half_scales, int4_linear, native_int4, pack_int4

pytestmark = pytest.mark.skipif(native_int4() is None, reason="the native int4 kernel could not be built on this "
                                "host (baseline ISA, TETHER_NATIVE=0, or no compiler / ninja: see the log)")
G = 32
# float32 rounding of sums over up to 1536 products: ~3e-7 of the largest output measured (both builds);
# a bf16 rounding of the scales (torch's int4 kernel) is ~1e-3
TOLERANCE = 2e-6


def groups(n: int, k: int, seed: int = 0):
    """Random (q [N, K] int32 in 0..15, scale [N, K/G], offset [N, K/G]) and w [N, K] float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    scale = torch.rand(n, k // G, generator=g) * 0.02 + 1e-3
    offset = (torch.rand(n, k // G, generator=g) - 0.7) * 0.1
    w = (q.view(n, -1, G).double() * scale[..., None].double() + offset[..., None].double()).view(n, k)
    return q, scale, offset, w


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("n", [16, 49, 576, 960])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_float32_activations_match_the_dequantized_weight(m, n, k):
    q, scale, offset, w = groups(n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = int4_linear(x, pack_int4(q), scale, offset, G)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.T) < TOLERANCE


@pytest.mark.parametrize("out_float32", [True, False])
@pytest.mark.parametrize("n, k", [(49, 32), (576, 576), (960, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_bf16_activations_are_widened_exactly_and_the_output_is_float32_or_rounded_once(m, n, k, out_float32):
    q, scale, offset, w = groups(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    out = int4_linear(x, pack_int4(q), scale, offset, G, out_float32=out_float32)
    ref = x.double() @ w.T  # the bf16 activations exactly, float64 math
    assert out.shape == (m, n) and out.dtype == (torch.float32 if out_float32 else torch.bfloat16)
    if out_float32:
        assert relative_error(out, ref) < TOLERANCE
    else:  # one bf16 rounding of the float32 result: 2^-9 relative at most (2^-8 allowed here)
        assert ((out.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all()
        assert torch.equal(out, int4_linear(x, pack_int4(q), scale, offset, G, out_float32=True).bfloat16())


def test_more_than_eight_rows_and_leading_dims():
    q, scale, offset, w = groups(64, 96, seed=3)
    x = torch.randn(2, 9, 96)  # 18 rows: passes of 8, 8 and 2 over the weights
    out = int4_linear(x, pack_int4(q), scale, offset, G)
    assert out.shape == (2, 9, 64)
    assert relative_error(out, x.double() @ w.T) < TOLERANCE


def test_strided_activations():
    q, scale, offset, w = groups(64, 96, seed=7)
    x = torch.randn(96, 3).t()  # [3, 96], not contiguous
    assert relative_error(int4_linear(x, pack_int4(q), scale, offset, G), x.double() @ w.T) < TOLERANCE


def test_larger_groups_share_one_scale():
    q, _, _, _ = groups(33, 256, seed=4)
    scale, offset = torch.rand(33, 2) * 0.02 + 1e-3, torch.rand(33, 2) * 0.1 - 0.05  # groups of 128
    w = q.view(33, 2, 128).double() * scale[..., None].double() + offset[..., None].double()
    x = torch.randn(3, 256)
    out = int4_linear(x, pack_int4(q), scale, offset, 128)
    assert relative_error(out, x.double() @ w.view(33, 256).T) < TOLERANCE


def test_reproduces_a_four_bit_checkpoint_weight_through_four_bit_groups():
    """A dequantized Q4_1 weight (float32, each group d * q + m) -> four_bit_groups -> the kernel's
    (q, scale, offset): the kernel applies that float32 weight."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (576, 18, G), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans 0..15, as the quantizer's min and max do
    d = (torch.rand(576, 18, 1, generator=g) * 0.02 + 1e-3).half().float()  # GGUF stores d and m as float16
    m = (-torch.rand(576, 18, 1, generator=g) * 0.1).half().float()
    weight = (q * d + m).view(576, 576)  # float32, as the loader has it
    found = four_bit_groups(weight)
    assert found is not None
    q4, step, zero = found
    scale, offset = step, zero - 8 * step  # (q - 8) * step + zero == q * scale + offset
    x = torch.randn(2, 576, generator=g)
    out = int4_linear(x, pack_int4(q4), scale.contiguous(), offset.contiguous(), G)
    assert relative_error(out, x.double() @ weight.double().T) < TOLERANCE
    assert torch.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-5)  # and torch's float32 matmul
    # the recovered scale and offset are float16 too (every group of SmolLM2's): half the scale bytes
    half_scale, half_offset = exact_half_scales(scale, offset)
    assert half_scale.dtype == torch.float16
    assert torch.equal(int4_linear(x, pack_int4(q4), half_scale, half_offset, G), out)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_float16_scales_apply_the_same_weights_where_they_are_exact(m):
    q, scale, offset, _ = groups(49, 576, seed=6)
    scale, offset = scale.half().float(), offset.half().float()  # as GGUF stores them
    half_scale, half_offset = exact_half_scales(scale, offset)
    assert half_scale.dtype == half_offset.dtype == torch.float16
    x, packed = torch.randn(m, 576), pack_int4(q)
    assert torch.equal(int4_linear(x, packed, half_scale, half_offset, G), int4_linear(x, packed, scale, offset, G))
    kept = exact_half_scales(scale + 1e-7, offset)  # not float16-exact: float32 kept
    assert kept[0].dtype == kept[1].dtype == torch.float32


def test_pack_layout_and_bad_inputs_raise():
    q = torch.arange(64, dtype=torch.int32).remainder(16).view(1, 64)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 32)  # rows padded to a whole quad
    flat = packed.view(-1)  # quad-major: block b of rows 0..3 is bytes 64b..64b+63, 16 a row
    assert flat[3].item() == 3 | (3 << 4)  # byte j of a block: weight j low, weight 16 + j high
    assert flat[64 + 5].item() == 5 | (5 << 4)  # row 0's second block
    assert flat[16:64].eq(0).all() and flat[64 + 16:].eq(0).all()  # the padding rows
    with pytest.raises(RuntimeError, match="0..15"):
        pack_int4(torch.full((1, 32), 16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        pack_int4(torch.zeros(1, 40, dtype=torch.int32))
    qs, scale, offset, _ = groups(16, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int4_linear(torch.randn(1, 64).half(), pack_int4(qs), scale, offset, G)
    with pytest.raises(RuntimeError, match="packed"):
        int4_linear(torch.randn(1, 96), pack_int4(qs), scale, offset, G)
    with pytest.raises(RuntimeError, match="scale and offset"):
        int4_linear(torch.randn(1, 64), pack_int4(qs), scale, offset[:8], G)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        int4_linear(torch.randn(1, 64), pack_int4(qs), scale.half(), offset, G)
    with pytest.raises(RuntimeError, match="group_size"):
        int4_linear(torch.randn(1, 64), pack_int4(qs), scale, offset, 48)
