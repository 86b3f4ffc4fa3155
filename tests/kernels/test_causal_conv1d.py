"""Causal depthwise conv1d (replicas/kernels/causal_conv1d): its one backend today, the PyTorch reference
(naive.py) on every device: packed varlen vs per sequence, prefill then decode updates vs one shot, initial
states honoured, and transformers' torch fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from replicas.kernels.causal_conv1d import (causal_conv1d, causal_conv1d_update, naive_causal_conv1d,
                                           naive_causal_conv1d_update)
from tests.kernels.test_gated_delta_rule import assert_close

C, W = 24, 4


def dense_conv(x: torch.Tensor, weight: torch.Tensor, bias, history: torch.Tensor) -> torch.Tensor:
    """One sequence, spelled out: x [L, C], history [C, W - 1] -> silu(conv) [L, C]."""
    window = torch.cat([history, x.T], dim=-1)  # [C, W - 1 + L]
    out = torch.stack([(window[:, t:t + W] * weight).sum(-1) for t in range(x.shape[0])])
    return F.silu(out if bias is None else out + bias)


def inputs(num_tokens: int, num_seqs: int, seed: int = 0, use_bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    bias = torch.randn(C, generator=gen) if use_bias else None
    states = torch.randn(num_seqs, C, W - 1, generator=gen)
    return x, weight, bias, states


@pytest.mark.parametrize("use_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("use_states", [False, True], ids=["zeros", "states"])
def test_varlen_packed_equals_per_sequence(use_states, use_bias):
    lengths = [1, 2, 5, 13, 3]  # some shorter than W - 1: the final state reaches into the initial one
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    x, weight, bias, states = inputs(sum(lengths), len(lengths), use_bias=use_bias)
    states = states if use_states else None
    y, final = naive_causal_conv1d(x, weight, bias, cu_seqlens, states, output_final_state=True, activation="silu")
    for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        history = states[n] if use_states else torch.zeros(C, W - 1)
        assert_close(f"y[{n}]", dense_conv(x[lo:hi], weight, bias, history), y[lo:hi], 1e-6)
        expected_final = torch.cat([history, x[lo:hi].T], dim=-1)[:, -(W - 1):]
        assert torch.equal(final[n], expected_final), n


def test_prefill_then_updates_equal_one_shot():
    x, weight, bias, states = inputs(20, 1, seed=1)
    y_all, final_all = naive_causal_conv1d(x, weight, bias, None, states, output_final_state=True, activation="silu")
    y, state = naive_causal_conv1d(x[:14], weight, bias, None, states, output_final_state=True, activation="silu")
    ys = [y]
    for t in range(14, 20):
        old, before = state, state.clone()
        y_t, state = naive_causal_conv1d_update(x[t:t + 1], state, weight, bias, activation="silu")
        assert torch.equal(old, before)  # the input state is not modified
        ys.append(y_t)
    assert_close("y", y_all, torch.cat(ys), 1e-6)
    assert torch.equal(final_all, state)


def test_chunks_continue_from_final_states():
    # Two sequences prefilled in two chunks each (one packed call per chunk) == one call over everything.
    x, weight, bias, states = inputs(30, 2, seed=2)
    a, b = x[:17], x[17:]  # sequence lengths 17 and 13
    whole, final = naive_causal_conv1d(x, weight, bias, torch.tensor([0, 17, 30]), states, True, "silu")
    cut_a, cut_b = 6, 2
    first = torch.cat([a[:cut_a], b[:cut_b]])
    y1, mid = naive_causal_conv1d(first, weight, bias, torch.tensor([0, cut_a, cut_a + cut_b]), states, True, "silu")
    second = torch.cat([a[cut_a:], b[cut_b:]])
    y2, end = naive_causal_conv1d(second, weight, bias, torch.tensor([0, 17 - cut_a, 30 - cut_a - cut_b]), mid,
                                  True, "silu")
    got = torch.cat([y1[:cut_a], y2[:17 - cut_a], y1[cut_a:], y2[17 - cut_a:]])
    assert_close("y", whole, got, 1e-6)
    assert torch.equal(final, end)


def test_matches_transformers_torch_fallbacks():
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    x, weight, bias, _ = inputs(11, 1, seed=3)
    ref = qwen.causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T  # [B, C, L] layout
    got, _ = naive_causal_conv1d(x, weight, bias, activation="silu")
    assert_close("y fn", ref, got, 1e-6)
    state = torch.randn(3, C, W - 1)
    step = torch.randn(3, C)
    hf_state = state.clone()
    ref = qwen.causal_conv1d_update(step[:, :, None], hf_state, weight, bias, activation="silu")[:, :, 0]
    got, new_state = naive_causal_conv1d_update(step, state, weight, bias, activation="silu")
    assert_close("y update", ref, got, 1e-6)
    assert torch.equal(hf_state, new_state)  # transformers updates its state in place


def test_dispatch_is_the_reference():
    """The op is its reference on every device (a CUDA kernel, when one comes, gets its parity test here)."""
    assert causal_conv1d is naive_causal_conv1d and causal_conv1d_update is naive_causal_conv1d_update


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
