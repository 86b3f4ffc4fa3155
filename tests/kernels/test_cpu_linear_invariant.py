"""The fixed-order linear (replicas/kernels/cpu_linear/invariant_native.py over invariant_gemm.cpp, what
engine.batch_invariant runs every linear on) against its reference (naive_packed_linear, float64 sums), and each
row's bits the same at every row count, thread count and stride; its Q8_0 head and 4-bit forms: the exact
weights, and the 4-bit form the dense form's bits. Skips where the kernel is not built here."""

import pytest
import torch
from torch import nn

from replicas.kernels.cpu_linear.int4 import four_bit_groups
from replicas.kernels.cpu_linear.invariant_native import (INT4_MAX_ROWS, InvariantBf16WeightLinear,
                                                          InvariantInt8Linear, InvariantLinear, invariant_linear,
                                                          native_invariant, pack_invariant_weight,
                                                          use_invariant_linears)
from replicas.kernels.cpu_linear.naive import dequantize_int8, naive_packed_linear
from tests.kernels.test_cpu_linear import NOT_BUILT, assert_matches, q8_groups

needs_native_invariant = pytest.mark.skipif(native_invariant() is None,
                                            reason=f"the fixed-order linear kernel {NOT_BUILT}")


INVARIANT_SHAPES = [(576, 1536), (1536, 576), (577, 33), (63, 17), (1, 8), (64, 1000)]  # odd K, N off every block


@needs_native_invariant
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k,n", INVARIANT_SHAPES, ids=lambda v: str(v))
def test_fixed_order_linear_matches_the_reference(dtype, k, n):
    """Float32 sums of the same products as F.linear's: within float32 rounding of sum |x| |w|, plus one
    rounding of the output to bf16."""
    torch.manual_seed(k * n)
    linear = nn.Linear(k, n, bias=k % 2 == 1).to(dtype)
    x = torch.randn(37, k).to(dtype)
    got = InvariantLinear(linear)(x)
    ref = naive_packed_linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    bound = x.double().abs() @ linear.weight.double().abs().T  # [M, N]: bounds every rounding of the sum
    allowed = 1e-6 * bound + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0) + 1e-7
    assert got.dtype == dtype and got.shape == (37, n)
    assert ((got.double() - ref).abs() <= allowed).all()


@needs_native_invariant
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (577, 33)], ids=lambda v: str(v))
def test_fixed_order_linear_rows_do_not_depend_on_the_batch(dtype, k, n):
    """Row r's bits alone = in batches of 2..300 rows, under 1, 2 and 3 threads, from a strided view."""
    torch.manual_seed(0)
    layer = InvariantLinear(nn.Linear(k, n, bias=True).to(dtype))
    x = torch.randn(300, k).to(dtype)
    alone = torch.cat([layer(x[r:r + 1]) for r in range(8)])  # [8, N]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (2, 3, 4, 5, 8, 17, 300):
                assert torch.equal(layer(x[:rows])[:8], alone[:min(rows, 8)]), (threads, rows)
    finally:
        torch.set_num_threads(before)
    wide = torch.randn(8, 2 * k).to(dtype)
    wide[:, ::2] = x[:8]
    assert torch.equal(layer(wide[:, ::2].contiguous()), alone)
    padded = torch.zeros(8, k + 5, dtype=dtype)
    padded[:, :k] = x[:8]
    assert torch.equal(layer(padded[:, :k]), alone)  # rows contiguous, row stride K + 5


@needs_native_invariant
def test_use_invariant_linears_replaces_every_linear_and_refuses_bad_inputs():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 200, bias=False))
    x = torch.randn(3, 16)
    expected = model(x)
    assert use_invariant_linears(model) == 2
    assert all(isinstance(model[i], InvariantLinear) for i in (0, 2))
    assert torch.allclose(model(x), expected, atol=1e-5)
    packed = pack_invariant_weight(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="w holds"):
        invariant_linear(torch.randn(2, 16), packed, None, 17)  # two blocks of outputs, packed one
    with pytest.raises(RuntimeError, match="bf16 or float32|x's dtype"):
        invariant_linear(torch.randn(2, 16, dtype=torch.float64), packed, None, 8)
    torch.library.opcheck(native_invariant().invariant_linear.default,
                          (torch.randn(3, 16), packed, torch.randn(8), 8, torch.empty(3, 8)))


