// Paged attention on CPU over one step's varlen batch (decode rows and prefill chunks of many sequences in
// one call). Built by replicas/kernels/native_build.py; launched by cpu_native.py; its spec is
// naive_varlen_attention in naive.py. All math in float32 (bf16 loads widened, the output rounded once), on
// tether_vec.h's GCC vector types of the ISA's width: VL = 16 floats (zmm) under the avx512 flags, 8 (ymm)
// under avx2. (g++'s own vectoriser turned the register-blocked loops below into permutes on ymm: 8 GFLOP/s,
// against ~130 from these; 16-float vectors under avx2 alone were as slow.) The exception: bf16 inputs on an
// AVX512-BF16 build (the avx512_bf16 level's -mavx512bf16, kBf16Dot), where QK^T is bf16 dot products with
// float32 sums (vdpbf16ps: two exact bf16 products per lane and instruction), as SDPA and vLLM compute it:
// scores = scale * (q . k) over pairs of dims of the unscaled bf16 q and k, no less accurate than float32 FMAs.
// P.V stays float32: p rounded to bf16 for it too (kBf16Probabilities, SDPA's and vLLM's) is faster still but
// moves outputs past one bf16 rounding of the reference (see there). The softmax is float32 either way.
//
// A work item is (sequence, KV head, up to kMaxRows rows, key range), a row being (query position, query head
// of that KV head): every K/V tile is read once for the whole head group, and keys no row of the item can see
// are never read (its key range is the union of its rows' causal windows). Flash-style online softmax per
// tile of kKeyTile keys. Two layouts:
//   small items (<= 8 rows: decode, one query times its head group) put keys on the vector lanes:
//     q.k as d-chunk FMAs, a vector of keys' partial sums reduced by one transpose-add tree; K, V read in place
//   larger items (prefill chunks) put rows on the lanes, K and V widened into a float tile first:
//     scores[j][m] = sum_d keys[j][d] * q_t[d][m]   (broadcast-FMA; softmax and mask vectorised over rows)
//     acc[m][:] = alpha[m] * acc[m][:] + sum_j p[j][m] * values[j][:]
//   or, in bf16 dot products (kBf16Dot), the tile's K copied as it is and the queries as pairs of dims on the
//   lanes, a key's pair of dims broadcast (tile_scores_dot); with kBf16Probabilities also V interleaved into
//   pairs of keys and p packed into pairs of keys per row, a row's pair broadcast (tile_accumulate_dot)
// Threads pull items, most expensive first, from an atomic counter. With fewer items than 2x threads (decode
// of one or two long sequences), long key ranges are split into partitions; each leaves (max, sum, acc) per
// row, and the thread that finishes a split's last partition merges them.
//
// Batch-invariant mode (`invariant`, engine.batch_invariant): a row's output bits are a function of its query,
// its sequence's keys and values up to its position, the window, scale and softcap only; not of the other rows
// and sequences in the call, of the chunk the row arrives in, or of the thread count. So a token's attention
// is the same computed in decode, in a prefill chunk of any split, or recomputed after a preemption. Three
// things make that so:
//   - one arithmetic per row in both layouts: a row's scores are sum_d k[d] * q[d] as one fma per d in order
//     (the tile path's), so small items transpose K in registers to put keys on the lanes (transposed_scores)
//     in place of their d-chunk sums and lane-reduction tree; the rescale is exp_nonpositive in both; the
//     softmax sums and p.V then add in the same order per row. (Decode items through the tile path instead,
//     their head group on a tile's lanes, measured 2x the decode time; this costs a few per cent.) Nothing a
//     row computes depends on what the other lanes or rows of its item hold. Where the tile path's QK is bf16
//     dot products (kBf16Dot), so is the small path's in this mode, in the same order: keys transposed in
//     registers as 16 x 16 pairs of dims (transposed_scores_dot), one dot per pair of dims from dim 0, times
//     the scale; the one instruction on both sides, so its own order of adds is the same too. With
//     kBf16Probabilities, p is rounded to bf16 as the tile path rounds it, and V interleaved into pairs of keys,
//     one dot per pair of keys (a key a row cannot see, or past an odd tile end, pairs as p = 0: an exact
//     zero). (Fast mode's small items keep their float32 arithmetic.);
//   - key tiles at absolute positions (multiples of kKeyTile from key 0), so a window, which moves an item's
//     first key with its first row, does not move tile edges. Keys a row cannot see score -inf: they leave its
//     running max alone and add exact zeros to its sum and accumulator;
//   - canonical partitions: the online softmax restarts at every multiple of kInvariantPartitionKeys, and each
//     row folds its partitions' (max, sum, acc) in key order through fold_partition, then divides once, whether
//     one item ran them one after another or a split gave them to several threads (a split then cuts at those
//     same multiples, one partition per part). A partition a row sees nothing of folds in as exact zeros.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>  // not torch/extension.h: a third of the compile time

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "tether_vec.h"

namespace {

using namespace tether;  // VL, vf, vi and their operations (tether_vec.h)

constexpr int kMaxRows = 64;           // rows per work item
constexpr int kMaxSmallRows = 8;       // items up to this many rows take the keys-on-lanes path
constexpr int kKeyTile = 32;           // keys per online-softmax step
constexpr int kMaxHeadDim = 256;
constexpr int kMinPartitionKeys = 128;  // a split key range keeps at least this many keys per partition
constexpr int kInvariantPartitionKeys = 512;  // invariant mode: the softmax restarts at multiples of this key
static_assert(kInvariantPartitionKeys % kKeyTile == 0, "partitions hold whole key tiles");
constexpr int kKeyBlock = 8;  // larger items' QK: keys whose score vectors stay in registers together
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- bf16 dot products (AVX512-BF16 builds, bf16 inputs): the tile path's QK (and P.V with
// kBf16Probabilities), and invariant mode's small items, which must give a row the tile path's bits
#if defined(__AVX512BF16__)
#define TETHER_BF16_DOT 1
static_assert(VL == 16, "AVX512-BF16 implies the avx512 build");
using pairs_t = __m512i;  // 16 lanes of a (lower, upper) bf16 pair each, the form vdpbf16ps multiplies

// Lane l: acc[l] + a.lower[l] * b.lower[l] + a.upper[l] * b.upper[l], the products exact (bf16 x bf16 fits a
// float), in the instruction's own order of adds and rounding (denormals flush to 0, in and out). Every caller
// gives a row the same sequence of these on the same pairs, so the order never matters, only that it is one.
[[gnu::always_inline]] inline vf dot_pairs(vf acc, pairs_t a, pairs_t b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
// The pair at p (p[0] lower, p[1] upper) on every lane.
[[gnu::always_inline]] inline pairs_t pair_at(const void* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm512_set1_epi32(bits);
}
// x rounded to bf16 (to nearest even, VCVTNEPS2BF16: a denormal becomes 0), widened back to float exactly.
[[gnu::always_inline]] inline vf round_bf16(vf x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Lane l: (lower[l], upper[l]), 16 bf16 each.
[[gnu::always_inline]] inline pairs_t interleave_pairs(__m256i lower, __m256i upper) {
  const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(lower), index, _mm512_castsi256_si512(upper));
}
// Lane l: (lower[l], upper[l]) of two vectors of floats that are bf16 values (round_bf16's): their upper halves.
[[gnu::always_inline]] inline pairs_t pack_pairs(vf lower, vf upper) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(lower), 16),
                                 _mm512_castps_si512(upper));
}
#else
#define TETHER_BF16_DOT 0
#endif
// The bf16 dot-product arithmetic applies: bf16 inputs on an AVX512-BF16 build. QK^T is then bf16 dots (exact
// products of the bf16 inputs, float32 sums: no less accurate than float32 FMAs); P.V stays float32 (p in
// float32 times V widened) unless kBf16Probabilities.
template <typename T>
constexpr bool kBf16Dot = TETHER_BF16_DOT && std::is_same_v<T, c10::BFloat16>;
// P.V in bf16 dots too, p rounded to bf16 (SDPA's and vLLM's): a 1,000-token SmolLM2 prefill chunk's attention
// takes ~2.45 ms in place of ~2.95 (2 threads, AMD EPYC Zen 5; float32 everywhere: ~4.2), but p's rounding
// (2^-9 relative) leaves 6-10% of the outputs of a long bf16 prefill more than one bf16 rounding from the
// float32 reference (tests/kernels/test_paged_attention.py check_close: 2^-7 |ref| + 1e-5; up to ~130x that
// where |ref| is near 0), and raises the rms error from 1.65e-3 of rms |out| (the output's own rounding) to
// 1.8e-3 - 2.2e-3. Off until that tolerance is widened; both settings keep invariant mode exact.
constexpr bool kBf16Probabilities = false;

