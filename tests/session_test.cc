// Session semantics through the CacheStore API beyond the single policies
// (session_policy_test.cc): query scoring against probabilities the test
// computes itself, block tables and versions, settle on append, pyramid
// budgets, and invariants and determinism over random streams. Every layout
// here is tiny so each expected result can be worked out by hand.
#include "cache_store/session.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/cache_store_harness.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

using store_testing::Concat;
using store_testing::Harness;
using store_testing::MakeLayout;
using store_testing::Range;
using test_data::Noise;
using test_data::TokenBytes;

// ---------------------------------------------------------------------------
// Query scoring: the store's softmax(q K^T / sqrt(d)) against probabilities
// the test computes in double from the stored keys.

// Query heads for one (session step, row), [query_heads][head_dim].
std::vector<float> QueryRow(const ModelLayout& l, int64_t step, int32_t row) {
  std::vector<float> q(int64_t{l.query_heads} * l.head_dim);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = static_cast<float>(6.0 * Noise(11, static_cast<uint64_t>(step),
                                          static_cast<uint64_t>(row), i));
  }
  return q;
}

// Summed-over-heads causal attention of `queries` ([rows][qh][d]) whose rows
// belong to positions row_positions, over the keys of a layer, in double.
std::vector<float> ReferenceAttention(
    const ModelLayout& l, const LayerKvCopy& kv,
    const std::vector<float>& queries,
    const std::vector<int64_t>& row_positions) {
  const int64_t n = static_cast<int64_t>(kv.positions.size());
  const int32_t d = l.head_dim;
  const int32_t group = l.query_heads / l.kv_heads;
  const int32_t rows = static_cast<int32_t>(row_positions.size());
  std::vector<float> out(rows * n, 0.0f);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<double> sum(n, 0.0);
    for (int32_t head = 0; head < l.query_heads; ++head) {
      const int32_t g = head / group;
      std::vector<double> logit(n);
      double mx = -INFINITY;
      for (int64_t s = 0; s < n; ++s) {
        if (kv.positions[s] > row_positions[r]) continue;
        double dot = 0;
        for (int32_t i = 0; i < d; ++i) {
          const double q = queries[(int64_t{r} * l.query_heads + head) * d + i];
          const double k = LoadAsFloat(l.dtype, kv.keys.data(),
                                       (s * l.kv_heads + g) * int64_t{d} + i);
          dot += q * k;
        }
        logit[s] = dot / std::sqrt(static_cast<double>(d));
        mx = std::max(mx, logit[s]);
      }
      double denom = 0;
      for (int64_t s = 0; s < n; ++s) {
        if (kv.positions[s] <= row_positions[r])
          denom += std::exp(logit[s] - mx);
      }
      for (int64_t s = 0; s < n; ++s) {
        if (kv.positions[s] <= row_positions[r]) {
          sum[s] += std::exp(logit[s] - mx) / denom;
        }
      }
    }
    for (int64_t s = 0; s < n; ++s) out[r * n + s] = static_cast<float>(sum[s]);
  }
  return out;
}

// (dtype, policy): h2o accumulates, so its victims also depend on age; tova
// judges each step's attention alone, so its victims depend on the values.
class QueryScoringTest
    : public ::testing::TestWithParam<std::tuple<DType, std::string>> {};

