"""Paged attention over a flattened varlen batch vs dense causal attention per sequence.

fla's varlen test in miniature: the kernel runs once on a packed batch (decode rows and
prefill chunks of sequences with scattered blocks), the reference runs per sequence.
"""

import pytest
import torch

from replicas.engine.model_runner import ModelRunner
from replicas.request.request import Request
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import naive, naive_paged_attention, naive_paged_decode_attention, store_kvcache
from core.messages import SamplingParams

H, HKV, D, BLOCK = 6, 2, 16, 4


def dense_attention(q, k, v, first_pos: int) -> torch.Tensor:
    # q: [Tq, H, D] at positions first_pos..; k, v: [L, Hkv, D] at positions 0..L-1
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * D ** -0.5
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


def build_batch(shapes: list[tuple[int, int]], dtype, seed: int = 0, num_blocks: int = 64):
    """A step over sequences with scattered blocks, built by ModelRunner.prepare; the cache holds every key.

    shapes: (context already cached, tokens this step) per sequence
    -> batch, k_cache, v_cache: [num_blocks, BLOCK, HKV, D], scheduled, full_kv: (k, v) [total, HKV, D] each"""
    torch.manual_seed(seed)
    k_cache = torch.zeros(num_blocks, BLOCK, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(torch.randperm(num_blocks).tolist())  # scattered blocks
    scheduled, full_kv = [], []
    for i, (cached, new) in enumerate(shapes):
        total = cached + new
        req = Request(f"s{i}", list(range(total)), SamplingParams(), 4, frozenset())
        req.block_table = [free.pop() for _ in range(-(-total // BLOCK))]
        req.num_computed_tokens = cached
        k, v = torch.randn(total, HKV, D, dtype=dtype), torch.randn(total, HKV, D, dtype=dtype)
        slots = torch.tensor([req.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)],
                             dtype=torch.int64)
        store_kvcache(k[:cached], v[:cached], k_cache, v_cache, slots)  # the cached part
        scheduled.append(ScheduledRequest(req, new))
        full_kv.append((k, v))
    runner = ModelRunner(None, [(k_cache, v_cache)], BLOCK, torch.device("cpu"))
    batch = runner.prepare(scheduled)
    new_k = torch.cat([k[s.request.num_computed_tokens:] for (k, _), s in zip(full_kv, scheduled)])
    new_v = torch.cat([v[s.request.num_computed_tokens:] for (_, v), s in zip(full_kv, scheduled)])
    store_kvcache(new_k, new_v, k_cache, v_cache, batch.slot_mapping)
    return batch, k_cache, v_cache, scheduled, full_kv


@pytest.mark.parametrize("tile", [64, 4], ids=["whole", "tiled"])  # prefill queries per SDPA call
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_varlen_batch_matches_dense(dtype, tol, tile, monkeypatch):
    monkeypatch.setattr(naive, "PREFILL_TILE", tile)
    # two decode rows, three prefill chunks (one from scratch), of different lengths and cached prefixes
    shapes = [(9, 1), (22, 1), (0, 13), (7, 6), (30, 1), (20, 9)]
    batch, k_cache, v_cache, scheduled, full_kv = build_batch(shapes, dtype)
    prefill = batch.groups[1]
    assert prefill.key_ends == [max(c + i + 1 for c, n in shapes if n > 1 and n > i) for i in range(13)]
    q = torch.randn(batch.input_ids.numel(), H, D, dtype=dtype)
    out = naive_paged_attention(q, k_cache, v_cache, batch.groups, D ** -0.5)  # [T, H, D]
    for s, (k, v), lo, hi in zip(scheduled, full_kv, batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
        expected = dense_attention(q[lo:hi], k, v, s.request.num_computed_tokens)
        assert (out[lo:hi].float() - expected).abs().max().item() <= tol, s.request.request_id


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_decode_reference_matches_group_path(dtype, tol):
    """naive_paged_decode_attention (the Triton decode kernel's spec) on the decode group's block_tables and
    context_lens gives the rows naive_paged_attention gives through gathered blocks and mask."""
    batch, k_cache, v_cache, _, _ = build_batch([(9, 1), (22, 1), (0, 13), (3, 1), (30, 1)], dtype, seed=1)
    decode = batch.groups[0]
    assert decode.query_index.shape == (4, 1) and decode.block_tables.dtype == torch.int32
    q = torch.randn(batch.input_ids.numel(), H, D, dtype=dtype)
    expected = naive_paged_attention(q, k_cache, v_cache, batch.groups, D ** -0.5)[decode.query_index[:, 0]]
    got = naive_paged_decode_attention(q[decode.query_index[:, 0]], k_cache, v_cache, decode.block_tables,
                                       decode.context_lens, D ** -0.5)  # [B, H, D]
    assert got.dtype == dtype
    assert (got.float() - expected.float()).abs().max().item() <= tol


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