template <typename T>
struct Problem {
  const T* q;        // [T, H, D]
  T* out;            // [T, H, D]
  const T* k_cache;  // [num_blocks, block_size, Hkv, D]
  const T* v_cache;
  const int32_t* query_start_loc;  // [S + 1]
  const int32_t* seq_lens;         // [S]
  const int32_t* block_table;      // [S, max_blocks]
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  float scale, softcap;
  int64_t window;
  bool invariant;  // batch-invariant mode (see the top of the file)
};

struct WorkItem {
  int32_t seq, kv_head;
  int32_t row_begin, row_end;  // rows (query index * group + head in group) of the sequence
  int32_t key_begin, key_end;  // the keys this item reads
  int32_t partial;             // its slot in the partial buffer; -1: it covers all its rows' keys, writes out
  int32_t split;               // the split it is a partition of, -1: none
  int64_t cost;
};

struct Split {
  int32_t first_item, parts;
};

// Where row m of the item lives in q and out ([T, H, D]), and its position in the sequence.
template <typename T>
struct ItemRows {
  int64_t q_begin, first_pos;  // the sequence's first query row in T, and that query's position
  ItemRows(const Problem<T>& pb, const WorkItem& w)
      : q_begin(pb.query_start_loc[w.seq]),
        first_pos(pb.seq_lens[w.seq] - (pb.query_start_loc[w.seq + 1] - pb.query_start_loc[w.seq])) {}
  int64_t offset(const Problem<T>& pb, const WorkItem& w, int m) const {
    const int row = w.row_begin + m;
    return ((q_begin + row / pb.group) * pb.num_heads + w.kv_head * pb.group + row % pb.group) * pb.head_dim;
  }
  int32_t position(const Problem<T>& pb, const WorkItem& w, int m) const {
    return int32_t(first_pos + (w.row_begin + m) / pb.group);
  }
};

// Pointers to the K and V rows of keys j0 .. j0 + n - 1 of the item's sequence and KV head (its block table).
template <typename T>
void kv_rows(const Problem<T>& pb, const WorkItem& w, int j0, int n, const T** k_rows, const T** v_rows) {
  const int32_t* blocks = pb.block_table + w.seq * pb.max_blocks;
  int64_t block = j0 / pb.block_size, offset = j0 % pb.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t at = ((int64_t(blocks[block]) * pb.block_size + offset) * pb.num_kv_heads + w.kv_head) * pb.head_dim;
    k_rows[j] = pb.k_cache + at;
    v_rows[j] = pb.v_cache + at;
    if (++offset == pb.block_size) offset = 0, ++block;
  }
}

// The item's result: normalised rows into out, or, for a partition, [rows][2 + D] (max, sum, acc) into partial.
template <typename T>
void finish_rows(const Problem<T>& pb, const WorkItem& w, const float* acc, int acc_stride, const float* row_max,
                 const float* row_sum, float* partial) {
  const int D = int(pb.head_dim);
  const ItemRows<T> at(pb, w);
  for (int m = 0; m < w.row_end - w.row_begin; ++m) {
    if (partial != nullptr) {
      float* dst = partial + m * (2 + D);
      dst[0] = row_max[m];
      dst[1] = row_sum[m];
      std::memcpy(dst + 2, acc + m * acc_stride, D * sizeof(float));
      continue;
    }
    T* dst = pb.out + at.offset(pb, w, m);
    const float inv_sum = 1.f / row_sum[m];
    for (int d = 0; d < D; ++d) dst[d] = T(acc[m * acc_stride + d] * inv_sum);
  }
}

// Invariant mode: one partition's (m, s, a[D]) of a row folded into the row's running (max, sum, acc[D]), which
// start at (-inf, 0, 0). A partition the row saw nothing of (m = -inf, s = 0, a = 0) leaves it as it was, bit
// for bit; the first one the row saw is copied exactly (weights 0 and 1). Explicit fmas: the arithmetic must
// not depend on what the compiler contracts where this is inlined.
inline void fold_partition(float m, float s, const float* a, float& max, float& sum, float* acc, int D) {
  const float new_max = std::max(max, m);
  const float w_old = max == kNegInf ? 0.f : std::exp(max - new_max);
  const float w_new = m == kNegInf ? 0.f : std::exp(m - new_max);
  sum = std::fma(s, w_new, sum * w_old);
  for (int d = 0; d < D; ++d) acc[d] = std::fma(a[d], w_new, acc[d] * w_old);
  max = new_max;
}

// Invariant mode's finish: the rows' folded (max, sum, acc [rows][D]) into partial as finish_rows writes it (a
// split's part: one canonical partition, whose fold is its own state exactly), or out = acc / sum, the division
// merge_partials ends with too.
template <typename T>
void finish_folded(const Problem<T>& pb, const WorkItem& w, const float* acc, int acc_stride, const float* max,
                   const float* sum, float* partial) {
  if (partial != nullptr) return finish_rows(pb, w, acc, acc_stride, max, sum, partial);
  const int D = int(pb.head_dim);
  const ItemRows<T> at(pb, w);
  for (int m = 0; m < w.row_end - w.row_begin; ++m) {
    T* dst = pb.out + at.offset(pb, w, m);
    for (int d = 0; d < D; ++d) dst[d] = T(acc[m * acc_stride + d] / sum[m]);
  }
}

