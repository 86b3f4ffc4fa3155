"""cpu_linear (replicas/kernels/cpu_linear) against its references (naive.py) and the checkpoint's weights:

- PackedLinear (oneDNN prepacked weights) vs naive_packed_linear (F.linear);
- Int4Linear on both its backends (torch's two int4 passes over bf16, the native kernel) vs the float32
  weights, and four_bit_groups' recovery of GGUF Q4 groups;
- the native int4 kernel (int4_native.py) vs naive_int4_linear and x @ w.T with w = q * scale + offset in
  float64;
- the native int8 kernel (int8_native.py) and Int8Linear vs naive_int8_linear and x @ w.T in float64, and
  eight_bit_groups' recovery of Q8_0 groups;
- the native MoE expert kernel (expert_native.py) vs naive_expert_linear, and SparseMoeBlock's decode path on it:
  the grouped-matmul path's results, and a token alone = in its batch.
The fixed-order linear (invariant_native.py) has its own file, test_cpu_linear_invariant.py.

The native tests skip where the kernel is not built here (baseline ISA, TETHER_NATIVE=0, or no compiler /
ninja: the log says which).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replicas.cpu_isa import cpu_isa
from replicas.kernels.cpu_linear import PackedLinear, can_pack, int4, pack_linears
from replicas.kernels.cpu_linear.expert_native import expert_linear, native_experts
from replicas.kernels.cpu_linear.int4 import Int4Linear, can_use_int4, find_four_bit_linears, four_bit_groups
from replicas.kernels.cpu_linear.int4_native import exact_half_scales, int4_linear, native_int4, pack_int4
from replicas.kernels.cpu_linear.int8_native import MAX_ROWS, Int8Linear, eight_bit_groups, int8_linear, native_int8
from replicas.kernels.cpu_linear.naive import (dequantize_int8, naive_expert_linear, naive_int4_linear,
                                               naive_int8_linear, naive_packed_linear)
from replicas.models.moe import MAX_NATIVE_PAIRS, SparseMoeBlock, use_native_experts

NOT_BUILT = "could not be built on this host (baseline ISA, TETHER_NATIVE=0, or no compiler / ninja: see the log)"
needs_packing = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="this torch has no oneDNN packing")
needs_bf16_packing = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                        reason="oneDNN's bf16 weights need avx512 (BW/VL/DQ) or AVX-NE-CONVERT; "
                                               f"this host's ISA is {cpu_isa()}")
needs_int4 = pytest.mark.skipif(not can_use_int4(torch.device("cpu")), reason="this torch has no int4 CPU kernel")
needs_native_int4 = pytest.mark.skipif(native_int4() is None, reason=f"the native int4 kernel {NOT_BUILT}")
needs_native_int8 = pytest.mark.skipif(native_int8() is None, reason=f"the native int8 kernel {NOT_BUILT}")
needs_native_experts = pytest.mark.skipif(native_experts() is None, reason=f"the native expert kernel {NOT_BUILT}")
G = 32  # GGUF's Q4 / Q8_0 block
# int4: float32 rounding of sums over up to 1536 products: ~3e-7 of the largest output measured (both builds);
# a bf16 rounding of the scales (torch's int4 kernel) is ~1e-3
INT4_TOLERANCE = 2e-6
# int8: float32 sums over up to 576 products, measured against the sum of |x| |w| (which bounds every rounding)
INT8_TOLERANCE = 1e-5
EXPERT_TOLERANCE = 1e-5  # float32 sums, measured against the sum of |x| |w| (which bounds every rounding)


# ---- PackedLinear vs naive_packed_linear (F.linear)

@needs_packing
@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_bfloat16_equals_f_linear_bit_for_bit(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(linear)(x), naive_packed_linear(x, linear.weight, linear.bias))


@needs_packing
def test_float32_matches_f_linear_and_keeps_leading_dims():
    torch.manual_seed(0)
    linear = nn.Linear(64, 320, bias=False)
    x = torch.randn(2, 7, 64)
    out = PackedLinear(linear)(x)
    assert out.shape == (2, 7, 320) and out.dtype == torch.float32
    assert torch.allclose(out, naive_packed_linear(x, linear.weight), rtol=0, atol=1e-5)


@needs_packing
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


@needs_packing
def test_pack_linears_packs_float32_on_any_host_and_bfloat16_only_where_supported():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 64).to(torch.bfloat16))
    x = torch.randn(3, 32)
    expected = model[0](x)
    assert pack_linears(model) == (2 if can_pack(torch.device("cpu"), torch.bfloat16) else 1)
    assert type(model[0]) is PackedLinear
    assert torch.allclose(model[0](x), expected, rtol=0, atol=1e-5)
    assert (type(model[1]) is PackedLinear) == can_pack(torch.device("cpu"), torch.bfloat16)


# ---- Int4Linear (int4.py) vs F.linear with the checkpoint's float32 weights

def four_bit_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """What a dequantized GGUF Q4_1 tensor is: each run of 32 weights = d * q + m, q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer's min and max: every group spans its range
    d = torch.rand(rows, cols // 32, 1, generator=g).half().float() * 0.02 + 1e-3
    m = -torch.rand(rows, cols // 32, 1, generator=g).half().float() * 0.1
    return (q * d + m).view(rows, cols)


@needs_int4
def test_four_bit_groups_rebuild_the_weight_and_refuse_other_weights():
    weight = four_bit_weight(48, 96)
    q, scale, zero = four_bit_groups(weight)
    assert q.dtype == torch.int32 and q.min() >= 0 and q.max() <= 15
    rebuilt = ((q.view(48, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(48, 96)
    assert torch.allclose(rebuilt, weight, rtol=0, atol=1e-6)
    assert four_bit_groups(torch.randn(48, 96)) is None  # not 4-bit: never quantized here
    assert four_bit_groups(torch.randn(48, 40)) is None  # not a whole number of groups


@needs_int4
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


@needs_int4
@needs_native_int4
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


@needs_int4
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


# ---- the native int4 kernel (int4_native.py) vs naive_int4_linear and x @ w.T in float64

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


@needs_native_int4
@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("n", [16, 49, 576, 960])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_float32_activations_match_the_dequantized_weight(m, n, k):
    q, scale, offset, w = groups(n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = int4_linear(x, pack_int4(q), scale, offset, G)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.T) < INT4_TOLERANCE


@needs_native_int4
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
        assert relative_error(out, ref) < INT4_TOLERANCE
    else:  # one bf16 rounding of the float32 result: 2^-9 relative at most (2^-8 allowed here)
        assert ((out.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all()
        assert torch.equal(out, int4_linear(x, pack_int4(q), scale, offset, G, out_float32=True).bfloat16())


@needs_native_int4
@pytest.mark.parametrize("out_float32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_native_int4_matches_naive(m, dtype, out_float32):
    """The kernel and naive_int4_linear apply the same float32 weights: they differ in the order of their
    float32 sums, and where that tips a bf16 output's rounding, by one bf16 ulp (2^-7 relative at most)."""
    q, scale, offset, _ = groups(96, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = int4_linear(x, pack_int4(q), scale, offset, G, out_float32=out_float32)
    ref = naive_int4_linear(x, q, scale, offset, out_float32=out_float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        assert relative_error(out, ref.double()) < INT4_TOLERANCE
    else:
        ref = ref.double()
        assert ((out.double() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-6 * ref.abs().max()).all()


@needs_native_int4
def test_more_than_eight_rows_and_leading_dims():
    q, scale, offset, w = groups(64, 96, seed=3)
    x = torch.randn(2, 9, 96)  # 18 rows: passes of 8, 8 and 2 over the weights
    out = int4_linear(x, pack_int4(q), scale, offset, G)
    assert out.shape == (2, 9, 64)
    assert relative_error(out, x.double() @ w.T) < INT4_TOLERANCE


@needs_native_int4
def test_strided_activations():
    q, scale, offset, w = groups(64, 96, seed=7)
    x = torch.randn(96, 3).t()  # [3, 96], not contiguous
    assert relative_error(int4_linear(x, pack_int4(q), scale, offset, G), x.double() @ w.T) < INT4_TOLERANCE


@needs_native_int4
def test_larger_groups_share_one_scale():
    q, _, _, _ = groups(33, 256, seed=4)
    scale, offset = torch.rand(33, 2) * 0.02 + 1e-3, torch.rand(33, 2) * 0.1 - 0.05  # groups of 128
    w = q.view(33, 2, 128).double() * scale[..., None].double() + offset[..., None].double()
    x = torch.randn(3, 256)
    out = int4_linear(x, pack_int4(q), scale, offset, 128)
    assert relative_error(out, x.double() @ w.view(33, 256).T) < INT4_TOLERANCE


@needs_native_int4
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
    assert relative_error(out, x.double() @ weight.double().T) < INT4_TOLERANCE
    assert torch.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-5)  # and torch's float32 matmul
    # the recovered scale and offset are float16 too (every group of SmolLM2's): half the scale bytes
    half_scale, half_offset = exact_half_scales(scale, offset)
    assert half_scale.dtype == torch.float16
    assert torch.equal(int4_linear(x, pack_int4(q4), half_scale, half_offset, G), out)


@needs_native_int4
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


@needs_native_int4
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


# ---- the native int8 kernel (int8_native.py) vs naive_int8_linear and x @ w.T in float64; eight_bit_groups

def q8_groups(n: int, k: int, seed: int = 0):
    """Random GGUF Q8_0-shaped (q [N, K] int8 in -127..127, scale [N, K/G] float32 holding float16 values)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, k // G, generator=g) * 0.01 + 1e-4).half().float()
    return q, scale


def assert_matches(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T  # the scale of every float32 rounding in the sum
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= INT8_TOLERANCE * bound + 1e-30).all(), \
        ((out.double() - ref).abs() / bound).max().item()


@needs_native_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("n", [16, 49, 1000])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_kernel_matches_the_dequantized_weight(m, n, k, dtype):
    q, scale = q8_groups(n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).to(dtype)
    out = torch.full((m, n), float("nan"))
    result = int8_linear(x, q, scale, G, out)
    assert result.data_ptr() == out.data_ptr()  # written in place
    assert_matches(out, x, dequantize_int8(q, scale))


@needs_native_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16, 17])
def test_native_int8_matches_naive(m, dtype):
    """The kernel and naive_int8_linear apply the same (exact) weights and differ in the order of their float32
    sums: each within INT8_TOLERANCE of the float64 product, so within twice that of each other."""
    q, scale = q8_groups(200, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = naive_int8_linear(x, q, scale)
    out = int8_linear(x, q, scale, G)
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
    bound = x.double().abs() @ dequantize_int8(q, scale).double().abs().T
    assert ((out.double() - ref.double()).abs() <= 2 * INT8_TOLERANCE * bound + 1e-30).all()


def test_naive_references_match_float64():
    """naive_int4_linear and naive_int8_linear (the specs the kernels are held to) against the same products in
    float64: float32 sums of the weights the checkpoint stores."""
    q, scale, offset, w = groups(49, 576, seed=9)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9))
    assert relative_error(naive_int4_linear(x, q, scale, offset, out_float32=True), x.double() @ w.T) < INT4_TOLERANCE
    q8, scale8 = q8_groups(49, 576, seed=9)
    assert_matches(naive_int8_linear(x, q8, scale8), x, dequantize_int8(q8, scale8))


@needs_native_int8
@pytest.mark.parametrize("m", [3, 9, 17, 40])
def test_kernel_any_row_count_and_strided_x(m):
    """Odd tile remainders, more than 16 rows (passes of 16), a non-contiguous x, a group size of 64."""
    q, scale = q8_groups(37, 128, seed=m)
    x = torch.randn(128, m, generator=torch.Generator().manual_seed(m)).T  # strided [m, 128]
    assert_matches(int8_linear(x, q, scale, G), x, dequantize_int8(q, scale))
    w = dequantize_int8(q, scale)
    groups64 = eight_bit_groups(w, 64)
    if groups64 is not None:  # two Q8_0 groups rarely share a scale; when found, the kernel applies it
        assert_matches(int8_linear(x, *groups64, 64), x, w)


@needs_native_int8
def test_kernel_rejects_bad_inputs():
    q, scale = q8_groups(16, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError):
        int8_linear(x, q.to(torch.int32), scale, G)
    with pytest.raises(RuntimeError):
        int8_linear(x, q, scale, 48)
    with pytest.raises(RuntimeError):
        int8_linear(x, q, scale.half(), G)
    with pytest.raises(RuntimeError):
        int8_linear(x, q, scale, G, torch.empty(2, 15))


def test_eight_bit_groups_recovers_q8_0_exactly():
    q, scale = q8_groups(300, 576, seed=1)
    w = dequantize_int8(q, scale)
    found = eight_bit_groups(w)
    assert found is not None
    q2, scale2 = found
    assert q2.dtype == torch.int8 and scale2.dtype == torch.float32 and q2.shape == q.shape
    assert torch.equal(dequantize_int8(q2, scale2), w)  # the same weights, bit for bit


def test_eight_bit_groups_without_the_full_range():
    """Groups whose max |q| is below 127 (and groups of zeros) are found by the search below 127."""
    q, scale = q8_groups(64, 128, seed=2)
    q = q.view(64, -1, G)
    q[::3, 1] = (q[::3, 1].float() * 0.4).round().to(torch.int8)  # max |q| ~50
    q[5, 2] = torch.tensor([0, 1, -3, 2] * 8, dtype=torch.int8)  # max |q| 3
    q[7, 0] = 0
    q = q.view(64, 128)
    w = dequantize_int8(q, scale)
    found = eight_bit_groups(w)
    assert found is not None
    assert torch.equal(dequantize_int8(*found), w)
    assert found[1][7, 0] == 0


def test_eight_bit_groups_rejects_other_weights():
    g = torch.Generator().manual_seed(3)
    assert eight_bit_groups(torch.randn(1000, 64, generator=g)) is None
    q, scale = q8_groups(64, 64, seed=4)
    w = dequantize_int8(q, scale)
    w[10, 5] = w[10, 5].item() * (1 + 2 ** -20)  # one weight off the grid
    assert eight_bit_groups(w) is None
    assert eight_bit_groups(w.double()) is None  # float32 only
    assert eight_bit_groups(torch.randn(4, 48, generator=g)) is None  # K not a multiple of 32
    nan = dequantize_int8(q, scale)
    nan[0, 0] = float("nan")
    assert eight_bit_groups(nan) is None


@needs_native_int8
def test_int8_linear_module_uses_dense_above_max_rows():
    q, scale = q8_groups(49, 64, seed=5)
    w = dequantize_int8(q, scale)
    dense = nn.Linear(64, 49, bias=False)
    with torch.no_grad():
        dense.weight.copy_(w)
    calls = []
    dense.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    layer = Int8Linear.from_weight(dense, w)
    assert layer is not None and layer.group_size == G and layer.max_rows == MAX_ROWS
    for rows in (1, MAX_ROWS):
        x = torch.randn(rows, 64)
        assert_matches(layer(x), x, w)
    assert calls == []
    x = torch.randn(MAX_ROWS + 1, 64)
    assert torch.equal(layer(x), dense(x)) and calls == [MAX_ROWS + 1] * 2
    assert Int8Linear.from_weight(dense, torch.randn(49, 64)) is None


@pytest.mark.slow
def test_smollm2_head_is_exactly_eight_bit(smollm2_float32_dir):
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    for path in sorted(smollm2_float32_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                weight = f.get_tensor(name).float()
                break
    else:
        pytest.fail(f"no {name} in {smollm2_float32_dir}")
    found = eight_bit_groups(weight)
    assert found is not None, "SmolLM2's head is not made of exact 8-bit groups"
    q, scale = found
    assert torch.equal(dequantize_int8(q, scale), weight)
    if native_int8() is not None:
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        assert_matches(int8_linear(x, q, scale, G), x, weight)


# ---- the native MoE expert kernel (expert_native.py) vs naive_expert_linear; SparseMoeBlock's decode path on it

@needs_native_experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_pairs,n,k", [(1, 1024, 512), (16, 96, 512), (3, 37, 70), (5, 8, 17), (0, 8, 16)])
def test_matches_the_reference(dtype, num_pairs, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(6, n, k, generator=g).to(dtype)
    x = torch.randn(num_pairs, k, generator=g).to(dtype)
    ids = torch.randint(0, 6, (num_pairs,), generator=g)
    out = expert_linear(x, w, ids)
    ref = torch.bmm(w[ids].double(), x.double().unsqueeze(-1)).squeeze(-1)
    bound = torch.bmm(w[ids].double().abs(), x.double().abs().unsqueeze(-1)).squeeze(-1)
    assert out.shape == (num_pairs, n) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= EXPERT_TOLERANCE * bound + 1e-30).all()
    assert torch.allclose(out, naive_expert_linear(x, w, ids), atol=1e-4, rtol=1e-5)


@needs_native_experts
def test_a_pair_does_not_depend_on_the_others_and_bad_ids_are_refused():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 64, 128, generator=g).bfloat16(), torch.randn(9, 128, generator=g)
    ids = torch.tensor([3, 0, 3, 1, 2, 2, 0, 1, 3])
    batch = expert_linear(x, w, ids)
    for p in range(9):
        assert torch.equal(expert_linear(x[p:p + 1], w, ids[p:p + 1])[0], batch[p])
    with pytest.raises(RuntimeError, match="out of range"):
        expert_linear(x[:1], w, torch.tensor([4]))


def moe_block(dtype: torch.dtype, shared: int) -> SparseMoeBlock:
    torch.manual_seed(1)
    block = SparseMoeBlock(64, 32, 8, 2, norm_topk_prob=True, shared_expert_intermediate_size=shared)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.to(dtype).eval()


@needs_native_experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 48])
def test_moe_decode_on_the_native_kernel(dtype, shared):
    block = moe_block(dtype, shared)
    x = torch.randn(MAX_NATIVE_PAIRS // 2, 64).to(dtype)  # 8 decode rows, top-2: the native path's limit
    with torch.inference_mode():
        grouped = block(x)
        assert use_native_experts(block) == 1
        native = block(x)
        alone = [block(x[t:t + 1]) for t in range(x.shape[0])]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the grouped path rounds its matmuls to bf16
    assert torch.allclose(native.float(), grouped.float(), atol=tolerance, rtol=tolerance)
    for t in range(x.shape[0]):  # float32: the router's one-row matmul (MKL) rounds apart from the batched one
        assert torch.equal(alone[t][0], native[t]) if dtype == torch.bfloat16 else \
            torch.allclose(alone[t][0], native[t], atol=1e-5, rtol=1e-5)


# ---- the native ops as torch ops: schemas and fake implementations (what torch.compile traces)

@needs_native_int4
@needs_native_int8
@needs_native_experts
def test_the_native_ops_are_torch_ops_with_fake_implementations():
    q, scale, offset, _ = groups(8, 64)
    torch.library.opcheck(native_int4().int4_pack.default, (q,))
    x = torch.randn(3, 64)
    for out_float32 in (True, False):
        torch.library.opcheck(native_int4().int4_linear.default, (x, pack_int4(q), scale, offset, G, out_float32))
    q8, scale8 = q8_groups(8, 64)
    torch.library.opcheck(native_int8().int8_linear.default, (x, q8, scale8, G, torch.empty(3, 8)))
    w, expert = torch.randn(4, 8, 64), torch.tensor([0, 3, 3])
    torch.library.opcheck(native_experts().expert_linear.default, (x, w, expert, torch.empty(3, 8)))
