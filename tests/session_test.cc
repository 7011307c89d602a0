// Session semantics through the CacheStore API: hand-computed cases for every
// eviction policy, the needle case, query scoring against probabilities the
// test computes itself, block tables and versions, settle on append, pyramid
// budgets, and determinism. Every layout here is tiny so each expected result
// can be worked out by hand (the comments show the arithmetic).
#include "cache_store/session.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ---------------------------------------------------------------------------
// Helpers.

ModelLayout MakeLayout(std::string name, int32_t layers, int32_t page_tokens,
                       DType dtype = DType::kF32, int32_t kv_heads = 1,
                       int32_t query_heads = 1, int32_t head_dim = 4) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = layers;
  l.kv_heads = kv_heads;
  l.query_heads = query_heads;
  l.head_dim = head_dim;
  l.dtype = dtype;
  l.page_tokens = page_tokens;
  return l;
}

using ::kvkeep::test_data::Noise;
using ::kvkeep::test_data::TokenBytes;

// One store and the helpers the tests drive it with.
class Harness {
 public:
  explicit Harness(std::vector<ModelLayout> layouts,
                   int64_t capacity_pages = 1024) {
    StoreOptions options;
    options.device = test_support::TestDevice();
    for (const ModelLayout& l : layouts) {
      options.pools.push_back(PoolSpec{l, capacity_pages});
      layouts_[l.name] = l;
    }
    absl::StatusOr<std::unique_ptr<CacheStore>> store =
        CacheStore::Create(options);
    if (!store.ok()) {
      ADD_FAILURE() << store.status();
      std::abort();
    }
    store_ = *std::move(store);
  }

  CacheStore& store() { return *store_; }
  const ModelLayout& layout(const std::string& name) {
    return layouts_.at(name);
  }

  absl::StatusOr<SessionId> Open(const std::string& layout,
                                 const std::string& policy,
                                 std::map<std::string, std::string> params,
                                 int64_t budget) {
    SessionSpec spec;
    spec.layout = layout;
    spec.policy = PolicySpec{policy, std::move(params)};
    spec.budget.tokens = budget;
    return store_->CreateSession(spec);
  }

  absl::StatusOr<StepResult> Append(SessionId id,
                                    std::vector<int64_t> positions) {
    absl::StatusOr<SessionStats> stats = store_->GetStats(id);
    if (!stats.ok()) return stats.status();
    const ModelLayout& l = layouts_.at(stats->layout);
    std::vector<std::vector<std::byte>> keys, values;
    std::vector<LayerKv> kv;
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      keys.push_back(TokenBytes(l, layer, positions, false));
      values.push_back(TokenBytes(l, layer, positions, true));
    }
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      kv.push_back(LayerKv{keys[layer], values[layer]});
    }
    return store_->Append(id, AppendRequest{positions, kv});
  }

  // Appends positions [first, first + n) in one call.
  absl::StatusOr<StepResult> AppendRange(SessionId id, int64_t first,
                                         int64_t n) {
    std::vector<int64_t> positions(n);
    for (int64_t i = 0; i < n; ++i) positions[i] = first + i;
    return Append(id, std::move(positions));
  }

  // Head-reduced attention rows, given by position (0 for every other
  // resident token), laid out in the layer's current slot order and sent at
  // its current version.
  absl::StatusOr<StepResult> AttendRows(
      SessionId id, int32_t layer,
      const std::vector<std::map<int64_t, float>>& rows) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
    if (!table.ok()) return table.status();
    std::vector<float> data;
    for (const auto& by_position : rows) {
      for (const auto& [pos, p] : by_position) {
        if (std::find(table->positions.begin(), table->positions.end(), pos) ==
            table->positions.end()) {
          ADD_FAILURE() << "test bug: position " << pos << " is not resident";
        }
      }
      for (int64_t pos : table->positions) {
        auto it = by_position.find(pos);
        data.push_back(it == by_position.end() ? 0.0f : it->second);
      }
    }
    LayerScores s;
    s.layer = layer;
    s.version = table->version;
    s.source = ScoreSource::kReduced;
    s.rows = static_cast<int32_t>(rows.size());
    s.data = data;
    return store_->UpdateScores(id, std::span<const LayerScores>(&s, 1));
  }
  absl::StatusOr<StepResult> Attend(
      SessionId id, int32_t layer,
      const std::map<int64_t, float>& by_position) {
    return AttendRows(id, layer, {by_position});
  }

  // The resident positions of a layer, ascending.
  std::vector<int64_t> Resident(SessionId id, int32_t layer) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
    EXPECT_TRUE(table.ok()) << table.status();
    if (!table.ok()) return {};
    std::vector<int64_t> p = table->positions;
    std::sort(p.begin(), p.end());
    return p;
  }

  int64_t UsedPages(const std::string& layout) {
    for (const LayoutStats& s : store_->Layouts()) {
      if (s.layout.name == layout) return s.pool.used_pages;
    }
    ADD_FAILURE() << "no layout " << layout;
    return -1;
  }

 private:
  std::map<std::string, ModelLayout> layouts_;
  std::unique_ptr<CacheStore> store_;
};

