// Element-wise math written so that GCC/Clang vectorise the loops that call it
// (no libm calls, no branches: selects become blends).
#pragma once

#include <cstdint>
#include <cstring>

namespace mlxq::cpu {

// exp(x) for x <= 0 (every softmax exponent here is a score minus a running
// max), with about 2 ulp error; exp(-inf) and anything below the smallest
// normal float are exactly 0. Cody-Waite range reduction to |f| <= ln2/2 and
// Cephes' minimax polynomial for e^f.
inline float exp_nonpositive(float x) {
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float f = x - n * 0.693359375f;
  f = f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  // 2^n by building the exponent field; n >= -126 wherever the result is kept.
  const float nc = n < -126.0f ? -126.0f : n;
  const int32_t bits = (static_cast<int32_t>(nc) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.33654475f ? 0.0f : p * two_n;
}

} // namespace mlxq::cpu
