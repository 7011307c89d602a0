// ExpNonPositive (kernels/fast_exp.h) against exp in double: the stated
// relative error over [-86, 0] and the edge cases the softmax relies on.
#include "kernels/fast_exp.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace kvkeep {
namespace {

// Every 61st float from -0 down to -86 (18 M of them, all binades), and
// every float in [-1, 0] near the polynomial's interval ends.
TEST(ExpNonPositiveTest, WithinStatedRelativeError) {
  const uint32_t last = std::bit_cast<uint32_t>(kExpNonPositiveMin);
  double worst = 0;
  float worst_x = 0;
  int64_t checked = 0;
  auto check = [&](float x) {
    const double want = std::exp(static_cast<double>(x));
    const double err = std::fabs(ExpNonPositive(x) - want) / want;
    if (err > worst) worst = err, worst_x = x;
    ++checked;
  };
  for (uint32_t b = 0x80000000u; b <= last; b += 61) {
    check(std::bit_cast<float>(b));
  }
  // |r| = ln2 / 2 at x = -(k + 0.5) ln2: n switches there.
  for (int k = 0; k < 124; ++k) {
    const float edge = -(k + 0.5f) * 0.69314718f;
    float x = edge;
    for (int i = 0; i < 200; ++i) x = std::nextafter(x, 0.0f);
    for (int i = 0; i < 400; ++i, x = std::nextafter(x, -1000.0f)) check(x);
  }
  EXPECT_GT(checked, 18'000'000);
  EXPECT_LT(worst, 1.2e-7) << "at x = " << worst_x;
}

TEST(ExpNonPositiveTest, EdgeCases) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ExpNonPositive(0.0f), 1.0f);
  EXPECT_EQ(ExpNonPositive(-0.0f), 1.0f);
  EXPECT_EQ(ExpNonPositive(-kInf), 0.0f);  // a masked slot
  EXPECT_EQ(ExpNonPositive(-86.5f), 0.0f);
  EXPECT_EQ(ExpNonPositive(-1e30f), 0.0f);
  EXPECT_TRUE(std::isnan(ExpNonPositive(std::nanf(""))));
  // Just inside the range: a normal float, close to exp.
  const float at_min = ExpNonPositive(kExpNonPositiveMin);
  EXPECT_GE(at_min, std::numeric_limits<float>::min());
  EXPECT_NEAR(at_min, std::exp(-86.0), 1.2e-7 * std::exp(-86.0));
  // Monotone across n's switch points and to the bottom of the range.
  float prev = 1.0f;
  for (float x = 0.0f; x >= kExpNonPositiveMin; x -= 0.001953125f) {
    const float y = ExpNonPositive(x);
    ASSERT_LE(y, prev) << x;
    prev = y;
  }
}

}  // namespace
}  // namespace kvkeep