// ---- small items (<= kMaxSmallRows rows): keys on the lanes, R rows (padding rows see no key)

// v[0 .. VL) as the rows of a VL x VL matrix -> its transpose, in place, in registers. log2(VL) levels; the
// level of block size b swaps, in each pair of rows (i, i + b) with i & b clear, row i's odd b-blocks with row
// i + b's even ones (two two-vector shuffles per pair). Inlined and unrolled whole, so v stays in registers.
[[gnu::always_inline]] inline void transpose(vf* v) {
  const vi lane = lane_index();
#pragma GCC unroll 4
  for (int b = VL / 2; b >= 1; b /= 2) {
    const vi odd = (lane & b) != 0;
    const vi lo = odd ? lane + (VL - b) : lane, hi = odd ? lane + VL : lane + b;  // 0 .. VL-1: a, VL ..: c
#pragma GCC unroll 16
    for (int i = 0; i < VL; ++i) {
      if (i & b) continue;
      const vf a = v[i], c = v[i + b];
      v[i] = __builtin_shuffle(a, c, lo);
      v[i + b] = __builtin_shuffle(a, c, hi);
    }
  }
}

// Invariant mode's small-item scores: lane l of s[r] = q[r] . key l of the `count` keys at k_rows (lanes past
// count score 0), summed over d in order, one fma per d: tile_scores' arithmetic, where the row is the lane and
// the key the broadcast, so a row's scores have the same bits in either path. The keys are transposed in
// registers, VL dims at a time (the small path's own d-chunk sums and lane-reduction tree round differently).
template <typename T, int R>
[[gnu::always_inline]] inline void transposed_scores(const T* const* k_rows, int count,
                                                     const float (*q)[kMaxHeadDim], int D, vf* s) {
  for (int r = 0; r < R; ++r) s[r] = vf{};
  for (int d0 = 0; d0 < D; d0 += VL) {
    vf t[VL];
    unroll<VL>([&](auto j) { t[j] = j < count ? vload(k_rows[j] + d0) : vf{}; });
    transpose(t);  // t[i]: dim d0 + i of the VL keys
    unroll<VL>([&](auto i) {
      for (int r = 0; r < R; ++r) s[r] = vfma(t[i], vset1(q[r][d0 + i]), s[r]);
    });
  }
}

#if TETHER_BF16_DOT
// Invariant mode's small-item scores in bf16 (AVX512-BF16): lane l of s[r] = q[r] . key l of the `count` keys
// at k_rows (lanes past count score 0), unscaled: one dot_pairs per pair of dims, in order from dim 0, as
// tile_scores_dot, where the row is the lane and the key pair the broadcast, so a row's dot has the same bits in
// either path. A key's 16 pairs of 32 dims are one 512-bit load; the keys are transposed in registers as
// 16 x 16 pairs (a 16-dim tail: 8 pairs, the upper lanes zero). q: each row's pairs of dims.
template <int R>
[[gnu::always_inline]] inline void transposed_scores_dot(const c10::BFloat16* const* k_rows, int count,
                                                         const uint32_t (*q)[kMaxHeadDim / 2], int D, vf* s) {
  for (int r = 0; r < R; ++r) s[r] = vf{};
  for (int d0 = 0; d0 < D; d0 += 2 * VL) {
    const bool tail = D - d0 < 2 * VL;  // D is a multiple of 16: 16 dims left
    vf t[VL];
    unroll<VL>([&](auto j) {
      __m512i k = _mm512_setzero_si512();
      if (j < count) k = _mm512_maskz_loadu_epi32(tail ? 0x00FF : 0xFFFF, k_rows[j] + d0);
      t[j] = (vf)k;
    });
    transpose(t);  // t[i]: pair d0 / 2 + i of the VL keys
    unroll<VL>([&](auto i) {
      if (i < VL / 2 || !tail)
        for (int r = 0; r < R; ++r) s[r] = dot_pairs(s[r], (pairs_t)t[i], _mm512_set1_epi32(q[r][d0 / 2 + i]));
    });
  }
}
#endif