@needs_native_invariant
@pytest.mark.parametrize("n,k", [(1000, 96), (33, 64), (17, 576)], ids=lambda v: str(v))
def test_fixed_order_int8_head_applies_the_exact_weights_at_every_row_count(n, k):
    """The Q8_0 head on the fixed-order kernel: x @ (q * scale).T within float32 rounding of sum |x| |w|, and
    row r's bits alone = in batches of 2..40 rows under 1 and 2 threads."""
    q, scale = q8_groups(n, k, seed=n)
    head = InvariantInt8Linear(q, scale)
    w = dequantize_int8(q, scale)
    assert InvariantInt8Linear.from_weight(w) is not None and head.weight.dtype == torch.float32
    x = torch.randn(40, k)
    assert_matches(head(x), x, w)
    alone = torch.cat([head(x[r:r + 1]) for r in range(8)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (2, 3, 5, 8, 17, 40):
                assert torch.equal(head(x[:rows])[:8], alone[:min(rows, 8)]), (threads, rows)
    finally:
        torch.set_num_threads(before)
    torch.library.opcheck(native_invariant().invariant_int8_linear.default,
                          (x[:3], head.q, head.scale, head.group_size, n, torch.empty(3, n)))


@needs_native_invariant
@pytest.mark.parametrize("n,k", [(48, 64), (1536, 576), (576, 1536), (33, 96)], ids=lambda v: str(v))
def test_fixed_order_four_bit_groups_give_the_dense_float32_bits(n, k):
    """A float32 layer of GGUF Q4 groups keeps them (q4) and, up to INT4_MAX_ROWS rows, reads them instead of
    its dense copy: the same float32 weights summed in the same order, so the same bits at every row count;
    and the float32 reference within rounding. A weight that is not exactly 4-bit keeps only the dense form."""
    g = torch.Generator().manual_seed(n)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
    q[..., 0], q[..., 1] = 0, 15  # every group spans its range, as llama.cpp's quantizer makes it
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().double()  # GGUF's float16 d and m
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().double()
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_((q * d + m).float().view(n, k))  # GGUF's dequantization: d * q + m, one rounding
    four_bit = InvariantLinear(linear, four_bit_groups(linear.weight.detach()))
    dense = InvariantLinear(linear)
    assert four_bit.q4 is not None and dense.q4 is None
    x = torch.randn(INT4_MAX_ROWS + 3, k)
    for rows in (1, 2, 3, 5, 8, INT4_MAX_ROWS, INT4_MAX_ROWS + 3):
        assert torch.equal(four_bit(x[:rows]), dense(x[:rows])), rows
    ref = naive_packed_linear(x.double(), linear.weight.double())
    assert ((four_bit(x).double() - ref).abs() <= 1e-6 * (x.double().abs() @ linear.weight.double().abs().T)).all()
    groups = four_bit_groups(linear.weight.detach())
    with torch.no_grad():
        linear.weight[0, 0] += 1e-4  # one weight off its group's grid
    assert InvariantLinear(linear, groups).q4 is None  # the groups no longer rebuild it bit for bit: dense only
    q, scale, offset = four_bit.q4, four_bit.scale4, four_bit.offset4
    for extra in ((), (four_bit.weight, 2)):  # the 4-bit groups; the dense weight above 2 rows
        torch.library.opcheck(native_invariant().invariant_int4_linear.default,
                              (x[:3], q, scale, offset, 32, n, torch.empty(3, n), *extra))


@needs_native_invariant
@pytest.mark.parametrize("n,k", [(1000, 96), (33, 64), (577, 576)], ids=lambda v: str(v))
def test_bf16_weights_of_a_float32_head_give_its_float32_bits(n, k):
    """A bf16 checkpoint's head, kept float32: stored in bf16 and widened in the kernel, every row count gives
    the float32 copy's outputs bit for bit. A weight that is not all bf16 values is refused."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
    bias = torch.randn(n, generator=gen)
    linear = nn.Linear(k, n).requires_grad_(False)
    linear.weight.copy_(weight)
    linear.bias.copy_(bias)
    dense = InvariantLinear(linear)  # the float32 copy on the widen form
    head = InvariantBf16WeightLinear.from_weight(weight, bias)
    assert head is not None and head.weight.dtype == torch.float32
    assert head.packed.dtype == torch.bfloat16  # half the bytes of the float32 copy
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, k, generator=gen)
        assert torch.equal(head(x), dense(x))
    assert InvariantBf16WeightLinear.from_weight(weight + 1e-4) is None
