// A linear layer over 8-bit weight groups for decode-sized batches (1-16 rows), float32 math.
//
//   w[n, k] = q[n, k] * scale[n, k / G],   q int8 (GGUF Q8_0: -127..127, G = 32)
//   out[m, n] = sum_k x[m, k] * w[n, k]
//
// Each weight is rebuilt in registers as float(q) * scale -- for a Q8_0 group (8-bit q times a float16
// d: 19 significant bits) that product is exact, the very float32 the dequantized checkpoint holds --
// and multiplied into every row of x by FMA. So the kernel applies the checkpoint's weights exactly and
// differs from a float32 matmul only in the order of its float32 sums, while it streams 1 byte per
// weight plus 4 bytes of float32 scale per group (1.125 byte per weight at G = 32, 28% of float32's).
//
// Layout: q row-major [N, K] int8 (contiguous), scale [N, K/G] float32. A tile of NR adjacent weight
// rows is one contiguous run of NR * K bytes, so the tiles of a thread read one sequential stream.
//
// Threads: at::parallel_for over tiles of weight rows, all rows of x per weight tile (rows of x beyond
// the tile's register budget run as a second pass over the same tile, its weights still in L1). It runs
// on torch's OpenMP threads only when built with -fopenmp (the module's `openmp` attribute says which).
//
// Built with the host's ISA flags (replicas/cpu_isa.py): AVX-512 or AVX2+FMA; the vector layer is tether_vec.h.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "tether_vec.h"

namespace {

using namespace tether;

constexpr int64_t kBlock = 32;  // group sizes are multiples of this (GGUF's Q8_0 block)

// ---- the ISA-specific part (the vector layer is tether_vec.h): vweights(q, scale): the VL int8 weights at q
// as float32 times scale. ----
#if defined(__AVX512F__)
inline vf vweights(const int8_t* q, vf scale) {  // 16 bytes -> 16 weights
  const __m512i i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(i), scale);
}
#else  // AVX2 + FMA
inline vf vweights(const int8_t* q, vf scale) {  // 8 bytes -> 8 weights
  const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(i), scale);
}
#endif

// Register budget: 32 vectors with AVX-512, 16 with AVX2. A tile keeps NR * MR * A accumulators (A per
// output, taking a group's VL-weight pieces in turn, for enough independent FMA chains), NR scales and
// NR rebuilt weight vectors. MR = rows of x per pass over a tile.
constexpr int kPassRows = VL == 16 ? 16 : 8;  // rows of x per pass over a weight tile
constexpr int64_t kMaxRows = 16;               // rows of x per pass over all the weights (more: more passes)
constexpr int tile_rows(int M) { return VL == 16 ? (M <= 4 ? 4 : M <= 8 ? 2 : 1) : (M <= 4 ? 2 : 1); }
constexpr int acc_sets(int M) { return M <= 2 ? 2 : 1; }  // both widths

// out[m, n0:n0+NR] for m < MR.  x: [MR, K] float32 (row stride K);  q: row n0 of [N, K] int8;
// scale: row n0 of [N, K/G] float32;  out: [MR, N] (row stride N).
template <int MR, int NR>
inline void tile(const float* x, int64_t K, const int8_t* q, const float* scale, int64_t G, float* out,
                 int64_t N) {
  constexpr int A = acc_sets(MR);
  static_assert(kBlock % (VL * A) == 0, "a block must be a whole number of A-piece steps");
  const int64_t groups = K / G;
  vf acc[NR][MR][A];
  unroll<NR>([&](auto r) { unroll<MR>([&](auto m) { unroll<A>([&](auto a) { acc[r][m][a] = vzero(); }); }); });

  for (int64_t g = 0; g < groups; ++g) {
    vf s[NR];
    unroll<NR>([&](auto r) { s[r] = vset1(scale[r * groups + g]); });
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += VL * A) {
      unroll<A>([&](auto a) {
        const int64_t k = k0 + a * VL;
        vf w[NR];
        unroll<NR>([&](auto r) { w[r] = vweights(q + r * K + k, s[r]); });
        unroll<MR>([&](auto m) {
          const vf xv = vload(x + m * K + k);
          unroll<NR>([&](auto r) { acc[r][m][a] = vfma(w[r], xv, acc[r][m][a]); });
        });
      });
    }
  }
  unroll<NR>([&](auto r) {
    unroll<MR>([&](auto m) {
      vf total = acc[r][m][0];
      unroll<A - 1>([&](auto a) { total = vadd(total, acc[r][m][a + 1]); });
      out[m * N + r] = vsum(total);
    });
  });
}

