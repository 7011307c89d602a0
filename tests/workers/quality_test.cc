// Tests of services/workers/quality.h: the metrics on hand-computed cases,
// their invariants on random ones, the nearest-rank summaries, and the
// oracle's optimality.
#include "services/workers/quality.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "services/workers/workload.h"

namespace kvkeep::workers {
namespace {

// Uniform floats in [-1, 1) from mt19937's raw output (fully specified by
// the standard, unlike std::*_distribution).
std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float scale) {
  std::vector<float> out(n);
  for (float& x : out) {
    x = scale * (static_cast<float>(rng() >> 8) * 0x1.0p-23f - 1.0f);
  }
  return out;
}

std::vector<int64_t> AllPositions(int64_t n) {
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = i;
  return out;
}

struct RandomCase {
  HeadShape shape;
  int64_t tokens;
  std::vector<float> q, k, v;
  FullCache cache() const { return {k, v, tokens}; }
};

RandomCase MakeRandomCase(uint32_t seed, HeadShape shape, int64_t tokens,
                          float q_scale = 3.0f) {
  std::mt19937 rng(seed);
  RandomCase c{shape, tokens, {}, {}, {}};
  const size_t d = shape.head_dim;
  c.q = RandomFloats(rng, shape.query_heads * d, q_scale);
  c.k = RandomFloats(rng, tokens * shape.kv_heads * d, 1.0f);
  c.v = RandomFloats(rng, tokens * shape.kv_heads * d, 1.0f);
  return c;
}

// --- MeasureStep -------------------------------------------------------------

TEST(MeasureStepTest, FullCacheLosesNothing) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const RandomCase c = MakeRandomCase(seed, {2, 6, 16}, 37);
    // Any order of the resident positions.
    std::vector<int64_t> all = AllPositions(c.tokens);
    std::reverse(all.begin(), all.end());
    const std::vector<HeadQuality> q =
        MeasureStep(c.shape, c.q, c.cache(), all).value();
    ASSERT_EQ(q.size(), 6u);
    for (const HeadQuality& h : q) {
      EXPECT_EQ(h.attention_loss, 0.0);
      EXPECT_EQ(h.top_recall, 1.0);
      EXPECT_EQ(h.output_error, 0.0);
    }
  }
}

// One head, d = 4 (scale 1/2), q = 2 e0: key j = l_j e0 has logit l_j.
// Logits 0, ln 2, ln 3 give p = 1/6, 2/6, 3/6; values are e0, e1, e2, so
// p V = (1/6, 2/6, 3/6, 0).
TEST(MeasureStepTest, HandComputedThreeTokens) {
  const HeadShape shape{1, 1, 4};
  const std::vector<float> q = {2, 0, 0, 0};
  const std::vector<float> k = {0,
                                0,
                                0,
                                0,
                                static_cast<float>(std::log(2.0)),
                                0,
                                0,
                                0,
                                static_cast<float>(std::log(3.0)),
                                0,
                                0,
                                0};
  const std::vector<float> v = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
  const FullCache full{k, v, 3};

  // S = {1, 2}: loss 1/6; top-3 = {2, 1, 0}, 2 resident; p_S = (0, 2/5,
  // 3/5) so the difference is (1/6, 2/6 - 2/5, 3/6 - 3/5) = (1/6, -1/15,
  // -1/10): |diff|^2 = 38/900, |pV|^2 = 14/36 = 350/900.
  std::vector<int64_t> s = {2, 1};
  HeadQuality h = MeasureStep(shape, q, full, s).value()[0];
  EXPECT_NEAR(h.attention_loss, 1.0 / 6, 1e-7);
  EXPECT_DOUBLE_EQ(h.top_recall, 2.0 / 3);
  EXPECT_NEAR(h.output_error, std::sqrt(38.0 / 350.0), 1e-7);
  // top_k = 2: the two most attended (2, 1) are both resident.
  EXPECT_DOUBLE_EQ(MeasureStep(shape, q, full, s, 2).value()[0].top_recall,
                   1.0);

  // S = {0, 1}: loss 3/6; top-2 = {2, 1}, one resident; p_S = (1/3, 2/3, 0):
  // diff = (1/6 - 1/3, 2/6 - 2/3, 1/2) = (-1/6, -2/6, 3/6), |diff|^2 = 14/36.
  s = {0, 1};
  h = MeasureStep(shape, q, full, s, 2).value()[0];
  EXPECT_NEAR(h.attention_loss, 0.5, 1e-7);
  EXPECT_DOUBLE_EQ(h.top_recall, 0.5);
  EXPECT_NEAR(h.output_error, 1.0, 1e-7);

  // S = {} : everything lost, the output is 0.
  h = MeasureStep(shape, q, full, {}).value()[0];
  EXPECT_DOUBLE_EQ(h.attention_loss, 1.0);
  EXPECT_DOUBLE_EQ(h.top_recall, 0.0);
  EXPECT_DOUBLE_EQ(h.output_error, 1.0);
}

