"""Paged attention over a flattened varlen batch vs dense causal attention per sequence.

fla's varlen test in miniature: the kernel runs once on a packed batch (decode rows and
prefill chunks of sequences with scattered blocks), the reference runs per sequence.
"""

import pytest
import torch

from replicas.engine.model_runner import ModelRunner
from replicas.engine.request import Request
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import naive_paged_attention, store_kvcache
from replicas.messages import SamplingParams

H, HKV, D, BLOCK = 6, 2, 16, 4


def dense_attention(q, k, v, first_pos: int) -> torch.Tensor:
    # q: [Tq, H, D] at positions first_pos..; k, v: [L, Hkv, D] at positions 0..L-1
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * D ** -0.5
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_varlen_batch_matches_dense(dtype, tol):
    torch.manual_seed(0)
    # (context already cached, tokens this step): two decode rows, two prefill chunks, one from scratch
    shapes = [(9, 1), (22, 1), (0, 13), (7, 6), (30, 1)]
    num_blocks = 64
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
    q = torch.randn(batch.input_ids.numel(), H, D, dtype=dtype)
    out = naive_paged_attention(q, k_cache, v_cache, batch.groups, D ** -0.5)  # [T, H, D]
    for s, (k, v), lo, hi in zip(scheduled, full_kv, batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
        expected = dense_attention(q[lo:hi], k, v, s.request.num_computed_tokens)
        assert (out[lo:hi].float() - expected).abs().max().item() <= tol, s.request.request_id


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
