// Tests of kernels/pooling.h: Pool1d against hand-computed values and against
// a torch-style reference (explicit padding of kernel/2 on each side; -inf
// for max pooling, zeros counted in the average for avg pooling, as
// torch's max_pool1d and avg_pool1d(count_include_pad=True) do).
#include "kernels/pooling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatEq;

std::vector<float> Pool(const std::vector<float>& in, int32_t kernel,
                        Pooling pooling) {
  std::vector<float> out(in.size(), std::numeric_limits<float>::quiet_NaN());
  Pool1d(in, kernel, pooling, out);
  return out;
}

TEST(Pool1dTest, MaxHandValues) {
  const std::vector<float> in = {1, 3, 2, 5, 4};
  EXPECT_THAT(Pool(in, 3, Pooling::kMax), ElementsAre(3, 3, 5, 5, 5));
  EXPECT_THAT(Pool(in, 5, Pooling::kMax), ElementsAre(3, 5, 5, 5, 5));
  // The padding is -inf, not 0: negative inputs stay negative at the edges.
  EXPECT_THAT(Pool({-5, -2, -7, -9}, 3, Pooling::kMax),
              ElementsAre(-2, -2, -2, -7));
}

TEST(Pool1dTest, AvgHandValuesCountThePadding) {
  const std::vector<float> in = {1, 3, 2, 5, 4};
  // Edges: (0 + 1 + 3) / 3 and (5 + 4 + 0) / 3.
  EXPECT_THAT(Pool(in, 3, Pooling::kAvg),
              ElementsAre(FloatEq(4.0f / 3), FloatEq(2.0f), FloatEq(10.0f / 3),
                          FloatEq(11.0f / 3), FloatEq(3.0f)));
  // Kernel 5: two zeros of padding on each side.
  EXPECT_THAT(
      Pool(in, 5, Pooling::kAvg),
      ElementsAre(FloatEq(6.0f / 5), FloatEq(11.0f / 5), FloatEq(15.0f / 5),
                  FloatEq(14.0f / 5), FloatEq(11.0f / 5)));
  EXPECT_THAT(Pool({-3, 6, -9}, 3, Pooling::kAvg),
              ElementsAre(FloatEq(1.0f), FloatEq(-2.0f), FloatEq(-1.0f)));
}

TEST(Pool1dTest, KernelOneIsIdentity) {
  const std::vector<float> in = {0.5f, -1.25f, 3.0f, 1e-30f, -0.0f};
  EXPECT_EQ(Pool(in, 1, Pooling::kMax), in);
  EXPECT_EQ(Pool(in, 1, Pooling::kAvg), in);
}

TEST(Pool1dTest, KernelLargerThanInput) {
  // Every window covers the whole input plus padding.
  EXPECT_THAT(Pool({2, -1, 4}, 7, Pooling::kMax), ElementsAre(4, 4, 4));
  EXPECT_THAT(
      Pool({2, -1, 4}, 7, Pooling::kAvg),
      ElementsAre(FloatEq(5.0f / 7), FloatEq(5.0f / 7), FloatEq(5.0f / 7)));
  EXPECT_THAT(Pool({-3}, 9, Pooling::kMax), ElementsAre(-3));
  EXPECT_THAT(Pool({-3}, 9, Pooling::kAvg), ElementsAre(FloatEq(-3.0f / 9)));
  // Kernel 5 over two elements: windows [pad pad a b pad] and [pad a b pad
  // pad].
  EXPECT_THAT(Pool({1, 2}, 5, Pooling::kAvg),
              ElementsAre(FloatEq(3.0f / 5), FloatEq(3.0f / 5)));
}

TEST(Pool1dTest, EmptyInput) {
  std::vector<float> out;
  Pool1d({}, 5, Pooling::kAvg, out);
  Pool1d({}, 5, Pooling::kMax, out);
  EXPECT_TRUE(out.empty());
}

// torch's definition, literally: pad, then slide a window of `kernel`.
std::vector<double> TorchPool(const std::vector<float>& in, int32_t kernel,
                              Pooling pooling) {
  const int64_t half = kernel / 2;
  const double pad =
      pooling == Pooling::kMax ? -std::numeric_limits<double>::infinity() : 0;
  std::vector<double> padded(half, pad);
  padded.insert(padded.end(), in.begin(), in.end());
  padded.insert(padded.end(), half, pad);
  std::vector<double> out;
  for (size_t i = 0; i + kernel <= padded.size(); ++i) {
    double acc = pooling == Pooling::kMax
                     ? -std::numeric_limits<double>::infinity()
                     : 0.0;
    for (int32_t j = 0; j < kernel; ++j) {
      acc = pooling == Pooling::kMax ? std::max(acc, padded[i + j])
                                     : acc + padded[i + j];
    }
    out.push_back(pooling == Pooling::kMax ? acc : acc / kernel);
  }
  return out;
}

TEST(Pool1dTest, RandomInputsMatchTorchDefinition) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n = 1; n <= 40; ++n) {
    for (int32_t kernel = 1; kernel <= 15; kernel += 2) {
      std::vector<float> in(n);
      for (float& v : in) v = normal(rng);
      for (Pooling pooling : {Pooling::kMax, Pooling::kAvg}) {
        const std::vector<double> want = TorchPool(in, kernel, pooling);
        const std::vector<float> got = Pool(in, kernel, pooling);
        ASSERT_EQ(got.size(), want.size());
        for (int64_t i = 0; i < n; ++i) {
          if (pooling == Pooling::kMax) {
            ASSERT_EQ(got[i], want[i]) << "n " << n << " kernel " << kernel;
          } else {
            double mag = 0;
            for (int64_t j = std::max<int64_t>(0, i - kernel / 2);
                 j <= std::min<int64_t>(n - 1, i + kernel / 2); ++j) {
              mag += std::fabs(in[j]);
            }
            ASSERT_NEAR(got[i], want[i], 1e-6 * mag / kernel + 1e-30)
                << "n " << n << " kernel " << kernel << " i " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvkeep
