"""Row sampling, Triton: greedy argmax or an exponential-race draw per row, and the row's logsumexp, in one pass
over the vocabulary. Spec: naive_sample_rows (naive.py), same signature.

Split over V: the grid is (R, NUM_SPLITS); each program walks its SPLIT_SIZE entries in blocks of BV, keeping
a running logsumexp (max and rescaled sum) and, lane by lane, the best score and its first index. The reduce
kernel merges the splits; ties keep the lowest index (splits are in order), as torch.argmax.

    logits row:  | split 0: BV BV BV | split 1: BV BV BV | ... |   -> (best, index, max, sum) per split

Greedy rows never read their noise (the load is masked off). The interpreter (TRITON_INTERPRET=1, CPU tensors)
runs it too: everything here is float32.
"""

import torch
import triton
import triton.language as tl

BV = 1024
MIN_SPLIT_SIZE = 8 * BV  # entries: fewer per program and the merge costs more than the parallelism wins
TARGET_PROGRAMS = 512  # enough to keep an H100/H200's 132 SMs busy


@triton.jit
def sample_rows_kernel(logits, temperature, noise, best_partial, index_partial, m_partial, s_partial, V,
                       SPLIT_SIZE, NUM_SPLITS: tl.constexpr, BV: tl.constexpr):
    # logits, noise: [R, V] float32; temperature: [R] float32; *_partial: [R, NUM_SPLITS]
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    b_t = tl.load(temperature + i_r)
    is_random = b_t > 0
    b_t = tl.where(is_random, b_t, 1.)
    start = i_s * SPLIT_SIZE
    end = tl.minimum(start + SPLIT_SIZE, V)
    end_u = tl.where(is_random, end, start)  # greedy rows read no noise

    b_best = tl.full([BV], float("-inf"), dtype=tl.float32)  # per lane: best score so far
    b_index = tl.zeros([BV], dtype=tl.int32)  # and its first index (0 stands when a row is all -inf)
    b_m = float("-inf")  # running max of the raw logits
    b_s = 0.  # sum of exp(logit - b_m)
    for i_v in range(start, end, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < end
        o_rv = i_r.to(tl.int64) * V + o_v
        b_x = tl.load(logits + o_rv, mask=m_v, other=float("-inf"))  # [BV]
        b_u = tl.load(noise + o_rv, mask=o_v < end_u, other=0.5)
        b_score = tl.where(is_random, tl.math.div_rn(b_x, b_t) - tl.log(-tl.log(b_u)), b_x)  # IEEE division, as torch
        is_better = b_score > b_best  # strict: an earlier index keeps a tie
        b_best = tl.where(is_better, b_score, b_best)
        b_index = tl.where(is_better, o_v, b_index)
        b_m_new = tl.maximum(b_m, tl.max(b_x, 0))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0., b_m_new)  # all -inf so far: no nan from -inf - -inf
        b_s = b_s * tl.exp(b_m - b_m_safe) + tl.sum(tl.exp(b_x - b_m_safe), 0)
        b_m = b_m_new

    b_max = tl.max(b_best, 0)
    i_best = tl.min(tl.where(b_best == b_max, b_index, V), 0)
    o_out = i_r * NUM_SPLITS + i_s
    tl.store(best_partial + o_out, b_max)
    tl.store(index_partial + o_out, i_best)
    tl.store(m_partial + o_out, b_m)
    tl.store(s_partial + o_out, b_s)


@triton.jit
def sample_rows_reduce_kernel(best_partial, index_partial, m_partial, s_partial, token_ids, lse,
                              NUM_SPLITS: tl.constexpr, BSPLIT: tl.constexpr):
    # *_partial: [R, NUM_SPLITS] -> token_ids: [R] int64, lse: [R] float32
    i_r = tl.program_id(0)
    o_s = tl.arange(0, BSPLIT)
    m_s = o_s < NUM_SPLITS
    o_rs = i_r * NUM_SPLITS + o_s
    b_best = tl.load(best_partial + o_rs, mask=m_s, other=float("-inf"))
    b_index = tl.load(index_partial + o_rs, mask=m_s, other=0)
    b_max = tl.max(b_best, 0)
    i_best = tl.min(tl.where(m_s & (b_best == b_max), b_index, 2147483647), 0)
    b_m = tl.load(m_partial + o_rs, mask=m_s, other=float("-inf"))
    b_s = tl.load(s_partial + o_rs, mask=m_s, other=0.)
    b_m_max = tl.max(b_m, 0)
    b_m_safe = tl.where(b_m_max == float("-inf"), 0., b_m_max)
    b_sum = tl.sum(b_s * tl.exp(b_m - b_m_safe), 0)
    tl.store(token_ids + i_r, i_best.to(tl.int64))
    tl.store(lse + i_r, b_m_safe + tl.log(b_sum))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor,
                num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [R, V] float32; temperature: [R] float32 (0 = greedy); noise: [R, V] float32 in (0, 1), read only
    on rows with temperature > 0 -> token_ids: [R] int64, logsumexp: [R] float32.

    num_splits: programs per row; None picks them from the shape."""
    R, V = logits.shape
    assert logits.dtype == noise.dtype == temperature.dtype == torch.float32
    assert noise.shape == logits.shape and temperature.shape == (R,)
    assert logits.is_contiguous() and noise.is_contiguous() and temperature.is_contiguous()
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, max(R, 1)), V // MIN_SPLIT_SIZE))
    split_size = triton.cdiv(triton.cdiv(V, num_splits), BV) * BV
    num_splits = triton.cdiv(V, split_size)
    token_ids = torch.empty(R, dtype=torch.int64, device=logits.device)
    lse = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R == 0:
        return token_ids, lse
    partial = lambda dtype: torch.empty(R, num_splits, dtype=dtype, device=logits.device)  # noqa: E731
    best, index, m, s = partial(torch.float32), partial(torch.int32), partial(torch.float32), partial(torch.float32)
    sample_rows_kernel[(R, num_splits)](logits, temperature, noise, best, index, m, s, V, split_size,
                                        NUM_SPLITS=num_splits, BV=BV)
    sample_rows_reduce_kernel[(R,)](best, index, m, s, token_ids, lse, NUM_SPLITS=num_splits,
                                    BSPLIT=triton.next_power_of_2(num_splits))
    return token_ids, lse