TEST_P(QueryScoringTest, QueriesEvictLikeTheEquivalentProbabilities) {
  const auto& [dtype, policy] = GetParam();
  const bool accumulates = policy == "h2o";
  constexpr int32_t kLayers = 2;
  constexpr int64_t kBudget = 10;
  constexpr int64_t kSinks = 1;
  constexpr int64_t kRecent = 2;
  constexpr int64_t kPrompt = 14;  // longer than the budget
  constexpr int64_t kDecode = 30;
  // GQA: 8 query heads over 2 kv heads.
  const ModelLayout layout = MakeLayout("q", kLayers, 4, 2, 8, 16, dtype);
  Harness h({layout});
  const std::map<std::string, std::string> params = {{"sinks", "1"},
                                                     {"recent", "2"}};
  KV_ASSIGN_OR_FAIL(SessionId by_queries, h.Open("q", policy, params, kBudget));
  KV_ASSIGN_OR_FAIL(SessionId by_probs, h.Open("q", policy, params, kBudget));
  // The policy's score per position, in double, from what the test sent
  // session by_probs: to check that the stream has a clear gap at every cut.
  std::vector<std::map<int64_t, double>> score(kLayers);
  int64_t evictions = 0;

  int64_t next = 0;
  for (int64_t step = 0; step <= kDecode; ++step) {
    const int64_t n_new = step == 0 ? kPrompt : 1;
    std::vector<int64_t> row_positions = Range(next, next + n_new);
    next += n_new;
    KV_ASSERT_OK(h.Append(by_queries, row_positions));
    KV_ASSERT_OK(h.Append(by_probs, row_positions));
    std::vector<float> queries;
    for (int32_t r = 0; r < n_new; ++r) {
      const std::vector<float> q = QueryRow(layout, step, r);
      queries.insert(queries.end(), q.begin(), q.end());
    }
    std::vector<LayerScores> q_scores, p_scores;
    std::vector<std::vector<float>> probs(kLayers);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable qt,
                        h.store().GetBlockTable(by_queries, layer));
      KV_ASSIGN_OR_FAIL(LayerKvCopy kv, h.store().ReadLayer(by_probs, layer));
      probs[layer] = ReferenceAttention(layout, kv, queries, row_positions);
      const int64_t n = static_cast<int64_t>(kv.positions.size());
      for (int64_t s = 0; s < n; ++s) {
        double& sc = score[layer][kv.positions[s]];
        if (!accumulates) sc = 0;
        for (int32_t r = accumulates ? 0 : n_new - 1; r < n_new; ++r) {
          sc += probs[layer][r * n + s];
        }
      }
      q_scores.push_back(LayerScores{layer, qt.version, ScoreSource::kQueries,
                                     static_cast<int32_t>(n_new), queries});
      p_scores.push_back(LayerScores{layer, kv.version, ScoreSource::kReduced,
                                     static_cast<int32_t>(n_new),
                                     probs[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult rq,
                      h.store().UpdateScores(by_queries, q_scores));
    KV_ASSIGN_OR_FAIL(StepResult rp,
                      h.store().UpdateScores(by_probs, p_scores));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const std::vector<int64_t>& evicted = rp.layers[layer].evicted_positions;
      EXPECT_EQ(rq.layers[layer].evicted_positions, evicted)
          << "layer " << layer << " step " << step;
      if (evicted.empty()) continue;
      ++evictions;
      // A clear gap between the evicted and the kept unprotected tokens.
      double evicted_max = -1, kept_min = 1e9;
      for (const auto& [pos, sc] : score[layer]) {
        const bool is_evicted =
            std::find(evicted.begin(), evicted.end(), pos) != evicted.end();
        if (is_evicted) {
          evicted_max = std::max(evicted_max, sc);
        } else if (pos >= kSinks && pos < next - kRecent) {
          kept_min = std::min(kept_min, sc);
        }
      }
      ASSERT_GT(kept_min - evicted_max, 1e-4)
          << "near-tie in the test's stream at step " << step
          << "; the comparison would be meaningless";
      for (int64_t pos : evicted) score[layer].erase(pos);
    }
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(h.Resident(by_queries, layer), h.Resident(by_probs, layer));
    }
  }
  EXPECT_GE(evictions, kLayers * kDecode);
  // The scores themselves agree, not only the victims they picked.
  KV_ASSIGN_OR_FAIL(SessionStats sq, h.store().GetStats(by_queries));
  KV_ASSIGN_OR_FAIL(SessionStats sp, h.store().GetStats(by_probs));
  EXPECT_EQ(sq.evicted_tokens, sp.evicted_tokens);
  EXPECT_NEAR(sq.evicted_score, sp.evicted_score, 1e-4 * sp.evicted_score);
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndPolicies, QueryScoringTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16,
                                         DType::kBF16),
                       ::testing::Values("h2o", "tova")),
    [](const ::testing::TestParamInfo<std::tuple<DType, std::string>>& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_" +
             std::get<1>(info.param);
    });

