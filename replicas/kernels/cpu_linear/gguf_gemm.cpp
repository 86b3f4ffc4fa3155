// Linear layers on GGUF weights kept in their file's block formats (gguf_blocks.py).
//
//   out[m, n] = sum_k x[m, k] * w[n, k]     x [M, K] float32, w a GGUF tensor [N, K] of one type, out [M, N] float32
//
// The weight is the file's bytes, reordered once (gguf_blocks.py `repack`): rows in tiles of VL, and for each
// GGUF block along k, each field of the block (scales, quants) with the tile's VL rows side by side -- byte j of
// the field in every row as one run of VL bytes (a float16 field as VL halves). Same bytes, same size as the file.
// Per type, a GGUF block of QK weights of one row, its fields in tile order, and the weight it holds:
//   F32 F16 BF16  (QK 1)  the value                                   w = float(v)
//   Q4_0  (QK 32)   d | qs[16]                                        w = d * (q - 8)      q: nibble k%16, k/16
//   Q4_1  (QK 32)   d | m | qs[16]                                    w = d * q + m
//   Q5_0  (QK 32)   d | qh[4] | qs[16]                                w = d * (q - 16)     bit 4: qh bit k
//   Q5_1  (QK 32)   d | m | qh[4] | qs[16]                            w = d * q + m
//   Q8_0  (QK 32)   d | qs[32] int8                                   w = q * d
//   Q4_K  (QK 256)  d | dmin | scales[12] | qs[128]                   w = (d * sc_j) * q - (dmin * m_j), j = k/32
//   Q5_K  (QK 256)  d | dmin | scales[12] | qh[32] | qs[128]          the same, bit 4 of q: qh[k%32] bit k/32
//   Q6_K  (QK 256)  d | scales[16] int8 | ql[128] | qh[64]            w = (d * sc_(k/16)) * (q - 32)
// Each weight is rebuilt in float32 as the gguf package's `dequantize` does it (the same products and sums, each
// rounded: contraction off below), so the weights are that reference's bit for bit. They go into a panel of
// kChunk k x a few tiles, and each output is one accumulator lane carried over k = 0 .. K-1 in order, from zero,
// one FMA per k (kept in memory between chunks): invariant_gemm.cpp's widen form over the dequantized weight, bit
// for bit, whatever M -- so batch invariant, and the same code for decode and prefill.
#pragma GCC optimize("fp-contract=off")
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "tether_vec.h"

