// A dense linear whose every output is summed in one fixed order whatever the batch (engine.batch_invariant).
//
//   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])     x [M, K], w [N, K] packed once, out [M, N]; bf16 | float32
//
// oneDNN's packed linear (PackedLinear) chooses how it blocks K by the row count M: on an AVX512-BF16 host
// without AMX a bf16 row's bits change from M = 3 on at K = 1536, and float32 rows from M = 2 on
// (`python -m bench.engine.invariance --linears`). So a token's logits depended on how many rows its step had.
// Here out[m, n] is one accumulator lane carried over k = 0, 1, .. K - 1 in order, from zero, then the bias,
// then one rounding to T -- for every M, every register block, every thread count: the outer-product form,
// with threads splitting N, never K.
//
// Three forms of the k step; for a dtype, the build's ISA fixes the form (so one form per host):
//   pairs (bf16, built with AVX512-BF16): vdpbf16ps adds x[m,k] w[n,k] + x[m,k+1] w[n,k+1] into the lane per pair
//         of k. Weights packed [N/16][K2/2][16][2] (K2 = K rounded up to even, N up to 16; zeros padded).
//   widen (float32; bf16 on other ISAs): w widened to float32 exactly, one FMA per k. Packed [N/VL][K][VL].
//   int8 groups (a Q8_0 head, float32 x and out): w = q * scale rebuilt exactly in float32 (int8_native.py says
//         why it is exact), one FMA per k. q packed [N/VL][K][VL] int8, scale [N/VL][K/G][VL] float32.
//   int4 groups (float32 layers whose checkpoint weights are GGUF Q4 groups): w = fma(q, scale, offset), which the
//         loader has checked is the float32 weight bit for bit, so this form's sums ARE the widen form's: the
//         layer may take either at any row count (decode-sized batches read 0.75 byte a weight instead of 4).
//         q packed [N/VL][K/2][VL] bytes (k = 2p in the low nibble, 2p + 1 in the high), scale and offset
//         [N/VL][K/G][VL] float32. (bf16 layers keep the pairs form: a bf16 4-bit form -- rebuild, round,
//         pair, vdpbf16ps -- gave the same bits but no speed, its dequantization costing what it saved in
//         bytes: 11.9 vs 12.0 ms a SmolLM2 decode step at one stream, 19.1 vs 16.5-17.1 at eight.)
// The forms' sums differ from each other (int4 aside) and from F.linear's within float32 rounding.
//
// Blocking: a panel of up to kMaxBlocks blocks of VL outputs stays in L2 while every row of x
// passes over it, kRows rows at a time, with kRows x blocks accumulators in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tether_vec.h"

namespace {

using namespace tether;
using bf16 = c10::BFloat16;

constexpr int kRows = 4;                        // rows of x per register block
constexpr int kMaxBlocks = VL == 16 ? 4 : 2;    // output blocks per register block (32 zmm / 16 ymm)

// bf16 weights take the pairs form where the build has AVX512-BF16 (VL = 16 there: a block is 16 outputs).
#if defined(__AVX512BF16__)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

struct Problem {
  int64_t M, K, N, ldx;  // x row stride ldx; out row stride N
  int64_t block_stride;  // weight elements between one output block and the next
};

// The pairs form: x, w bf16; acc[m][b] += x[m, 2p] w[n, 2p] + x[m, 2p+1] w[n, 2p+1] per pair p, in order.
struct Pairs {
  using X = bf16;
  const bf16* w;
  template <int MB, int NB>
  void accumulate(const Problem& pb, const bf16* xr, int64_t b0, vf (&acc)[MB][NB]) const {
#if defined(__AVX512BF16__)
    const bf16* wb = w + b0 * pb.block_stride;
    auto step = [&](int64_t p, auto x_pair) {  // x[m, 2p], x[m, 2p + 1] broadcast as one 32-bit pair
      __m512bh wv[NB];
      unroll<NB>([&](auto b) { wv[b] = (__m512bh)_mm512_loadu_si512(wb + b * pb.block_stride + p * 2 * VL); });
      unroll<MB>([&](auto m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(x_pair(xr + m * pb.ldx + 2 * p)));
        unroll<NB>([&](auto b) { acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]); });
      });
    };
    for (int64_t p = 0; p < pb.K / 2; ++p)
      step(p, [](const bf16* at) { uint32_t pair; std::memcpy(&pair, at, 4); return pair; });
    if (pb.K % 2)  // the last k alone: its pair's high half is 0 (as the packed weight's)
      step(pb.K / 2, [](const bf16* at) { return uint32_t(at->x); });
#else
    TORCH_CHECK(false, "invariant_linear: the pairs form needs AVX512-BF16");
#endif
  }
};

