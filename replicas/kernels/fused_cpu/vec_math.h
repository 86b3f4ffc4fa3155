// Scalar helpers written so that g++ -O3 vectorizes the loops that call them (no libm call, no branch):
// bf16 <-> float by bit shifts, and an exp accurate to ~2 ulp over the float range.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace tether {

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
