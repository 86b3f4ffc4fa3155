// The vector layer shared by the native linear kernels (int4_gemv.cpp, int8_gemv.cpp): VL floats in one
// register, chosen by the ISA flags the build passes (replicas/cpu_isa.py): AVX-512 (16), AVX2 + FMA (8), or
// a portable scalar (1). Each kernel adds its own weight-unpacking functions under the same macros.
#pragma once

#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace simd {

#if defined(__AVX512F__)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else  // portable: multiply-adds (std::fma is a library call without hardware FMA)
constexpr int VL = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset1(float a) { return a; }
inline vf vload(const float* p) { return *p; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vadd(vf a, vf b) { return a + b; }
inline float vsum(vf a) { return a; }
#endif

// f(0), f(1), .. f(N-1) with compile-time indices: a tile's loops written out, so that its accumulators
// are registers (GCC keeps a runtime-indexed array of vectors on the stack).
template <typename F, int... I>
inline void unroll_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) { unroll_impl(f, std::make_integer_sequence<int, N>{}); }

}  // namespace simd