TEST(QueryScoring, RefusesQueriesWhoseTokensWereEvicted) {
  // TOVA may evict the newest token; its query cannot be scored afterwards.
  const ModelLayout layout = MakeLayout("q", 1, 2);
  Harness h({layout});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("q", "tova", {}, 2));
  KV_ASSERT_OK(h.AppendRange(id, 0, 3));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, .5f}, {1, .5f}}));  // evicts p2
  ASSERT_THAT(h.Resident(id, 0), ElementsAre(0, 1));
  KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, 0));
  const std::vector<float> q = QueryRow(layout, 0, 0);
  LayerScores s{0, t.version, ScoreSource::kQueries, 1, q};
  absl::StatusOr<StepResult> r = h.store().UpdateScores(id, std::span(&s, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("resident"));
}

// ---------------------------------------------------------------------------
// Block tables, versions and the change a worker follows.

// A worker's copy of one layer's block table.
struct Mirror {
  std::vector<PageId> pages;
  std::vector<int64_t> positions;
};

// Follows a change in the one order session_types.h gives a worker:
//   1. apply the moves in order;
//   2. keep slots [0, resident - k), k = this call's new tokens (`appended`)
//      not in evicted_positions, and drop pages_freed from the end;
//   3. append pages_added, and the k kept new tokens in position order.
void Follow(Mirror& m, const LayerChange& c,
            const std::vector<int64_t>& appended) {
  for (const SlotMove& move : c.moves) {
    ASSERT_LT(static_cast<size_t>(move.from_slot), m.positions.size());
    ASSERT_LT(static_cast<size_t>(move.to_slot), m.positions.size());
    m.positions[move.to_slot] = m.positions[move.from_slot];
  }
  std::vector<int64_t> kept_new;
  for (int64_t p : appended) {
    if (!std::binary_search(c.evicted_positions.begin(),
                            c.evicted_positions.end(), p)) {
      kept_new.push_back(p);
    }
  }
  const int64_t keep = c.resident - static_cast<int64_t>(kept_new.size());
  ASSERT_GE(keep, 0);
  ASSERT_LE(static_cast<size_t>(keep), m.positions.size());
  m.positions.resize(keep);
  ASSERT_LE(c.pages_freed.size(), m.pages.size());
  EXPECT_TRUE(std::equal(c.pages_freed.begin(), c.pages_freed.end(),
                         m.pages.end() - c.pages_freed.size()))
      << "pages_freed are not the last pages of the block table";
  m.pages.resize(m.pages.size() - c.pages_freed.size());
  m.pages.insert(m.pages.end(), c.pages_added.begin(), c.pages_added.end());
  m.positions.insert(m.positions.end(), kept_new.begin(), kept_new.end());
}

// Everything the store says about a layer agrees with itself and the mirror.
void CheckLayer(Harness& h, SessionId id, int32_t layer, const Mirror& m) {
  const ModelLayout& l = h.layout("b");
  absl::StatusOr<BlockTable> t = h.store().GetBlockTable(id, layer);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<LayerKvCopy> kv = h.store().ReadLayer(id, layer);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(t->layer, layer);
  EXPECT_EQ(t->page_tokens, l.page_tokens);
  EXPECT_EQ(t->positions, m.positions);
  EXPECT_EQ(t->pages, m.pages);
  EXPECT_EQ(kv->positions, t->positions);
  EXPECT_EQ(kv->version, t->version);
  const int64_t n = static_cast<int64_t>(t->positions.size());
  EXPECT_EQ(static_cast<int64_t>(t->pages.size()),
            (n + l.page_tokens - 1) / l.page_tokens);
  // cache_positions: rank by position.
  std::vector<int64_t> sorted = t->positions;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(t->cache_positions.size(), t->positions.size());
  for (int64_t s = 0; s < n; ++s) {
    const int64_t rank =
        std::lower_bound(sorted.begin(), sorted.end(), t->positions[s]) -
        sorted.begin();
    EXPECT_EQ(t->cache_positions[s], rank) << "slot " << s;
  }
  // Each slot holds exactly the bytes appended with its position.
  EXPECT_EQ(kv->keys, TokenBytes(l, layer, kv->positions, false));
  EXPECT_EQ(kv->values, TokenBytes(l, layer, kv->positions, true));
}

