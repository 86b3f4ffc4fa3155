"""Gated delta rule: chunked vs recurrent references, packed varlen vs per sequence, prefill + decode vs one
shot, transformers' torch fallbacks, and (CUDA only) fla's Triton kernels vs the references.

Modelled on fla's flash-linear-attention/tests/ops/test_gdn.py: awkward T (not multiples of the 64-token
chunk), H != HV, outputs and final states checked by name with a relative-RMS error.
"""

import pytest
import torch
import torch.nn.functional as F

from replicas.kernels.gated_delta_rule import (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                               naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule)

K, V = 32, 24


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """fla's check: rms(ref - got) / rms(ref) <= tol; the message names the tensor and its diffs."""
    ref, got = ref.detach().double(), got.detach().double()
    max_diff = (ref - got).abs().max().item() if ref.numel() else 0.0
    ratio = (ref - got).pow(2).mean().sqrt().item() / (ref.pow(2).mean().sqrt().item() + 1e-12)
    assert ratio <= tol, f"{name}: rms ratio {ratio:.3e} > {tol}, max abs diff {max_diff:.3e}"


def make_inputs(batch: int, num_tokens: int, num_heads: int, num_v_heads: int, seed: int = 0,
                dtype=torch.float32, num_states: int | None = None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = rand(batch, num_tokens, num_heads, K), rand(batch, num_tokens, num_heads, K)
    v = rand(batch, num_tokens, num_v_heads, V)
    g = F.logsigmoid(rand(batch, num_tokens, num_v_heads) + 2.0)  # decays near 1, as trained models have
    beta = torch.rand(batch, num_tokens, num_v_heads, generator=gen)
    h0 = rand(num_states or batch, num_v_heads, K, V)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g), cast(beta), h0.to(device)


@pytest.mark.parametrize("use_h0", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["H=HV", "H<HV"])
@pytest.mark.parametrize("num_tokens", [1, 63, 75, 130])
def test_chunk_matches_recurrent(num_tokens, heads, use_h0):
    q, k, v, g, beta, h0 = make_inputs(2, num_tokens, *heads)
    h0 = h0 if use_h0 else None
    ref, ref_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    got, got_ht = naive_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    assert got.shape == (2, num_tokens, heads[1], V) and got_ht.shape == (2, heads[1], K, V)
    assert_close("o", ref, got, 1e-5)
    assert_close("ht", ref_ht, got_ht, 1e-5)


def test_scale_and_no_l2norm_and_small_chunks():
    q, k, v, g, beta, h0 = make_inputs(1, 50, 2, 4, seed=1)
    k = F.normalize(k, dim=-1)
    ref, ref_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0,
                                                   output_final_state=True)
    got, got_ht = naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0,
                                               output_final_state=True, chunk_size=16)
    assert_close("o", ref, got, 1e-5)
    assert_close("ht", ref_ht, got_ht, 1e-5)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_varlen_packed_equals_per_sequence(form):
    lengths = [1, 63, 75, 130, 5]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 4, seed=2, num_states=len(lengths))
    fn = naive_chunk_gated_delta_rule if form == "chunk" else naive_recurrent_gated_delta_rule
    got, got_ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
                     use_qk_l2norm_in_kernel=True)
    outs, states = [], []
    for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        o, ht = naive_recurrent_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                                                 beta[:, lo:hi], initial_state=h0[n:n + 1],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
        states.append(ht)
    assert_close("o", torch.cat(outs, dim=1), got, 1e-5)
    assert_close("ht", torch.cat(states), got_ht, 1e-5)


def test_prefill_then_decode_equals_one_shot():
    # The checkpoint invariant: a final state is exactly where the next step starts.
    q, k, v, g, beta, h0 = make_inputs(1, 75, 2, 4, seed=3)
    ref, ref_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    o, ht = naive_chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70],
                                         initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs = [o]
    for t in range(70, 75):
        o, ht = naive_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                 beta[:, t:t + 1], initial_state=ht, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert_close("o", ref, torch.cat(outs, dim=1), 1e-5)
    assert_close("ht", ref_ht, ht, 1e-5)


@pytest.mark.parametrize("num_tokens", [1, 75])
def test_matches_transformers_torch_fallbacks(num_tokens):
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, h0 = make_inputs(2, num_tokens, 2, 4, seed=4)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_ht = qwen.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    got, got_ht = naive_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert_close("o chunk", ref, got, 1e-5)
    assert_close("ht chunk", ref_ht, got_ht, 1e-5)
    ref, ref_ht = qwen.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    got, got_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert_close("o recurrent", ref, got, 1e-6)
    assert_close("ht recurrent", ref_ht, got_ht, 1e-6)


def test_dispatch_on_cpu_is_the_reference():
    q, k, v, g, beta, h0 = make_inputs(1, 9, 2, 4, seed=5)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for dispatched, naive in ((chunk_gated_delta_rule, naive_chunk_gated_delta_rule),
                              (fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule)):
        o, ht = dispatched(q, k, v, g, beta, **kwargs)
        ref, ref_ht = naive(q, k, v, g, beta, **kwargs)
        assert torch.equal(o, ref) and torch.equal(ht, ref_ht)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["H=HV", "H<HV"])
def test_fla_matches_reference_varlen(heads, dtype, tol):
    pytest.importorskip("fla.ops.gated_delta_rule")
    from replicas.kernels.gated_delta_rule import use_fla

    lengths = [1, 63, 75, 130, 5]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), *heads, seed=6, dtype=dtype, num_states=len(lengths),
                                       device="cuda")
    assert use_fla(q)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    ref, ref_ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    tri, tri_ht = chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert_close("o chunk", ref, tri, tol)
    assert_close("ht chunk", ref_ht, tri_ht, tol)
    # decode: one token per sequence, B = N, T = 1
    q1, k1, v1, g1, b1 = (x[:, cu_seqlens[1:] - 1].transpose(0, 1) for x in (q, k, v, g, beta))
    ref, ref_ht = naive_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    tri, tri_ht = fused_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert_close("o recurrent", ref, tri, tol)
    assert_close("ht recurrent", ref_ht, tri_ht, tol)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