namespace {

using namespace tether;

constexpr int kRows = 4;                      // rows of x per register block
constexpr int kMaxTiles = VL == 16 ? 4 : 2;   // tiles of VL outputs per register block (32 zmm / 16 ymm)
constexpr int64_t kChunk = 256;               // k per panel: one K-quant block, eight of the others

// ---- VL lanes (one per row of a tile) from a field's run

inline vi lanes_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vi lanes_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vf lanes_f16(const uint8_t* p) {  // exact
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vf lanes_bf16(const uint8_t* p) { return vload(reinterpret_cast<const c10::BFloat16*>(p)); }
inline vf to_vf(vi v) { return __builtin_convertvector(v, vf); }

// ---- one type each: `blocks` GGUF blocks of a tile (tb: their fields, block after block) -> panel [blocks*QK][VL]

constexpr int64_t F = VL;  // bytes of a one-byte field run
constexpr int64_t H = 2 * VL;  // bytes of a float16 field run

void dequant_f32(const uint8_t* tb, int64_t blocks, float* panel) {
  std::memcpy(panel, tb, blocks * VL * sizeof(float));
}
void dequant_f16(const uint8_t* tb, int64_t blocks, float* panel) {
  for (int64_t k = 0; k < blocks; ++k) vstore(panel + k * VL, lanes_f16(tb + k * H));
}
void dequant_bf16(const uint8_t* tb, int64_t blocks, float* panel) {
  for (int64_t k = 0; k < blocks; ++k) vstore(panel + k * VL, lanes_bf16(tb + k * H));
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 4 low bits from qs (k < 16: low nibbles of bytes 0..15, then their high nibbles),
// the fifth bit from qh (bit k of its 32); signed types subtract 8 or 16, the others add m.
template <bool kMin, bool kFifthBit>
void dequant_legacy(const uint8_t* tb, int64_t blocks, float* panel) {
  constexpr int64_t qh_at = kMin ? 2 * H : H, qs_at = qh_at + (kFifthBit ? 4 * F : 0);
  constexpr int bias = kFifthBit ? 16 : 8;
  constexpr int64_t block_bytes = qs_at + 16 * F;
  for (int64_t blk = 0; blk < blocks; ++blk, tb += block_bytes, panel += 32 * VL) {
    const vf d = lanes_f16(tb), m = kMin ? lanes_f16(tb + H) : vf{};
    auto weight = [&](vi q) { return kMin ? d * to_vf(q) + m : d * to_vf(q - bias); };
    for (int j = 0; j < 16; ++j) {  // byte j: k = j (low nibble) and k = 16 + j (high)
      const vi bytes = lanes_u8(tb + qs_at + j * F);
      vi low = bytes & 15, high = bytes >> 4;
      if (kFifthBit) {
        low |= ((lanes_u8(tb + qh_at + (j / 8) * F) >> (j % 8)) & 1) << 4;
        high |= ((lanes_u8(tb + qh_at + (2 + j / 8) * F) >> (j % 8)) & 1) << 4;
      }
      vstore(panel + j * VL, weight(low));
      vstore(panel + (16 + j) * VL, weight(high));
    }
  }
}

void dequant_q8_0(const uint8_t* tb, int64_t blocks, float* panel) {
  constexpr int64_t block_bytes = H + 32 * F;
  for (int64_t blk = 0; blk < blocks; ++blk, tb += block_bytes, panel += 32 * VL) {
    const vf d = lanes_f16(tb);
    for (int k = 0; k < 32; ++k) vstore(panel + k * VL, to_vf(lanes_i8(tb + H + k * F)) * d);
  }
}

// Q4_K / Q5_K: eight sub-blocks of 32, each with a 6-bit scale and min packed in `scales` (ggml's get_scale_min_k4).
template <bool kFifthBit>
void dequant_k4(const uint8_t* tb, int64_t blocks, float* panel) {
  constexpr int64_t sc_at = 2 * H, qh_at = sc_at + 12 * F, qs_at = qh_at + (kFifthBit ? 32 * F : 0);
  constexpr int64_t block_bytes = qs_at + 128 * F;
  for (int64_t blk = 0; blk < blocks; ++blk, tb += block_bytes, panel += 256 * VL) {
    const vf d = lanes_f16(tb), dmin = lanes_f16(tb + H);
    auto s = [&](int i) { return lanes_u8(tb + sc_at + i * F); };
    for (int j = 0; j < 8; j += 2) {  // sub-blocks j and j + 1 share their bytes: low nibbles, then high
      vf ds[2], dm[2];
      for (int h = 0; h < 2; ++h) {
        const int jj = j + h;
        const vi sc = jj < 4 ? s(jj) & 63 : (s(jj + 4) & 15) | ((s(jj - 4) >> 6) << 4);
        const vi mn = jj < 4 ? s(jj + 4) & 63 : (s(jj + 4) >> 4) | ((s(jj) >> 6) << 4);
        ds[h] = d * to_vf(sc);
        dm[h] = dmin * to_vf(mn);
      }
      for (int i = 0; i < 32; ++i) {
        const vi bytes = lanes_u8(tb + qs_at + (j / 2 * 32 + i) * F);
        vi low = bytes & 15, high = bytes >> 4;
        if (kFifthBit) {
          const vi bits = lanes_u8(tb + qh_at + i * F);
          low |= ((bits >> j) & 1) << 4;
          high |= ((bits >> (j + 1)) & 1) << 4;
        }
        vstore(panel + (j * 32 + i) * VL, ds[0] * to_vf(low) - dm[0]);
        vstore(panel + ((j + 1) * 32 + i) * VL, ds[1] * to_vf(high) - dm[1]);
      }
    }
  }
}

void dequant_q6_k(const uint8_t* tb, int64_t blocks, float* panel) {
  constexpr int64_t sc_at = H, ql_at = sc_at + 16 * F, qh_at = ql_at + 128 * F, block_bytes = qh_at + 64 * F;
  for (int64_t blk = 0; blk < blocks; ++blk, tb += block_bytes, panel += 256 * VL) {
    const vf d = lanes_f16(tb);
    vf ds[16];  // sixteen sub-blocks of 16, each with an int8 scale
    for (int g = 0; g < 16; ++g) ds[g] = d * to_vf(lanes_i8(tb + sc_at + g * F));
    for (int h = 0; h < 2; ++h)       // halves of 128: k = h * 128 + r
      for (int i = 0; i < 32; ++i) {  // qh byte h*32 + i: 2 bits for r = i, 32 + i, 64 + i, 96 + i
        const vi high = lanes_u8(tb + qh_at + (h * 32 + i) * F);
        const vi low_a = lanes_u8(tb + ql_at + (h * 64 + i) * F), low_b = lanes_u8(tb + ql_at + (h * 64 + 32 + i) * F);
        const vi q[4] = {(low_a & 15) | ((high & 3) << 4), (low_b & 15) | (((high >> 2) & 3) << 4),
                         (low_a >> 4) | (((high >> 4) & 3) << 4), (low_b >> 4) | (((high >> 6) & 3) << 4)};
        for (int t = 0; t < 4; ++t) {
          const int k = h * 128 + t * 32 + i;
          vstore(panel + k * VL, ds[k / 16] * to_vf(q[t] - 32));
        }
      }
  }
}

struct BlockType {
  int64_t qk, bytes;  // weights and bytes per GGUF block (per row)
  void (*dequant)(const uint8_t*, int64_t, float*);
};

BlockType block_type(int64_t ggml_type) {  // GGMLQuantizationType values
  switch (ggml_type) {
    case 0: return {1, 4, dequant_f32};
    case 1: return {1, 2, dequant_f16};
    case 30: return {1, 2, dequant_bf16};
    case 2: return {32, 18, dequant_legacy<false, false>};
    case 3: return {32, 20, dequant_legacy<true, false>};
    case 6: return {32, 22, dequant_legacy<false, true>};
    case 7: return {32, 24, dequant_legacy<true, true>};
    case 8: return {32, 34, dequant_q8_0};
    case 12: return {256, 144, dequant_k4<false>};
    case 13: return {256, 176, dequant_k4<true>};
    case 14: return {256, 210, dequant_q6_k};
  }
  TORCH_CHECK(false, "gguf_linear: GGML type ", ggml_type, " is not kept in blocks");
}

struct Problem {
  int64_t M, K, N, ldx;
  BlockType type;
  int64_t tile_block_bytes;  // one GGUF block of a tile: bytes * VL
  int64_t row_blocks;        // GGUF blocks per row: K / qk
};

// The two forms of the k step, one per activation dtype (a build's ISA fixes which bf16 takes):
//   Widen (float32 x, out; bf16 x too where the build lacks AVX512-BF16, widened exactly): the float32 panel,
//     acc = fma(x[m, k], w[n, k], acc) for k in order -- invariant_gemm.cpp's widen form.
//   Pairs (bf16 x and out, built with AVX512-BF16): the panel rounded to bf16 (nearest even) and paired
//     [kc/2][VL][2]; vdpbf16ps adds x[m,2p] w[n,2p] + x[m,2p+1] w[n,2p+1] per pair p in order (the odd last k
//     alone) -- invariant_gemm.cpp's pairs form over the bf16-rounded dequantized weight, so a bf16 model's sums
//     are those of the same weights converted to bf16.
struct Widen {
  using X = float;
  using P = float;
  static constexpr int64_t kStride = kChunk * VL;  // panel elements per tile
  // one tile's kc k: dequantized straight into its place in the panel
  static void fill(const BlockType& type, const uint8_t* src, int64_t kc, float*, P* tile) {
    type.dequant(src, kc / type.qk, tile);
  }
  template <typename T, int MB, int NB>
  static void accumulate(const float* panel, int64_t kc, const T* xr, int64_t ldx, vf (&acc)[MB][NB]) {
    for (int64_t k = 0; k < kc; ++k) {
      vf wv[NB];
      unroll<NB>([&](auto b) { wv[b] = vload(panel + b * kStride + k * VL); });
      unroll<MB>([&](auto m) {
        const vf xv = vset1(to_float(xr[m * ldx + k]));
        unroll<NB>([&](auto b) { acc[m][b] = vfma(xv, wv[b], acc[m][b]); });
      });
    }
  }
};

struct WidenBf16 : Widen {
  using X = c10::BFloat16;
};

#if defined(__AVX512BF16__)
struct Pairs {
  using X = c10::BFloat16;
  using P = c10::BFloat16;
  static constexpr int64_t kStride = kChunk * VL;  // panel elements per tile: kChunk/2 pairs of [VL][2]
  // one tile's kc k: dequantized into `floats` [kc][VL] (one tile: it stays in L1), then rounded to bf16 and
  // paired into its place in the panel [kc/2][VL][2] (a zero beside an odd last k)
  static void fill(const BlockType& type, const uint8_t* src, int64_t kc, float* floats, P* tile) {
    type.dequant(src, kc / type.qk, floats);
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t p = 0; p < (kc + 1) / 2; ++p) {
      const float* at = floats + 2 * p * VL;
      const __m512 even = _mm512_loadu_ps(at), odd = 2 * p + 1 < kc ? _mm512_loadu_ps(at + VL) : _mm512_setzero_ps();
      const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(even, second, odd),
                                                  _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_si512(tile + 2 * p * VL, (__m512i)packed);
    }
  }
  template <typename T, int MB, int NB>
  static void accumulate(const P* panel, int64_t kc, const T* xr, int64_t ldx, vf (&acc)[MB][NB]) {
    auto step = [&](int64_t p, auto x_pair) {
      __m512bh wv[NB];
      unroll<NB>([&](auto b) { wv[b] = (__m512bh)_mm512_loadu_si512(panel + b * kStride + 2 * p * VL); });
      unroll<MB>([&](auto m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(x_pair(xr + m * ldx + 2 * p)));
        unroll<NB>([&](auto b) { acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]); });
      });
    };
    for (int64_t p = 0; p < kc / 2; ++p)
      step(p, [](const X* at) { uint32_t pair; std::memcpy(&pair, at, 4); return pair; });
    if (kc % 2) step(kc / 2, [](const X* at) { return uint32_t(at->x); });
  }
};
#endif