// The widen form: x of type T, w of type W (T, or bf16 under float32 x: a bf16 checkpoint's float32 head, the
// same sums as its float32 copy at half the bytes); acc[m][b] = fma(x[m, k], w[n, k], acc) for k in order.
template <typename T, typename W = T>
struct Widen {
  using X = T;
  const W* w;
  template <int MB, int NB>
  void accumulate(const Problem& pb, const T* xr, int64_t b0, vf (&acc)[MB][NB]) const {
    const W* wb = w + b0 * pb.block_stride;
    for (int64_t k = 0; k < pb.K; ++k) {
      vf wv[NB];
      unroll<NB>([&](auto b) { wv[b] = vload(wb + b * pb.block_stride + k * VL); });
      unroll<MB>([&](auto m) {
        const vf xv = vset1(to_float(xr[m * pb.ldx + k]));
        unroll<NB>([&](auto b) { acc[m][b] = vfma(xv, wv[b], acc[m][b]); });
      });
    }
  }
};

// The int8 groups form: x float32; w[n, k] = q * scale[n, k / G], exact; one fma per k in order.
struct Int8Groups {
  using X = float;
  const int8_t* q;
  const float* scale;
  int64_t G;
  template <int MB, int NB>
  void accumulate(const Problem& pb, const float* xr, int64_t b0, vf (&acc)[MB][NB]) const {
    const int64_t groups = pb.K / G, scale_stride = groups * VL;
    const int8_t* qb = q + b0 * pb.block_stride;
    const float* sb = scale + b0 * scale_stride;
    for (int64_t g = 0; g < groups; ++g) {
      vf s[NB];
      unroll<NB>([&](auto b) { s[b] = vload(sb + b * scale_stride + g * VL); });
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        vf wv[NB];
        unroll<NB>([&](auto b) { wv[b] = widen_int8(qb + b * pb.block_stride + k * VL) * s[b]; });
        unroll<MB>([&](auto m) {
          const vf xv = vset1(xr[m * pb.ldx + k]);
          unroll<NB>([&](auto b) { acc[m][b] = vfma(xv, wv[b], acc[m][b]); });
        });
      }
    }
  }
  static vf widen_int8(const int8_t* at) {  // VL int8 -> float32
#if defined(__AVX512F__)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
#endif
  }
};

// The int4 groups form: x float32; w[n, k] = fma(q, scale, offset) per group of G, exactly the widen form's
// float32 weight (checked at load); one fma per k in order, k = 2p then 2p + 1 from each byte.
struct Int4Groups {
  using X = float;
  const uint8_t* q;
  const float *scale, *offset;
  int64_t G;
  template <int MB, int NB>
  void accumulate(const Problem& pb, const float* xr, int64_t b0, vf (&acc)[MB][NB]) const {
    const int64_t groups = pb.K / G, scale_stride = groups * VL;
    const uint8_t* qb = q + b0 * pb.block_stride;
    const float* sb = scale + b0 * scale_stride;
    const float* ob = offset + b0 * scale_stride;
    for (int64_t g = 0; g < groups; ++g) {
      vf s[NB], o[NB];
      unroll<NB>([&](auto b) {
        s[b] = vload(sb + b * scale_stride + g * VL);
        o[b] = vload(ob + b * scale_stride + g * VL);
      });
      for (int64_t p = g * G / 2; p < (g + 1) * G / 2; ++p) {
        unroll<2>([&](auto half) {  // k = 2p, then 2p + 1
          vf wv[NB];
          unroll<NB>([&](auto b) { wv[b] = vfma(nibbles<half>(qb + b * pb.block_stride + p * VL), s[b], o[b]); });
          unroll<MB>([&](auto m) {
            const vf xv = vset1(xr[m * pb.ldx + 2 * p + half]);
            unroll<NB>([&](auto b) { acc[m][b] = vfma(xv, wv[b], acc[m][b]); });
          });
        });
      }
    }
  }
  template <int High>
  static vf nibbles(const uint8_t* at) {  // VL bytes -> their low (High = 0) or high nibbles as float32
#if defined(__AVX512F__)
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    if (High) bytes = _mm_srli_epi16(bytes, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, _mm_set1_epi8(0x0F))));
#else
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
    if (High) bytes = _mm_srli_epi16(bytes, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, _mm_set1_epi8(0x0F))));
#endif
  }
};

