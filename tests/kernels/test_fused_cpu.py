"""The fused CPU ops (replicas/kernels/fused_cpu) against their PyTorch references (naive.py).

float32: equal to rounding (the kernels sum in another order); bfloat16 outputs: within one bf16 ulp of the
reference, since both round the same float32 value and only its last float bits may differ."""

import pytest
import torch
from transformers import LlamaConfig

from replicas.cpu_isa import cpu_isa
from replicas.kernels import fused_cpu
from replicas.kernels.fused_cpu.naive import (naive_add_rms_norm, naive_apply_token_bitmask, naive_rms_norm,
                                             naive_rotary_embedding, naive_silu_and_mul)
from replicas.models.rope import rope_tables

pytestmark = pytest.mark.skipif(fused_cpu.fused_ops() is None,
                                reason=f"native ops not built here (ISA {cpu_isa()}, or no compiler / ninja)")
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(got: torch.Tensor, expected: torch.Tensor):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    else:  # one bf16 ulp: 2^-7 relative
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm(rows, x_dtype, out_dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, 576).to(x_dtype) * 3
    weight = (torch.rand(576) + 0.5).to(out_dtype)
    got = fused_cpu.rms_norm(x, weight.float(), 1e-5, out_dtype)
    assert_close(got, naive_rms_norm(x, weight, 1e-5, out_dtype))


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("h_dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(rows, h_dtype):
    torch.manual_seed(rows)
    residual, h = torch.randn(rows, 960), torch.randn(rows, 960).to(h_dtype)
    weight = torch.rand(960).to(h_dtype)
    expected_residual = residual.clone()
    expected = naive_add_rms_norm(expected_residual, h, weight, 1e-6, h_dtype)
    got = fused_cpu.rms_norm(h, weight.float(), 1e-6, h_dtype, residual=residual)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(got, expected)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place_on_a_strided_view(head_dim, dtype):
    """q and k as a view into the qkv projection's output ([T, (H + 2 Hkv) D]), as LlamaAttention rotates them."""
    torch.manual_seed(head_dim)
    tokens, heads, kv_heads = 11, 9, 3
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, head_dim=head_dim)
    cos, sin = rope_tables(config, 4096)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    width = (heads + kv_heads) * head_dim
    expected = naive_rotary_embedding(qkv[:, :width].view(tokens, -1, head_dim), positions, cos, sin)
    v_before = qkv[:, width:].clone()
    fused_cpu.rotary_embedding_(qkv[:, :width].view(tokens, -1, head_dim), positions, cos, sin)
    assert_close(qkv[:, :width].view(tokens, -1, head_dim), expected)
    assert torch.equal(qkv[:, width:], v_before)  # v untouched


@pytest.mark.parametrize("rows", [1, 2, 130])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_silu_and_mul(rows, x_dtype, out_dtype):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(x_dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
    assert_close(fused_cpu.silu_and_mul(gate_up, out_dtype), naive_silu_and_mul(gate_up, out_dtype))


@pytest.mark.parametrize("vocab", [49152, 100, 37])
def test_apply_token_bitmask(vocab):
    """Only the listed rows masked; words of all ones (free text), none (nothing allowed) and mixed bits; a
    vocabulary that is not a multiple of 32 (the last word's high bits past it)."""
    torch.manual_seed(vocab)
    rows, words = 5, -(-vocab // 32)
    logits = torch.randn(rows, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows + 1, words), dtype=torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2, : words // 2] = 0
    listed = [0, 1, 2, 4]
    expected = naive_apply_token_bitmask(logits, bitmask, listed)
    fused_cpu.apply_token_bitmask_(logits, bitmask, listed)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[2, :16 * (words // 2)]).all() and not torch.isinf(logits[3]).any()


def test_the_native_ops_are_torch_ops_with_fake_implementations():
    """torch.library.opcheck: the schemas say what each op writes, and the fake implementations (what
    torch.compile traces) give what the ops give."""
    ops = fused_cpu.fused_ops()
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
    torch.library.opcheck(ops.rms_norm.default, (torch.empty(3, 64), x, weight, 1e-5))
    torch.library.opcheck(ops.add_rms_norm.default, (torch.empty(3, 64), residual, x, weight, 1e-5))
    torch.library.opcheck(ops.silu_and_mul.default, (torch.empty(3, 32), x))
    cos, sin = torch.rand(8, 16), torch.rand(8, 16)
    torch.library.opcheck(ops.rotary_embedding.default, (torch.randn(3, 2, 16), torch.tensor([0, 3, 7]), cos, sin))
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32)
    torch.library.opcheck(ops.apply_token_bitmask.default, (torch.randn(3, 64), bitmask, torch.tensor([0, 2])))
