"""The native CPU paged-attention kernel (cpu_attention.cpp) vs naive_varlen_attention, its spec.

Each case is one packed step (decode rows and prefill chunks over cached prefixes, several sequences, blocks
shuffled through the pool) run once through the kernel and once through the reference. Every cache slot no
sequence owns holds NaN, and block-table entries past a sequence's blocks are -1, so a kernel that reads a key
it should not fails loudly. float32 must agree to 1e-5; bfloat16 to one bf16 rounding of the output (both
sides compute in float32 from the same bf16 inputs: |diff| <= 2^-7 |ref| + 1e-5).
"""

import pytest
import torch
import torch.nn.functional as F

from replicas.kernels.paged_attention.cpu_native import cpu_paged_attention, cpu_store_kvcache, native_ops
from replicas.kernels.paged_attention.naive import naive_varlen_attention, store_kvcache

# SmolLM2-135M: 9 query heads over 3 KV heads of 64
H, HKV, D = 9, 3, 64
# (keys cached before the step, new tokens) per sequence: decode rows, a fresh prompt, chunks over prefixes
MIXED = [(9, 1), (0, 13), (40, 1), (20, 37), (0, 1), (100, 1), (64, 70), (5, 3), (30, 2)]


@pytest.fixture(scope="module")
def ops():
    module = native_ops()  # the first run on a host builds it (~10 s on 2 cores), later runs load it
    if module is None:
        pytest.skip("native op unavailable: no C++ compiler / ninja, baseline ISA, TETHER_NATIVE=0 or a failed "
                    "build (the log says which)")
    return module


def make_step(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int = 0):
    """One step's packed batch over a cache whose blocks are shuffled through the pool.

    seqs: (keys cached before the step, new tokens) per sequence
    -> q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (NaN in unowned slots);
       query_start_loc: [S + 1] int32; seq_lens: [S] int32; block_table: [S, max_blocks] int32 (-1 past the
       blocks in use); dense: per sequence (k, v) [L, Hkv, D], every key in position order"""
    gen = torch.Generator().manual_seed(seed)
    lens = [cached + new for cached, new in seqs]
    blocks = [-(-length // block_size) for length in lens]
    num_blocks = sum(blocks) + 3  # three never used
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.full((len(seqs), max(blocks) + 1), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    dense = []
    for s, length in enumerate(lens):
        table = [pool.pop() for _ in range(blocks[s])]
        block_table[s, :blocks[s]] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        store_kvcache(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    query_start_loc = torch.tensor([0] + [new for _, new in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = (2 * torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=gen)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, query_start_loc, seq_lens, block_table, dense


def check_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    diff = (got.float() - ref.float()).abs()
    allowed = 1e-5 if ref.dtype == torch.float32 else 2 ** -7 * ref.float().abs() + 1e-5
    bad = diff > allowed
    assert not bad.any(), f"{int(bad.sum())} of {diff.numel()} differ, max {diff.max().item():.3g}"


def run_both(seqs, num_heads=H, num_kv_heads=HKV, head_dim=D, block_size=16, dtype=torch.float32,
             sliding_window=0, softcap=0.0, seed=0):
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step(seqs, num_heads, num_kv_heads, head_dim,
                                                                   block_size, dtype, seed)
    args = (q, k_cache, v_cache, qsl, seq_lens, block_table, head_dim ** -0.5, sliding_window, softcap)
    return cpu_paged_attention(*args), naive_varlen_attention(*args)


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 32], ids=lambda b: f"block{b}")
def test_block_edges(ops, block_size, dtype):
    """Prompts of 1, 15, 16, 17, 33 tokens from scratch, and decode rows ending on each side of a block edge."""
    seqs = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (14, 1), (15, 1), (16, 1), (32, 1)]
    check_close(*run_both(seqs, block_size=block_size, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("sliding_window", [0, 8, 50], ids=["causal", "window8", "window50"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)], ids=["mha", "gqa3", "gqa8"])
def test_mixed_batch(ops, num_heads, num_kv_heads, head_dim, sliding_window, softcap, dtype):
    check_close(*run_both(MIXED, num_heads, num_kv_heads, head_dim, dtype=dtype, sliding_window=sliding_window,
                          softcap=softcap, seed=head_dim + num_heads))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,sliding_window", [
    pytest.param([(999, 1)], H, HKV, 0, id="decode1000"),
    pytest.param([(700, 1), (300, 1)], H, HKV, 0, id="decode2"),
    pytest.param([(600, 64)], 1, 1, 450, id="chunk-window450"),  # early rows see nothing of the last partition
    pytest.param([(500, 64)], 1, 1, 0, id="chunk-causal"),
])
def test_split_key_ranges(ops, seqs, num_heads, num_kv_heads, sliding_window, threads):
    """Fewer work items than 2x threads: long key ranges are split across threads, the partitions merged."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, ref = run_both(seqs, num_heads, num_kv_heads, sliding_window=sliding_window, seed=threads)
    finally:
        torch.set_num_threads(before)
    check_close(got, ref)


def test_head_dims(ops):
    """Every multiple of 16 up to 256 runs (64 and 128 are the tuned ones)."""
    for head_dim in (16, 48, 80, 96, 256):
        check_close(*run_both(MIXED[:4], 6, 2, head_dim, sliding_window=12, seed=head_dim))


def test_rejects_bad_layouts(ops):
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step([(3, 2)], 4, 2, 24, 4, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):  # head_dim 24
        ops.paged_attention(torch.empty_like(q), q, k_cache, v_cache, qsl, seq_lens, block_table, 0.2, 0, 0.0)
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step([(3, 2)], 4, 2, 16, 4, torch.float32)
    block_table[0, 0] = 99
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(torch.empty_like(q), q, k_cache, v_cache, qsl, seq_lens, block_table, 0.2, 0, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache(ops, dtype):
    """Rows land in their slots like the reference's index_copy_; slot -1 rows are skipped."""
    k_cache = torch.randn(6, 16, HKV, D).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(20, HKV, D).to(dtype), torch.randn(20, HKV, D).to(dtype)
    slots = torch.randperm(6 * 16)[:20]
    slots[[3, 11]] = -1
    keep = slots >= 0
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kvcache(k[keep], v[keep], ref_k, ref_v, slots[keep])
    cpu_store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("sliding_window", [0, 8], ids=["causal", "window8"])
def test_reference_matches_sdpa(sliding_window):
    """naive_varlen_attention (through block tables) = SDPA per sequence on its dense keys, explicit mask."""
    q, k_cache, v_cache, qsl, seq_lens, block_table, dense = make_step(MIXED, H, HKV, D, 16, torch.float32)
    out = naive_varlen_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, D ** -0.5, sliding_window)
    for s, (k, v) in enumerate(dense):
        first, last = int(qsl[s]), int(qsl[s + 1])
        positions = torch.arange(k.shape[0] - (last - first), k.shape[0])[:, None]  # [Q, 1]
        keys = torch.arange(k.shape[0])[None, :]  # [1, L]
        mask = (keys <= positions) & ((positions - keys < sliding_window) if sliding_window else True)
        expected = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), k.transpose(0, 1),
                                                  v.transpose(0, 1), attn_mask=mask, scale=D ** -0.5,
                                                  enable_gqa=True).transpose(0, 1)  # [Q, H, D]
        torch.testing.assert_close(out[first:last], expected, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
