"""GGUF weights kept in their blocks (replicas/kernels/cpu_linear/gguf_blocks.py over gguf_gemm.cpp) against their
reference: the gguf package's dequantize, then F.linear (naive_gguf_linear), for every kept type on awkward shapes
(rows off the tile, k across chunk edges, 1 row); the float32 fixed-order linear's bits over the dequantized
weight; each row's bits the same at every row count and thread count; embedding rows bit for bit."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from replicas.kernels.cpu_linear.gguf_blocks import BLOCKS, BlockWeight, GGUFLinear, dequantized, native_gguf
from replicas.kernels.cpu_linear.invariant_native import invariant_linear, native_invariant, pack_invariant_weight
from replicas.kernels.cpu_linear.naive import naive_gguf_linear

needs_native = pytest.mark.skipif(native_gguf() is None, reason="the GGUF block kernel is not built here")

QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ALL_TYPES = QUANTIZED + [Q.F16, Q.BF16, Q.F32]


def random_rows(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of valid random blocks: random quants, float16 scales of a realistic size (~0.01)."""
    rng = np.random.default_rng(seed)
    qk, nbytes, fields = BLOCKS[qtype]
    if qk == 1:
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        if qtype == Q.F32:
            return values.view(np.uint8).reshape(n, -1)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8).reshape(n, -1)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    blocks = rng.integers(0, 256, (n, k // qk, nbytes), dtype=np.uint8)
    for at, size, unit in fields:
        if unit == 2:  # d, m, dmin: float16
            halves = (rng.standard_normal((n, k // qk)) * 0.01).astype(np.float16)
            blocks[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // qk, 2)
    return blocks.reshape(n, -1)


def shapes(qtype: Q) -> list[tuple[int, int]]:
    """(N, K): N off every tile; K one block, across the 256-k chunk edge, several chunks."""
    qk = BLOCKS[qtype][0]
    ks = {256: [256, 768, 1280], 32: [32, 288, 544], 1: [1, 17, 300]}[qk]
    return [(n, k) for n, k in zip([33, 17, 70], ks)]


@needs_native
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_gguf_linear_matches_the_reference(qtype):
    """Within float32 rounding of sum |x| |w| of x @ dequantize(w).T, for 1, 3 and 37 rows."""
    for n, k in shapes(qtype):
        rows = random_rows(qtype, n, k, seed=n * k)
        weight = BlockWeight(rows, qtype, k)
        for m in (1, 3, 37):
            x = torch.randn(m, k)
            got = weight.linear(x)
            ref = naive_gguf_linear(x.double(), rows, qtype, k).double()
            dense = dequantized(rows, qtype, k).double()
            bound = x.double().abs() @ dense.abs().T
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert ((got.double() - ref).abs() <= 1e-6 * bound + 1e-7).all(), (qtype.name, n, k, m)


@needs_native
@pytest.mark.skipif(native_invariant() is None, reason="the fixed-order linear is not built here")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_gguf_linear_is_the_fixed_order_linear_bit_for_bit(qtype):
    """Each weight rebuilt as the gguf package rebuilds it, summed in the fixed order: the batch-invariant linear over
    the dequantized weight gives the same bits, bias included -- float32, and bf16 over the weight rounded to bf16
    where both take the pairs form (AVX512-BF16) -- so a kept GGUF and its conversion agree."""
    pairs = torch.ops.tether.gguf_layout()[1] == 1
    for n, k in shapes(qtype):
        rows = random_rows(qtype, n, k, seed=n + k)
        x, bias = torch.randn(5, k), torch.randn(n)
        weight, dense = BlockWeight(rows, qtype, k), dequantized(rows, qtype, k).contiguous()
        assert torch.equal(weight.linear(x, bias), invariant_linear(x, pack_invariant_weight(dense), bias, n))
        x16 = x.to(torch.bfloat16)
        got = weight.linear(x16, bias)
        if pairs:
            dense16 = pack_invariant_weight(dense.to(torch.bfloat16))
            assert torch.equal(got, invariant_linear(x16, dense16, bias, n)), (qtype.name, n, k)
        else:  # the widen form on the float32 weight: the float32 result of the bf16 input, rounded once
            assert torch.equal(got, weight.linear(x16.float(), bias).to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_linear_rows_do_not_depend_on_the_batch(qtype):
    """Row r's bits alone = in batches of 2..300 rows, under 1, 2 and 3 threads."""
    rows = random_rows(qtype, 80, 512, seed=1)
    weight = BlockWeight(rows, qtype, 512)
    x = torch.randn(300, 512)
    alone = torch.cat([weight.linear(x[r:r + 1]) for r in range(8)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (2, 4, 5, 17, 300):
                assert torch.equal(weight.linear(x[:m])[:8], alone[:min(m, 8)]), (threads, m)
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_gguf_rows_are_the_dequantized_rows(qtype):
    n, k = shapes(qtype)[1]
    rows = random_rows(qtype, n, k, seed=3)
    ids = torch.tensor([0, n - 1, 5, 5, 16, n // 2])
    assert torch.equal(BlockWeight(rows, qtype, k).lookup(ids), dequantized(rows, qtype, k)[ids])


def test_merged_parts_of_different_types_with_bias_and_the_dequantized_fallback(monkeypatch):
    """A q/k/v projection whose parts differ in type (Q4_K_M's Q6_K V rows), set in another order than the
    output's (a file may list attn_k before attn_q): the concatenation in q, k, v order plus bias, in x's dtype;
    and the same layer where the native op is missing (float32 dequantized weights)."""
    k = 256
    parts = {"q_proj": (Q.Q4_K, 48), "k_proj": (Q.Q4_K, 16), "v_proj": (Q.Q6_K, 16)}
    raw = {name: random_rows(qtype, n, k, seed=n) for name, (qtype, n) in parts.items()}
    bias = torch.randn(80)
    x = torch.randn(3, k).to(torch.bfloat16)
    ref = torch.cat([naive_gguf_linear(x, raw[name], qtype, k) for name, (qtype, _) in parts.items()], -1) + bias
    dense = torch.cat([dequantized(raw[name], qtype, k) for name, (qtype, _) in parts.items()])
    # bf16: the weights rounded to bf16 (2^-9 each) where the pairs form runs, the output rounded once (2^-9)
    allowed = 2 ** -8 * (x.float().abs() @ dense.abs().T) + 2 ** -8 * ref.abs() + 1e-6

    def build():
        layer = GGUFLinear(k, {name: n for name, (_, n) in parts.items()})
        for name, (qtype, _) in reversed(parts.items()):
            layer.set_part(name, BlockWeight(raw[name], qtype, k))
        offset = 0
        for name, (_, n) in parts.items():
            layer.set_bias(name, bias[offset:offset + n])
            offset += n
        return layer

    layers = [build()] if native_gguf() is not None else []
    monkeypatch.setattr("replicas.kernels.cpu_linear.gguf_blocks.native_gguf", lambda: None)
    fallback = build()
    assert fallback.parts["q_proj"].packed is None
    for layer in layers + [fallback]:
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (3, 80)
        assert ((got.float() - ref).abs() <= allowed).all()


@needs_native
def test_parts_of_one_type_are_stacked_into_one_weight():
    """q/k/v of one type (whole tiles): one weight, one kernel call, the same output bit for bit."""
    k, rows = 256, {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    raw = {name: random_rows(Q.Q4_K, n, k, seed=n + 1) for name, n in rows.items()}
    layer = GGUFLinear(k, rows)
    for name in rows:
        layer.set_part(name, BlockWeight(raw[name], Q.Q4_K, k))
    x = torch.randn(5, k)
    apart = layer(x)
    layer.stack_parts()
    assert len(layer.parts) == 1 and torch.equal(layer(x), apart)