std::vector<int64_t> Range(int64_t first, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = first; i < end; ++i) v.push_back(i);
  return v;
}
std::vector<int64_t> Concat(std::vector<int64_t> a,
                            const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---------------------------------------------------------------------------
// window and streaming_llm

TEST(WindowPolicy, KeepsTheLastBudgetTokens) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "window", {}, 4));
  for (int64_t pos = 0; pos < 4; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    for (const LayerChange& c : r.layers) {
      EXPECT_THAT(c.evicted_positions, IsEmpty());
      EXPECT_EQ(c.resident, pos + 1);
    }
  }
  for (int64_t pos = 4; pos < 7; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    ASSERT_EQ(r.layers.size(), 2u);
    for (const LayerChange& c : r.layers) {
      EXPECT_THAT(c.evicted_positions, ElementsAre(pos - 4));
      EXPECT_EQ(c.resident, 4);
    }
  }
  // A chunk larger than the budget keeps only its own last 4 tokens.
  KV_ASSIGN_OR_FAIL(StepResult r, h.AppendRange(id, 10, 6));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(3, 4, 5, 6, 10, 11));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(12, 13, 14, 15));
  EXPECT_THAT(h.Resident(id, 1), ElementsAre(12, 13, 14, 15));
  // window does not take per-step attention.
  absl::StatusOr<StepResult> s = h.Attend(id, 0, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(WindowPolicy, SlackEvictsDownToBudgetMinusSlackThenWaits) {
  Harness h({MakeLayout("l", 1, 2)});
  // budget 6, slack 2: at 7 tokens evict 3 (down to 4), then 2 appends
  // without eviction (5, 6 resident), then again 3 at the 7th.
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "window", {{"slack", "2"}}, 6));
  std::vector<std::vector<int64_t>> evicted;
  std::vector<int64_t> resident;
  for (int64_t pos = 0; pos < 13; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    evicted.push_back(r.layers[0].evicted_positions);
    resident.push_back(r.layers[0].resident);
  }
  EXPECT_THAT(resident, ElementsAre(1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6, 4));
  for (int64_t pos : {0, 1, 2, 3, 4, 5, 7, 8, 10, 11}) {
    EXPECT_THAT(evicted[pos], IsEmpty()) << "append of " << pos;
  }
  EXPECT_THAT(evicted[6], ElementsAre(0, 1, 2));
  EXPECT_THAT(evicted[9], ElementsAre(3, 4, 5));
  EXPECT_THAT(evicted[12], ElementsAre(6, 7, 8));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(9, 10, 11, 12));
}

TEST(StreamingLlmPolicy, KeepsSinksAndTheMostRecent) {
  Harness h({MakeLayout("l", 1, 4)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "streaming_llm", {{"sinks", "2"}}, 5));
  KV_ASSERT_OK(h.AppendRange(id, 0, 5));
  for (int64_t pos = 5; pos < 9; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    // The oldest token after the two sinks goes.
    EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(pos - 3));
  }
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 1, 6, 7, 8));
}

TEST(StreamingLlmPolicy, DefaultsToFourSinks) {
  Harness h({MakeLayout("l", 1, 4)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "streaming_llm", {}, 6));
  KV_ASSERT_OK(h.AppendRange(id, 0, 20));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 1, 2, 3, 18, 19));
}

TEST(StreamingLlmPolicy, SlackEvictsDownToBudgetMinusSlackThenWaits) {
  Harness h({MakeLayout("l", 1, 2)});
  // sinks 1, budget 5, slack 2: at 6 tokens evict 3 (keep the sink + 2).
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "streaming_llm",
                                         {{"sinks", "1"}, {"slack", "2"}}, 5));
  std::vector<int64_t> resident;
  for (int64_t pos = 0; pos < 9; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    resident.push_back(r.layers[0].resident);
    if (pos == 5) {
      EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(1, 2, 3));
    } else if (pos == 8) {
      EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(4, 5, 6));
    } else {
      EXPECT_THAT(r.layers[0].evicted_positions, IsEmpty()) << pos;
    }
  }
  EXPECT_THAT(resident, ElementsAre(1, 2, 3, 4, 5, 3, 4, 5, 3));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 7, 8));
}

