// Tests of SelectLowestUnprotected (kernels/selection.h), the CPU twin of the
// GPU selection kernel: hand cases for protection, ties and -0.0, then random
// layers against an independent model (filter, sort, take k) and against what
// the h2o policy selects through EvictionPolicy::SelectLowestUnprotected.
#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache_store/eviction_policy.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/selection.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

struct Layer {
  std::vector<float> scores;
  std::vector<int64_t> arrival;
  int64_t appended = 0;
};

std::vector<int32_t> Select(const Layer& l, int64_t sinks, int64_t recent,
                            int64_t k) {
  std::vector<RankedItem> scratch;
  std::vector<int32_t> out;
  SelectLowestUnprotected(l.scores.data(), l.arrival.data(),
                          static_cast<int64_t>(l.scores.size()), l.appended,
                          sinks, recent, k, scratch, &out);
  return out;
}

// The model: every eligible slot, stably sorted by (score, arrival) with the
// float comparison (so -0.0 == 0.0), the first k.
std::vector<int32_t> Model(const Layer& l, int64_t sinks, int64_t recent,
                           int64_t k) {
  std::vector<int32_t> eligible;
  for (int32_t s = 0; s < static_cast<int32_t>(l.scores.size()); ++s) {
    const int64_t a = l.arrival[s];
    if (a >= sinks && a < l.appended - recent) eligible.push_back(s);
  }
  std::sort(eligible.begin(), eligible.end(), [&](int32_t x, int32_t y) {
    if (l.scores[x] < l.scores[y]) return true;
    if (l.scores[y] < l.scores[x]) return false;
    return l.arrival[x] < l.arrival[y];
  });
  if (k < 0) k = 0;
  if (static_cast<int64_t>(eligible.size()) > k) eligible.resize(k);
  return eligible;
}

// What the h2o policy picks for the same layer (its score is the key).
std::vector<int32_t> H2O(const Layer& l, int64_t sinks, int64_t recent,
                         int64_t k) {
  absl::StatusOr<PolicyPtr> policy = NewPolicy(PolicySpec{
      "h2o",
      {{"sinks", std::to_string(sinks)}, {"recent", std::to_string(recent)}}});
  EXPECT_TRUE(policy.ok()) << policy.status();
  if (!policy.ok()) return {};
  std::vector<float> scores = l.scores;
  LayerTokens tokens;
  tokens.arrival = l.arrival;
  tokens.score = scores;
  tokens.appended = l.appended;
  tokens.page_tokens = 16;
  std::vector<RankedItem> scratch;
  std::vector<int32_t> out;
  (*policy)->SelectVictims(tokens, k, scratch, &out);
  return out;
}

TEST(SelectLowestUnprotectedTest, HandCases) {
  // Slots hold arrivals out of order, as after compactions.
  //   slot:    0    1    2    3    4    5
  //   arrival: 0    5    2    3    4    1   appended 8
  //   score:   0.1  0.5  0.2  0.2  0.9  0.3
  const Layer l{{0.1f, 0.5f, 0.2f, 0.2f, 0.9f, 0.3f}, {0, 5, 2, 3, 4, 1}, 8};
  // No protection: ascending score, the 0.2 tie to the older (arrival 2).
  EXPECT_THAT(Select(l, 0, 0, 6), ElementsAre(0, 2, 3, 5, 1, 4));
  EXPECT_THAT(Select(l, 0, 0, 1), ElementsAre(0));
  EXPECT_THAT(Select(l, 0, 0, 3), ElementsAre(0, 2, 3));
  // sinks 2 protects arrivals 0, 1 (slots 0, 5); recent 3 protects arrivals
  // 5, 6, 7 (slot 1). Eligible: slots 2, 3, 4.
  EXPECT_THAT(Select(l, 2, 3, 10), ElementsAre(2, 3, 4));
  EXPECT_THAT(Select(l, 2, 3, 2), ElementsAre(2, 3));
  // k = 0, negative k, everything protected.
  EXPECT_THAT(Select(l, 0, 0, 0), IsEmpty());
  EXPECT_THAT(Select(l, 0, 0, -3), IsEmpty());
  EXPECT_THAT(Select(l, 8, 0, 4), IsEmpty());
  EXPECT_THAT(Select(l, 0, 8, 4), IsEmpty());
  EXPECT_THAT(Select(l, 4, 4, 4), IsEmpty());
  // An empty layer.
  EXPECT_THAT(Select(Layer{}, 0, 0, 3), IsEmpty());
}

