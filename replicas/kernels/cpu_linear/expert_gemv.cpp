// MoE experts for decode-sized batches: each (token, expert) pair times its own expert's weights, float32 math.
//
//   out[p, n] = sum_k x[p, k] * w[expert[p], n, k]       w: [E, N, K] float32 | bfloat16, contiguous
//
// At decode a few pairs pick a few experts; the grouped matmul runs a GEMM call per expert (empty ones too)
// on weights in their plain layout, which at 1-16 rows is far from the memory bandwidth (a [1, 512] x [512,
// 1024] bf16 product: 50 us). Here every pair streams only its expert's rows once, widened to float32 in
// registers (bf16 -> f32 is exact: a shift), into FMA chains.
//
// Threads: at::parallel_for over tiles of NR weight rows; inside a tile, the pairs in the order given, so
// pairs of one expert that are adjacent (the caller sorts them by expert) read the tile from L1. Each pair's
// sums run in one fixed order whatever the other pairs are: a pair's result does not depend on its batch.
//
// Built with the host's ISA flags (replicas/cpu_isa.py): AVX-512 or AVX2+FMA; the vector layer is tether_vec.h.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "tether_vec.h"

namespace {

using namespace tether;

constexpr int NR = 4;  // weight rows per tile: 4 independent FMA chains per pass over x

// out[n0 .. n0 + rows) of one pair: x [K] float32, w: row n0 of its expert [N, K].
template <typename w_t>
inline void tile(const float* x, const w_t* w, int64_t K, int64_t rows, float* out) {
  vf acc[NR];
  unroll<NR>([&](auto r) { acc[r] = vzero(); });
  const int64_t k_vec = K / VL * VL;
  for (int64_t k = 0; k < k_vec; k += VL) {
    const vf xv = vload(x + k);
    unroll<NR>([&](auto r) {
      if (r < rows) acc[r] = vfma(vload(w + r * K + k), xv, acc[r]);  // bf16 widened exactly
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float total = vsum(acc[r]);
    for (int64_t k = k_vec; k < K; ++k) total += x[k] * static_cast<float>(w[r * K + k]);
    out[r] = total;
  }
}

template <typename w_t>
void pairs(const float* x, const w_t* w, const int64_t* expert, int64_t P, int64_t N, int64_t K, float* out) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 16 / NR), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * NR, rows = std::min<int64_t>(NR, N - n);
      for (int64_t p = 0; p < P; ++p)
        tile(x + p * K, w + (expert[p] * N + n) * K, K, rows, out + p * N + n);
    }
  });
}

// x [P, K] float32 | bfloat16, w [E, N, K] float32 | bfloat16 contiguous, expert [P] int64 (each < E),
// out [P, N] float32 contiguous -> out[p] = w[expert[p]] @ x[p] (written in place).
void expert_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& expert,
                            torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.is_contiguous() && w.size(2) == x.size(1),
              "expert_linear: x [P, K], w contiguous [E, N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "expert_linear: w must be float32 or bfloat16");
  const int64_t P = x.size(0), E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(expert.dim() == 1 && expert.size(0) == P && expert.scalar_type() == torch::kInt64,
              "expert_linear: expert must be int64 [P]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == P && out.size(1) == N && out.is_contiguous() &&
              out.scalar_type() == torch::kFloat32, "expert_linear: out must be contiguous float32 [P, N]");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && expert.device().is_cpu() && out.device().is_cpu(),
              "expert_linear: CPU tensors only");
  const auto ids = expert.contiguous();
  const int64_t* ep = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(ep[p] >= 0 && ep[p] < E, "expert_linear: expert id out of range");
  if (P == 0 || N == 0) return;
  const auto xf = x.contiguous().to(torch::kFloat32);  // bf16 activations widened once (exact)
  if (w.scalar_type() == torch::kFloat32)
    pairs(xf.data_ptr<float>(), w.data_ptr<float>(), ep, P, N, K, out.data_ptr<float>());
  else
    pairs(xf.data_ptr<float>(), w.data_ptr<at::BFloat16>(), ep, P, N, K, out.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("expert_linear(Tensor x, Tensor w, Tensor expert, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("expert_linear", &expert_linear);
}
