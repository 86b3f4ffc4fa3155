"""Paged attention (replicas/kernels/paged_attention): each backend against the references in naive.py.

- the PyTorch path (naive_paged_attention over the padded groups; naive_paged_decode_attention, the Triton
  decode kernel's spec) vs dense causal attention per sequence: fla's varlen test in miniature, the kernel run
  once on a packed batch (decode rows and prefill chunks of sequences with scattered blocks), the reference
  per sequence; naive_varlen_attention (the native kernel's spec) vs SDPA per sequence;
- the native CPU kernel (cpu_attention.cpp) vs naive_varlen_attention: each case one packed step (decode rows
  and prefill chunks over cached prefixes, several sequences, blocks shuffled through the pool) run once
  through each. Every cache slot no sequence owns holds NaN, and block-table entries past a sequence's blocks
  are -1, so a kernel that reads a key it should not fails loudly. float32 must agree to 1e-5; bfloat16 to
  one bf16 rounding of the output (both sides compute in float32 from the same bf16 inputs, the kernel's QK^T
  on AVX512-BF16 builds as bf16 dot products, whose products are exact and sums float32: |diff| <= 2^-7
  |ref| + 1e-5). Skipped where the op is not built here. Its batch-invariant mode (invariant=True) meets the
  same tolerances, and a row's bits there are the same whatever else is in the call: the sequence alone, one
  query at a time (decode), prefill chunks of other sizes, all sequences in one mixed call, 1, 2 or 3 threads;
- the Triton decode kernel and store_kvcache (triton_decode.py, triton_store.py) vs naive_paged_decode_attention
  and naive's store_kvcache: compiled on CUDA, elsewhere under Triton's interpreter (TRITON_INTERPRET=1, CPU
  tensors), so CI checks them too; skipped where triton does not import. Awkward shapes: scattered blocks,
  context lengths that are not multiples of the block size (one of 1), GQA groups of 3 and 8 query heads, a
  head dim that is not a power of two, forced context splits (flash-decoding), bf16 and fp32.
"""

import pytest
import torch
import torch.nn.functional as F

from core.messages import SamplingParams
from replicas.engine.model_runner import ModelRunner
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import (naive, naive_paged_attention, naive_paged_decode_attention,
                                              naive_store_kvcache, naive_varlen_attention, store_kvcache)
from replicas.kernels.paged_attention.cpu_native import cpu_paged_attention, cpu_store_kvcache, native_ops
from replicas.request.request import Request
from tests.kernels.test_gated_delta_rule import assert_close

H, HKV, D, BLOCK = 6, 2, 16, 4
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
INVARIANT = [pytest.param(False, id="fast"), pytest.param(True, id="invariant")]  # the native op's two modes


# ---- the PyTorch path vs dense attention per sequence

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


# ---- the native CPU kernel vs naive_varlen_attention

# SmolLM2-135M: 9 query heads over 3 KV heads of 64
SMOL_H, SMOL_HKV, SMOL_D = 9, 3, 64
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
        naive_store_kvcache(k, v, k_cache, v_cache, slots)
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


def run_both(seqs, num_heads=SMOL_H, num_kv_heads=SMOL_HKV, head_dim=SMOL_D, block_size=16, dtype=torch.float32,
             sliding_window=0, softcap=0.0, seed=0, invariant=False):
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step(seqs, num_heads, num_kv_heads, head_dim,
                                                                   block_size, dtype, seed)
    args = (q, k_cache, v_cache, qsl, seq_lens, block_table, head_dim ** -0.5, sliding_window, softcap)
    return cpu_paged_attention(*args, batch_invariant=invariant), naive_varlen_attention(*args)


@pytest.mark.parametrize("invariant", INVARIANT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 32], ids=lambda b: f"block{b}")
def test_block_edges(ops, block_size, dtype, invariant):
    """Prompts of 1, 15, 16, 17, 33 tokens from scratch, and decode rows ending on each side of a block edge."""
    seqs = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (14, 1), (15, 1), (16, 1), (32, 1)]
    check_close(*run_both(seqs, block_size=block_size, dtype=dtype, invariant=invariant))


@pytest.mark.parametrize("invariant", INVARIANT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("sliding_window", [0, 8, 50], ids=["causal", "window8", "window50"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)], ids=["mha", "gqa3", "gqa8"])
def test_mixed_batch(ops, num_heads, num_kv_heads, head_dim, sliding_window, softcap, dtype, invariant):
    check_close(*run_both(MIXED, num_heads, num_kv_heads, head_dim, dtype=dtype, sliding_window=sliding_window,
                          softcap=softcap, seed=head_dim + num_heads, invariant=invariant))


