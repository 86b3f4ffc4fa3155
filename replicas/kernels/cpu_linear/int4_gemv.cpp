// A linear layer over 4-bit weight groups for decode-sized batches (1-8 rows), float32 math.
//
//   w[n, k] = q[n, k] * scale[n, k / G] + offset[n, k / G],   q in 0..15, G a multiple of 32
//   out[m, n] = sum_k x[m, k] * w[n, k]
//
// Each weight is rebuilt in registers as fma(q, scale, offset) -- one float32 rounding of the exact
// weight -- and multiplied into every row of x: the 4-bit weights (0.5 byte each, plus 8 bytes of
// float32 scale / offset per group, or 4 of float16 ones) are read once per call, in one pass, at full
// float32 precision. AVX-512 rebuilds 16 weights with one permute of the group's 16 possible weights
// (table[q] = fma(q, scale, offset)); AVX2 converts q to float and applies one FMA. (The form
// scale * sum(q * x) + offset * sum(x) over precomputed group sums of x is the same sum; at G = 32 its
// per-group partial sums cost what it saves per weight, and it measured slower on AVX2.)
//
// Packed layout (`pack`): uint8 [N rounded up to 4, K/2], rows in quads. Each run of 32 weights of a
// row (a block) is 16 bytes, byte j holding q[32b + j] in its low nibble and q[32b + 16 + j] in its
// high one; a quad stores block b of its 4 rows side by side (64 bytes, a cache line), then block b + 1:
//   byte (n / 4) * 2K + b * 64 + (n % 4) * 16 + j.
// So a tile of 4 rows (AVX-512) reads one sequential stream -- out of cache, ~1.5x the speed of
// row-major rows -- and one 16-byte load zero-extended to int32 lanes gives weights j.. (low nibbles)
// and 16 + j.. (high nibbles, after a shift) of a block. The same layout on every ISA; padding rows 0.
//
// Threads: at::parallel_for over the weight rows (every row of x per weight tile). It runs on
// torch's OpenMP threads only when this file is built with -fopenmp; without it, one thread
// (the module's `openmp` attribute says which).
//
// Built with the host's ISA flags (replicas/cpu_isa.py): AVX-512 or AVX2+FMA; the vector layer is tether_vec.h.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "tether_vec.h"

namespace {

using namespace tether;

constexpr int64_t kBlock = 32;     // weights per packed block of a row (16 bytes)
constexpr int64_t kQuad = 4;       // weight rows interleaved by the packed layout: 4 x 16 bytes, a cache line
constexpr int64_t kMaxRows = 8;    // rows of x per kernel pass; more rows run in passes of 8

// ---- the ISA-specific part (the vector layer is tether_vec.h): Dequant, which turns one weight row's packed
// bytes of a group into weights: Dequant(scale, offset)(bytes + j, lo, hi) gives the weights j..j+VL
// (low nibbles) and 16+j..16+j+VL (high nibbles) of a block as fma(q, scale, offset). ----
#if defined(__AVX512F__)
struct Dequant {
  Dequant() = default;
  vf table;  // the group's 16 possible weights: table[q] = fma(q, scale, offset)
  Dequant(float scale, float offset)
      : table(_mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_ps(scale), _mm512_set1_ps(offset))) {}
  void operator()(const uint8_t* p, vf& lo, vf& hi) const {  // 16 bytes -> 32 weights
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(b, table);  // the permute reads each lane's low 4 bits: the low nibble
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
};
#else  // AVX2 + FMA
struct Dequant {
  Dequant() = default;
  vf scale, offset;
  Dequant(float s, float o) : scale(_mm256_set1_ps(s)), offset(_mm256_set1_ps(o)) {}
  void operator()(const uint8_t* p, vf& lo, vf& hi) const {  // 8 bytes -> 16 weights
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), scale, offset);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), scale, offset);
  }
};
#endif

// The tile: NR weight rows at a time (their x loads shared), A accumulators per output (each taking
// every A-th VL-weight piece of a block). Enough independent FMA chains to hide the FMA latency
// (~8), few enough registers: 32 vectors with AVX-512, 16 with AVX2. Measured at SmolLM2's shapes.
constexpr int kTileRows = VL == 16 ? 4 : 1;
constexpr int acc_sets(int M) { return VL == 16 ? (M == 1 ? 2 : 1) : (M <= 2 ? 4 : M <= 4 ? 2 : 1); }