// ---------------------------------------------------------------------------
// h2o

TEST(H2OPolicy, EvictsTheLowestAccumulatedScore) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "h2o", {{"sinks", "1"}, {"recent", "1"}}, 4));
  // Scores after each step (position: score):
  //   p0: 1.0
  KV_ASSERT_OK(h.Append(id, {0}));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, 1.0f}}));
  //   p0 1.5, p1 0.5
  KV_ASSERT_OK(h.Append(id, {1}));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, 0.5f}, {1, 0.5f}}));
  //   p0 1.7, p1 1.2, p2 0.1
  KV_ASSERT_OK(h.Append(id, {2}));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, 0.2f}, {1, 0.7f}, {2, 0.1f}}));
  //   p0 1.8, p1 1.3, p2 0.4, p3 0.5 (4 = budget: nothing goes)
  KV_ASSERT_OK(h.Append(id, {3}));
  KV_ASSIGN_OR_FAIL(StepResult r3,
                    h.Attend(id, 0, {{0, .1f}, {1, .1f}, {2, .3f}, {3, .5f}}));
  EXPECT_THAT(r3.layers[0].evicted_positions, IsEmpty());
  //   p0 1.9, p1 1.4, p2 0.5, p3 0.7, p4 0.5: p0 is a sink and p4 recent, so
  //   p2 (0.5) goes.
  KV_ASSERT_OK(h.Append(id, {4}));
  KV_ASSIGN_OR_FAIL(
      StepResult r4,
      h.Attend(id, 0, {{0, .1f}, {1, .1f}, {2, .1f}, {3, .2f}, {4, .5f}}));
  EXPECT_THAT(r4.layers[0].evicted_positions, ElementsAre(2));
  EXPECT_EQ(r4.layers[0].resident, 4);
  //   p0 2.1, p1 1.5, p3 1.0, p4 0.6, p5 0.3: p5 is recent now, so p4 (the
  //   newest unprotected, 0.6) goes and the heavy hitter p1 stays.
  KV_ASSERT_OK(h.Append(id, {5}));
  KV_ASSIGN_OR_FAIL(
      StepResult r5,
      h.Attend(id, 0, {{0, .2f}, {1, .1f}, {3, .3f}, {4, .1f}, {5, .3f}}));
  EXPECT_THAT(r5.layers[0].evicted_positions, ElementsAre(4));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 1, 3, 5));
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  EXPECT_EQ(stats.evicted_tokens, 2);
  EXPECT_NEAR(stats.evicted_score, 0.5 + 0.6, 1e-5);
  EXPECT_EQ(stats.score_updates, 6);
}

TEST(H2OPolicy, NeverEvictsSinksOrRecentTokens) {
  Harness h({MakeLayout("l", 1, 4)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "h2o", {{"sinks", "1"}, {"recent", "2"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 5));
  // p0, p3 and p4 get nothing but are protected; of p1 (.3) and p2 (.7),
  // p1 goes.
  KV_ASSIGN_OR_FAIL(StepResult r, h.Attend(id, 0, {{1, .3f}, {2, .7f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(1));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 2, 3, 4));
}

TEST(H2OPolicy, TiesEvictTheOlderToken) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "h2o", {}, 3));
  KV_ASSERT_OK(h.AppendRange(id, 0, 4));
  // All four tied at 0: the oldest goes.
  KV_ASSIGN_OR_FAIL(StepResult r1, h.Attend(id, 0, {}));
  EXPECT_THAT(r1.layers[0].evicted_positions, ElementsAre(0));
  // p1 gets .5; p2, p3 and the new p4 tie at 0: p2, the oldest of them.
  KV_ASSERT_OK(h.Append(id, {4}));
  KV_ASSIGN_OR_FAIL(StepResult r2, h.Attend(id, 0, {{1, .5f}}));
  EXPECT_THAT(r2.layers[0].evicted_positions, ElementsAre(2));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(1, 3, 4));
}