template <typename T, int R, bool kInvariant>
void run_small_item(const Problem<T>& pb, const WorkItem& w, float* partial) {
  const int D = int(pb.head_dim), rows = w.row_end - w.row_begin;
  const int64_t window = pb.window;
  float q[R][kMaxHeadDim], acc[R][kMaxHeadDim];  // scaled queries; unnormalised output
  float parts[R][VL * VL];                      // per row, per key of a group of VL: partial dot products
  float probs[R][kKeyTile];                     // scores, then probabilities
  float row_max[R], row_sum[R], alpha[R];
  int32_t pos[R];
  const T* k_rows[kKeyTile];
  const T* v_rows[kKeyTile];
  // Invariant mode on bf16 (AVX512-BF16 build): the tile path's bf16 arithmetic (tile_keys): the dot of the
  // unscaled bf16 query and key in pairs of dims, times the scale; with kBf16Probabilities, p rounded to bf16,
  // summed and multiplied by V as such, in pairs of keys.
  constexpr bool kDot = kInvariant && kBf16Dot<T>;
  uint32_t q_pairs[kDot ? R : 1][kMaxHeadDim / 2];                  // the unscaled queries, pairs of dims
  uint16_t p_bf16[kDot && kBf16Probabilities ? R : 1][kKeyTile];  // the probabilities as bf16 bits
  const ItemRows<T> at(pb, w);
  for (int r = 0; r < R; ++r) {
    const T* src = r < rows ? pb.q + at.offset(pb, w, r) : nullptr;
    if constexpr (kDot) {
      if (src != nullptr)
        std::memcpy(q_pairs[r], src, D * sizeof(T));
      else
        std::fill(q_pairs[r], q_pairs[r] + D / 2, 0u);
    } else {
      for (int d = 0; d < D; ++d) q[r][d] = src ? to_float(src[d]) * pb.scale : 0.f;
    }
    pos[r] = r < rows ? at.position(pb, w, r) : -1;
  }
  auto reset = [&] {
    for (int r = 0; r < R; ++r) {
      std::fill(acc[r], acc[r] + D, 0.f);
      row_max[r] = kNegInf;
      row_sum[r] = 0.f;
    }
  };

  // The online softmax over keys [j_begin, j_end), from and into (row_max, row_sum, acc).
  auto run_keys = [&](int j_begin, int j_end) {
    for (int j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
      const int n = std::min(kKeyTile, j_end - j0);
      kv_rows(pb, w, j0, n, k_rows, v_rows);
      for (int g = 0; g < n; g += VL) {  // scores of VL keys at a time, masked (keys past n too)
        const int count = std::min(VL, n - g);
        const vi key = lane_index() + (j0 + g);
        if constexpr (kInvariant) {
          vf dots[R];
          if constexpr (kDot) {
#if TETHER_BF16_DOT
            transposed_scores_dot<R>(k_rows + g, count, q_pairs, D, dots);
            for (int r = 0; r < R; ++r) dots[r] = dots[r] * pb.scale;  // tile_scores_dot's
#endif
          } else {
            transposed_scores<T, R>(k_rows + g, count, q, D, dots);
          }
          for (int r = 0; r < R; ++r) {
            vf s = dots[r];
            if (pb.softcap > 0.f) s = pb.softcap * tanh_approx(s * (1.f / pb.softcap));
            vi visible = (lane_index() < count) & (key <= pos[r]);
            if (window > 0) visible &= pos[r] - key < int32_t(window);
            vstore(probs[r] + g, visible ? s : vset1(kNegInf));
          }
          continue;
        }
        for (int j = 0; j < VL; ++j) {
          vf dot[R] = {};
          if (j < count) {
            for (int d = 0; d < D; d += VL) {
              const vf k = vload(k_rows[g + j] + d);
              for (int r = 0; r < R; ++r) dot[r] += k * vload(q[r] + d);
            }
          }
          for (int r = 0; r < R; ++r) vstore(parts[r] + j * VL, dot[r]);
        }
        for (int r = 0; r < R; ++r) {
          vf s = reduce_lanes(parts[r]);
          if (pb.softcap > 0.f) s = pb.softcap * tanh_approx(s * (1.f / pb.softcap));
          vi visible = (lane_index() < count) & (key <= pos[r]);
          if (window > 0) visible &= pos[r] - key < int32_t(window);
          vstore(probs[r] + g, visible ? s : vset1(kNegInf));
        }
      }
      const int n_lanes = (n + VL - 1) / VL * VL;
      for (int r = 0; r < R; ++r) {  // online softmax
        float tile_max = kNegInf, tile_sum = 0.f;
        for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, probs[r][j]);
        const float new_max = std::max(row_max[r], tile_max);
        const float shift = new_max == kNegInf ? 0.f : new_max;  // a row that saw no key yet keeps p = 0
        for (int j = 0; j < n_lanes; j += VL) {
          vf p = exp_nonpositive(vload(probs[r] + j) - shift);
#if TETHER_BF16_DOT
          if constexpr (kDot && kBf16Probabilities) {  // rounded to bf16 (the tile path's p), its bits kept for p . V
            p = round_bf16(p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_bf16[r] + j),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
          }
#endif
          vstore(probs[r] + j, p);
        }
        for (int j = 0; j < n; ++j) tile_sum += probs[r][j];
        if constexpr (kInvariant)  // the tile path's rescale, bit for bit (e^-inf = 0 there too)
          alpha[r] = exp_nonpositive(vset1(row_max[r] - shift))[0];
        else
          alpha[r] = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - shift);
        row_sum[r] = row_sum[r] * alpha[r] + tile_sum;
        row_max[r] = new_max;
      }
#if TETHER_BF16_DOT
      if constexpr (kDot && kBf16Probabilities) {  // acc = alpha * acc + p . V in pairs of keys (tile_accumulate_dot's)
        for (int d = 0; d < D; d += VL) {
          vf a[R];
          for (int r = 0; r < R; ++r) a[r] = vload(acc[r] + d) * alpha[r];
          for (int j = 0; j < n; j += 2) {  // an odd n: key n pairs as p = 0, v = 0 (p_bf16 is 0 past n)
            const __m256i lower = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[j] + d));
            const __m256i upper = j + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[j + 1] + d))
                                            : _mm256_setzero_si256();
            const pairs_t v = interleave_pairs(lower, upper);
            for (int r = 0; r < R; ++r) a[r] = dot_pairs(a[r], v, pair_at(p_bf16[r] + j));
          }
          for (int r = 0; r < R; ++r) vstore(acc[r] + d, a[r]);
        }
        continue;
      }
#endif
      for (int d = 0; d < D; d += VL) {  // acc = alpha * acc + p . V
        vf a[R];
        for (int r = 0; r < R; ++r) a[r] = vload(acc[r] + d) * alpha[r];
        for (int j = 0; j < n; ++j) {
          const vf v = vload(v_rows[j] + d);
          for (int r = 0; r < R; ++r) a[r] += probs[r][j] * v;
        }
        for (int r = 0; r < R; ++r) vstore(acc[r] + d, a[r]);
      }
    }
  };

  if constexpr (!kInvariant) {
    reset();
    run_keys(w.key_begin, w.key_end);
    finish_rows(pb, w, &acc[0][0], kMaxHeadDim, row_max, row_sum, partial);
  } else {  // as run_tile_item's invariant mode: canonical partitions, folded
    float fold_acc[R][kMaxHeadDim], fold_max[R], fold_sum[R];
    for (int r = 0; r < R; ++r) {
      std::fill(fold_acc[r], fold_acc[r] + D, 0.f);
      fold_max[r] = kNegInf;
      fold_sum[r] = 0.f;
    }
    for (int p0 = w.key_begin, p1; p0 < w.key_end; p0 = p1) {
      p1 = std::min(w.key_end, (p0 / kInvariantPartitionKeys + 1) * kInvariantPartitionKeys);
      reset();
      run_keys(p0, p1);
      for (int r = 0; r < rows; ++r)
        fold_partition(row_max[r], row_sum[r], acc[r], fold_max[r], fold_sum[r], fold_acc[r], D);
    }
    finish_folded(pb, w, &fold_acc[0][0], kMaxHeadDim, fold_max, fold_sum, partial);
  }
}

// ---- larger items: rows on the lanes, K and V widened into float tiles

// Per-thread buffers, fixed size: nothing is allocated per item or per key tile.
struct Scratch {
  float q_t[kMaxHeadDim * kMaxRows];     // [D][rows_pad]: the item's queries, scaled, transposed
  float keys[kKeyTile * kMaxHeadDim];    // [n][D] as float
  float values[kKeyTile * kMaxHeadDim];  // [n][D]
  float scores[kKeyTile * kMaxRows];     // [n][rows_pad]: scores, then probabilities
  float acc[kMaxRows * kMaxHeadDim];     // [rows_pad][D]: unnormalised output
  float row_max[kMaxRows], row_sum[kMaxRows], alpha[kMaxRows];  // running max and sum, this tile's rescale
  int32_t pos[kMaxRows];  // each row's position in its sequence
  // invariant mode: the rows' partitions folded so far (fold_partition), acc as [rows][D]
  float fold_acc[kMaxRows * kMaxHeadDim];
  float fold_max[kMaxRows], fold_sum[kMaxRows];
  // bf16 on an AVX512-BF16 build (tile_keys): pairs of bf16 (lower, upper) as 32-bit words
  uint32_t q_pairs[kMaxHeadDim / 2 * kMaxRows];  // [D / 2][rows_pad]: row m's dims (2i, 2i + 1), unscaled
  uint16_t keys_bf16[kKeyTile * kMaxHeadDim];     // [n_pad][D]: the tile's keys (rows past n zero)
  uint32_t v_pairs[kKeyTile / 2 * kMaxHeadDim];  // kBf16Probabilities: [(n + 1) / 2][D], keys (2i, 2i + 1)'s v at d
  uint32_t p_pairs[kKeyTile / 2 * kMaxRows];     // kBf16Probabilities: [(n + 1) / 2][rows_pad], their p of row m
};