// Rows [m0, m0 + MB) x tiles [0, NB) of the panel over its kc k: acc from (first: zero) accm, then back to accm,
// or (last) + bias, rounded once, to out.
template <typename Form, int MB, int NB, typename O>
void chunk_block(const Problem& pb, const typename Form::P* panel, int64_t kc, const typename Form::X* xr,
                 float* accm, bool first, bool last, const float* bias, O* out, int64_t n0) {
  vf acc[MB][NB];
  unroll<MB>([&](auto m) {
    unroll<NB>([&](auto b) { acc[m][b] = first ? vzero() : vload(accm + (m * kMaxTiles + b) * VL); });
  });
  Form::template accumulate<typename Form::X, MB, NB>(panel, kc, xr, pb.ldx, acc);
  unroll<MB>([&](auto m) {
    unroll<NB>([&](auto b) {
      if (!last) return vstore(accm + (m * kMaxTiles + b) * VL, acc[m][b]);
      float lanes[VL];
      vstore(lanes, acc[m][b]);
      const int64_t n = n0 + b * VL, valid = std::min<int64_t>(VL, pb.N - n);
      for (int64_t j = 0; j < valid; ++j) out[m * pb.N + n + j] = from_float<O>(bias ? lanes[j] + bias[n + j] : lanes[j]);
    });
  });
}