// float16 -> float32, n values (F16C with the avx2 flags and up).
inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}

// The group scales and offsets of the weight rows, [N, K/G] each: float32, or float16 where that holds
// them exactly (GGUF's Q4 blocks store them as float16: 4 bytes a group instead of 8).
struct Scales {
  const void *scale, *offset;
  bool half;
  int64_t groups;  // K / G
  // Rows n..n+rows as float32 [rows, groups] each: pointers into the tensors, or float16 widened into buf.
  void rows(int64_t n, int64_t rows, std::vector<float>& buf, const float*& s, const float*& o) const {
    const int64_t at = n * groups, count = rows * groups;
    if (!half) {
      s = static_cast<const float*>(scale) + at, o = static_cast<const float*>(offset) + at;
      return;
    }
    buf.resize(2 * count);
    half_to_float(static_cast<const uint16_t*>(scale) + at, buf.data(), count);
    half_to_float(static_cast<const uint16_t*>(offset) + at, buf.data() + count, count);
    s = buf.data(), o = buf.data() + count;
  }
};

// out[m, n0:n0+NR] for m < M.  x: [M, K] float32;  packed: row n0's first block in its quad;
// scale, offset: rows n0.. of [N, K/G] float32;  out: [M, N] (row stride N).
template <int M, int NR, typename OutT>
inline void tile(const float* x, int64_t K, const uint8_t* packed, const float* scale,
                 const float* offset, int64_t G, OutT* out, int64_t N) {
  constexpr int A = acc_sets(M);
  const int64_t groups = K / G;
  vf acc[NR][M][A];  // A accumulators per output, taking the block's VL-weight pieces in turn
  unroll<NR>([&](auto r) { unroll<M>([&](auto m) { unroll<A>([&](auto a) { acc[r][m][a] = vzero(); }); }); });

  for (int64_t g = 0; g < groups; ++g) {
    Dequant dq[NR];
    unroll<NR>([&](auto r) { dq[r] = Dequant(scale[r * groups + g], offset[r * groups + g]); });
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += kBlock) {  // the group's blocks of 32 weights
      const uint8_t* bytes = packed + (k0 / kBlock) * (kQuad * 16);  // the quad's block: rows' 16 bytes
      unroll<16 / VL>([&](auto piece) {  // weights k0 + j.. (low nibbles) and k0 + 16 + j.. (high)
        constexpr int j = piece * VL, a_lo = (2 * piece) % A, a_hi = (2 * piece + 1) % A;
        vf lo[NR], hi[NR];
        unroll<NR>([&](auto r) { dq[r](bytes + r * 16 + j, lo[r], hi[r]); });
        unroll<M>([&](auto m) {
          const vf xl = vload(x + m * K + k0 + j), xh = vload(x + m * K + k0 + 16 + j);
          unroll<NR>([&](auto r) {
            acc[r][m][a_lo] = vfma(lo[r], xl, acc[r][m][a_lo]);
            acc[r][m][a_hi] = vfma(hi[r], xh, acc[r][m][a_hi]);
          });
        });
      });
    }
  }
  unroll<NR>([&](auto r) {
    unroll<M>([&](auto m) {
      vf total = acc[r][m][0];
      unroll<A - 1>([&](auto a) { total = total + acc[r][m][a + 1]; });
      out[m * N + r] = static_cast<OutT>(vsum(total));
    });
  });
}

// All N outputs of M (<= kMaxRows) rows, the weight rows split over threads.
template <int M, typename OutT>
void rows(const float* x, int64_t K, const uint8_t* packed, const Scales& sc, int64_t G, OutT* out,
          int64_t N) {
  constexpr int NR = kTileRows;
  const int64_t groups = K / G;
  // Weight rows n0..n1 (a whole number of tiles, or single rows), their scales widened at once if float16.
  auto span = [&](auto nr, int64_t n0, int64_t n1, std::vector<float>& buf) {
    const float *s, *o;  // [n1 - n0, groups] each
    sc.rows(n0, n1 - n0, buf, s, o);
    for (int64_t n = n0; n < n1; n += nr) {
      const uint8_t* p = packed + (n / kQuad) * (kQuad * K / 2) + (n % kQuad) * 16;
      tile<M, decltype(nr)::value>(x, K, p, s + (n - n0) * groups, o + (n - n0) * groups, G, out + n, N);
    }
  };
  const int64_t tiles = N / NR, tiles_per_span = std::max(1, 16 / NR);
  // ~64 weight rows per task at least: at decode sizes every thread gets one contiguous range
  at::parallel_for(0, tiles, std::max<int64_t>(1, 64 / NR), [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t t = begin; t < end; t += tiles_per_span)
      span(std::integral_constant<int, NR>{}, t * NR, std::min(end, t + tiles_per_span) * NR, buf);
  });
  std::vector<float> buf;
  span(std::integral_constant<int, 1>{}, tiles * NR, N, buf);  // the last N % NR rows, one at a time
}