thread_local Scratch scratch;

#if TETHER_BF16_DOT
// scores[j][m] = scale * (q[m] . keys[j]) for j < n_pad (a multiple of kKeyBlock), m < rows_pad: one dot_pairs
// per pair of dims, in order from dim 0 (what transposed_scores_dot mirrors), kVecs row vectors of 16 at a time.
template <int kVecs>
[[gnu::always_inline]] inline void tile_scores_dot_block(const uint32_t* q_pairs, const uint16_t* keys, float* scores,
                                                         float scale, int c, int n_pad, int rows_pad, int D) {
  for (int j0 = 0; j0 < n_pad; j0 += kKeyBlock) {
    vf acc[kVecs][kKeyBlock] = {};
    const uint16_t* k = keys + j0 * D;
    for (int i = 0; i < D / 2; ++i) {
      pairs_t qv[kVecs];
      unroll<kVecs>([&](auto v) { qv[v] = _mm512_loadu_si512(q_pairs + i * rows_pad + c + v * VL); });
      unroll<kKeyBlock>([&](auto r) {
        const pairs_t kp = pair_at(k + r * D + 2 * i);
        unroll<kVecs>([&](auto v) { acc[v][r] = dot_pairs(acc[v][r], qv[v], kp); });
      });
    }
    unroll<kKeyBlock>([&](auto r) {
      unroll<kVecs>([&](auto v) { vstore(scores + (j0 + r) * rows_pad + c + v * VL, acc[v][r] * scale); });
    });
  }
}

inline void tile_scores_dot(const uint32_t* q_pairs, const uint16_t* keys, float* scores, float scale, int n_pad,
                            int rows_pad, int D) {
  int c = 0;
  for (; c + 2 * VL <= rows_pad; c += 2 * VL)
    tile_scores_dot_block<2>(q_pairs, keys, scores, scale, c, n_pad, rows_pad, D);
  if (c < rows_pad) tile_scores_dot_block<1>(q_pairs, keys, scores, scale, c, n_pad, rows_pad, D);
}

// The tile's keys copied as they are into keys_bf16 (zero rows up to n_pad); its values widened into values, or
// with kBf16Probabilities into v_pairs as pairs of keys (an odd n: key n's values zero).
inline void load_tile_dot(const c10::BFloat16* const* k_rows, const c10::BFloat16* const* v_rows, int n, int n_pad,
                          int D, Scratch& sc) {
  for (int j = 0; j < n; ++j) std::memcpy(sc.keys_bf16 + j * D, k_rows[j], D * sizeof(uint16_t));
  std::memset(sc.keys_bf16 + n * D, 0, (n_pad - n) * D * sizeof(uint16_t));
  if constexpr (!kBf16Probabilities) {
    for (int j = 0; j < n; ++j)
      for (int d = 0; d < D; ++d) sc.values[j * D + d] = to_float(v_rows[j][d]);
    return;
  }
  for (int j = 0; j < n; j += 2) {
    for (int d = 0; d < D; d += VL) {
      const __m256i lower = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[j] + d));
      const __m256i upper = j + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[j + 1] + d))
                                      : _mm256_setzero_si256();
      _mm512_storeu_si512(sc.v_pairs + j / 2 * D + d, interleave_pairs(lower, upper));
    }
  }
}

// acc[m][:] = alpha[m] * acc[m][:] + sum_{i < n_pairs} p_pairs[i][m] . v_pairs[i][:] for m < rows_acc (a
// multiple of 8), 8 rows by kVecs vectors of dims at a time: one dot_pairs per pair of keys, in key order (the
// small path's kDot order).
template <int kVecs>
[[gnu::always_inline]] inline void tile_accumulate_dot_block(const uint32_t* p_pairs,
                                                             const uint32_t* v_pairs, const float* alpha, float* acc,
                                                             int m0, int d0, int n_pairs, int rows_pad, int D) {
  constexpr int kRows = 8;
  vf a[kVecs][kRows];
  unroll<kRows>([&](auto r) {
    unroll<kVecs>([&](auto v) { a[v][r] = vload(acc + (m0 + r) * D + d0 + v * VL) * alpha[m0 + r]; });
  });
  for (int i = 0; i < n_pairs; ++i) {
    pairs_t vp[kVecs];
    unroll<kVecs>([&](auto v) { vp[v] = _mm512_loadu_si512(v_pairs + i * D + d0 + v * VL); });
    const uint32_t* p = p_pairs + i * rows_pad + m0;
    unroll<kRows>([&](auto r) {
      const pairs_t pp = pair_at(p + r);
      unroll<kVecs>([&](auto v) { a[v][r] = dot_pairs(a[v][r], vp[v], pp); });
    });
  }
  unroll<kRows>([&](auto r) {
    unroll<kVecs>([&](auto v) { vstore(acc + (m0 + r) * D + d0 + v * VL, a[v][r]); });
  });
}

inline void tile_accumulate_dot(const uint32_t* p_pairs, const uint32_t* v_pairs,
                                const float* alpha, float* acc, int n_pairs, int rows_pad, int rows_acc, int D) {
  for (int m0 = 0; m0 < rows_acc; m0 += 8) {
    int d0 = 0;
    for (; d0 + 2 * VL <= D; d0 += 2 * VL)
      tile_accumulate_dot_block<2>(p_pairs, v_pairs, alpha, acc, m0, d0, n_pairs, rows_pad, D);
    if (d0 < D) tile_accumulate_dot_block<1>(p_pairs, v_pairs, alpha, acc, m0, d0, n_pairs, rows_pad, D);
  }
}
#endif

// scores[j][m] = sum_d keys[j][d] * q_t[d][m] for j < n_pad (a multiple of kKeyBlock), m < rows_pad.
inline void tile_scores(const float* q_t, const float* keys, float* scores, int n_pad, int rows_pad, int D) {
  for (int c = 0; c < rows_pad; c += VL) {
    for (int j0 = 0; j0 < n_pad; j0 += kKeyBlock) {
      vf acc[kKeyBlock] = {};
      const float* k = keys + j0 * D;
      for (int d = 0; d < D; ++d) {
        const vf qv = vload(q_t + d * rows_pad + c);
        for (int r = 0; r < kKeyBlock; ++r) acc[r] += k[r * D + d] * qv;
      }
      for (int r = 0; r < kKeyBlock; ++r) vstore(scores + (j0 + r) * rows_pad + c, acc[r]);
    }
  }
}

