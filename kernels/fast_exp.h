// ExpNonPositive: exp(x) for x <= 0 in plain float arithmetic that a
// compiler vectorises (no libm call, no branch), for softmax after the row
// maximum is subtracted. Header-only so that every caller inlines it into
// its own (possibly multi-versioned) loop. Thread-safe (pure function).
//
// Method (Cephes' expf): x = n ln2 + r with n = rint(x / ln2) and
// |r| <= ln2 / 2 (ln2 split in two constants so that n * C1 is exact), exp(r)
// by a degree-7 polynomial, then 2^n added to the exponent bits.
// Accuracy over x in [-86, 0]: within 8.5e-8 relative of exp(x), about
// 1.4 ulp (measured over every float in that range on 2026-12-02: 8.13e-8
// compiled without FMA, 8.40e-8 with -march=native's FMAs; glibc's expf is
// within ~6e-8). fast_exp_test samples the range and holds it to 1.2e-7.
// Edge cases: x < -86 (exp(x) < 4.5e-38, below any softmax term that
// matters next to the maximum's 1) and -inf give exactly 0; NaN gives NaN;
// x > 0 is outside the contract (clamped to 0: gives 1).
#ifndef KVKEEP_KERNELS_FAST_EXP_H_
#define KVKEEP_KERNELS_FAST_EXP_H_

#include <bit>
#include <cstdint>

namespace kvkeep {

inline constexpr float kExpNonPositiveMin = -86.0f;

[[gnu::always_inline]] inline float ExpNonPositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kC1 = 0.693359375f;  // ln2 = kC1 + kC2; kC1 has 9 bits
  constexpr float kC2 = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding rounds to int
  float xc = x < kExpNonPositiveMin ? kExpNonPositiveMin : x;
  xc = xc > 0.0f ? 0.0f : xc;
  // n in [-124, 0], so 2^n * p (p in [0.70, 1.42]) stays a normal float.
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kC1) - n * kC2;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits =
      std::bit_cast<int32_t>(p) + (static_cast<int32_t>(n) << 23);
  const float y = std::bit_cast<float>(bits);
  // x != x keeps a NaN; below the range (and -inf) the result is 0.
  return x != x ? x : (x < kExpNonPositiveMin ? 0.0f : y);
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_FAST_EXP_H_