// Weight rows n0.. (NR of them) times all M rows of x: passes of kPassRows rows over the tile.
template <int M, int NR>
inline void tile_all_rows(const float* x, int64_t K, const int8_t* q, const float* scale, int64_t G,
                          float* out, int64_t N) {
  if constexpr (M <= kPassRows) {
    tile<M, NR>(x, K, q, scale, G, out, N);
  } else {
    tile<kPassRows, NR>(x, K, q, scale, G, out, N);
    tile_all_rows<M - kPassRows, NR>(x + kPassRows * K, K, q, scale, G, out + kPassRows * N, N);
  }
}

// All N outputs of M (<= kMaxRows) rows, the weight rows split over threads.
template <int M>
void rows(const float* x, int64_t K, const int8_t* q, const float* scale, int64_t G, float* out, int64_t N) {
  constexpr int NR = tile_rows(M);
  const int64_t groups = K / G;
  const int64_t tiles = N / NR;
  // ~64 weight rows per task at least: at decode sizes every thread gets one contiguous range
  at::parallel_for(0, tiles, std::max<int64_t>(1, 64 / NR), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * NR;
      tile_all_rows<M, NR>(x, K, q + n * K, scale + n * groups, G, out + n, N);
    }
  });
  for (int64_t n = tiles * NR; n < N; ++n)  // the last N % NR weight rows, one at a time
    tile_all_rows<M, 1>(x, K, q + n * K, scale + n * groups, G, out + n, N);
}

void dispatch(int64_t M, const float* x, int64_t K, const int8_t* q, const float* scale, int64_t G, float* out,
              int64_t N) {
  switch (M) {
    case 1: return rows<1>(x, K, q, scale, G, out, N);
    case 2: return rows<2>(x, K, q, scale, G, out, N);
    case 3: return rows<3>(x, K, q, scale, G, out, N);
    case 4: return rows<4>(x, K, q, scale, G, out, N);
    case 5: return rows<5>(x, K, q, scale, G, out, N);
    case 6: return rows<6>(x, K, q, scale, G, out, N);
    case 7: return rows<7>(x, K, q, scale, G, out, N);
    case 8: return rows<8>(x, K, q, scale, G, out, N);
    case 9: return rows<9>(x, K, q, scale, G, out, N);
    case 10: return rows<10>(x, K, q, scale, G, out, N);
    case 11: return rows<11>(x, K, q, scale, G, out, N);
    case 12: return rows<12>(x, K, q, scale, G, out, N);
    case 13: return rows<13>(x, K, q, scale, G, out, N);
    case 14: return rows<14>(x, K, q, scale, G, out, N);
    case 15: return rows<15>(x, K, q, scale, G, out, N);
    default: return rows<16>(x, K, q, scale, G, out, N);
  }
}

// x [M, K] float32 | bfloat16 (any strides), q [N, K] int8 contiguous, scale [N, K/G] float32 contiguous,
// out [M, N] float32 contiguous -> out = x @ (q * scale).T (written in place).
void int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          int64_t group_size, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be a [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.size(1) == K,
              "int8_linear: q must be a contiguous int8 [N, K] tensor with K=", K);
  const int64_t N = q.size(0);
  TORCH_CHECK(G > 0 && G % kBlock == 0 && K % G == 0,
              "int8_linear: group_size=", G, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
              scale.size(0) == N && scale.size(1) == K / G,
              "int8_linear: scale must be a contiguous float32 [N, K/group_size] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat32 && out.is_contiguous() &&
              out.size(0) == M && out.size(1) == N,
              "int8_linear: out must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu() && out.device().is_cpu(),
              "int8_linear: CPU tensors only");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  const auto xf = x.contiguous().to(torch::kFloat32);  // bf16 activations widened once (exact)
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)  // beyond 16 rows: passes of 16 over the weights
    dispatch(std::min(kMaxRows, M - m0), xp + m0 * K, K, qp, sp, G, op + m0 * N, N);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, int group_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