TEST(H2OPolicy, SlackEvictsDownToBudgetMinusSlack) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "h2o", {{"slack", "2"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 5));
  KV_ASSIGN_OR_FAIL(StepResult r,
                    h.Attend(id, 0, {{0, .4f}, {1, .1f}, {2, .3f}, {3, .2f}}));
  // Down to 2: the three lowest (p4 0, p1 .1, p3 .2), reported ascending.
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(1, 3, 4));
  // Two more tokens fit without eviction.
  for (int64_t pos = 5; pos < 7; ++pos) {
    KV_ASSERT_OK(h.Append(id, {pos}));
    KV_ASSIGN_OR_FAIL(StepResult s, h.Attend(id, 0, {}));
    EXPECT_THAT(s.layers[0].evicted_positions, IsEmpty());
  }
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 2, 5, 6));
}

// ---------------------------------------------------------------------------
// tova

TEST(TovaPolicy, EvictsTheLeastAttendedTokenEvenTheNewest) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "tova", {}, 3));
  KV_ASSERT_OK(h.AppendRange(id, 0, 3));
  KV_ASSERT_OK(h.Attend(id, 0, {{0, .2f}, {1, .4f}, {2, .4f}}));
  KV_ASSERT_OK(h.Append(id, {3}));
  KV_ASSIGN_OR_FAIL(StepResult r1,
                    h.Attend(id, 0, {{0, .4f}, {1, .3f}, {2, .2f}, {3, .1f}}));
  EXPECT_THAT(r1.layers[0].evicted_positions, ElementsAre(3));
  // Nothing accumulates: p0 had .2 + .4 so far, but only this step counts.
  KV_ASSERT_OK(h.Append(id, {4}));
  KV_ASSIGN_OR_FAIL(StepResult r2,
                    h.Attend(id, 0, {{0, .1f}, {1, .5f}, {2, .2f}, {4, .2f}}));
  EXPECT_THAT(r2.layers[0].evicted_positions, ElementsAre(0));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(1, 2, 4));
}

TEST(TovaPolicy, OnlyTheLastRowOfAChunkCounts) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "tova", {}, 3));
  KV_ASSERT_OK(h.AppendRange(id, 0, 4));
  // Summed rows would evict p3 (p0 .4, p1 1.0, p2 .4, p3 .2); the last row
  // alone evicts p1 (.1).
  KV_ASSIGN_OR_FAIL(StepResult r,
                    h.AttendRows(id, 0,
                                 {{{1, .9f}, {2, .1f}},
                                  {{0, .4f}, {1, .1f}, {2, .3f}, {3, .2f}}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(1));
}

TEST(TovaPolicy, AveragesOverQueryHeads) {
  // Per-head probabilities, 2 heads: the head average decides.
  Harness h({MakeLayout("l", 1, 2, DType::kF32, 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "tova", {}, 2));
  KV_ASSERT_OK(h.AppendRange(id, 0, 3));
  KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, 0));
  ASSERT_THAT(t.positions, ElementsAre(0, 1, 2));
  // head 0: [.6 .3 .1], head 1: [.0 .2 .8] -> sums .6 .5 .9: p1 goes although
  // head 1 alone would pick p0 and head 0 alone p2.
  const std::vector<float> probs = {.6f, .3f, .1f, .0f, .2f, .8f};
  LayerScores s{0, t.version, ScoreSource::kPerHead, 1, probs};
  KV_ASSIGN_OR_FAIL(StepResult r, h.store().UpdateScores(id, std::span(&s, 1)));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(1));
}

// ---------------------------------------------------------------------------
// scissorhands

// Four tokens, three steps of attention, then a fifth token and a fourth step
// (threshold 1: a token is unimportant when below 1/n). Returns what the
// fourth step evicts with the given history window.
std::vector<int64_t> ScissorhandsFourthStep(const std::string& history) {
  Harness h({MakeLayout("l", 1, 2)});
  absl::StatusOr<SessionId> id =
      h.Open("l", "scissorhands", {{"history", history}}, 4);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return {};
  EXPECT_TRUE(h.AppendRange(*id, 0, 4).ok());
  // Cut .25. Unimportant per step: {p1, p2}, {p1, p3}, {p0, p1}.
  for (const std::map<int64_t, float>& row :
       std::vector<std::map<int64_t, float>>{
           {{0, .4f}, {1, .1f}, {2, .1f}, {3, .4f}},
           {{0, .4f}, {1, .1f}, {2, .4f}, {3, .1f}},
           {{0, .1f}, {1, .1f}, {2, .4f}, {3, .4f}}}) {
    absl::StatusOr<StepResult> r = h.Attend(*id, 0, row);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) {
      EXPECT_THAT(r->layers[0].evicted_positions, IsEmpty());
    }
  }
  EXPECT_TRUE(h.Append(*id, {4}).ok());
  // Cut .2: unimportant {p3, p4}. Counts over all four steps: p0 1, p1 3,
  // p2 1, p3 2, p4 1. Over the last two steps: p0 1, p1 1, p2 0, p3 1, p4 1.
  // (h2o would evict p4: its accumulated score .05 is the lowest.)
  absl::StatusOr<StepResult> r =
      h.Attend(*id, 0, {{0, .3f}, {1, .3f}, {2, .3f}, {3, .05f}, {4, .05f}});
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  return r->layers[0].evicted_positions;
}