// Over every attention-driven policy (h2o_page evicts whole pages, so its
// settles and updates may evict more than asked).
class BlockTableTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BlockTableTest, FollowsEveryStepAndVersionsBumpOnlyOnChange) {
  constexpr int32_t kLayers = 2;
  const bool by_page = GetParam() == "h2o_page";
  Harness h({MakeLayout("b", kLayers, 3, 2, 2, 4, DType::kF16)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("b", GetParam(), {{"sinks", "1"}, {"recent", "2"}, {"slack", "2"}},
             8));
  std::vector<Mirror> mirror(kLayers);
  std::vector<uint64_t> version(kLayers, 1);
  int64_t quiet_updates = 0, evicting_updates = 0;
  int64_t next = 0;
  for (int64_t step = 0; step < 40; ++step) {
    // Mostly decode tokens, sometimes a chunk of 3.
    const int64_t n_new = step % 7 == 0 ? 3 : 1;
    const std::vector<int64_t> positions = Range(next, next + n_new);
    next += n_new + (step % 5 == 0 ? 2 : 0);  // gaps in positions are fine
    KV_ASSIGN_OR_FAIL(StepResult a, h.Append(id, positions));
    ASSERT_EQ(a.layers.size(), static_cast<size_t>(kLayers));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const LayerChange& c = a.layers[layer];
      EXPECT_EQ(c.layer, layer);
      // An append bumps the version once, a settle eviction once more.
      EXPECT_EQ(c.version,
                version[layer] + 1 + (c.evicted_positions.empty() ? 0 : 1));
      version[layer] = c.version;
      Follow(mirror[layer], c, positions);
      CheckLayer(h, id, layer, mirror[layer]);
    }
    // Every other step, scores for both layers (the others leave the layers
    // over budget, for the next append to settle).
    if (step % 2 == 1) continue;
    std::vector<LayerScores> scores;
    std::vector<std::vector<float>> rows(kLayers);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, layer));
      const int64_t n = static_cast<int64_t>(t.positions.size());
      for (int64_t s = 0; s < n; ++s) {
        rows[layer].push_back(static_cast<float>(
            (Noise(5, step, layer, static_cast<uint64_t>(t.positions[s])) +
             1.0) /
            (2.0 * static_cast<double>(n))));
      }
      scores.push_back(
          LayerScores{layer, t.version, ScoreSource::kReduced, 1, rows[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult u, h.store().UpdateScores(id, scores));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const LayerChange& c = u.layers[layer];
      EXPECT_TRUE(c.pages_added.empty());
      if (c.evicted_positions.empty()) {
        ++quiet_updates;
        EXPECT_EQ(c.version, version[layer]) << "no change, no new version";
        EXPECT_TRUE(c.moves.empty());
      } else {
        ++evicting_updates;
        EXPECT_EQ(c.version, version[layer] + 1);
        if (by_page) {
          EXPECT_LE(c.resident, 8 - 2);
        } else {
          EXPECT_EQ(c.resident, 8 - 2);
        }
      }
      version[layer] = c.version;
      Follow(mirror[layer], c, {});
      CheckLayer(h, id, layer, mirror[layer]);
    }
  }
  EXPECT_GT(quiet_updates, 0);
  EXPECT_GT(evicting_updates, 0);
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  EXPECT_EQ(stats.layer_version, version);
  // Every page of either layer is distinct and accounted for.
  std::set<PageId> pages;
  for (const Mirror& m : mirror) pages.insert(m.pages.begin(), m.pages.end());
  EXPECT_EQ(static_cast<int64_t>(pages.size()), stats.pages);
  EXPECT_EQ(h.Pool("b").used_pages, stats.pages);
}

