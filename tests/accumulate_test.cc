// Tests of AccumulateScores (kernels/accumulate.h), the CPU twin of the CUDA
// accumulation kernel: against an independent double-precision reference
// over awkward sizes (GQA 1, 4, 8; rows 1 and 3; slots 1 .. 1001, not
// multiples of the block; empty layers; kv_head_scores present or not), and
// bit for bit against the summation order its header states (which is what
// lets the CUDA kernel and the host path, ReduceHeads then the policies'
// AccumulateScores over head-summed rows, match it exactly).
//
// Tolerance against the double reference: a float32 recursive sum of m terms
// is within (m - 1) * 2^-24 * (sum of |terms|) of the exact sum (Higham,
// "Accuracy and Stability of Numerical Algorithms", 4.2); the test allows m *
// 2^-24 * (sum of |terms|), the bound itself, not an observed margin.
#include "kernels/accumulate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"

namespace kvkeep {
namespace {

constexpr float kGuard = -12345.0f;  // past the end of every output array
constexpr int64_t kPad = 5;          // guard elements after each array

// One layer's arrays on the host, with guard elements after each output.
struct HostLayer {
  int64_t slots = 0;
  std::vector<float> probs;   // [query_heads][rows][slots]
  std::vector<float> scores;  // [slots + kPad]
  std::vector<float> kv;      // [kv_heads][slots] + kPad, or empty