// Rows [m0, m0 + MB) x output blocks [b0, b0 + NB) -> out (+ bias, then one rounding to O).
template <int MB, int NB, typename Form, typename O>
void register_block(const Problem& pb, const Form& form, const typename Form::X* x, const float* bias, O* out,
                    int64_t m0, int64_t b0) {
  vf acc[MB][NB];
  unroll<MB>([&](auto m) { unroll<NB>([&](auto b) { acc[m][b] = vzero(); }); });
  form.template accumulate<MB, NB>(pb, x + m0 * pb.ldx, b0, acc);
  float lanes[VL];
  unroll<MB>([&](auto m) {
    unroll<NB>([&](auto b) {
      const int64_t n0 = (b0 + b) * VL, valid = std::min<int64_t>(VL, pb.N - n0);
      vstore(lanes, acc[m][b]);
      O* dst = out + (m0 + m) * pb.N + n0;
      for (int64_t j = 0; j < valid; ++j) dst[j] = from_float<O>(bias ? lanes[j] + bias[n0 + j] : lanes[j]);
    });
  });
}

// f(integral_constant<mb>, integral_constant<nb>) for 1 <= mb <= kRows, 1 <= nb <= kMaxBlocks.
template <typename F>
void with_block_shape(int64_t mb, int nb, F&& f) {
  auto rows = [&](auto m) {
    switch (nb) {
      case 1: return f(m, std::integral_constant<int, 1>{});
      case 2: return f(m, std::integral_constant<int, 2>{});
      case 3: if constexpr (kMaxBlocks >= 4) return f(m, std::integral_constant<int, 3>{}); break;
      case 4: if constexpr (kMaxBlocks >= 4) return f(m, std::integral_constant<int, 4>{}); break;
    }
    TORCH_CHECK(false, "invariant_linear: bad block count ", nb);
  };
  switch (mb) {
    case 1: return rows(std::integral_constant<int, 1>{});
    case 2: return rows(std::integral_constant<int, 2>{});
    case 3: return rows(std::integral_constant<int, 3>{});
    default: return rows(std::integral_constant<int, kRows>{});
  }
}

// Every row of x times every output block: contiguous ranges of blocks per thread (OpenMP's static split),
// panels of kMaxBlocks blocks inside each, every row passing over a panel kRows rows at a time.
template <typename Form, typename O>
void run(const Problem& pb, const Form& form, const typename Form::X* x, const float* bias, O* out) {
  const int64_t blocks = (pb.N + VL - 1) / VL;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += kMaxBlocks) {
      const int nb = int(std::min<int64_t>(kMaxBlocks, end - b0));
      for (int64_t m0 = 0; m0 < pb.M; m0 += kRows)
        with_block_shape(std::min<int64_t>(kRows, pb.M - m0), nb, [&](auto mb, auto nbc) {
          register_block<decltype(mb)::value, decltype(nbc)::value>(pb, form, x, bias, out, m0, b0);
        });
    }
  });
}

void check_x_out(const at::Tensor& x, const at::Tensor& out, int64_t out_features, at::ScalarType out_type) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "invariant_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == out_type && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
              out.size(1) == out_features, "invariant_linear: out must be a contiguous [M, N] tensor of ", out_type);
}

// x [M, K] bf16 | float32 (rows contiguous), w packed by invariant_layout's form, bias [N] float32 or None,
// out [M, N] contiguous in x's dtype -> out = x @ w.T + bias.
void invariant_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      int64_t out_features, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "invariant_linear: bf16 or float32");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous(), "invariant_linear: w packed in x's dtype");
  check_x_out(x, out, out_features, x.scalar_type());
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features),
              "invariant_linear: bias must be float32 [N]");
  const bool bf = x.scalar_type() == at::kBFloat16, paired = bf && kPairs;
  const int64_t K = x.size(1), blocks = (out_features + VL - 1) / VL;
  const int64_t block_stride = paired ? (K + 1) / 2 * 2 * VL : K * VL;
  TORCH_CHECK(w.numel() == blocks * block_stride, "invariant_linear: w holds ", w.numel(), " elements, the packed [",
              out_features, ", ", K, "] weight ", blocks * block_stride);
  const Problem pb{x.size(0), K, out_features, x.stride(0), block_stride};
  if (pb.M == 0 || pb.N == 0) return;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (paired)
    run(pb, Pairs{w.data_ptr<bf16>()}, x.data_ptr<bf16>(), b, out.data_ptr<bf16>());
  else if (bf)
    run(pb, Widen<bf16>{w.data_ptr<bf16>()}, x.data_ptr<bf16>(), b, out.data_ptr<bf16>());
  else
    run(pb, Widen<float>{w.data_ptr<float>()}, x.data_ptr<float>(), b, out.data_ptr<float>());
}