TEST(ScissorhandsPolicy, EvictsTheTokenMostOftenUnimportant) {
  EXPECT_THAT(ScissorhandsFourthStep("32"), ElementsAre(1));
}

TEST(ScissorhandsPolicy, CountsOnlyTheHistoryWindowAndBreaksTiesByAge) {
  // Last two steps: p0, p1, p3 and p4 tie at one; the oldest, p0, goes.
  EXPECT_THAT(ScissorhandsFourthStep("2"), ElementsAre(0));
}

TEST(ScissorhandsPolicy, ProtectsRecentTokens) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "scissorhands", {{"recent", "2"}}, 3));
  KV_ASSERT_OK(h.AppendRange(id, 0, 4));
  // p2 and p3 are unimportant (below .25) but recent; p0 and p1 are not
  // unimportant: they tie at 0 and the older goes.
  KV_ASSIGN_OR_FAIL(
      StepResult r,
      h.Attend(id, 0, {{0, .45f}, {1, .45f}, {2, .05f}, {3, .05f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0));
}

// ---------------------------------------------------------------------------
// snapkv

// Six prompt tokens, window 2; window attention rows summed:
//   p0 .35, p1 .6, p2 .2, p3 .4 (prefix), p4 .2, p5 .25 (window).
const std::vector<std::map<int64_t, float>> kSnapWindow = {
    {{0, .05f}, {1, .5f}, {2, .1f}, {3, .2f}, {4, .1f}, {5, .05f}},
    {{0, .3f}, {1, .1f}, {2, .1f}, {3, .2f}, {4, .1f}, {5, .2f}}};

absl::StatusOr<StepResult> Compress(
    Harness& h, SessionId id, int32_t layer,
    const std::vector<std::map<int64_t, float>>& rows) {
  absl::StatusOr<BlockTable> table = h.store().GetBlockTable(id, layer);
  if (!table.ok()) return table.status();
  std::vector<float> data;
  for (const auto& row : rows) {
    for (int64_t pos : table->positions) {
      auto it = row.find(pos);
      data.push_back(it == row.end() ? 0.0f : it->second);
    }
  }
  LayerScores s{layer, table->version, ScoreSource::kReduced,
                static_cast<int32_t>(rows.size()), data};
  return h.store().CompressPrompt(id, std::span(&s, 1));
}

// Compresses the listed layers in one call, each with the same window rows.
absl::StatusOr<StepResult> CompressLayers(
    Harness& h, SessionId id, const std::vector<int32_t>& layers,
    const std::vector<std::map<int64_t, float>>& rows) {
  std::vector<std::vector<float>> data(layers.size());
  std::vector<LayerScores> window;
  for (size_t i = 0; i < layers.size(); ++i) {
    absl::StatusOr<BlockTable> table = h.store().GetBlockTable(id, layers[i]);
    if (!table.ok()) return table.status();
    for (const auto& row : rows) {
      for (int64_t pos : table->positions) {
        auto it = row.find(pos);
        data[i].push_back(it == row.end() ? 0.0f : it->second);
      }
    }
    window.push_back(LayerScores{layers[i], table->version,
                                 ScoreSource::kReduced,
                                 static_cast<int32_t>(rows.size()), data[i]});
  }
  return h.store().CompressPrompt(id, window);
}

TEST(SnapKvPolicy, CompressionKeepsTheBudgetIncludingTheWindow) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "1"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  // Kernel 1: no smoothing. Keep the top 2 of the prefix (p1, p3).
  KV_ASSIGN_OR_FAIL(StepResult r, Compress(h, id, 0, kSnapWindow));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 2));
  EXPECT_EQ(r.layers[0].resident, 4);
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(1, 3, 4, 5));
  KV_ASSIGN_OR_FAIL(SessionStats stats, h.store().GetStats(id));
  EXPECT_TRUE(stats.compressed);
}

