"""The native int8 kernel (replicas/kernels/cpu_linear/int8_native.py) against x @ w.T with the
dequantized weight w = q * scale computed in float64, and eight_bit_groups' recovery of Q8_0 groups."""

import pytest
import torch
from torch import nn

from replicas.kernels.cpu_linear.int8_native import (MAX_ROWS, Int8Linear, eight_bit_groups, int8_linear,
                                                     native_int8)

needs_native = pytest.mark.skipif(native_int8() is None, reason="the native int8 kernel could not be built on "
                                  "this host (baseline ISA, TETHER_NATIVE=0, or no compiler / ninja: see the log)")
G = 32
# float32 sums over up to 576 products, measured against the sum of |x| |w| (which bounds every rounding)
TOLERANCE = 1e-5


def q8_groups(n: int, k: int, seed: int = 0):
    """Random GGUF Q8_0-shaped (q [N, K] int8 in -127..127, scale [N, K/G] float32 holding float16 values)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, k // G, generator=g) * 0.01 + 1e-4).half().float()
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, -1, G).float() * scale[..., None]).view(n, k)  # exact in float32


def assert_matches(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T  # the scale of every float32 rounding in the sum
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= TOLERANCE * bound + 1e-30).all(), \
        ((out.double() - ref).abs() / bound).max().item()


@needs_native
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
    assert_matches(out, x, dequantized(q, scale))


@needs_native
@pytest.mark.parametrize("m", [3, 9, 17, 40])
def test_kernel_any_row_count_and_strided_x(m):
    """Odd tile remainders, more than 16 rows (passes of 16), a non-contiguous x, a group size of 64."""
    q, scale = q8_groups(37, 128, seed=m)
    x = torch.randn(128, m, generator=torch.Generator().manual_seed(m)).T  # strided [m, 128]
    assert_matches(int8_linear(x, q, scale, G), x, dequantized(q, scale))
    w = dequantized(q, scale)
    groups64 = eight_bit_groups(w, 64)
    if groups64 is not None:  # two Q8_0 groups rarely share a scale; when found, the kernel applies it
        assert_matches(int8_linear(x, *groups64, 64), x, w)


@needs_native
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
    w = dequantized(q, scale)
    found = eight_bit_groups(w)
    assert found is not None
    q2, scale2 = found
    assert q2.dtype == torch.int8 and scale2.dtype == torch.float32 and q2.shape == q.shape
    assert torch.equal(dequantized(q2, scale2), w)  # the same weights, bit for bit


def test_eight_bit_groups_without_the_full_range():
    """Groups whose max |q| is below 127 (and groups of zeros) are found by the search below 127."""
    q, scale = q8_groups(64, 128, seed=2)
    q = q.view(64, -1, G)
    q[::3, 1] = (q[::3, 1].float() * 0.4).round().to(torch.int8)  # max |q| ~50
    q[5, 2] = torch.tensor([0, 1, -3, 2] * 8, dtype=torch.int8)  # max |q| 3
    q[7, 0] = 0
    q = q.view(64, 128)
    w = dequantized(q, scale)
    found = eight_bit_groups(w)
    assert found is not None
    assert torch.equal(dequantized(*found), w)
    assert found[1][7, 0] == 0


def test_eight_bit_groups_rejects_other_weights():
    g = torch.Generator().manual_seed(3)
    assert eight_bit_groups(torch.randn(1000, 64, generator=g)) is None
    q, scale = q8_groups(64, 64, seed=4)
    w = dequantized(q, scale)
    w[10, 5] = w[10, 5].item() * (1 + 2 ** -20)  # one weight off the grid
    assert eight_bit_groups(w) is None
    assert eight_bit_groups(w.double()) is None  # float32 only
    assert eight_bit_groups(torch.randn(4, 48, generator=g)) is None  # K not a multiple of 32
    nan = dequantized(q, scale)
    nan[0, 0] = float("nan")
    assert eight_bit_groups(nan) is None


@needs_native
def test_int8_linear_module_uses_dense_above_max_rows():
    q, scale = q8_groups(49, 64, seed=5)
    w = dequantized(q, scale)
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
def test_smollm2_head_is_exactly_eight_bit(smollm2_dir):
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    for path in sorted(smollm2_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                weight = f.get_tensor(name).float()
                break
    else:
        pytest.fail(f"no {name} in {smollm2_dir}")
    found = eight_bit_groups(weight)
    assert found is not None, "SmolLM2's head is not made of exact 8-bit groups"
    q, scale = found
    assert torch.equal(dequantized(q, scale), weight)
    if native_int8() is not None:
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        assert_matches(int8_linear(x, q, scale, G), x, weight)