  AccumulateLayer view(bool with_kv) {
    return AccumulateLayer{probs.empty() ? nullptr : probs.data(),
                           scores.data(), with_kv ? kv.data() : nullptr, slots};
  }
};

HostLayer MakeLayer(int32_t query_heads, int32_t kv_heads, int32_t rows,
                    int64_t slots, std::mt19937& rng) {
  std::uniform_real_distribution<float> prob(0.0f, 1.0f);
  std::uniform_real_distribution<float> initial(-2.0f, 50.0f);
  HostLayer l;
  l.slots = slots;
  l.probs.resize(int64_t{query_heads} * rows * slots);
  for (float& p : l.probs) p = prob(rng) / static_cast<float>(slots);
  l.scores.assign(slots + kPad, kGuard);
  for (int64_t s = 0; s < slots; ++s) l.scores[s] = initial(rng);
  l.kv.assign(int64_t{kv_heads} * slots + kPad, kGuard);
  for (int64_t i = 0; i < int64_t{kv_heads} * slots; ++i)
    l.kv[i] = initial(rng);
  return l;
}

// The exact result and the error bound, per element, in double.
struct Expected {
  std::vector<double> scores, scores_bound;
  std::vector<double> kv, kv_bound;
};

Expected Reference(const HostLayer& l, int32_t query_heads, int32_t kv_heads,
                   int32_t rows) {
  const int64_t n = l.slots;
  const int32_t group = query_heads / kv_heads;
  constexpr double kUnit = 1.0 / (1 << 24);  // float32 unit roundoff
  Expected e;
  e.scores.resize(n);
  e.scores_bound.resize(n);
  e.kv.resize(int64_t{kv_heads} * n);
  e.kv_bound.resize(int64_t{kv_heads} * n);
  for (int64_t s = 0; s < n; ++s) {
    double sum = l.scores[s], mag = std::fabs(l.scores[s]);
    for (int32_t h = 0; h < query_heads; ++h) {
      for (int32_t r = 0; r < rows; ++r) {
        const double p = l.probs[(int64_t{h} * rows + r) * n + s];
        sum += p;
        mag += std::fabs(p);
      }
    }
    e.scores[s] = sum;
    e.scores_bound[s] = (int64_t{query_heads} * rows + 1) * kUnit * mag;
    for (int32_t g = 0; g < kv_heads; ++g) {
      const int64_t i = int64_t{g} * n + s;
      double gsum = l.kv[i], gmag = std::fabs(l.kv[i]);
      for (int32_t h = g * group; h < (g + 1) * group; ++h) {
        for (int32_t r = 0; r < rows; ++r) {
          const double p = l.probs[(int64_t{h} * rows + r) * n + s];
          gsum += p;
          gmag += std::fabs(p);
        }
      }
      e.kv[i] = gsum;
      e.kv_bound[i] = (int64_t{group} * rows + 1) * kUnit * gmag;
    }
  }
  return e;
}

void ExpectGuardsIntact(const HostLayer& l, int32_t kv_heads) {
  for (int64_t i = l.slots; i < l.slots + kPad; ++i) {
    EXPECT_EQ(l.scores[i], kGuard) << "scores written past slots at " << i;
  }
  for (int64_t i = int64_t{kv_heads} * l.slots; i < int64_t(l.kv.size()); ++i) {
    EXPECT_EQ(l.kv[i], kGuard) << "kv_head_scores written past end at " << i;
  }
}

struct Gqa {
  int32_t query_heads;
  int32_t kv_heads;
};
constexpr Gqa kGqaShapes[] = {{1, 1},  {4, 4}, {4, 1}, {8, 2},
                              {32, 4}, {8, 1}, {32, 8}};

TEST(AccumulateScoresTest, MatchesDoubleReferenceOverShapes) {
  int cases = 0;
  for (const Gqa gqa : kGqaShapes) {
    for (int32_t rows : {1, 3}) {
      for (bool with_kv : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "query_heads " << gqa.query_heads << " kv_heads "
                     << gqa.kv_heads << " rows " << rows << " kv " << with_kv);
        std::mt19937 rng(gqa.query_heads * 100 + gqa.kv_heads * 10 + rows +
                         (with_kv ? 7 : 0));
        // Several layers of different sizes in one call, one of them empty.
        std::vector<HostLayer> layers;
        for (int64_t slots : {1, 3, 7, 0, 16, 17, 255, 257, 1001}) {
          layers.push_back(
              MakeLayer(gqa.query_heads, gqa.kv_heads, rows, slots, rng));
        }
        std::vector<Expected> expected;
        std::vector<AccumulateLayer> views;
        for (HostLayer& l : layers) {
          expected.push_back(Reference(l, gqa.query_heads, gqa.kv_heads, rows));
          views.push_back(l.view(with_kv));
        }
        const std::vector<std::vector<float>> kv_before = [&] {
          std::vector<std::vector<float>> v;
          for (const HostLayer& l : layers) v.push_back(l.kv);
          return v;
        }();
        AccumulateScores(views, gqa.query_heads, gqa.kv_heads, rows);
        for (size_t i = 0; i < layers.size(); ++i) {
          const HostLayer& l = layers[i];
          const Expected& e = expected[i];
          for (int64_t s = 0; s < l.slots; ++s) {
            ASSERT_NEAR(l.scores[s], e.scores[s], e.scores_bound[s])
                << "layer " << i << " slot " << s;
          }
          if (with_kv) {
            for (size_t k = 0; k < e.kv.size(); ++k) {
              ASSERT_NEAR(l.kv[k], e.kv[k], e.kv_bound[k])
                  << "layer " << i << " kv element " << k;
            }
          } else {
            EXPECT_EQ(l.kv, kv_before[i]) << "kv_head_scores was null";
          }
          ExpectGuardsIntact(l, gqa.kv_heads);
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 7 * 2 * 2);
}

// The header's summation order, literally, in float: the CUDA kernel must
// match this bit for bit, and so it is the twin's contract.
TEST(AccumulateScoresTest, FollowsTheStatedSummationOrderExactly) {
  for (const Gqa gqa : kGqaShapes) {
    for (int32_t rows : {1, 2, 5}) {
      SCOPED_TRACE(::testing::Message()
                   << "query_heads " << gqa.query_heads << " kv_heads "
                   << gqa.kv_heads << " rows " << rows);
      std::mt19937 rng(gqa.query_heads * 31 + gqa.kv_heads * 7 + rows);
      HostLayer l = MakeLayer(gqa.query_heads, gqa.kv_heads, rows, 300, rng);
      const int64_t n = l.slots;
      const int32_t group = gqa.query_heads / gqa.kv_heads;
      std::vector<float> want_scores(l.scores.begin(), l.scores.begin() + n);
      std::vector<float> want_kv(l.kv.begin(),
                                 l.kv.begin() + int64_t{gqa.kv_heads} * n);
      auto p = [&](int32_t h, int32_t r, int64_t s) {
        return l.probs[(int64_t{h} * rows + r) * n + s];
      };
      for (int64_t s = 0; s < n; ++s) {
        for (int32_t r = 0; r < rows; ++r) {
          float t = p(0, r, s);
          for (int32_t h = 1; h < gqa.query_heads; ++h) t = t + p(h, r, s);
          want_scores[s] = want_scores[s] + t;
          for (int32_t g = 0; g < gqa.kv_heads; ++g) {
            float gs = p(g * group, r, s);
            for (int32_t j = 1; j < group; ++j)
              gs = gs + p(g * group + j, r, s);
            want_kv[int64_t{g} * n + s] = want_kv[int64_t{g} * n + s] + gs;
          }
        }
      }
      const AccumulateLayer view = l.view(true);
      AccumulateScores({&view, 1}, gqa.query_heads, gqa.kv_heads, rows);
      for (int64_t s = 0; s < n; ++s) {
        ASSERT_EQ(l.scores[s], want_scores[s]) << "slot " << s;
      }
      for (int64_t i = 0; i < int64_t{gqa.kv_heads} * n; ++i) {
        ASSERT_EQ(l.kv[i], want_kv[i]) << "kv element " << i;
      }
    }
  }
}

// The host path sums heads with ReduceHeads, then the policies add the rows
// in order with AccumulateScores(query_heads = 1) (EvictionPolicy::
// AccumulateRows): both give the floats of a plain row-by-row sum and of the
// one-pass accumulation over every head, so switching a backend between the
// two changes no eviction.
TEST(AccumulateScoresTest, BitIdenticalToReduceHeadsThenAddRows) {
  for (int32_t heads : {1, 3, 4, 8, 32}) {
    for (int32_t rows : {1, 4}) {
      SCOPED_TRACE(::testing::Message()
                   << "heads " << heads << " rows " << rows);
      std::mt19937 rng(heads * 13 + rows);
      HostLayer l = MakeLayer(heads, 1, rows, 517, rng);
      const int64_t n = l.slots;
      std::vector<float> reduced(int64_t{rows} * n);
      ReduceHeads(l.probs.data(), heads, rows, n, reduced.data());
      std::vector<float> want(l.scores.begin(), l.scores.begin() + n);
      for (int32_t r = 0; r < rows; ++r) {
        for (int64_t s = 0; s < n; ++s) want[s] += reduced[r * n + s];
      }
      std::vector<float> policy(l.scores.begin(), l.scores.begin() + n);
      const AccumulateLayer summed{reduced.data(), policy.data(), nullptr, n};
      AccumulateScores({&summed, 1}, /*query_heads=*/1, /*kv_heads=*/1, rows);
      const AccumulateLayer view = l.view(false);
      AccumulateScores({&view, 1}, heads, 1, rows);
      for (int64_t s = 0; s < n; ++s) {
        ASSERT_EQ(l.scores[s], want[s]) << "slot " << s;
        ASSERT_EQ(policy[s], want[s]) << "slot " << s;
      }
    }
  }
}

TEST(AccumulateScoresTest, EmptyInputsChangeNothing) {
  std::mt19937 rng(3);
  HostLayer l = MakeLayer(8, 2, 2, 33, rng);
  const std::vector<float> scores = l.scores, kv = l.kv;
  const AccumulateLayer view = l.view(true);
  AccumulateScores({&view, 1}, 8, 2, /*rows=*/0);  // no query rows
  EXPECT_EQ(l.scores, scores);
  EXPECT_EQ(l.kv, kv);
  AccumulateScores({}, 8, 2, 2);  // no layers
  // A layer with no slots needs no arrays at all.
  const AccumulateLayer empty{nullptr, nullptr, nullptr, 0};
  AccumulateScores({&empty, 1}, 8, 2, 2);
}

// GQA: query head h feeds kv head h / G only. One-hot probabilities make each
// kv head's score count its own heads.
TEST(AccumulateScoresTest, GqaGroupsAreContiguousHeads) {
  constexpr int32_t kQueryHeads = 8, kKvHeads = 2, kRows = 1;
  constexpr int64_t kSlots = 4;
  HostLayer l;
  l.slots = kSlots;
  l.probs.assign(kQueryHeads * kRows * kSlots, 0.0f);
  // Head h puts weight h + 1 on slot h % 4.
  for (int32_t h = 0; h < kQueryHeads; ++h) {
    l.probs[h * kSlots + h % kSlots] = static_cast<float>(h + 1);
  }
  l.scores.assign(kSlots + kPad, 0.0f);
  l.kv.assign(kKvHeads * kSlots + kPad, 0.0f);
  const AccumulateLayer view = l.view(true);
  AccumulateScores({&view, 1}, kQueryHeads, kKvHeads, kRows);
  // Slot s: heads s and s + 4 -> (s + 1) + (s + 5).
  for (int64_t s = 0; s < kSlots; ++s) {
    EXPECT_EQ(l.scores[s], static_cast<float>(2 * s + 6));
    EXPECT_EQ(l.kv[s], static_cast<float>(s + 1));           // heads 0..3
    EXPECT_EQ(l.kv[kSlots + s], static_cast<float>(s + 5));  // heads 4..7
  }
}

// AccumulateCheckedRows (the fused check and add of head-reduced rows): its
// output is bit for bit AccumulateScores on the scores extended by zeros (the
// slots an append added), it reports what CheckRows reports, reads the scores
// without writing them and writes nothing past `slots`.
TEST(AccumulateCheckedRowsTest,
     AddsLikeAccumulateScoresAndChecksLikeCheckRows) {
  for (int32_t rows : {1, 3}) {
    for (int64_t slots : {1, 7, 17, 256, 1001}) {
      for (int64_t appended : {0, 1, 3}) {
        if (appended > slots) continue;
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " slots "
                                          << slots << " appended " << appended);
        std::mt19937 rng(
            static_cast<uint32_t>(rows * 7919 + slots * 31 + appended));
        HostLayer l = MakeLayer(1, 1, rows, slots, rng);
        const int64_t scored = slots - appended;
        const std::vector<float> before(l.scores.begin(),
                                        l.scores.begin() + scored);
        std::vector<float> want(slots, 0.0f);
        std::copy(before.begin(), before.end(), want.begin());
        const AccumulateLayer view{l.probs.data(), want.data(), nullptr, slots};
        AccumulateScores({&view, 1}, 1, 1, rows);
        std::vector<float> out(slots + kPad, kGuard);
        const RowCheck got = AccumulateCheckedRows(
            l.probs.data(), rows, slots, l.scores.data(), scored, out.data());
        for (int64_t s = 0; s < slots; ++s) {
          ASSERT_EQ(out[s], want[s]) << "slot " << s;
        }
        for (int64_t s = slots; s < slots + kPad; ++s) {
          ASSERT_EQ(out[s], kGuard) << "written past the end at " << s;
        }
        for (int64_t s = 0; s < scored; ++s) {
          ASSERT_EQ(l.scores[s], before[s]) << "scores written at " << s;
        }
        const RowCheck ref = CheckRows(l.probs.data(), rows, slots);
        EXPECT_EQ(got.min_value, ref.min_value);
        // Both sum a row in vector lanes; the lanes' order may differ, so
        // the sums agree to the float32 bound on `slots` terms (all >= 0).
        EXPECT_NEAR(got.max_row_sum, ref.max_row_sum,
                    static_cast<double>(slots) * std::ldexp(1.0, -24) *
                        std::max(got.max_row_sum, ref.max_row_sum));
      }
    }
  }
}

TEST(AccumulateCheckedRowsTest, ReportsNaNInfinityAndNegativesAsCheckRows) {
  constexpr int32_t kRows = 2;
  constexpr int64_t kSlots = 37, kScored = 35;  // the last two just appended
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf, -0.5f}) {
    // In the scored part and in the appended tail, of either row.
    for (int64_t at :
         {int64_t{0}, int64_t{20}, kSlots - 1, kSlots + 3, 2 * kSlots - 1}) {
      SCOPED_TRACE(::testing::Message() << "value " << bad << " at " << at);
      std::vector<float> rows(kRows * kSlots, 0.01f);
      rows[at] = bad;
      const std::vector<float> scores(kScored, 1.0f);
      std::vector<float> out(kSlots);
      const RowCheck got = AccumulateCheckedRows(
          rows.data(), kRows, kSlots, scores.data(), kScored, out.data());
      const RowCheck ref = CheckRows(rows.data(), kRows, kSlots);
      if (std::isnan(ref.min_value)) {
        EXPECT_TRUE(std::isnan(got.min_value));
        EXPECT_TRUE(std::isnan(got.max_row_sum));
      } else {
        EXPECT_EQ(got.min_value, ref.min_value);
        EXPECT_EQ(std::isinf(got.max_row_sum), std::isinf(ref.max_row_sum));
      }
      EXPECT_TRUE(!std::isfinite(got.min_value) ||
                  !std::isfinite(got.max_row_sum) || got.min_value < 0.0f);
    }
  }
}

}  // namespace
}  // namespace kvkeep