TEST(SnapKvPolicy, MaxPoolingSmoothsScoresAlongTheSequence) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv",
             {{"window", "2"}, {"kernel", "3"}, {"pooling", "maxpool"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  // Pooled prefix: p0 max(.35,.6) = .6, p1 .6, p2 .6, p3 max(.2,.4) = .4.
  // p3 goes first, then p0 (the oldest of three ties at .6); p2, the lowest
  // raw score, survives thanks to its neighbour.
  KV_ASSIGN_OR_FAIL(StepResult r, Compress(h, id, 0, kSnapWindow));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 3));
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(1, 2, 4, 5));
}

TEST(SnapKvPolicy, AvgPoolingCountsTheZeroPadding) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "3"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  // Pooled prefix: p0 (0+.35+.6)/3 = .317, p1 .383, p2 .4, p3 (.2+.4+0)/3 = .2.
  KV_ASSIGN_OR_FAIL(StepResult r, Compress(h, id, 0, kSnapWindow));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 3));
}

TEST(SnapKvPolicy, OnlyCompressesOnceAndNeverEvictsDuringDecode) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "1"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  // The window is exactly `window` rows.
  absl::StatusOr<StepResult> wrong_rows = Compress(h, id, 0, {kSnapWindow[0]});
  EXPECT_EQ(wrong_rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong_rows.status().message()), HasSubstr("window"));
  // Per-step scores are not snapkv's input.
  absl::StatusOr<StepResult> scores = h.Attend(id, 0, {});
  EXPECT_EQ(scores.status().code(), absl::StatusCode::kFailedPrecondition);

  KV_ASSERT_OK(Compress(h, id, 0, kSnapWindow));
  absl::StatusOr<StepResult> again = Compress(h, id, 0, kSnapWindow);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("already compressed"));
  for (int64_t pos = 6; pos < 12; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    EXPECT_THAT(r.layers[0].evicted_positions, IsEmpty());
  }
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(1, 3, 4, 5, 6, 7, 8, 9, 10, 11));
}

// Compression is one-shot per session, so a call that leaves layers out is
// refused whole (a layer left out could never be compressed later and would
// stay over budget: decode never evicts under snapkv), and the shot is not
// used up: every layer can still be compressed, in one call.
void ExpectRefusedThenCompressible(Harness& h, SessionId id,
                                   const absl::StatusOr<StepResult>& partial) {
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(partial.status().message()),
              HasSubstr("every layer"));
  KV_ASSIGN_OR_FAIL(StepResult r, CompressLayers(h, id, {0, 1}, kSnapWindow));
  EXPECT_EQ(r.layers.size(), 2u);
  absl::StatusOr<SessionStats> stats = h.store().GetStats(id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_THAT(stats->layer_resident, ElementsAre(4, 4));
  EXPECT_TRUE(stats->compressed);
}

TEST(SnapKvPolicy, AnEmptyCompressionIsRefusedAndDoesNotUseUpTheShot) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "1"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  const std::vector<LayerScores> none;
  ExpectRefusedThenCompressible(h, id, h.store().CompressPrompt(id, none));
}

TEST(SnapKvPolicy, APartialCompressionIsRefusedAndLeavesNoLayerBehind) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "1"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 6));
  ExpectRefusedThenCompressible(h, id, Compress(h, id, 0, kSnapWindow));
}

TEST(SnapKvPolicy, ShortPromptKeepsEverything) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "2"}, {"kernel", "1"}}, 4));
  KV_ASSERT_OK(h.AppendRange(id, 0, 3));
  KV_ASSIGN_OR_FAIL(StepResult r,
                    Compress(h, id, 0, {{{0, .5f}, {1, .5f}}, {{2, 1.f}}}));
  EXPECT_THAT(r.layers[0].evicted_positions, IsEmpty());
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(0, 1, 2));
}

// ---------------------------------------------------------------------------
// h2o_page