@pytest.mark.parametrize("invariant", INVARIANT)
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,sliding_window", [
    pytest.param([(999, 1)], SMOL_H, SMOL_HKV, 0, id="decode1000"),
    pytest.param([(700, 1), (300, 1)], SMOL_H, SMOL_HKV, 0, id="decode2"),
    pytest.param([(600, 64)], 1, 1, 450, id="chunk-window450"),  # early rows see nothing of the last partition
    pytest.param([(500, 64)], 1, 1, 0, id="chunk-causal"),
])
def test_split_key_ranges(ops, seqs, num_heads, num_kv_heads, sliding_window, threads, invariant):
    """Fewer work items than 2x threads: long key ranges are split across threads, the partitions merged."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, ref = run_both(seqs, num_heads, num_kv_heads, sliding_window=sliding_window, seed=threads,
                            invariant=invariant)
    finally:
        torch.set_num_threads(before)
    check_close(got, ref)


@pytest.mark.parametrize("invariant", INVARIANT)
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,head_dim,sliding_window,softcap", [
    pytest.param([(0, 300)], SMOL_H, SMOL_HKV, SMOL_D, 0, 0.0, id="prefill300-gqa3-d64"),
    pytest.param([(0, 300), (40, 1)], SMOL_H, SMOL_HKV, SMOL_D, 100, 2.0, id="prefill300-gqa3-d64-window100-softcap"),
    pytest.param([(0, 1000)], SMOL_H, SMOL_HKV, SMOL_D, 0, 0.0, id="prefill1000-gqa3-d64"),
    pytest.param([(0, 1000)], 16, 2, 128, 300, 0.0, id="prefill1000-gqa8-d128-window300"),
    pytest.param([(512, 511), (3, 1)], 16, 2, 128, 0, 2.0, id="chunk511-after512-gqa8-d128-softcap"),
])
def test_long_prefill_chunks_bf16(ops, seqs, num_heads, num_kv_heads, head_dim, sliding_window, softcap, invariant):
    """bf16 prefill chunks of hundreds of rows (the tile path; on an AVX512-BF16 build its QK^T in bf16 dot
    products, pairs of dims) over many key tiles, windows, softcap, a last tile of an odd 31 keys (1,023) and
    512-key canonical partitions: within one bf16 rounding of the float32 reference."""
    check_close(*run_both(seqs, num_heads, num_kv_heads, head_dim, dtype=torch.bfloat16, sliding_window=sliding_window,
                          softcap=softcap, seed=head_dim + len(seqs), invariant=invariant))


@pytest.mark.parametrize("invariant", INVARIANT)
def test_head_dims(ops, invariant):
    """Every multiple of 16 up to 256 runs (64 and 128 are the tuned ones)."""
    for head_dim in (16, 48, 80, 96, 256):
        check_close(*run_both(MIXED[:4], 6, 2, head_dim, sliding_window=12, seed=head_dim, invariant=invariant))


# (keys cached before the step, new tokens): a fresh prompt, decode rows, one of 1,500 keys (three canonical
# partitions of 512, split across threads when the items are few), chunks straddling the partition edge at 512
INVARIANT_SEQS = [(0, 40), (1499, 1), (20, 37), (300, 1), (560, 70), (5, 3), (1000, 30)]


def calls_per_sequence(seqs, chunk: int):
    """Each sequence's rows in calls of up to `chunk` queries (1: decode-style), one sequence per call.

    -> per sequence, [(first query, last query + 1 of the sequence's, query_start_loc [2], seq_lens [1])]"""
    calls = []
    for cached, new in seqs:
        ends = [(a, min(new, a + chunk)) for a in range(0, new, chunk)]
        calls.append([(a, b, torch.tensor([0, b - a], dtype=torch.int32),
                       torch.tensor([cached + b], dtype=torch.int32)) for a, b in ends])
    return calls


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype,sliding_window,softcap", [
    pytest.param(SMOL_H, SMOL_HKV, SMOL_D, torch.float32, 0, 0.0, id="gqa3-d64-fp32"),
    pytest.param(SMOL_H, SMOL_HKV, SMOL_D, torch.bfloat16, 0, 0.0, id="gqa3-d64-bf16"),
    pytest.param(SMOL_H, SMOL_HKV, SMOL_D, torch.bfloat16, 700, 0.0, id="gqa3-d64-bf16-window700"),
    pytest.param(SMOL_H, SMOL_HKV, SMOL_D, torch.bfloat16, 0, 2.0, id="gqa3-d64-bf16-softcap"),
    pytest.param(6, 2, 80, torch.bfloat16, 0, 0.0, id="gqa3-d80-bf16"),  # 40 pairs of dims: a 16-dim tail
    pytest.param(16, 2, 128, torch.bfloat16, 100, 0.0, id="gqa8-d128-bf16-window100"),
    pytest.param(16, 2, 128, torch.float32, 0, 2.0, id="gqa8-d128-fp32-softcap"),
    pytest.param(4, 4, 64, torch.float32, 50, 0.0, id="mha-d64-fp32-window50"),  # chunks of 7: 7 rows, padded to 8
])
def test_batch_invariant_rows(ops, num_heads, num_kv_heads, head_dim, dtype, sliding_window, softcap):
    """invariant=True: every row's output has the same bits computed in one mixed call with all the sequences,
    in a call of its sequence alone, one query at a time (decode-style calls, the keys up to that query), or in
    prefill chunks of 7 or 64 queries, under 1, 2 and 3 threads; and still matches the reference."""
    seqs = INVARIANT_SEQS
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step(seqs, num_heads, num_kv_heads, head_dim, 16,
                                                                   dtype, seed=head_dim + sliding_window)
    scale = head_dim ** -0.5

    def attend(q_rows, query_start_loc, lens, table):
        return cpu_paged_attention(q_rows, k_cache, v_cache, query_start_loc, lens, table, scale, sliding_window,
                                   softcap, batch_invariant=True)

    mixed = attend(q, qsl, seq_lens, block_table)  # [T, H, D]
    check_close(mixed, naive_varlen_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, scale,
                                              sliding_window, softcap))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(attend(q, qsl, seq_lens, block_table), mixed), f"mixed call, {threads} threads"
            for chunk in (1, 7, 64, max(new for _, new in seqs)):  # the last: each sequence whole, alone
                for s, calls in enumerate(calls_per_sequence(seqs, chunk)):
                    first = int(qsl[s])
                    got = torch.cat([attend(q[first + a:first + b], call_qsl, call_lens, block_table[s:s + 1])
                                     for a, b, call_qsl, call_lens in calls])
                    assert torch.equal(got, mixed[first:int(qsl[s + 1])]), \
                        f"sequence {s} {seqs[s]}, chunks of {chunk}, {threads} threads"
    finally:
        torch.set_num_threads(before)


