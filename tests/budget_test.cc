// Tests of cache_store/budget.h: the uniform, per-layer and pyramid
// schedules, the pyramid formula of the header reproduced by hand, and the
// INVALID_ARGUMENT cases.
#include "cache_store/budget.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

BudgetSpec Pyramid(int64_t tokens, double beta = 20.0) {
  BudgetSpec spec;
  spec.tokens = tokens;
  spec.schedule = "pyramid";
  spec.pyramid_beta = beta;
  return spec;
}

std::vector<int64_t> Budgets(const BudgetSpec& spec, int32_t layers,
                             int64_t protected_tokens) {
  absl::StatusOr<std::vector<int64_t>> b =
      LayerBudgets(spec, layers, protected_tokens);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *b : std::vector<int64_t>{};
}

TEST(LayerBudgetsTest, UniformGivesEveryLayerTheTokens) {
  BudgetSpec spec;
  spec.tokens = 100;
  EXPECT_EQ(spec.schedule, "uniform");  // the default
  EXPECT_THAT(Budgets(spec, 4, 10), ElementsAre(100, 100, 100, 100));
  EXPECT_THAT(Budgets(spec, 1, 0), ElementsAre(100));
}

TEST(LayerBudgetsTest, PerLayerOverridesTokensAndSchedule) {
  BudgetSpec spec;
  spec.tokens = 7;
  spec.schedule = "pyramid";
  spec.per_layer = {10, 20, 30};
  EXPECT_THAT(Budgets(spec, 3, 5), ElementsAre(10, 20, 30));
  spec.schedule = "no-such-schedule";  // not even looked at
  EXPECT_THAT(Budgets(spec, 3, 5), ElementsAre(10, 20, 30));
}

TEST(LayerBudgetsTest, PerLayerWrongCountIsInvalid) {
  BudgetSpec spec;
  spec.per_layer = {10, 20};
  for (int32_t layers : {1, 3, 32}) {
    const absl::StatusOr<std::vector<int64_t>> b =
        LayerBudgets(spec, layers, 0);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(b.status().message(), HasSubstr("got 2 entries"));
    EXPECT_THAT(b.status().message(),
                HasSubstr(absl::StrCat(layers, " layers")));
  }
}

TEST(LayerBudgetsTest, UnknownScheduleIsInvalid) {
  BudgetSpec spec;
  spec.tokens = 64;
  for (const char* name : {"linear", "Pyramid", ""}) {
    spec.schedule = name;
    const absl::StatusOr<std::vector<int64_t>> b = LayerBudgets(spec, 4, 0);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(b.status().message(), HasSubstr(absl::StrCat("'", name, "'")));
    EXPECT_THAT(b.status().message(), HasSubstr("uniform or pyramid"));
  }
}

TEST(LayerBudgetsTest, PyramidBetaBelowOneIsInvalid) {
  for (double beta :
       {0.999, 0.5, 0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
        std::numeric_limits<double>::infinity()}) {
    const absl::StatusOr<std::vector<int64_t>> b =
        LayerBudgets(Pyramid(100, beta), 4, 10);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << beta;
    EXPECT_THAT(b.status().message(), HasSubstr("beta"));
  }
  EXPECT_TRUE(LayerBudgets(Pyramid(100, 1.0), 4, 10).ok());
}

TEST(LayerBudgetsTest, PyramidBudgetBelowProtectedIsInvalid) {
  const absl::StatusOr<std::vector<int64_t>> b =
      LayerBudgets(Pyramid(9), 4, 10);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("10 protected"));
}