TEST(H2OPagePolicy, EvictsTheWholePageWithTheLowestMean) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "h2o_page", {{"recent", "2"}}, 6));
  KV_ASSERT_OK(h.AppendRange(id, 0, 8));
  EXPECT_EQ(h.UsedPages("l"), 4);
  // Page means: [p0 p1] .05, [p2 p3] .15, [p4 p5] .1, [p6 p7] recent.
  // Token-level h2o would take p3 (0) and p0; pages take [p0 p1].
  KV_ASSIGN_OR_FAIL(StepResult r, h.Attend(id, 0,
                                           {{0, .05f},
                                            {1, .05f},
                                            {2, .3f},
                                            {3, 0.f},
                                            {4, .1f},
                                            {5, .1f},
                                            {6, .2f},
                                            {7, .2f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 1));
  EXPECT_EQ(r.layers[0].pages_freed.size(), 1u);
  EXPECT_EQ(h.UsedPages("l"), 3);
  EXPECT_THAT(h.Resident(id, 0), ElementsAre(2, 3, 4, 5, 6, 7));
}

TEST(H2OPagePolicy, RoundsTheCountUpToWholePages) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id,
                    h.Open("l", "h2o_page", {{"recent", "2"}}, 5));
  KV_ASSERT_OK(h.AppendRange(id, 0, 8));
  // 3 over budget: two pages go, the two lowest means ([p0 p1] .05,
  // [p4 p5] .1), and resident drops to 4.
  KV_ASSIGN_OR_FAIL(StepResult r, h.Attend(id, 0,
                                           {{0, .05f},
                                            {1, .05f},
                                            {2, .3f},
                                            {3, 0.f},
                                            {4, .1f},
                                            {5, .1f},
                                            {6, .2f},
                                            {7, .2f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 1, 4, 5));
  EXPECT_EQ(r.layers[0].resident, 4);
  EXPECT_EQ(r.layers[0].pages_freed.size(), 2u);
  EXPECT_EQ(h.UsedPages("l"), 2);
}

TEST(H2OPagePolicy, EvictsMultiplesOfPageTokensWhileEligiblePagesExist) {
  Harness h({MakeLayout("l", 1, 4)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "h2o_page", {{"sinks", "1"}, {"recent", "2"}}, 10));
  int64_t evictions = 0;
  for (int64_t pos = 0; pos < 60; ++pos) {
    KV_ASSERT_OK(h.Append(id, {pos}));
    KV_ASSIGN_OR_FAIL(BlockTable t, h.store().GetBlockTable(id, 0));
    std::map<int64_t, float> row;
    for (int64_t p : t.positions) {
      row[p] = static_cast<float>(Noise(7, static_cast<uint64_t>(pos),
                                        static_cast<uint64_t>(p), 0) +
                                  1.0) /
               (2.0f * static_cast<float>(t.positions.size()));
    }
    KV_ASSIGN_OR_FAIL(StepResult r, h.Attend(id, 0, row));
    const LayerChange& c = r.layers[0];
    EXPECT_LE(c.resident, 10);
    EXPECT_THAT(c.evicted_positions, ::testing::Not(::testing::Contains(0)));
    if (!c.evicted_positions.empty()) {
      ++evictions;
      EXPECT_EQ(c.evicted_positions.size() % 4, 0u)
          << "step " << pos << " evicted " << c.evicted_positions.size();
    }
    // Pages are ceil(resident / page_tokens); the rest are back in the pool.
    EXPECT_EQ(h.UsedPages("l"), (c.resident + 3) / 4);
  }
  EXPECT_GT(evictions, 5);
}

TEST(H2OPagePolicy, FallsBackToTokensWithoutEligiblePages) {
  Harness h({MakeLayout("l", 1, 4)});
  // Page 0 holds the sink, page 1 the recent tokens: no page is eligible.
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "h2o_page",
                                         {{"sinks", "1"}, {"recent", "1"}}, 6));
  KV_ASSERT_OK(h.AppendRange(id, 0, 8));
  KV_ASSIGN_OR_FAIL(
      StepResult r,
      h.Attend(id, 0,
               {{1, .2f}, {2, .05f}, {3, .3f}, {4, .1f}, {5, .01f}, {6, .3f}}));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(2, 5));
  EXPECT_EQ(r.layers[0].resident, 6);
  EXPECT_EQ(h.UsedPages("l"), 2);
}

// ---------------------------------------------------------------------------
// full