INSTANTIATE_TEST_SUITE_P(Policies, BlockTableTest,
                         ::testing::Values("h2o", "tova", "scissorhands",
                                           "h2o_page"));

// Appends that window and streaming_llm answer with evictions, including
// chunks longer than the budget whose oldest tokens are evicted on arrival:
// the one documented order gives the store's own block table.
TEST(BlockTable, RecencyAppendChangesAreFollowableByAWorker) {
  for (const auto& [policy, params] :
       std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
           {"window", {}},
           {"window", {{"slack", "3"}}},
           {"streaming_llm", {{"sinks", "3"}}},
           {"streaming_llm",
            {{"sinks", "2"}, {"recent", "2"}, {"slack", "1"}}}}) {
    SCOPED_TRACE(policy + " " + ::testing::PrintToString(params));
    Harness h({MakeLayout("b", 1, 2)});
    KV_ASSIGN_OR_FAIL(SessionId id, h.Open("b", policy, params, 6));
    Mirror m;
    int64_t next = 0;
    for (int64_t step = 0; step < 14; ++step) {
      // Chunks of 1..8 tokens: some longer than the budget.
      const int64_t n = 1 + (step * 5) % 8;
      const std::vector<int64_t> positions = Range(next, next + n);
      next += n;
      KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, positions));
      const LayerChange& c = r.layers[0];
      EXPECT_LE(c.resident, 6);
      Follow(m, c, positions);
      KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, 0));
      EXPECT_EQ(m.positions, t.positions) << "step " << step;
      EXPECT_EQ(m.pages, t.pages) << "step " << step;
      // No page is held beyond ceil(resident / page_tokens).
      EXPECT_EQ(h.Pool("b").used_pages, (c.resident + 1) / 2);
      KV_ASSIGN_OR_FAIL(LayerKvCopy kv, h.store().ReadLayer(id, 0));
      EXPECT_EQ(kv.keys, TokenBytes(h.layout("b"), 0, t.positions, false));
      EXPECT_EQ(kv.values, TokenBytes(h.layout("b"), 0, t.positions, true));
    }
  }
}

TEST(BlockTable, CachePositionsAreTheRankByPosition) {
  Harness h({MakeLayout("b", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("b", "h2o", {}, 4));
  KV_ASSERT_OK(h.Append(id, {10, 20, 30, 40, 50, 60}));
  // Evict p10 and p30: slots 4 (p50) and 5 (p60) fill holes 0 and 2.
  KV_ASSIGN_OR_FAIL(
      StepResult r,
      h.Attend(id, 0, {{20, .2f}, {40, .2f}, {50, .2f}, {60, .2f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(10, 30));
  EXPECT_THAT(r.layers[0].moves, ElementsAre(SlotMove{4, 0}, SlotMove{5, 2}));
  KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, 0));
  EXPECT_THAT(t.positions, ElementsAre(50, 20, 60, 40));
  EXPECT_THAT(t.cache_positions, ElementsAre(2, 0, 3, 1));
  EXPECT_EQ(t.pages.size(), 2u);
  KV_ASSIGN_OR_FAIL(LayerKvCopy kv, h.store().ReadLayer(id, 0));
  EXPECT_EQ(kv.positions, t.positions);
  EXPECT_EQ(kv.keys, TokenBytes(h.layout("b"), 0, t.positions, false));
}

// ---------------------------------------------------------------------------
// Settle on append

TEST(SettleOnAppend, AnH2OLayerOverBudgetEvictsAtTheNextAppend) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "h2o", {}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 3));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, .1f}, {1, .6f}, {2, .3f}}));
  KV_ASSERT_OK(h.Attend(id, 1, {{0, .6f}, {1, .1f}, {2, .3f}}));
  // Two more without scores: 5 resident, over the budget of 4.
  KV_ASSIGN_OR_FAIL(StepResult first, h.AppendRange(id, 3, 2));
  for (const LayerChange& c : first.layers) {
    EXPECT_THAT(c.evicted_positions, IsEmpty());
    EXPECT_EQ(c.resident, 5);
  }
  EXPECT_EQ(h.Pool("l").used_pages, 6);
  // The next append first settles each layer down to 4 with the scores it
  // has (layer 0: p3, p4 tie at 0, the older goes; layer 1 the same), then
  // appends.
  KV_ASSIGN_OR_FAIL(StepResult second, h.Append(id, {5}));
  for (const LayerChange& c : second.layers) {
    EXPECT_THAT(c.evicted_positions, ElementsAre(3)) << "layer " << c.layer;
    EXPECT_EQ(c.resident, 5);
  }
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 1, 2, 4, 5));
  // Still over budget (5 > 4): the next append settles again. p4 and p5
  // tie at 0, below every scored token, and the older p4 goes.
  KV_ASSIGN_OR_FAIL(StepResult third, h.Append(id, {6}));
  EXPECT_THAT(third.layers[0].evicted_positions, ElementsAre(4));
  EXPECT_THAT(third.layers[1].evicted_positions, ElementsAre(4));
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  EXPECT_EQ(stats.evicted_tokens, 4);
  EXPECT_THAT(stats.layer_resident, ElementsAre(5, 5));
  EXPECT_EQ(h.Pool("l").used_pages, 6);
}