// x [M, K] float32 (rows contiguous), w bf16 packed [N/VL][K][VL] (the widen layout), bias [N] float32 or None,
// out [M, N] float32: the widen form over weights stored in bf16, widened exactly -- a bf16 checkpoint's
// float32 layer (its head) with the sums of its float32 copy, bit for bit, reading half the bytes.
void invariant_bf16_weight_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                  int64_t out_features, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "invariant_bf16_weight_linear: float32 x, bf16 w");
  check_x_out(x, out, out_features, at::kFloat);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features),
              "invariant_bf16_weight_linear: bias must be float32 [N]");
  const int64_t K = x.size(1), blocks = (out_features + VL - 1) / VL;
  TORCH_CHECK(w.numel() == blocks * K * VL, "invariant_bf16_weight_linear: w must be packed [N/VL][K][VL]");
  const Problem pb{x.size(0), K, out_features, x.stride(0), K * VL};
  if (pb.M == 0 || pb.N == 0) return;
  run(pb, Widen<float, bf16>{w.data_ptr<bf16>()}, x.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
      out.data_ptr<float>());
}

// x [M, K] float32 (rows contiguous), q packed [N/VL][K][VL] int8, scale packed [N/VL][K/G][VL] float32,
// out [M, N] float32 contiguous -> out = x @ (q * scale).T.
void invariant_int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group_size,
                           int64_t out_features, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "invariant_int8_linear: float32 x");
  check_x_out(x, out, out_features, at::kFloat);
  const int64_t K = x.size(1), blocks = (out_features + VL - 1) / VL, G = group_size;
  TORCH_CHECK(G > 0 && K % G == 0, "invariant_int8_linear: group_size ", G, " must divide K = ", K);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == blocks * K * VL,
              "invariant_int8_linear: q must be the packed int8 [", out_features, ", ", K, "] weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == blocks * (K / G) * VL,
              "invariant_int8_linear: scale must be the packed float32 [", out_features, ", ", K / G, "] scales");
  const Problem pb{x.size(0), K, out_features, x.stride(0), K * VL};
  if (pb.M == 0 || pb.N == 0) return;
  run(pb, Int8Groups{q.data_ptr<int8_t>(), scale.data_ptr<float>(), G}, x.data_ptr<float>(), nullptr,
      out.data_ptr<float>());
}

// x [M, K] float32 (rows contiguous), q packed [N/VL][K/2][VL] uint8, scale / offset packed [N/VL][K/G][VL]
// float32, out [M, N] float32 contiguous -> out = x @ fma(q, scale, offset).T. With `dense` (the same weight
// packed for the widen form) and M > max_rows, the widen form runs instead: the same sums (the weight is
// checked at load), the choice by M made here so a compiled graph needs no branch on the row count.
void invariant_int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const at::Tensor& offset, int64_t group_size, int64_t out_features, at::Tensor out,
                           const std::optional<at::Tensor>& dense, int64_t max_rows) {
  if (dense && x.size(0) > max_rows) return invariant_linear(x, *dense, std::nullopt, out_features, out);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "invariant_int4_linear: float32 x");
  check_x_out(x, out, out_features, at::kFloat);
  const int64_t K = x.size(1), blocks = (out_features + VL - 1) / VL, G = group_size;
  TORCH_CHECK(G > 0 && G % 2 == 0 && K % G == 0, "invariant_int4_linear: group_size ", G, " must be even, divide K = ", K);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.numel() == blocks * K / 2 * VL,
              "invariant_int4_linear: q must be the packed 4-bit [", out_features, ", ", K, "] weight");
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == blocks * (K / G) * VL,
                "invariant_int4_linear: scale and offset must be the packed float32 [", out_features, ", ", K / G, "]");
  const Problem pb{x.size(0), K, out_features, x.stride(0), K / 2 * VL};
  if (pb.M == 0 || pb.N == 0) return;
  run(pb, Int4Groups{q.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), G},
      x.data_ptr<float>(), nullptr, out.data_ptr<float>());
}

// [outputs per block, 1 if k comes in pairs (the bf16 pairs form)] for weights of dtype `bf16 ? bf16 : float32`
// (and int8 groups: the float32 block).
std::vector<int64_t> invariant_layout(bool bf) { return {VL, bf && kPairs ? 1 : 0}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("invariant_linear(Tensor x, Tensor w, Tensor? bias, int out_features, Tensor(a!) out) -> ()");
  m.def("invariant_bf16_weight_linear(Tensor x, Tensor w, Tensor? bias, int out_features, Tensor(a!) out) -> ()");
  m.def("invariant_int8_linear(Tensor x, Tensor q, Tensor scale, int group_size, int out_features, Tensor(a!) out) -> ()");
  m.def("invariant_int4_linear(Tensor x, Tensor q, Tensor scale, Tensor offset, int group_size, int out_features, "
        "Tensor(a!) out, Tensor? dense=None, int max_rows=0) -> ()");
  m.def("invariant_layout(bool bf16) -> int[]", &invariant_layout);  // no tensor: one kernel for every key
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("invariant_linear", &invariant_linear);
  m.impl("invariant_bf16_weight_linear", &invariant_bf16_weight_linear);
  m.impl("invariant_int8_linear", &invariant_int8_linear);
  m.impl("invariant_int4_linear", &invariant_int4_linear);
}