TEST(MeasureStepTest, EvictingTheTopTokenLosesItsProbability) {
  for (uint32_t seed : {5u, 6u, 7u, 8u}) {
    const RandomCase c = MakeRandomCase(seed, {1, 1, 8}, 20, 6.0f);
    std::vector<double> p(c.tokens);
    ASSERT_TRUE(AttentionF64(c.shape, c.q, c.k, c.tokens, p).ok());
    const int64_t top = std::max_element(p.begin(), p.end()) - p.begin();
    std::vector<int64_t> s;
    for (int64_t j = 0; j < c.tokens; ++j) {
      if (j != top) s.push_back(j);
    }
    const HeadQuality h = MeasureStep(c.shape, c.q, c.cache(), s).value()[0];
    EXPECT_NEAR(h.attention_loss, p[top], 1e-12);
    EXPECT_DOUBLE_EQ(h.top_recall, 9.0 / 10);  // 10 of 20 tokens ranked
    EXPECT_GT(h.output_error, 0.0);
  }
}

// Query heads read the kv head of their group: evicting the token that kv
// head 0 makes dominant hurts query heads 0-1 only.
TEST(MeasureStepTest, GroupedQueryHeads) {
  const HeadShape shape{2, 4, 4};
  const std::vector<float> q = {8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0};
  // kv head 0: token 0 aligned; kv head 1: token 1 aligned.
  const std::vector<float> k = {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0};
  const std::vector<float> v = {1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0};
  const std::vector<int64_t> s = {1};
  const std::vector<HeadQuality> h =
      MeasureStep(shape, q, {k, v, 2}, s).value();
  const double big = std::exp(4.0) / (std::exp(4.0) + 1);  // logit 8 / 2
  EXPECT_NEAR(h[0].attention_loss, big, 1e-12);
  EXPECT_NEAR(h[1].attention_loss, big, 1e-12);
  EXPECT_NEAR(h[2].attention_loss, 1 - big, 1e-12);
  EXPECT_NEAR(h[3].attention_loss, 1 - big, 1e-12);
}