// acc[m][:] = alpha[m] * acc[m][:] + sum_{j < n} probs[j][m] * values[j][:] for m < rows_acc (a multiple of
// 8, <= rows_pad, the row stride of probs), 8 rows by kVecs vectors of dims at a time: each of the 8 x kVecs
// accumulators one fma per key, in key order. kVecs = 2 under avx512 (16 independent fma chains: 8 were
// latency-bound; 32 zmm registers hold them), 1 under avx2 (16 ymm registers).
template <int kVecs>
[[gnu::always_inline]] inline void tile_accumulate_block(const float* probs, const float* values, const float* alpha,
                                                         float* acc, int m0, int d0, int n, int rows_pad, int D) {
  constexpr int kRows = 8;
  vf a[kVecs][kRows];
  unroll<kRows>([&](auto r) {
    unroll<kVecs>([&](auto v) { a[v][r] = vload(acc + (m0 + r) * D + d0 + v * VL) * alpha[m0 + r]; });
  });
  for (int j = 0; j < n; ++j) {
    vf vals[kVecs];
    unroll<kVecs>([&](auto v) { vals[v] = vload(values + j * D + d0 + v * VL); });
    const float* p = probs + j * rows_pad + m0;
    unroll<kRows>([&](auto r) {
      unroll<kVecs>([&](auto v) { a[v][r] += p[r] * vals[v]; });
    });
  }
  unroll<kRows>([&](auto r) {
    unroll<kVecs>([&](auto v) { vstore(acc + (m0 + r) * D + d0 + v * VL, a[v][r]); });
  });
}

inline void tile_accumulate(const float* probs, const float* values, const float* alpha, float* acc, int n,
                            int rows_pad, int rows_acc, int D) {
  constexpr int kVecs = VL == 16 ? 2 : 1;
  for (int m0 = 0; m0 < rows_acc; m0 += 8) {
    int d0 = 0;
    for (; d0 + kVecs * VL <= D; d0 += kVecs * VL)
      tile_accumulate_block<kVecs>(probs, values, alpha, acc, m0, d0, n, rows_pad, D);
    if (d0 < D) tile_accumulate_block<1>(probs, values, alpha, acc, m0, d0, n, rows_pad, D);
  }
}

// The online softmax of the item's rows over keys [j_begin, j_end), from and into sc's running state (row_max,
// row_sum, acc). rows_pad: the score tile's width; rows_acc: the rows accumulated (a multiple of 8: padding
// rows past them are never read). bf16 on an AVX512-BF16 build (kDot): the scores are scale * (q . k) in bf16
// pairs of dims (tile_scores_dot, from sc.q_pairs, K copied as it is), V widened; with kBf16Probabilities, p
// rounded to bf16 (the row sums add the rounded p) and p . V in bf16 pairs of keys (tile_accumulate_dot). Else
// all in float32 from widened K and V.
template <typename T>
void tile_keys(const Problem<T>& pb, const WorkItem& w, Scratch& sc, int j_begin, int j_end, int rows_pad,
               int rows_acc, int pos_min, int pos_max) {
  constexpr bool kDot = kBf16Dot<T>;
  const int D = int(pb.head_dim);
  const int64_t window = pb.window;
  const T* k_rows[kKeyTile];
  const T* v_rows[kKeyTile];

  for (int j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
    const int n = std::min(kKeyTile, j_end - j0);
    const int n_pad = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    kv_rows(pb, w, j0, n, k_rows, v_rows);
    if constexpr (kDot) {
#if TETHER_BF16_DOT
      load_tile_dot(k_rows, v_rows, n, n_pad, D, sc);
      tile_scores_dot(sc.q_pairs, sc.keys_bf16, sc.scores, pb.scale, n_pad, rows_pad, D);
#endif
    } else {
      for (int j = 0; j < n; ++j) {
        for (int d = 0; d < D; ++d) sc.keys[j * D + d] = to_float(k_rows[j][d]);
        for (int d = 0; d < D; ++d) sc.values[j * D + d] = to_float(v_rows[j][d]);
      }
      std::fill(sc.keys + n * D, sc.keys + n_pad * D, 0.f);
      tile_scores(sc.q_t, sc.keys, sc.scores, n_pad, rows_pad, D);
    }

    if (pb.softcap > 0.f) {
      const float cap = pb.softcap, inv_cap = 1.f / pb.softcap;
      for (int i = 0; i < n * rows_pad; i += VL)
        vstore(sc.scores + i, cap * tanh_approx(vload(sc.scores + i) * inv_cap));
    }
    const bool all_visible = j0 + n - 1 <= pos_min && (window <= 0 || pos_max - j0 < window);
    for (int c = 0; c < rows_pad; c += VL) {  // mask, then the online softmax, VL rows at a time
      vi pos;
      std::memcpy(&pos, sc.pos + c, sizeof pos);
      vf tile_max = vset1(kNegInf);
      for (int j = 0; j < n; ++j) {
        float* s = sc.scores + j * rows_pad + c;
        if (!all_visible) {
          const vi key = vi{} + (j0 + j);
          vi visible = key <= pos;
          if (window > 0) visible &= pos - key < int32_t(window);
          vstore(s, visible ? vload(s) : vset1(kNegInf));
        }
        tile_max = vmax(tile_max, vload(s));
      }
      const vf old_max = vload(sc.row_max + c), new_max = vmax(old_max, tile_max);
      const vf shift = new_max == vset1(kNegInf) ? vf{} : new_max;  // rows that saw no key keep p = 0
      const vf alpha = exp_nonpositive(old_max - shift);
      vf tile_sum = {};
      if constexpr (kDot && kBf16Probabilities) {
#if TETHER_BF16_DOT
        for (int j = 0; j < n; j += 2) {  // p rounded to bf16, stored in pairs of keys (an odd n: key n's p = 0)
          const vf lower = round_bf16(exp_nonpositive(vload(sc.scores + j * rows_pad + c) - shift));
          tile_sum += lower;
          vf upper = {};
          if (j + 1 < n) {
            upper = round_bf16(exp_nonpositive(vload(sc.scores + (j + 1) * rows_pad + c) - shift));
            tile_sum += upper;
          }
          _mm512_storeu_si512(sc.p_pairs + j / 2 * rows_pad + c, pack_pairs(lower, upper));
        }
#endif
      } else {
        for (int j = 0; j < n; ++j) {
          const vf p = exp_nonpositive(vload(sc.scores + j * rows_pad + c) - shift);
          vstore(sc.scores + j * rows_pad + c, p);
          tile_sum += p;
        }
      }
      vstore(sc.row_max + c, new_max);
      vstore(sc.alpha + c, alpha);
      vstore(sc.row_sum + c, vload(sc.row_sum + c) * alpha + tile_sum);
    }
    if constexpr (kDot && kBf16Probabilities) {
#if TETHER_BF16_DOT
      tile_accumulate_dot(sc.p_pairs, sc.v_pairs, sc.alpha, sc.acc, (n + 1) / 2, rows_pad, rows_acc, D);
#endif
    } else {
      tile_accumulate(sc.scores, sc.values, sc.alpha, sc.acc, n, rows_pad, rows_acc, D);
    }
  }
}