template <typename OutT>
void dispatch(int64_t M, const float* x, int64_t K, const uint8_t* packed, const Scales& sc, int64_t G,
              OutT* out, int64_t N) {
  switch (M) {
    case 1: return rows<1>(x, K, packed, sc, G, out, N);
    case 2: return rows<2>(x, K, packed, sc, G, out, N);
    case 3: return rows<3>(x, K, packed, sc, G, out, N);
    case 4: return rows<4>(x, K, packed, sc, G, out, N);
    case 5: return rows<5>(x, K, packed, sc, G, out, N);
    case 6: return rows<6>(x, K, packed, sc, G, out, N);
    case 7: return rows<7>(x, K, packed, sc, G, out, N);
    default: return rows<8>(x, K, packed, sc, G, out, N);
  }
}

// q [N, K] int32 in 0..15 -> uint8 [N rounded up to 4, K/2] in the layout above (padding rows 0).
torch::Tensor pack(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt32, "pack: q must be a 2-D int32 tensor");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kBlock == 0, "pack: K=", K, " is not a multiple of ", kBlock);
  const auto qc = q.contiguous();
  TORCH_CHECK(N * K == 0 || (qc.min().item<int32_t>() >= 0 && qc.max().item<int32_t>() <= 15),
              "pack: q must be in 0..15");
  const int64_t padded = (N + kQuad - 1) / kQuad * kQuad;
  auto packed = torch::zeros({padded, K / 2}, q.options().dtype(torch::kUInt8));
  const int32_t* src = qc.data_ptr<int32_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const int32_t* in = src + n * K + b * kBlock;
      uint8_t* o = dst + (n / kQuad) * (kQuad * K / 2) + b * (kQuad * 16) + (n % kQuad) * 16;
      for (int j = 0; j < 16; ++j) o[j] = static_cast<uint8_t>(in[j] | (in[16 + j] << 4));
    }
  return packed;
}

// x [M, K] float32 | bfloat16 (any strides), packed uint8 [N, K/2], scale / offset [N, K/G] float32 (or both
// float16) -> [M, N] float32 if out_float32 else x's dtype.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& offset, int64_t group_size, bool out_float32) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x must be a [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), G = group_size;
  TORCH_CHECK(G > 0 && G % kBlock == 0 && K % G == 0,
              "int4_linear: group_size=", G, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(0) == (N + kQuad - 1) / kQuad * kQuad && packed.size(1) == K / 2,
              "int4_linear: packed must be contiguous uint8 [N rounded up to 4, K/2] (from pack)");
  const bool half = scale.scalar_type() == torch::kFloat16;
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == (half ? torch::kFloat16 : torch::kFloat32) &&
                t->is_contiguous() && t->size(0) == N && t->size(1) == K / G,
                "int4_linear: scale and offset must be contiguous [N, K/group_size], both float32 or both float16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "int4_linear: CPU tensors only");

  const auto xf = x.contiguous().to(torch::kFloat32);  // [M, K]: bf16 activations widened once (exact)
  const auto out_dtype = out_float32 ? torch::kFloat32 : x.scalar_type();
  auto out = torch::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const Scales sc{scale.data_ptr(), offset.data_ptr(), half, K / G};
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // beyond 8 rows: passes of 8 over the weights
    const int64_t rows_now = std::min(kMaxRows, M - m0);
    if (out_dtype == torch::kFloat32)
      dispatch(rows_now, xp + m0 * K, K, pp, sc, G, out.data_ptr<float>() + m0 * N, N);
    else
      dispatch(rows_now, xp + m0 * K, K, pp, sc, G, out.data_ptr<c10::BFloat16>() + m0 * N, N);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("int4_pack(Tensor q) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group_size, bool out_float32) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("int4_pack", &pack);
  m.impl("int4_linear", &int4_linear);
}