def test_rejects_bad_layouts(ops):
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step([(3, 2)], 4, 2, 24, 4, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):  # head_dim 24
        ops.paged_attention(torch.empty_like(q), q, k_cache, v_cache, qsl, seq_lens, block_table, 0.2, 0, 0.0,
                            False)
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step([(3, 2)], 4, 2, 16, 4, torch.float32)
    block_table[0, 0] = 99
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(torch.empty_like(q), q, k_cache, v_cache, qsl, seq_lens, block_table, 0.2, 0, 0.0,
                            False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache(ops, dtype):
    """Rows land in their slots like the reference's index_copy_; slot -1 rows are skipped."""
    k_cache = torch.randn(6, 16, SMOL_HKV, SMOL_D).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(20, SMOL_HKV, SMOL_D).to(dtype), torch.randn(20, SMOL_HKV, SMOL_D).to(dtype)
    slots = torch.randperm(6 * 16)[:20]
    slots[[3, 11]] = -1
    keep = slots >= 0
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    naive_store_kvcache(k[keep], v[keep], ref_k, ref_v, slots[keep])
    cpu_store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("sliding_window", [0, 8], ids=["causal", "window8"])
def test_reference_matches_sdpa(sliding_window):
    """naive_varlen_attention (through block tables) = SDPA per sequence on its dense keys, explicit mask."""
    q, k_cache, v_cache, qsl, seq_lens, block_table, dense = make_step(MIXED, SMOL_H, SMOL_HKV, SMOL_D, 16,
                                                                       torch.float32)
    out = naive_varlen_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, SMOL_D ** -0.5, sliding_window)
    for s, (k, v) in enumerate(dense):
        first, last = int(qsl[s]), int(qsl[s + 1])
        positions = torch.arange(k.shape[0] - (last - first), k.shape[0])[:, None]  # [Q, 1]
        keys = torch.arange(k.shape[0])[None, :]  # [1, L]
        mask = (keys <= positions) & ((positions - keys < sliding_window) if sliding_window else True)
        expected = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), k.transpose(0, 1),
                                                  v.transpose(0, 1), attn_mask=mask, scale=SMOL_D ** -0.5,
                                                  enable_gqa=True).transpose(0, 1)  # [Q, H, D]
        torch.testing.assert_close(out[first:last], expected, atol=1e-5, rtol=1e-5)