// -0.0 == 0.0 as floats: their tie goes to the older token whichever sign it
// has, in every path of SelectLowest (k == 1, heap, nth_element).
TEST(SelectLowestUnprotectedTest, NegativeZeroTiesWithZero) {
  const Layer a{{0.0f, -0.0f, 1.0f}, {7, 3, 0}, 10};
  EXPECT_THAT(Select(a, 0, 0, 1), ElementsAre(1));
  EXPECT_THAT(Select(a, 0, 0, 3), ElementsAre(1, 0, 2));
  const Layer b{{-0.0f, 0.0f, 1.0f}, {7, 3, 0}, 10};
  EXPECT_THAT(Select(b, 0, 0, 1), ElementsAre(1));
  EXPECT_THAT(Select(b, 0, 0, 3), ElementsAre(1, 0, 2));
  // The heap path (k * 16 < n).
  Layer c;
  for (int i = 0; i < 100; ++i) {
    c.scores.push_back(i % 2 == 0 ? 0.0f : -0.0f);
    c.arrival.push_back(99 - i);
  }
  c.appended = 100;
  EXPECT_THAT(Select(c, 0, 0, 3), ElementsAre(99, 98, 97));
  // Negative scores rank below both zeros.
  const Layer d{{0.0f, -1e-30f, -0.0f}, {0, 1, 2}, 3};
  EXPECT_THAT(Select(d, 0, 0, 3), ElementsAre(1, 0, 2));
}

// The output is appended to what *out already holds.
TEST(SelectLowestUnprotectedTest, AppendsToOut) {
  const Layer l{{3.0f, 1.0f, 2.0f}, {0, 1, 2}, 3};
  std::vector<RankedItem> scratch;
  std::vector<int32_t> out = {42};
  SelectLowestUnprotected(l.scores.data(), l.arrival.data(), 3, 3, 0, 0, 2,
                          scratch, &out);
  EXPECT_THAT(out, ElementsAre(42, 1, 2));
}

// A random layer: `slots` resident tokens holding distinct arrivals drawn
// from [0, appended), in shuffled slot order; scores from a small set when
// `ties` (many equal scores, both zeros), else spread.
Layer RandomLayer(int64_t slots, bool ties, std::mt19937& rng) {
  Layer l;
  l.appended = slots + static_cast<int64_t>(rng() % (slots + 3));
  std::vector<int64_t> all(l.appended);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  l.arrival.assign(all.begin(), all.begin() + slots);
  const float levels[] = {0.0f, -0.0f, 1.0f, -2.5f, 0.25f};
  std::uniform_real_distribution<float> spread(-4.0f, 4.0f);
  for (int64_t s = 0; s < slots; ++s) {
    l.scores.push_back(ties ? levels[rng() % 5] : spread(rng));
  }
  return l;
}

TEST(SelectLowestUnprotectedTest, RandomLayersMatchModelAndPolicy) {
  std::mt19937 rng(2024);
  int cases = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    const int64_t slots = rng() % 300;
    const bool ties = trial % 2 == 0;
    const Layer l = RandomLayer(slots, ties, rng);
    const int64_t sinks = trial % 5 == 0 ? 0 : rng() % 12;
    const int64_t recent = trial % 7 == 0 ? 0 : rng() % 40;
    // Every path of SelectLowest: k == 1, the heap (k * 16 < n), the sort.
    const int64_t ks[] = {
        0,     1,        2, 16, static_cast<int64_t>(rng() % (slots + 3)),
        slots, slots + 5};
    for (int64_t k : ks) {
      SCOPED_TRACE(::testing::Message()
                   << "trial " << trial << " slots " << slots << " k " << k
                   << " sinks " << sinks << " recent " << recent);
      const std::vector<int32_t> got = Select(l, sinks, recent, k);
      ASSERT_EQ(got, Model(l, sinks, recent, k));
      ASSERT_EQ(got, H2O(l, sinks, recent, k));
      ++cases;
    }
  }
  EXPECT_EQ(cases, 1500 * 7);
}

}  // namespace
}  // namespace kvkeep
