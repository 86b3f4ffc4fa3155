// The vector layer of Tether's native CPU kernels (int4_gemv.cpp, int8_gemv.cpp, expert_gemv.cpp, cpu_fused.cpp,
// cpu_attention.cpp): one float vector the width of the ISA the build targets, the operations the kernels share
// on it, and the scalar conversions and exp they share. replicas/kernels/native_build.py puts this directory on
// the include path and hashes this file into every build's tag: an edit here rebuilds every op.
//
//   VL                 floats per vector: 16 (zmm) under the avx512 flags, 8 (ymm) under avx2 (replicas/cpu_isa.py)
//   vf, vi             GCC vector types of VL floats / int32s; vf and __m512 / __m256 (GCC vectors of the same
//                      floats) convert freely, so intrinsics take and return it; + - * / < ?: work by lane
//   vzero vset1 vload vstore vfma vadd vmax vsum lane_index reduce_lanes    (vload of bf16 widens exactly)
//   exp_nonpositive tanh_approx      e^x for x <= 0 and tanh on vectors, Cephes-accurate (~1 ulp)
//   to_float from_float fast_exp     scalar: bf16 <-> float (round to nearest even), an exp g++ vectorises
//   unroll<N>(f)                     f(0) .. f(N-1) with compile-time indices
//
// Each helper keeps the exact arithmetic of the kernel it came from: vfma is one FMA, `a * b + c` on vf is
// whatever the including file's fp-contract makes it (cpu_fused.cpp turns contraction off before including this).
#pragma once

#if !(defined(__AVX2__) && defined(__FMA__))
#error "the native kernels need AVX2 + FMA (native_build.py builds none at the baseline ISA level)"
#endif

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace tether {

// ---- the vector type

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif

using vf = float __attribute__((vector_size(VL * sizeof(float))));
using vi = int32_t __attribute__((vector_size(VL * sizeof(int32_t))));

inline vf vzero() { return vf{}; }
inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline vi lane_index() {  // {0, 1, ..., VL - 1}
  vi v = {};
  for (int i = 0; i < VL; ++i) v[i] = i;
  return v;
}

// Intrinsics where the ISAs differ. The bf16 widen is one zero-extend and shift (g++ splits the generic
// __builtin_convertvector form into halves in some loops).
#if defined(__AVX512F__)
inline vf vload(const c10::BFloat16* p) {  // VL bf16 -> float: the bits, 16 places up
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#else
inline vf vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Lane j of the result: the sum of the lanes of parts[j] ([VL][VL] floats). log2(VL) levels of two-vector
// shuffles and adds (45 operations for 16 lanes) in place of VL horizontal sums. Entering the level of
// half-width h, each vector holds 2h partial sums per row of VL / 2h rows; each output vector takes the low
// halves of those chunks from a pair of vectors, adds the high halves, and so holds h partial sums per row of
// twice as many rows, in row order.
inline vf reduce_lanes(const float* parts) {
  vf v[VL];
  for (int i = 0; i < VL; ++i) v[i] = vload(parts + i * VL);
  for (int h = VL / 2, count = VL / 2; h >= 1; h /= 2, count /= 2) {
    const vi lo = lane_index() / h * (2 * h) + lane_index() % h, hi = lo + h;
    for (int i = 0; i < count; ++i)
      v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi);
  }
  return v[0];
}

// e^x for x <= 0 (Cephes expf: Cody-Waite reduction, degree-5 polynomial, ~1 ulp); 0 below -87, so e^-inf = 0.
inline vf exp_nonpositive(vf x) {
  const vf xc = vmax(x, vset1(-87.f));
  const vf n = (xc * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vset1(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.f;
  const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  return x < vset1(-87.f) ? vf{} : y * (vf)two_n;
}

// tanh (Cephes tanhf): an odd polynomial below |x| = 0.625, 1 - 2 / (e^2|x| + 1) above, signed.
inline vf tanh_approx(vf x) {
  const vi sign = (vi)x & int32_t(0x80000000u);
  const vf a = (vf)((vi)x ^ sign), z = x * x;
  const vf e = exp_nonpositive(-2.f * a);
  vf p = vset1(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vf t = a < vset1(0.625f) ? a + a * z * p : (1.f - e) / (1.f + e);
  return (vf)((vi)t | sign);
}

// f(0), f(1), .. f(N-1) with compile-time indices: a tile's loops written out, so that its accumulators
// are registers (GCC keeps a runtime-indexed array of vectors on the stack).
template <typename F, int... I>
inline void unroll_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) { unroll_impl(f, std::make_integer_sequence<int, N>{}); }

// ---- scalars, written so that g++ -O3 vectorizes the loops that call them (no libm call, no branch)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to nearest even, as torch's float -> bfloat16 cast (NaN kept a NaN).
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  uint32_t nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  return out;
}

// exp(x): x = n ln2 + r, |r| <= ln2 / 2; exp(r) by a degree-6 polynomial; 2^n through the exponent bits.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;  // ternaries, not fmin / nearbyint: g++ vectorizes these into min / max / add
  x = x > 88.7f ? 88.7f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.3888949e-3f;
  p = p * r + 8.3333510e-3f;
  p = p * r + 4.1666645e-2f;
  p = p * r + 1.6666666e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace tether