TEST(MeasureStepTest, RejectsBadInput) {
  const RandomCase c = MakeRandomCase(9, {2, 4, 8}, 5);
  auto code = [&](std::vector<int64_t> s, int32_t top_k = 10) {
    return MeasureStep(c.shape, c.q, c.cache(), s, top_k).status().code();
  };
  EXPECT_EQ(code({0, 1}), absl::StatusCode::kOk);
  EXPECT_EQ(code({0, 0}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({5}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({-1}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({0}, 0), absl::StatusCode::kInvalidArgument);
  const FullCache short_values{c.k, std::span<const float>(c.v).first(8), 5};
  EXPECT_EQ(MeasureStep(c.shape, c.q, short_values, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureStep({2, 3, 8}, c.q, c.cache(), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SurvivesTest, Membership) {
  const std::vector<int64_t> resident = {9, 3, 250, 4};
  const std::vector<int64_t> needles = {3, 5, 250};
  EXPECT_EQ(Survives(needles, resident),
            (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(Survives({}, resident).empty());
}

// --- Summaries ---------------------------------------------------------------

TEST(SummaryTest, NearestRankPercentile) {
  std::vector<double> x;
  for (int i = 20; i >= 1; --i) x.push_back(i);     // unsorted on purpose
  EXPECT_EQ(NearestRankPercentile(x, 0.95), 19.0);  // ceil(19.0) = 19th
  EXPECT_EQ(NearestRankPercentile(x, 0.5), 10.0);
  EXPECT_EQ(NearestRankPercentile(x, 1.0), 20.0);
  x.resize(10);                                     // 20..11
  EXPECT_EQ(NearestRankPercentile(x, 0.95), 20.0);  // ceil(9.5) = 10th
  EXPECT_EQ(NearestRankPercentile(std::vector<double>{7.0}, 0.95), 7.0);
  EXPECT_EQ(NearestRankPercentile({}, 0.95), 0.0);

  const std::vector<double> y = {0.5, 0.0, 1.0, 0.25};
  const Distribution d = Summarize(y);
  EXPECT_EQ(d.count, 4);
  EXPECT_DOUBLE_EQ(d.mean, 0.4375);
  EXPECT_EQ(d.p95, 1.0);  // ceil(3.8) = 4th
  EXPECT_EQ(d.max, 1.0);
  EXPECT_EQ(d.min, 0.0);
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(SummaryTest, AggregatorSummarisesEachMetric) {
  QualityAggregator agg;
  agg.Add(HeadQuality{0.1, 1.0, 0.01});
  const std::vector<HeadQuality> step = {{0.3, 0.5, 0.03}, {0.2, 0.9, 0.02}};
  agg.Add(step);
  EXPECT_EQ(agg.count(), 3);
  EXPECT_NEAR(agg.attention_loss().mean, 0.2, 1e-15);
  EXPECT_EQ(agg.attention_loss().p95, 0.3);
  EXPECT_EQ(agg.attention_loss().max, 0.3);
  EXPECT_NEAR(agg.top_recall().mean, 0.8, 1e-15);
  EXPECT_EQ(agg.top_recall().min, 0.5);
  EXPECT_EQ(agg.output_error().max, 0.03);
}

// --- The oracle --------------------------------------------------------------

TEST(OracleTest, TopByMassRanksByMassThenPosition) {
  const std::vector<double> mass = {0.5, 2.0, 0.5, 3.0, 0.0, 0.5};
  EXPECT_EQ(TopByMass(mass, 6, 2), (std::vector<int64_t>{1, 3}));
  // Ties at 0.5: the lower positions first.
  EXPECT_EQ(TopByMass(mass, 6, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  // Only what has arrived counts.
  EXPECT_EQ(TopByMass(mass, 3, 2), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(TopByMass(mass, 2, 5), (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(TopByMass(mass, 6, 0).empty());
}

TEST(OracleTest, OnlineCacheMatchesTopByMassAndNeverReadmits) {
  std::mt19937 rng(11);
  for (int round = 0; round < 20; ++round) {
    std::vector<double> mass(60);
    // Few distinct values, so ties are common.
    for (double& m : mass) m = static_cast<double>(rng() % 7);
    const int64_t budget = 1 + rng() % 15;
    OracleCache oracle(mass, budget);
    std::vector<bool> evicted(mass.size(), false);
    for (int64_t t = 0; t < static_cast<int64_t>(mass.size()); ++t) {
      const int64_t out = oracle.Admit();
      if (out >= 0) {
        ASSERT_FALSE(evicted[out]);
        evicted[out] = true;
      }
      const std::vector<int64_t> resident = oracle.Resident();
      ASSERT_EQ(resident, TopByMass(mass, t + 1, budget)) << "t=" << t;
      for (int64_t p : resident) ASSERT_FALSE(evicted[p]);
    }
    EXPECT_EQ(oracle.Admit(), -1);  // nothing left to arrive
    EXPECT_EQ(oracle.arrived(), 60);
  }
}

// Over a fixed set of tokens and several future queries, the oracle's set
// (top `budget` by future mass) has the least total attention loss of all
// sets of its size; and no set beats BestPossibleLoss at any step.
TEST(OracleTest, NoSetOfTheSameSizeLosesLess) {
  const HeadShape shape{2, 4, 8};
  const int64_t n = 9;
  const int32_t steps = 6;
  for (uint32_t seed : {21u, 22u, 23u, 24u, 25u}) {
    const RandomCase c = MakeRandomCase(seed, shape, n);
    std::mt19937 rng(seed * 7 + 1);
    std::vector<std::vector<float>> queries;
    for (int32_t s = 0; s < steps; ++s) {
      queries.push_back(
          RandomFloats(rng, shape.query_heads * shape.head_dim, 4.0f));
    }
    std::vector<double> mass(n, 0.0);
    std::vector<std::vector<double>> step_mass(steps,
                                               std::vector<double>(n, 0.0));
    for (int32_t s = 0; s < steps; ++s) {
      ASSERT_TRUE(
          AccumulateAttention(shape, queries[s], c.k, n, step_mass[s]).ok());
      for (int64_t j = 0; j < n; ++j) mass[j] += step_mass[s][j];
    }
    auto total_loss = [&](const std::vector<int64_t>& set) {
      double sum = 0;
      for (int32_t s = 0; s < steps; ++s) {
        const std::vector<HeadQuality> heads =
            MeasureStep(shape, queries[s], c.cache(), set).value();
        for (const HeadQuality& h : heads) sum += h.attention_loss;
      }
      return sum;
    };
    for (int64_t budget : {1, 3, 5}) {
      const double oracle = total_loss(TopByMass(mass, n, budget));
      int64_t sets = 0;
      for (uint32_t bits = 0; bits < (1u << n); ++bits) {
        if (std::popcount(bits) != budget) continue;
        std::vector<int64_t> set;
        for (int64_t j = 0; j < n; ++j) {
          if (bits >> j & 1) set.push_back(j);
        }
        ++sets;
        EXPECT_LE(oracle, total_loss(set) + 1e-12);
        for (int32_t s = 0; s < steps; ++s) {
          const std::vector<HeadQuality> heads =
              MeasureStep(shape, queries[s], c.cache(), set).value();
          double mean = 0;
          for (const HeadQuality& h : heads) {
            mean += h.attention_loss / shape.query_heads;
          }
          EXPECT_GE(mean + 1e-12,
                    BestPossibleLoss(step_mass[s], shape.query_heads, budget));
        }
      }
      EXPECT_GT(sets, 8);
    }
  }
}

TEST(OracleTest, FutureMassOfAWorkload) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kNeedleOnce);
  spec.num_layers = 1;
  spec.prompt_tokens = 200;
  spec.decode_steps = 40;
  const Workload w = Workload::Create(spec).value();
  const std::vector<double> mass = FutureAttentionMass(w, 0).value();
  ASSERT_EQ(static_cast<int64_t>(mass.size()), w.total_tokens());
  // Each decode query spreads one unit per query head.
  double total = 0;
  for (double m : mass) total += m;
  EXPECT_NEAR(total, 40.0 * spec.query_heads, 1e-9);
  // The same as accumulating step by step by hand.
  const LayerStream s = w.Materialize(0, w.total_tokens()).value();
  const HeadShape sh = w.shape();
  const size_t qn = sh.query_heads * sh.head_dim,
               kn = sh.kv_heads * sh.head_dim;
  std::vector<double> by_hand(w.total_tokens(), 0.0);
  for (int64_t t = 200; t < w.total_tokens(); ++t) {
    ASSERT_TRUE(
        AccumulateAttention(sh, std::span<const float>(s.q).subspan(t * qn, qn),
                            std::span<const float>(s.k).first((t + 1) * kn),
                            t + 1, by_hand)
            .ok());
  }
  EXPECT_EQ(mass, by_hand);
  // At a 20% budget the online oracle holds the needle from its arrival to
  // the end: its single question outweighs any ordinary token's future.
  const int64_t needle = w.needles()[0].position;
  OracleCache oracle(mass, w.total_tokens() / 5);
  for (int64_t t = 0; t < w.total_tokens(); ++t) {
    oracle.Admit();
    if (t >= needle) {
      const std::vector<int64_t> r = oracle.Resident();
      ASSERT_TRUE(std::binary_search(r.begin(), r.end(), needle)) << t;
    }
  }
  // from_token = 0 counts the prompt's queries too.
  const std::vector<double> all = FutureAttentionMass(w, 0, 0).value();
  double all_total = 0;
  for (double m : all) all_total += m;
  EXPECT_NEAR(all_total, 240.0 * spec.query_heads, 1e-9);
}

TEST(OracleTest, ConsumeEvictsByRemainingMass) {
  // Total future mass 4, 3, 2: the static oracle keeps 0 and 1.
  OracleCache fixed({4, 3, 2}, 2);
  EXPECT_EQ(fixed.Admit(), -1);
  EXPECT_EQ(fixed.Admit(), -1);
  EXPECT_EQ(fixed.Admit(), 2);
  EXPECT_EQ(fixed.Resident(), (std::vector<int64_t>{0, 1}));
  // Once a step has paid token 0 all its mass, it is the one to go.
  OracleCache belady({4, 3, 2}, 2);
  belady.Admit();
  belady.Admit();
  const std::vector<double> step = {4.0, 0.5};
  ASSERT_TRUE(belady.Consume(step).ok());
  EXPECT_DOUBLE_EQ(belady.remaining(0), 0.0);
  EXPECT_DOUBLE_EQ(belady.remaining(1), 2.5);
  EXPECT_EQ(belady.Admit(), 0);
  EXPECT_EQ(belady.Resident(), (std::vector<int64_t>{1, 2}));
  const std::vector<double> too_long = {0, 0, 0, 0};
  EXPECT_EQ(belady.Consume(too_long).code(),
            absl::StatusCode::kInvalidArgument);
}

// Decode a needle_once workload at a 12.5% budget with the Belady oracle:
// it holds the needle when its question comes, never loses less than the
// per-step bound, and (on this workload) loses less than a window and than
// sinks + window.
TEST(OracleTest, BeladyOracleOnANeedleWorkload) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kNeedleOnce);
  spec.num_layers = 1;
  const Workload w = Workload::Create(spec).value();
  const HeadShape sh = w.shape();
  const int64_t total = w.total_tokens();
  const int64_t budget = spec.prompt_tokens / 8;
  const LayerStream s = w.Materialize(0, total).value();
  const size_t qn = sh.query_heads * sh.head_dim;
  const size_t kn = sh.kv_heads * sh.head_dim;
  OracleCache oracle(FutureAttentionMass(w, 0).value(), budget);
  const Needle& needle = w.needles()[0];
  QualityAggregator by_oracle, by_window, by_sinks_window;
  for (int64_t t = 0; t < total; ++t) {
    oracle.Admit();
    if (t < spec.prompt_tokens) continue;
    const std::span<const float> q =
        std::span<const float>(s.q).subspan(t * qn, qn);
    const FullCache full{std::span<const float>(s.k).first((t + 1) * kn),
                         std::span<const float>(s.v).first((t + 1) * kn),
                         t + 1};
    const std::vector<int64_t> resident = oracle.Resident();
    if (t == needle.query_tokens[0]) {
      EXPECT_TRUE(Survives(std::vector<int64_t>{needle.position}, resident)[0]);
    }
    const std::vector<HeadQuality> got =
        MeasureStep(sh, q, full, resident).value();
    by_oracle.Add(got);
    std::vector<double> step(t + 1, 0.0);
    ASSERT_TRUE(AccumulateAttention(sh, q, full.keys, t + 1, step).ok());
    double mean = 0;
    for (const HeadQuality& h : got) mean += h.attention_loss / sh.query_heads;
    EXPECT_GE(mean + 1e-12, BestPossibleLoss(step, sh.query_heads, budget));
    ASSERT_TRUE(oracle.Consume(step).ok());

    std::vector<int64_t> window, sinks_window = {0, 1, 2, 3};
    for (int64_t j = t + 1 - budget; j <= t; ++j) window.push_back(j);
    for (int64_t j = t + 1 - (budget - 4); j <= t; ++j) {
      sinks_window.push_back(j);
    }
    by_window.Add(MeasureStep(sh, q, full, window).value());
    by_sinks_window.Add(MeasureStep(sh, q, full, sinks_window).value());
  }
  EXPECT_LT(by_oracle.attention_loss().mean, by_window.attention_loss().mean);
  EXPECT_LT(by_oracle.attention_loss().mean,
            by_sinks_window.attention_loss().mean);
}

}  // namespace
}  // namespace kvkeep::workers