template <typename Form, int MB, typename O>
void chunk_block_tiles(int nb, const Problem& pb, const typename Form::P* panel, int64_t kc,
                       const typename Form::X* xr, float* accm, bool first, bool last, const float* bias, O* out,
                       int64_t n0) {
  switch (nb) {
    case 1: return chunk_block<Form, MB, 1>(pb, panel, kc, xr, accm, first, last, bias, out, n0);
    case 2: return chunk_block<Form, MB, 2>(pb, panel, kc, xr, accm, first, last, bias, out, n0);
    case 3: if constexpr (kMaxTiles >= 4) return chunk_block<Form, MB, 3>(pb, panel, kc, xr, accm, first, last, bias, out, n0); break;
    case 4: if constexpr (kMaxTiles >= 4) return chunk_block<Form, MB, 4>(pb, panel, kc, xr, accm, first, last, bias, out, n0); break;
  }
  TORCH_CHECK(false, "gguf_linear: bad tile count ", nb);
}

// Threads split the tiles (never k); each takes kMaxTiles tiles at a time, kChunk k at a time: dequantizes them into
// its panel (in the form's layout, a tile at a time), and every row of x passes over the panel kRows rows at a time.
template <typename Form, typename O>
void run(const Problem& pb, const uint8_t* w, const typename Form::X* x, const float* bias, O* out) {
  const int64_t tiles = (pb.N + VL - 1) / VL;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // uninitialized: every panel element is written before it is read, every accumulator too (first chunk)
    std::unique_ptr<float[]> floats(new float[kChunk * VL]), acc(new float[pb.M * kMaxTiles * VL]);
    std::unique_ptr<typename Form::P[]> formed(new typename Form::P[kMaxTiles * Form::kStride]);
    const typename Form::P* panel = formed.get();
    for (int64_t t0 = begin; t0 < end; t0 += kMaxTiles) {
      const int nb = int(std::min<int64_t>(kMaxTiles, end - t0));
      for (int64_t k0 = 0; k0 < pb.K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, pb.K - k0);
        for (int b = 0; b < nb; ++b)
          Form::fill(pb.type, w + ((t0 + b) * pb.row_blocks + k0 / pb.type.qk) * pb.tile_block_bytes, kc,
                     floats.get(), formed.get() + b * Form::kStride);
        const bool first = k0 == 0, last = k0 + kc == pb.K;
        for (int64_t m0 = 0; m0 < pb.M; m0 += kRows) {
          const typename Form::X* xr = x + m0 * pb.ldx + k0;
          float* accm = acc.get() + m0 * kMaxTiles * VL;
          O* o = out + m0 * pb.N;
          switch (std::min<int64_t>(kRows, pb.M - m0)) {
            case 1: chunk_block_tiles<Form, 1>(nb, pb, panel, kc, xr, accm, first, last, bias, o, t0 * VL); break;
            case 2: chunk_block_tiles<Form, 2>(nb, pb, panel, kc, xr, accm, first, last, bias, o, t0 * VL); break;
            case 3: chunk_block_tiles<Form, 3>(nb, pb, panel, kc, xr, accm, first, last, bias, o, t0 * VL); break;
            default: chunk_block_tiles<Form, kRows>(nb, pb, panel, kc, xr, accm, first, last, bias, o, t0 * VL);
          }
        }
      }
    }
  });
}