// The header's formula by hand: free = tokens - protected, lo = free / beta,
// hi = 2 * free - lo, step = (hi - lo) / (L - 1), layer l: protected + hi -
// l * step.
TEST(LayerBudgetsTest, PyramidHandComputed) {
  // free 90, lo 4 (4.5 floored), hi 176, step 172 / 3 = 57.
  EXPECT_THAT(Budgets(Pyramid(100), 4, 10), ElementsAre(186, 129, 72, 15));
  // SnapKV-style window 32 of 512, 32 layers: free 480, lo 24, hi 936,
  // step 912 / 31 = 29: 968, 939, ..., 968 - 31 * 29 = 69.
  const std::vector<int64_t> b = Budgets(Pyramid(512), 32, 32);
  ASSERT_EQ(b.size(), 32u);
  for (int l = 0; l < 32; ++l) EXPECT_EQ(b[l], 968 - 29 * l) << l;
  // Non-integer beta: free 50, lo 20, hi 80, step 30.
  EXPECT_THAT(Budgets(Pyramid(50, 2.5), 3, 0), ElementsAre(80, 50, 20));
  // beta 1: lo = hi = free, a flat schedule at the budget.
  EXPECT_THAT(Budgets(Pyramid(100, 1.0), 5, 10),
              ElementsAre(100, 100, 100, 100, 100));
  // Nothing free beyond the protected tokens.
  EXPECT_THAT(Budgets(Pyramid(10), 3, 10), ElementsAre(10, 10, 10));
  // Two layers: step = hi - lo. free 100, lo 5, hi 195.
  EXPECT_THAT(Budgets(Pyramid(110), 2, 10), ElementsAre(205, 15));
}

TEST(LayerBudgetsTest, PyramidOneLayerKeepsTheBudget) {
  EXPECT_THAT(Budgets(Pyramid(100), 1, 10), ElementsAre(100));
  EXPECT_THAT(Budgets(Pyramid(10), 1, 10), ElementsAre(10));
}

// Shape properties over a grid of budgets, layer counts and betas.
TEST(LayerBudgetsTest, PyramidIsMonotoneAndKeepsProtected) {
  for (int32_t layers : {2, 3, 8, 32, 80}) {
    for (int64_t protected_tokens : {0, 4, 32}) {
      for (int64_t free : {0, 1, 7, 100, 1000, 4096}) {
        for (double beta : {1.0, 1.5, 4.0, 20.0}) {
          SCOPED_TRACE(::testing::Message()
                       << "layers " << layers << " protected "
                       << protected_tokens << " free " << free << " beta "
                       << beta);
          const std::vector<int64_t> b = Budgets(
              Pyramid(protected_tokens + free, beta), layers, protected_tokens);
          ASSERT_EQ(static_cast<int32_t>(b.size()), layers);
          for (int32_t l = 0; l < layers; ++l) {
            EXPECT_GE(b[l], protected_tokens) << l;
            if (l > 0) {
              EXPECT_LE(b[l], b[l - 1]) << l;
            }
          }
          // The layer-to-layer step is constant.
          for (int32_t l = 2; l < layers; ++l) {
            EXPECT_EQ(b[l - 1] - b[l], b[0] - b[1]) << l;
          }
          // A real pyramid (first > last) whenever hi - lo = 2 (free - lo)
          // spans the layers, so that the integer step is at least 1.
          const int64_t lo = static_cast<int64_t>(std::floor(free / beta));
          if (free > lo && 2 * (free - lo) >= layers - 1) {
            EXPECT_GT(b.front(), b.back());
          }
          // Never below the budget on average.
          const int64_t total = std::accumulate(b.begin(), b.end(), int64_t{0});
          EXPECT_GE(total, (protected_tokens + free) * layers);
        }
      }
    }
  }
}

// What the formula actually guarantees: the integer step drops the remainder
// rem = (hi - lo) % (L - 1), which the lower layers keep, so the mean is
// exactly tokens + rem / 2: never below the budget, and above it by less than
// (L - 1) / 2 tokens.
TEST(LayerBudgetsTest, PyramidMeanExceedsTokensByHalfTheRemainder) {
  for (int32_t layers : {2, 3, 8, 32, 80}) {
    for (int64_t free : {0, 1, 7, 10, 100, 1000, 4096}) {
      for (double beta : {1.0, 1.5, 20.0}) {
        const int64_t protected_tokens = 8;
        const int64_t tokens = protected_tokens + free;
        const std::vector<int64_t> b =
            Budgets(Pyramid(tokens, beta), layers, protected_tokens);
        ASSERT_EQ(static_cast<int32_t>(b.size()), layers);
        const int64_t lo = static_cast<int64_t>(std::floor(free / beta));
        const int64_t rem = (2 * free - 2 * lo) % (layers - 1);
        const int64_t total = std::accumulate(b.begin(), b.end(), int64_t{0});
        // Twice the excess over tokens * L is rem * L exactly.
        EXPECT_EQ(2 * (total - tokens * layers), rem * layers)
            << "layers " << layers << " tokens " << tokens << " beta " << beta;
      }
    }
  }
}

}  // namespace
}  // namespace kvkeep