# ---- the Triton decode kernel and store_kvcache vs their references

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTEXT_LENS = [37, 1, 16, 50, 9]  # sequence 0 first: B = 1 takes a long one
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16 measured 3e-3 to 6e-3 (P and out rounded to bf16)


@pytest.fixture(scope="module")
def triton_ops():
    """(paged_decode_attention, store_kvcache), the Triton launchers; the test skips where triton does not import."""
    pytest.importorskip("triton")
    from replicas.kernels.paged_attention.triton_decode import paged_decode_attention
    from replicas.kernels.paged_attention.triton_store import store_kvcache as triton_store_kvcache

    return paged_decode_attention, triton_store_kvcache


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
def test_decode_kernel_matches_reference(triton_ops, dtype, batch, heads, head_dim, block_size, num_splits):
    paged_decode_attention, _ = triton_ops
    q, k_cache, v_cache, block_tables, context_lens = decode_inputs(batch, heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ref = naive_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    tri = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits)
    assert tri.shape == ref.shape and tri.dtype == dtype
    assert_close("o", ref, tri, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_kernel_on_a_model_runner_group(triton_ops, dtype):
    """The decode group ModelRunner.prepare builds (its block_tables and context_lens) through the kernel gives
    the rows naive_paged_attention gives for the whole step (decode rows beside a prefill chunk)."""
    paged_decode_attention, _ = triton_ops
    batch, k_cache, v_cache, _, _ = build_batch([(9, 1), (0, 13), (22, 1), (3, 1)], dtype, seed=2)
    decode = batch.groups[0]
    q = torch.randn(batch.input_ids.numel(), H, D, dtype=dtype)
    expected = naive_paged_attention(q, k_cache, v_cache, batch.groups, D ** -0.5)[decode.query_index[:, 0]]
    to = lambda x: x.to(DEVICE)  # noqa: E731
    got = paged_decode_attention(to(q[decode.query_index[:, 0]]), to(k_cache), to(v_cache), to(decode.block_tables),
                                 to(decode.context_lens), D ** -0.5, num_splits=2)
    assert_close("o", expected, got.cpu(), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kvcache_matches_reference(triton_ops, dtype):
    _, triton_store_kvcache = triton_ops
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 9, 2, 24  # Hkv * D = 48: a masked tail in the 64-wide block
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided rows, as slices of a fused projection
    slot_mapping = torch.randperm(8 * 4, generator=gen)[:num_tokens].to(DEVICE)
    k_cache = torch.zeros(8, 4, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    naive_store_kvcache(k, v, ref_k, ref_v, slot_mapping)
    triton_store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    skipped = slot_mapping.clone()
    skipped[3] = -1  # a row that writes nothing
    k_cache.zero_(), v_cache.zero_()
    triton_store_kvcache(k, v, k_cache, v_cache, skipped)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[3]], torch.zeros_like(k[3]))
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[skipped[[0, 8]]], k[[0, 8]])


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


def test_the_native_ops_are_torch_ops_with_fake_implementations(ops):
    """torch.library.opcheck: the schemas say what each op writes, and the fake implementations (what
    torch.compile traces) give what the ops give."""
    q, k_cache, v_cache, qsl, seq_lens, block_table, _ = make_step([(9, 1), (0, 5)], SMOL_H, SMOL_HKV, SMOL_D, 16,
                                                                   torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()  # opcheck compares inputs before and after
    torch.library.opcheck(ops.paged_attention.default, (torch.empty_like(q), q, k_cache, v_cache, qsl, seq_lens,
                                                        block_table, SMOL_D ** -0.5, 0, 0.0, True))
    k = torch.randn(3, SMOL_HKV, SMOL_D)
    torch.library.opcheck(ops.store_kvcache.default, (k, k.clone(), k_cache, v_cache, torch.tensor([0, 5, -1])))