Problem problem(const at::Tensor& w, int64_t ggml_type, int64_t M, int64_t K, int64_t N, int64_t ldx) {
  const BlockType type = block_type(ggml_type);
  TORCH_CHECK(K % type.qk == 0, "gguf_linear: K = ", K, " is not whole blocks of ", type.qk);
  const int64_t tiles = (N + VL - 1) / VL;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == tiles * VL * (K / type.qk) * type.bytes,
              "gguf_linear: w must be the repacked [", N, ", ", K, "] tensor of type ", ggml_type);
  return Problem{M, K, N, ldx, type, type.bytes * VL, K / type.qk};
}

// x [M, K] float32 or bf16 (rows contiguous), w the repacked GGUF tensor (uint8) of `ggml_type`, bias [N] float32
// or None, out [M, N] in x's dtype: out = x @ w.T + bias, each output rounded once.
void gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t out_features,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.stride(1) == 1,
              "gguf_linear: x float32 | bf16 [M, K]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
              out.size(1) == out_features, "gguf_linear: out must be a contiguous [M, N] in x's dtype");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features),
              "gguf_linear: bias must be float32 [N]");
  const Problem pb = problem(w, ggml_type, x.size(0), x.size(1), out_features, x.stride(0));
  if (pb.M == 0 || pb.N == 0) return;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    return run<Widen>(pb, w.data_ptr<uint8_t>(), x.data_ptr<float>(), b, out.data_ptr<float>());
  using bf16 = c10::BFloat16;
#if defined(__AVX512BF16__)
  run<Pairs>(pb, w.data_ptr<uint8_t>(), x.data_ptr<bf16>(), b, out.data_ptr<bf16>());
#else
  run<WidenBf16>(pb, w.data_ptr<uint8_t>(), x.data_ptr<bf16>(), b, out.data_ptr<bf16>());
#endif
}

// Rows `ids` [T] int64 of the repacked [num_rows, K] GGUF tensor -> out [T, K] float32 (an embedding lookup).
void gguf_rows(const at::Tensor& w, int64_t ggml_type, int64_t num_rows, const at::Tensor& ids, at::Tensor out) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "gguf_rows: ids int64 [T]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.size(0),
              "gguf_rows: out must be a contiguous float32 [T, K]");
  const int64_t K = out.size(1);
  const Problem pb = problem(w, ggml_type, 0, K, num_rows, 0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < num_rows, "gguf_rows: id ", id[t], " out of [0, ", num_rows, ")");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, ids.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kChunk * VL);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = id[t] / VL, lane = id[t] % VL;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        pb.type.dequant(wp + (tile * pb.row_blocks + k0 / pb.type.qk) * pb.tile_block_bytes, kc / pb.type.qk,
                        panel.data());
        for (int64_t k = 0; k < kc; ++k) o[t * K + k0 + k] = panel[k * VL + lane];
      }
    }
  });
}

// [rows per tile of the build's repacked layout, 1 if bf16 activations take the pairs form].
std::vector<int64_t> gguf_layout() {
#if defined(__AVX512BF16__)
  return {VL, 1};
#else
  return {VL, 0};
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int ggml_type, int out_features, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("gguf_rows(Tensor w, int ggml_type, int num_rows, Tensor ids, Tensor(a!) out) -> ()");
  m.def("gguf_layout() -> int[]", &gguf_layout);
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_rows", &gguf_rows);
}