template <typename T>
void run_tile_item(const Problem<T>& pb, const WorkItem& w, Scratch& sc, float* partial) {
  const int D = int(pb.head_dim), rows = w.row_end - w.row_begin;
  const int rows_pad = (rows + VL - 1) / VL * VL;  // score tile width
  const ItemRows<T> at(pb, w);
  for (int m = 0; m < rows_pad; ++m) {
    const T* src = m < rows ? pb.q + at.offset(pb, w, m) : nullptr;
    if constexpr (kBf16Dot<T>) {  // the bf16 pairs as they are (tile_keys scales the dot products)
      for (int i = 0; i < D / 2; ++i) {
        uint32_t pair = 0;
        if (src != nullptr) std::memcpy(&pair, src + 2 * i, sizeof pair);
        sc.q_pairs[i * rows_pad + m] = pair;
      }
    } else {
      for (int d = 0; d < D; ++d) sc.q_t[d * rows_pad + m] = src ? to_float(src[d]) * pb.scale : 0.f;
    }
    sc.pos[m] = m < rows ? at.position(pb, w, m) : -1;  // padding rows see no key where a mask applies
  }
  const int pos_min = at.position(pb, w, 0), pos_max = at.position(pb, w, rows - 1);
  auto reset = [&](int rows_acc) {
    std::fill(sc.row_max, sc.row_max + rows_pad, kNegInf);
    std::fill(sc.row_sum, sc.row_sum + rows_pad, 0.f);
    std::fill(sc.acc, sc.acc + rows_acc * D, 0.f);
  };
  if (!pb.invariant) {
    reset(rows_pad);
    tile_keys(pb, w, sc, w.key_begin, w.key_end, rows_pad, rows_pad, pos_min, pos_max);
    return finish_rows(pb, w, sc.acc, D, sc.row_max, sc.row_sum, partial);
  }

  // Invariant mode: w.key_begin is a multiple of kKeyTile (plan), and each canonical partition's state is
  // folded into the rows' running one. The accumulation stops at the next multiple of 8 rows (the rows past
  // it only pad the score tile); that changes no row's arithmetic.
  const int rows_acc = (rows + 7) / 8 * 8;
  std::fill(sc.fold_max, sc.fold_max + rows, kNegInf);
  std::fill(sc.fold_sum, sc.fold_sum + rows, 0.f);
  std::fill(sc.fold_acc, sc.fold_acc + rows * D, 0.f);
  for (int p0 = w.key_begin, p1; p0 < w.key_end; p0 = p1) {
    p1 = std::min(w.key_end, (p0 / kInvariantPartitionKeys + 1) * kInvariantPartitionKeys);
    reset(rows_acc);
    tile_keys(pb, w, sc, p0, p1, rows_pad, rows_acc, pos_min, pos_max);
    for (int m = 0; m < rows; ++m)
      fold_partition(sc.row_max[m], sc.row_sum[m], sc.acc + m * D, sc.fold_max[m], sc.fold_sum[m],
                     sc.fold_acc + m * D, D);
  }
  finish_folded(pb, w, sc.fold_acc, D, sc.fold_max, sc.fold_sum, partial);
}

template <typename T, bool kInvariant>
void run_item(const Problem<T>& pb, const WorkItem& w, float* partial) {
  switch (w.row_end - w.row_begin) {
    case 1: return run_small_item<T, 1, kInvariant>(pb, w, partial);
    case 2: return run_small_item<T, 2, kInvariant>(pb, w, partial);
    case 3: return run_small_item<T, 3, kInvariant>(pb, w, partial);
    case 4: return run_small_item<T, 4, kInvariant>(pb, w, partial);
    case 5: case 6: case 7: case 8: return run_small_item<T, kMaxSmallRows, kInvariant>(pb, w, partial);
    default: {
      // The thread's scratch through a pointer the optimiser cannot see through: as the constant &scratch
      // (every call passes it), g++ propagates it into run_tile_item and tile_keys, and a thread_local in this
      // -fPIC library costs a __tls_get_addr call (and a vzeroupper and spilled vectors) at each use in the loops.
      Scratch* sc = &scratch;
      asm("" : "+r"(sc));
      return run_tile_item(pb, w, *sc, partial);
    }
  }
}

template <typename T>
void run_item(const Problem<T>& pb, const WorkItem& w, float* partial) {
  if (pb.invariant) return run_item<T, true>(pb, w, partial);
  return run_item<T, false>(pb, w, partial);
}

// The partitions of one split item -> its output rows.
template <typename T>
void merge_partials(const Problem<T>& pb, const WorkItem& w, const float* partials, int parts) {
  const int D = int(pb.head_dim);
  const int64_t part_stride = int64_t(kMaxRows) * (2 + D);
  const ItemRows<T> at(pb, w);
  float acc[kMaxHeadDim];
  if (pb.invariant) {  // each part one canonical partition: folded in key order as one item folds its own
    for (int m = 0; m < w.row_end - w.row_begin; ++m) {
      float max = kNegInf, sum = 0.f;
      std::fill(acc, acc + D, 0.f);
      for (int p = 0; p < parts; ++p) {
        const float* part = partials + p * part_stride + m * (2 + D);
        fold_partition(part[0], part[1], part + 2, max, sum, acc, D);
      }
      T* dst = pb.out + at.offset(pb, w, m);
      for (int d = 0; d < D; ++d) dst[d] = T(acc[d] / sum);
    }
    return;
  }
  for (int m = 0; m < w.row_end - w.row_begin; ++m) {
    float max = kNegInf, sum = 0.f;
    for (int p = 0; p < parts; ++p) max = std::max(max, partials[p * part_stride + m * (2 + D)]);
    std::fill(acc, acc + D, 0.f);
    for (int p = 0; p < parts; ++p) {
      const float* part = partials + p * part_stride + m * (2 + D);
      const float weight = part[0] == kNegInf ? 0.f : std::exp(part[0] - max);
      sum += weight * part[1];
      for (int d = 0; d < D; ++d) acc[d] += weight * part[2 + d];
    }
    T* dst = pb.out + at.offset(pb, w, m);
    for (int d = 0; d < D; ++d) dst[d] = T(acc[d] / sum);
  }
}

