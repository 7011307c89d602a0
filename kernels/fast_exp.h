// Exponentials in plain float arithmetic that a compiler vectorises (no
// libm call, no branch). Header-only so that every caller inlines them into
// its own (possibly multi-versioned) loop. Thread-safe (pure functions).
#ifndef KVKEEP_KERNELS_FAST_EXP_H_
#define KVKEEP_KERNELS_FAST_EXP_H_

#include <bit>
#include <cstdint>

namespace kvkeep {

// e^x in float32, within 2 ulp of the true value for x in [-87, 88] (Cephes'
// expf: x = n ln2 + r, a degree-6 polynomial in r, n added to the
// exponent); x is clamped to that range, so e^-1000 is about 1e-38 and not
// 0. Branch-free, so loops over it vectorise.
[[gnu::always_inline]] inline float FastExp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round x log2(e) to the nearest integer n with the 1.5 * 2^23 trick.
  constexpr float kShifter = 12582912.0f;
  const float t = x * 1.44269504088896341f + kShifter;
  const float n = t - kShifter;
  const int32_t ni =
      std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShifter);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return std::bit_cast<float>(std::bit_cast<int32_t>(y) + (ni << 23));
}

// exp(x) for x <= 0, for softmax after the row maximum is subtracted:
// FastExp with the edges a softmax relies on.
// Accuracy over x in [-86, 0]: within 8.6e-8 relative of exp(x), about
// 1.4 ulp (measured over every float in that range on 2026-12-02: 8.31e-8
// compiled for baseline x86-64, 8.53e-8 for x86-64-v4, whose FMAs change
// the last bits; glibc's expf is within ~6e-8). fast_exp_test samples the
// range and holds it to 1.2e-7.
// Edge cases: x < -86 (exp(x) < 4.5e-38, below any softmax term that
// matters next to the maximum's 1) and -inf give exactly 0; NaN gives NaN;
// x > 0 is outside the contract (clamped to 0: gives 1).
inline constexpr float kExpNonPositiveMin = -86.0f;

[[gnu::always_inline]] inline float ExpNonPositive(float x) {
  const float y = FastExp(x > 0.0f ? 0.0f : x);
  return x != x ? x : (x < kExpNonPositiveMin ? 0.0f : y);
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_FAST_EXP_H_