TEST(FullPolicy, NeverEvicts) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "full", {}, 2));
  for (int64_t pos = 0; pos < 10; ++pos) {
    KV_ASSIGN_OR_FAIL(StepResult r, h.Append(id, {pos}));
    for (const LayerChange& c : r.layers) {
      EXPECT_THAT(c.evicted_positions, IsEmpty());
      EXPECT_EQ(c.resident, pos + 1);
    }
  }
  absl::StatusOr<StepResult> s = h.Attend(id, 0, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("full"));
  absl::StatusOr<StepResult> c = Compress(h, id, 0, {{}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(h.Resident(id, 1), ElementsAreArray(Range(0, 10)));
  EXPECT_EQ(h.UsedPages("l"), 10);
}

// ---------------------------------------------------------------------------
// The needle: a mid-sequence token that keeps receiving attention.

TEST(Needle, SurvivesH2OAtATwentyPercentBudgetButNotRecencyPolicies) {
  constexpr int64_t kSteps = 200;
  constexpr int64_t kBudget = 40;
  constexpr int64_t kNeedle = 100;
  constexpr int32_t kHeads = 2;
  Harness h({MakeLayout("l", 1, 4, DType::kF32, 1, kHeads)});
  KV_ASSIGN_OR_FAIL(
      SessionId h2o,
      h.Open("l", "h2o", {{"sinks", "4"}, {"recent", "8"}}, kBudget));
  KV_ASSIGN_OR_FAIL(SessionId window, h.Open("l", "window", {}, kBudget));
  KV_ASSIGN_OR_FAIL(SessionId streaming,
                    h.Open("l", "streaming_llm", {{"sinks", "4"}}, kBudget));
  for (int64_t t = 0; t < kSteps; ++t) {
    for (SessionId id : {h2o, window, streaming}) {
      KV_ASSERT_OK(h.Append(id, {t}));
    }
    KV_ASSIGN_OR_FAIL(BlockTable table, h.store().GetBlockTable(h2o, 0));
    const int64_t n = static_cast<int64_t>(table.positions.size());
    // Per head: the needle takes half of the attention once it exists; the
    // rest is spread at random over the other resident tokens.
    std::vector<float> probs(kHeads * n);
    for (int32_t head = 0; head < kHeads; ++head) {
      const bool needle_here = t >= kNeedle;
      double total = 0;
      std::vector<double> w(n);
      for (int64_t s = 0; s < n; ++s) {
        if (table.positions[s] == kNeedle) continue;
        w[s] =
            Noise(t, static_cast<uint64_t>(table.positions[s]), head, 3) + 1.0;
        total += w[s];
      }
      const double rest = needle_here ? 0.5 : 1.0;
      for (int64_t s = 0; s < n; ++s) {
        probs[head * n + s] = static_cast<float>(
            table.positions[s] == kNeedle ? 0.5 : w[s] / total * rest);
      }
    }
    LayerScores s{0, table.version, ScoreSource::kPerHead, 1, probs};
    KV_ASSIGN_OR_FAIL(StepResult r,
                      h.store().UpdateScores(h2o, std::span(&s, 1)));
    EXPECT_LE(r.layers[0].resident, kBudget);
    if (t >= kNeedle) {
      EXPECT_THAT(r.layers[0].evicted_positions,
                  ::testing::Not(::testing::Contains(kNeedle)))
          << "h2o lost the needle at step " << t;
    }
  }
  const std::vector<int64_t> kept = h.Resident(h2o, 0);
  EXPECT_EQ(kept.size(), static_cast<size_t>(kBudget));
  EXPECT_TRUE(std::binary_search(kept.begin(), kept.end(), kNeedle));
  // The sinks and the recent window are there too.
  for (int64_t p : Concat(Range(0, 4), Range(kSteps - 8, kSteps))) {
    EXPECT_TRUE(std::binary_search(kept.begin(), kept.end(), p)) << p;
  }
  EXPECT_THAT(h.Resident(window, 0),
              ElementsAreArray(Range(kSteps - kBudget, kSteps)));
  EXPECT_THAT(h.Resident(streaming, 0),
              ElementsAreArray(
                  Concat(Range(0, 4), Range(kSteps - kBudget + 4, kSteps))));
}

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
  const ModelLayout layout = MakeLayout("q", kLayers, 4, dtype, 2, 8, 16);
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
  const ModelLayout layout = MakeLayout("q", 1, 2, DType::kF32, 1, 1, 4);
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
  Harness h({MakeLayout("b", kLayers, 3, DType::kF16, 2, 2, 4)});
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
  EXPECT_EQ(h.UsedPages("b"), stats.pages);
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
      EXPECT_EQ(h.UsedPages("b"), (c.resident + 1) / 2);
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
  EXPECT_EQ(h.UsedPages("l"), 6);
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
  EXPECT_EQ(h.UsedPages("l"), 6);
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
  Harness h({MakeLayout("r", 2, 3, DType::kBF16, 1, 2, 4)});
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