// Items: (sequence, KV head, tile of rows, the keys its rows see); long key ranges split when items are few.
// Invariant mode: an item's first key is rounded down to a multiple of kKeyTile (tiles at absolute positions),
// and a split cuts at every multiple of kInvariantPartitionKeys: whether and where to split may depend on the
// batch and the threads, since a part is then exactly one canonical partition and merge_partials folds them as
// an unsplit item does.
std::vector<WorkItem> plan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
                           int64_t num_kv_heads, int64_t group, int64_t window, int64_t max_keys, int threads,
                           bool invariant, std::vector<Split>& splits, int& num_partials) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s], seq_len = seq_lens[s];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len && seq_len <= max_keys, "sequence ", s, ": ", q_len,
                " queries, ", seq_len, " keys, block table of ", max_keys, " keys");
    const int64_t rows = int64_t(q_len) * group;
    if (rows == 0) continue;
    const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, tile_rows = (rows + tiles - 1) / tiles;
    for (int64_t row_begin = 0; row_begin < rows; row_begin += tile_rows) {
      const int64_t row_end = std::min(rows, row_begin + tile_rows);
      const int64_t pos_min = seq_len - q_len + row_begin / group, pos_max = seq_len - q_len + (row_end - 1) / group;
      int64_t key_begin = window > 0 ? std::max<int64_t>(0, pos_min - window + 1) : 0;
      if (invariant) key_begin = key_begin / kKeyTile * kKeyTile;
      const int64_t cost = (row_end - row_begin + VL - 1) / VL * (pos_max + 1 - key_begin);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({int32_t(s), int32_t(h), int32_t(row_begin), int32_t(row_end), int32_t(key_begin),
                         int32_t(pos_max + 1), -1, -1, cost});
    }
  }
  num_partials = 0;
  if (threads < 2 || items.empty() || int64_t(items.size()) >= 2 * threads) return items;
  const int64_t want = (2 * threads + int64_t(items.size()) - 1) / int64_t(items.size());
  std::vector<WorkItem> split_items;
  for (const WorkItem& w : items) {
    const int64_t keys = w.key_end - w.key_begin;
    const int64_t parts = invariant ? (w.key_end - 1) / kInvariantPartitionKeys -
                                          w.key_begin / kInvariantPartitionKeys + 1  // the canonical ones it spans
                                    : std::min(want, keys / kMinPartitionKeys);
    if (parts < 2) {
      split_items.push_back(w);
      continue;
    }
    const int64_t part_keys = ((keys + parts - 1) / parts + kKeyTile - 1) / kKeyTile * kKeyTile;
    splits.push_back({int32_t(split_items.size()), 0});
    for (int64_t begin = w.key_begin, end; begin < w.key_end; begin = end) {
      end = invariant ? (begin / kInvariantPartitionKeys + 1) * kInvariantPartitionKeys : begin + part_keys;
      WorkItem part = w;
      part.key_begin = int32_t(begin);
      part.key_end = int32_t(std::min<int64_t>(w.key_end, end));
      part.partial = num_partials++;
      part.split = int32_t(splits.size() - 1);
      part.cost = w.cost * (part.key_end - part.key_begin) / keys;
      split_items.push_back(part);
      ++splits.back().parts;
    }
  }
  return split_items;
}

template <typename T>
void attention(const Problem<T>& pb, int64_t num_seqs) {
  const int threads = at::get_num_threads();
  std::vector<Split> splits;
  int num_partials = 0;
  const std::vector<WorkItem> items =
      plan(pb.query_start_loc, pb.seq_lens, num_seqs, pb.num_kv_heads, pb.group, pb.window,
           pb.max_blocks * pb.block_size, threads, pb.invariant, splits, num_partials);
  if (items.empty()) return;
  // [num_partials][kMaxRows][2 + D]: uninitialised, each partition writes its rows
  const std::unique_ptr<float[]> partials(new float[size_t(num_partials) * kMaxRows * (2 + pb.head_dim)]);
  std::vector<int32_t> order(items.size());  // most expensive first: threads finish together
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return items[a].cost > items[b].cost; });
  std::vector<std::atomic<int32_t>> pending(splits.size());  // partitions of each split still running
  for (size_t i = 0; i < splits.size(); ++i) pending[i].store(splits[i].parts);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, int64_t(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < int64_t(items.size()); i = next.fetch_add(1)) {
      const WorkItem& w = items[order[i]];
      float* partial = w.partial < 0 ? nullptr : partials.get() + int64_t(w.partial) * kMaxRows * (2 + pb.head_dim);
      run_item(pb, w, partial);
      if (w.split >= 0 && pending[w.split].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the last one merges
        const WorkItem& first = items[splits[w.split].first_item];
        merge_partials(pb, first, partials.get() + int64_t(first.partial) * kMaxRows * (2 + pb.head_dim),
                       splits[w.split].parts);
      }
    }
  });
}

void check_int32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int32 CPU tensor of ", dim, " dims");
}

}  // namespace

// out, q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; query_start_loc: [S + 1] int32;
// seq_lens: [S] int32 (keys after this step); block_table: [S, max_blocks] int32. invariant: batch-invariant
// mode (see the top of the file); false: the fastest order.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                     double scale, int64_t sliding_window, double softcap, bool invariant) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q: [T, H, D], k_cache: [num_blocks, block_size, Hkv, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_cache, &v_cache})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == q.scalar_type(),
                "out, q, k_cache and v_cache must be contiguous CPU tensors of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(out.sizes() == q.sizes() && v_cache.sizes() == k_cache.sizes(), "shape mismatch");
  check_int32(query_start_loc, "query_start_loc", 1);
  check_int32(seq_lens, "seq_lens", 1);
  check_int32(block_table, "block_table", 2);
  const int64_t num_seqs = seq_lens.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= kMaxHeadDim, "head_dim must match, a multiple of 16 <= 256");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs, "batch size mismatch");
  TORCH_CHECK(num_seqs == 0 || query_start_loc.data_ptr<int32_t>()[num_seqs] <= q.size(0), "query_start_loc past T");
  const int64_t block_size = k_cache.size(1), max_blocks = block_table.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {  // the blocks each sequence's keys live in exist
    const int64_t used = std::min<int64_t>(max_blocks, (seq_lens.data_ptr<int32_t>()[s] + block_size - 1) / block_size);
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = block_table.data_ptr<int32_t>()[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "sequence ", s, ": block ", block, " out of range");
    }
  }
  auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Problem<T> pb{q.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                        block_table.data_ptr<int32_t>(),
                        H, Hkv, H / Hkv, D, block_size, max_blocks, float(scale), float(softcap),
                        sliding_window, invariant};
    attention(pb, num_seqs);
  };
  if (q.scalar_type() == at::kFloat)
    launch(static_cast<float*>(nullptr));
  else
    launch(static_cast<at::BFloat16*>(nullptr));
}

// k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64, -1 = skip.
void store_kvcache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &k_cache, &v_cache})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == k_cache.scalar_type(),
                "k, v, k_cache and v_cache must be contiguous CPU tensors of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 vector");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) && slot_mapping.size(0) == k.size(0),
              "k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T]");
  const int64_t num_tokens = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range (", num_slots, " slots)");
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * row_bytes, row_bytes);
      std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * row_bytes, row_bytes);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_table, float scale, int sliding_window, float softcap, bool invariant) "
        "-> ()");
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kvcache", &store_kvcache);
}