// ---------------------------------------------------------------------------
// Pyramid budgets

TEST(PyramidBudgets, DecreaseAcrossLayersAndHold) {
  constexpr int32_t kLayers = 4;
  Harness h({MakeLayout("p", kLayers, 4)});
  SessionSpec spec;
  spec.layout = "p";
  spec.policy = PolicySpec{"h2o", {{"sinks", "1"}, {"recent", "2"}}};
  spec.budget.tokens = 20;
  spec.budget.schedule = "pyramid";
  spec.budget.pyramid_beta = 2;
  KV_ASSIGN_OR_FAIL(SessionId id, h.store().CreateSession(spec));
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  // free = 20 - 3 = 17, lo = 8, hi = 26, step = 6: 29, 23, 17, 11.
  EXPECT_THAT(stats.layer_budget, ElementsAre(29, 23, 17, 11));
  for (int64_t pos = 0; pos < 50; ++pos) {
    KV_ASSERT_OK(h.Append(id, {pos}));
    std::vector<LayerScores> scores;
    std::vector<std::vector<float>> rows(kLayers);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, layer));
      const int64_t n = static_cast<int64_t>(t.positions.size());
      for (int64_t s = 0; s < n; ++s) {
        rows[layer].push_back(static_cast<float>(
            (Noise(9, pos, layer, static_cast<uint64_t>(t.positions[s])) + 1) /
            (2.0 * static_cast<double>(n))));
      }
      scores.push_back(
          LayerScores{layer, t.version, ScoreSource::kReduced, 1, rows[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult r, h.store().UpdateScores(id, scores));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(r.layers[layer].resident,
                std::min<int64_t>(pos + 1, stats.layer_budget[layer]))
          << "layer " << layer << " after " << pos;
    }
  }
  KV_ASSIGN_OR_FAIL(SessionStats after, h.store().GetStats(id));
  EXPECT_THAT(after.layer_resident, ElementsAre(29, 23, 17, 11));
  EXPECT_EQ(after.resident_tokens, 80);
}

TEST(PyramidBudgets, ExplicitPerLayerBudgetsOverrideTheSchedule) {
  Harness h({MakeLayout("p", 3, 4)});
  SessionSpec spec;
  spec.layout = "p";
  spec.policy = PolicySpec{"window", {}};
  spec.budget.per_layer = {5, 3, 4};
  spec.budget.schedule = "pyramid";
  KV_ASSIGN_OR_FAIL(SessionId id, h.store().CreateSession(spec));
  KV_ASSERT_OK(h.AppendRange(id, 0, 10));
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  EXPECT_THAT(stats.layer_budget, ElementsAre(5, 3, 4));
  EXPECT_THAT(stats.layer_resident, ElementsAre(5, 3, 4));
  EXPECT_THAT(h.Resident(id, 1), ElementsAre(7, 8, 9));
}

