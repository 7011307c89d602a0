// Tests of PageScores (kernels/page_scores.h), the page aggregation h2o_page
// uses and the CPU twin of the CUDA kernel: against an independent reference
// (means in double) over page sizes 1, 3, 7, 16, 17, layers with a partly
// filled last page, fewer slots than a page, shuffled arrival orders with
// gaps, and every protection shape (sinks only, recent only, both, none,
// everything protected). Oldest and eligibility are exact; the mean is
// checked against double within the float32 bound for P terms and one
// division ((P + 1) * 2^-24 relative to the sum of magnitudes), and bit for
// bit against the stated order (sum from 0 left to right, then / P), which is
// what h2o_page computed before it called this function.
#include "kernels/page_scores.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvkeep {
namespace {

struct Tokens {
  std::vector<float> score;
  std::vector<int64_t> arrival;
  int64_t appended = 0;
};

// `slots` resident tokens out of `appended` ever appended: distinct arrivals
// with gaps (evicted tokens), in shuffled slots.
Tokens MakeTokens(int64_t slots, std::mt19937& rng) {
  Tokens t;
  t.appended = 2 * slots + 3;
  std::vector<int64_t> all(t.appended);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  t.arrival.assign(all.begin(), all.begin() + slots);
  std::uniform_real_distribution<float> score(-1.0f, 100.0f);
  t.score.resize(slots);
  for (float& s : t.score) s = score(rng);
  return t;
}

struct Result {
  std::vector<float> mean;
  std::vector<int64_t> oldest;
  std::vector<uint8_t> eligible;
};

Result Run(const Tokens& t, int32_t page_tokens, ProtectedTokens protect) {
  const int64_t pages =
      FullPages(static_cast<int64_t>(t.score.size()), page_tokens);
  // Sentinels: every output must be written.
  Result r{std::vector<float>(pages, std::numeric_limits<float>::quiet_NaN()),
           std::vector<int64_t>(pages, -7), std::vector<uint8_t>(pages, 9)};
  PageScores(t.score.data(), t.arrival.data(),
             static_cast<int64_t>(t.score.size()), page_tokens, protect,
             r.mean.data(), r.oldest.data(), r.eligible.data());
  return r;
}

void ExpectMatchesReference(const Tokens& t, int32_t page_tokens,
                            ProtectedTokens protect) {
  const int64_t slots = static_cast<int64_t>(t.score.size());
  const int64_t pages = slots / page_tokens;  // partial last page excluded
  const Result r = Run(t, page_tokens, protect);
  ASSERT_EQ(static_cast<int64_t>(r.mean.size()), pages);
  constexpr double kUnit = 1.0 / (1 << 24);
  for (int64_t page = 0; page < pages; ++page) {
    double sum = 0, mag = 0;
    int64_t oldest = std::numeric_limits<int64_t>::max();
    bool eligible = true;
    float ordered = 0.0f;
    for (int32_t i = 0; i < page_tokens; ++i) {
      const int64_t s = page * page_tokens + i;
      sum += t.score[s];
      mag += std::fabs(t.score[s]);
      ordered += t.score[s];
      oldest = std::min(oldest, t.arrival[s]);
      const int64_t a = t.arrival[s];
      if (a < protect.sinks || a >= protect.appended - protect.recent) {
        eligible = false;
      }
    }
    const double mean = sum / page_tokens;
    EXPECT_NEAR(r.mean[page], mean,
                (page_tokens + 1) * kUnit * mag / page_tokens)
        << "page " << page;
    EXPECT_EQ(r.mean[page], ordered / static_cast<float>(page_tokens))
        << "page " << page << ": not the stated summation order";
    EXPECT_EQ(r.oldest[page], oldest) << "page " << page;
    EXPECT_EQ(r.eligible[page], eligible ? 1 : 0) << "page " << page;
  }
}

TEST(PageScoresTest, MatchesReferenceOverPageSizesAndProtection) {
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int64_t slots :
         {int64_t{0}, int64_t{page_tokens - 1}, int64_t{page_tokens},
          int64_t{5 * page_tokens + 2}, int64_t{40 * page_tokens}}) {
      std::mt19937 rng(page_tokens * 1000 + slots);
      const Tokens t = MakeTokens(slots, rng);
      const int64_t a = t.appended;
      const ProtectedTokens shapes[] = {
          {0, 0, a},  // nothing protected: every full page eligible
          {4, 0, a},  // sinks only
          {0, 9, a},  // recent only
          {3, 2 * page_tokens, a},
          {a, 0, a},      // everything is a sink
          {0, a + 5, a},  // recent wider than the layer
      };
      for (const ProtectedTokens& protect : shapes) {
        SCOPED_TRACE(::testing::Message()
                     << "P " << page_tokens << " slots " << slots << " sinks "
                     << protect.sinks << " recent " << protect.recent);
        ExpectMatchesReference(t, page_tokens, protect);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 5 * 6);
}

TEST(PageScoresTest, HandValues) {
  // Two full pages of 3 and a partial one (ignored).
  const std::vector<float> score = {1, 2, 3, 10, 20, 60, 99};
  const std::vector<int64_t> arrival = {5, 1, 9, 2, 8, 3, 0};
  float mean[2];
  int64_t oldest[2];
  uint8_t eligible[2];
  // Protected: arrival < 2 (sinks) or >= 10 - 1 = 9 (recent).
  PageScores(score.data(), arrival.data(), 7, 3, ProtectedTokens{2, 1, 10},
             mean, oldest, eligible);
  EXPECT_EQ(mean[0], 2.0f);
  EXPECT_EQ(mean[1], 30.0f);
  EXPECT_EQ(oldest[0], 1);
  EXPECT_EQ(oldest[1], 2);
  EXPECT_EQ(eligible[0], 0);  // holds arrival 1 (a sink) and 9 (recent)
  EXPECT_EQ(eligible[1], 1);
}

TEST(PageScoresTest, ProtectedBoundaries) {
  const ProtectedTokens p{2, 3, 10};
  EXPECT_TRUE(p.contains(0));
  EXPECT_TRUE(p.contains(1));
  EXPECT_FALSE(p.contains(2));
  EXPECT_FALSE(p.contains(6));
  EXPECT_TRUE(p.contains(7));  // 10 - 3
  EXPECT_TRUE(p.contains(9));
  EXPECT_EQ(FullPages(0, 4), 0);
  EXPECT_EQ(FullPages(3, 4), 0);
  EXPECT_EQ(FullPages(9, 4), 2);
}

}  // namespace
}  // namespace kvkeep
