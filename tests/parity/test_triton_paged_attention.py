"""Triton paged decode attention and store_kvcache vs their PyTorch references.

On CUDA the kernels run compiled; elsewhere under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), so
CI checks them too. Awkward shapes: scattered blocks, context lengths that are not multiples of the block
size (one of 1), GQA groups of 3 and 8 query heads, a head dim that is not a power of two, forced context
splits (flash-decoding), bf16 and fp32.
"""


import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.paged_attention.naive import naive_paged_attention, naive_paged_decode_attention  # noqa: E402
from replicas.kernels.paged_attention.naive import store_kvcache as naive_store_kvcache  # noqa: E402
from replicas.kernels.paged_attention.triton_decode import paged_decode_attention  # noqa: E402
from replicas.kernels.paged_attention.triton_store import store_kvcache  # noqa: E402
from tests.parity.test_gated_delta_rule import assert_close  # noqa: E402
from tests.parity.test_paged_attention import D, H, build_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTEXT_LENS = [37, 1, 16, 50, 9]  # sequence 0 first: B = 1 takes a long one
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16 measured 3e-3 to 6e-3 (P and out rounded to bf16)


def decode_inputs(batch: int, heads: tuple[int, int], head_dim: int, block_size: int, dtype, seed: int = 0):
    """q: [B, H, D]; caches: [num_blocks, block_size, Hkv, D] with each sequence's blocks scattered;
    block_tables: [B, N] int32 padded with block 0; context_lens: [B] int32"""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    context_lens = CONTEXT_LENS[:batch]
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(batch, max(blocks_per_seq), dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)  # noqa: E731
    q = rand(batch, num_heads, head_dim)
    k_cache, v_cache = (rand(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2))
    return (q, k_cache, v_cache, block_tables.to(DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split3"])
@pytest.mark.parametrize("heads,head_dim,block_size", [((6, 2), 32, 4), ((8, 1), 24, 16)],
                         ids=["G3-D32-bs4", "G8-D24-bs16"])
@pytest.mark.parametrize("batch", [1, 5], ids=["B1", "B5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_kernel_matches_reference(dtype, batch, heads, head_dim, block_size, num_splits):
    q, k_cache, v_cache, block_tables, context_lens = decode_inputs(batch, heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ref = naive_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    tri = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits)
    assert tri.shape == ref.shape and tri.dtype == dtype
    assert_close("o", ref, tri, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_kernel_on_a_model_runner_group(dtype):
    """The decode group ModelRunner.prepare builds (its block_tables and context_lens) through the kernel gives
    the rows naive_paged_attention gives for the whole step (decode rows beside a prefill chunk)."""
    batch, k_cache, v_cache, _, _ = build_batch([(9, 1), (0, 13), (22, 1), (3, 1)], dtype, seed=2)
    decode = batch.groups[0]
    q = torch.randn(batch.input_ids.numel(), H, D, dtype=dtype)
    expected = naive_paged_attention(q, k_cache, v_cache, batch.groups, D ** -0.5)[decode.query_index[:, 0]]
    to = lambda x: x.to(DEVICE)  # noqa: E731
    got = paged_decode_attention(to(q[decode.query_index[:, 0]]), to(k_cache), to(v_cache), to(decode.block_tables),
                                 to(decode.context_lens), D ** -0.5, num_splits=2)
    assert_close("o", expected, got.cpu(), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kvcache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 9, 2, 24  # Hkv * D = 48: a masked tail in the 64-wide block
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided rows, as slices of a fused projection
    slot_mapping = torch.randperm(8 * 4, generator=gen)[:num_tokens].to(DEVICE)
    k_cache = torch.zeros(8, 4, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    naive_store_kvcache(k, v, ref_k, ref_v, slot_mapping)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    skipped = slot_mapping.clone()
    skipped[3] = -1  # a row that writes nothing
    k_cache.zero_(), v_cache.zero_()
    store_kvcache(k, v, k_cache, v_cache, skipped)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[3]], torch.zeros_like(k[3]))
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[skipped[[0, 8]]], k[[0, 8]])


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