// ---------------------------------------------------------------------------
// Invariants over random streams, for every attention-driven policy: budget
// never exceeded after an update, protected tokens never evicted, the same
// input gives the same result.

class AttentionPolicyInvariants : public ::testing::TestWithParam<std::string> {
};

TEST_P(AttentionPolicyInvariants, HoldOverARandomStream) {
  constexpr int64_t kBudget = 12;
  constexpr int64_t kSinks = 2;
  constexpr int64_t kRecent = 3;
  Harness h({MakeLayout("r", 2, 3, 1, 2, 4, DType::kBF16)});
  const std::map<std::string, std::string> params = {
      {"sinks", std::to_string(kSinks)},
      {"recent", std::to_string(kRecent)},
      {"slack", "1"}};
  KV_ASSIGN_OR_FAIL(SessionId a, h.Open("r", GetParam(), params, kBudget));
  KV_ASSIGN_OR_FAIL(SessionId b, h.Open("r", GetParam(), params, kBudget));
  for (int64_t pos = 0; pos < 80; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult ra, h.Append(a, {pos}));
    KV_ASSIGN_OR_FAIL(StepResult rb, h.Append(b, {pos}));
    ASSERT_EQ(ra.layers[0].evicted_positions, rb.layers[0].evicted_positions);
    std::vector<LayerScores> scores;
    std::vector<std::vector<float>> probs(2);
    for (int32_t layer = 0; layer < 2; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(a, layer));
      const int64_t n = static_cast<int64_t>(t.positions.size());
      for (int32_t head = 0; head < 2; ++head) {
        std::vector<double> w(n);
        double total = 0;
        for (int64_t s = 0; s < n; ++s) {
          // Coarse values make exact ties common: the tie rule is exercised.
          w[s] = std::floor((Noise(3, pos, layer * 2 + head,
                                   static_cast<uint64_t>(t.positions[s])) +
                             1) *
                            2);
          total += w[s];
        }
        for (int64_t s = 0; s < n; ++s) {
          probs[layer].push_back(total == 0 ? 0.0f
                                            : static_cast<float>(w[s] / total));
        }
      }
      scores.push_back(LayerScores{layer, t.version, ScoreSource::kPerHead, 1,
                                   probs[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult ua, h.store().UpdateScores(a, scores));
    KV_ASSIGN_OR_FAIL(StepResult ub, h.store().UpdateScores(b, scores));
    for (int32_t layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(ua.layers[layer].evicted_positions,
                ub.layers[layer].evicted_positions);
      EXPECT_EQ(ua.layers[layer].moves, ub.layers[layer].moves);
      EXPECT_LE(ua.layers[layer].resident, kBudget);
      for (int64_t p : ua.layers[layer].evicted_positions) {
        EXPECT_GE(p, kSinks) << "sink evicted";
        EXPECT_LT(p, pos + 1 - kRecent) << "recent token evicted";
      }
      if (pos >= kBudget) {
        EXPECT_GE(ua.layers[layer].resident, kBudget - 1 - 3);
      }
    }
  }
  for (int32_t layer = 0; layer < 2; ++layer) {
    const std::vector<int64_t> kept = h.Resident(a, layer);
    EXPECT_EQ(kept, h.Resident(b, layer));
    for (int64_t p : Concat(Range(0, kSinks), Range(80 - kRecent, 80))) {
      EXPECT_TRUE(std::binary_search(kept.begin(), kept.end(), p)) << p;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, AttentionPolicyInvariants,
                         ::testing::Values("h2o", "tova", "scissorhands",
                                           "h2o_page"));

}  // namespace
}  // namespace kvkeep
