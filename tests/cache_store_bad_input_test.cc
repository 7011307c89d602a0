// CacheStore: bad input to a live session, each refused with the right
// code, a message naming what was wrong, and nothing changed (a whole-store
// snapshot before and after), and multi-layer steps that are all or nothing.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/cache_store_harness.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep::store_testing {
namespace {

// ---------------------------------------------------------------------------
// Bad input to a live session. The layout: 2 layers, GQA 4 query heads over
// 2 kv heads, head_dim 4, pages of 2 tokens. The session (h2o, sinks 1,
// recent 1, budget 6) holds 4 tokens and one step of scores.

class BadInputTest : public ::testing::Test {
 protected:
  static constexpr int32_t kLayers = 2;
  static constexpr int32_t kQueryHeads = 4;
  static constexpr int32_t kHeadDim = 4;

  BadInputTest()
      : h_({MakeLayout("bad", kLayers, 2, 2, kQueryHeads, kHeadDim), [] {
              ModelLayout l = MakeLayout("pre", 1, 2, 1, 2, 4);
              l.keys_pre_rope = true;
              return l;
            }()}) {}

  void SetUp() override {
    KV_ASSIGN_OR_FAIL(
        id_, h_.Open("bad", "h2o", {{"sinks", "1"}, {"recent", "1"}}, 6));
    KV_ASSERT_OK(h_.Append(id_, "bad", {0, 1, 2, 3}));
    KV_ASSERT_OK(h_.AttendAll(id_, kLayers,
                              {{{0, .4f}, {1, .3f}, {2, .2f}, {3, .1f}},
                               {{0, .1f}, {1, .2f}, {2, .3f}, {3, .4f}}}));
    before_ = Take(h_, id_);
    ASSERT_EQ(before_.stats.resident_tokens, 8);
  }

  // The session is exactly as SetUp left it, and still works.
  void ExpectUnchangedAndWorking() {
    ExpectSame(before_, Take(h_, id_));
    KV_ASSIGN_OR_FAIL(StepResult a, h_.Append(id_, "bad", {4}));
    for (const LayerChange& c : a.layers) EXPECT_EQ(c.resident, 5);
    KV_ASSIGN_OR_FAIL(
        StepResult u,
        h_.AttendAll(id_, kLayers, {{{4, 1.f}}, {{0, .5f}, {4, .5f}}}));
    for (const LayerChange& c : u.layers) EXPECT_EQ(c.resident, 5);
    KV_ASSIGN_OR_FAIL(SessionStats stats, h_.store().GetStats(id_));
    EXPECT_EQ(stats.score_updates, before_.stats.score_updates + 2);
  }

  // A score entry for `layer` at its current version.
  LayerScores Scores(int32_t layer, ScoreSource source, int32_t rows,
                     std::span<const float> data) {
    return LayerScores{layer, before_.tables[layer].version, source, rows,
                       data};
  }
  absl::StatusOr<StepResult> Update(const LayerScores& s) {
    return h_.store().UpdateScores(id_, std::span(&s, 1));
  }

  Harness h_;
  SessionId id_ = 0;
  Snapshot before_;
};

TEST_F(BadInputTest, AppendWithTheWrongNumberOfLayers) {
  AppendBuffers one(MakeLayout("bad", 1, 2, 2, kQueryHeads, kHeadDim), {4});
  ExpectError(h_.store().Append(id_, one.request()),
              absl::StatusCode::kInvalidArgument, {"1 layers", "has 2"});
  AppendBuffers three(MakeLayout("bad", 3, 2, 2, kQueryHeads, kHeadDim), {4});
  ExpectError(h_.store().Append(id_, three.request()),
              absl::StatusCode::kInvalidArgument, {"3 layers"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, AppendWithTheWrongKeyOrValueBytes) {
  const ModelLayout& l = h_.layout("bad");
  {
    AppendBuffers b(l, {4});
    b.keys[1].pop_back();
    b.layers[1].keys = b.keys[1];
    ExpectError(h_.store().Append(id_, b.request()),
                absl::StatusCode::kInvalidArgument,
                {"layer 1", "bytes", "expected 32"});
  }
  {
    AppendBuffers b(l, {4});
    b.values[0].resize(b.values[0].size() * 2);
    b.layers[0].values = b.values[0];
    ExpectError(h_.store().Append(id_, b.request()),
                absl::StatusCode::kInvalidArgument, {"layer 0", "bytes"});
  }
  {
    // Two positions, bytes for one token.
    AppendBuffers b(l, {4});
    const std::vector<int64_t> two = {4, 5};
    ExpectError(h_.store().Append(id_, AppendRequest{two, b.layers}),
                absl::StatusCode::kInvalidArgument,
                {"bytes", "expected 64", "2 tokens"});
  }
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, AppendOfZeroTokens) {
  ExpectError(h_.Append(id_, "bad", {}), absl::StatusCode::kInvalidArgument,
              {"zero tokens"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, AppendWithNonIncreasingPositions) {
  // Within one request, and against what was appended before (3).
  for (const std::vector<int64_t>& positions :
       std::vector<std::vector<int64_t>>{{5, 5}, {6, 5}, {3}, {2, 7}, {-1}}) {
    SCOPED_TRACE(::testing::PrintToString(positions));
    ExpectError(h_.Append(id_, "bad", positions),
                absl::StatusCode::kInvalidArgument, {"strictly increase"});
  }
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, ScoresOfTheWrongSizeForEachSource) {
  const int64_t n = 4;
  const std::vector<float> per_head(kQueryHeads * n + 1, 0.0f);
  ExpectError(Update(Scores(0, ScoreSource::kPerHead, 1, per_head)),
              absl::StatusCode::kInvalidArgument,
              {"per-head", "17", "expected 16", "query_heads"});
  const std::vector<float> reduced(n - 1, 0.0f);
  ExpectError(Update(Scores(1, ScoreSource::kReduced, 1, reduced)),
              absl::StatusCode::kInvalidArgument,
              {"head-reduced", "3", "expected 4", "resident"});
  // Two rows declared, one row sent.
  const std::vector<float> one_row(n, 0.0f);
  ExpectError(Update(Scores(1, ScoreSource::kReduced, 2, one_row)),
              absl::StatusCode::kInvalidArgument, {"expected 8"});
  const std::vector<float> queries(kQueryHeads * kHeadDim - 1, 0.0f);
  ExpectError(Update(Scores(0, ScoreSource::kQueries, 1, queries)),
              absl::StatusCode::kInvalidArgument,
              {"queries", "15", "expected 16", "head_dim"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, RowsOutsideOneToResident) {
  const std::vector<float> none;
  ExpectError(Update(Scores(0, ScoreSource::kReduced, 0, none)),
              absl::StatusCode::kInvalidArgument, {"rows = 0", "resident"});
  const std::vector<float> five(5 * 4, 0.0f);
  ExpectError(Update(Scores(0, ScoreSource::kReduced, 5, five)),
              absl::StatusCode::kInvalidArgument, {"rows = 5", "4"});
  const std::vector<float> neg;
  ExpectError(Update(Scores(1, ScoreSource::kQueries, -1, neg)),
              absl::StatusCode::kInvalidArgument, {"rows = -1"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, NonFiniteOrNegativeProbabilities) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (ScoreSource source : {ScoreSource::kPerHead, ScoreSource::kReduced}) {
    const int64_t size = source == ScoreSource::kPerHead ? kQueryHeads * 4 : 4;
    for (const auto& [bad, what] : std::vector<std::pair<float, const char*>>{
             {nan, "NaN or infinity"},
             {inf, "NaN or infinity"},
             // Both infinite and negative: either message names it.
             {-inf, "probabilities contain"},
             {-0.25f, "negative"}}) {
      // The bad value is in the last element (the last head, for per-head).
      std::vector<float> data(size, 0.1f);
      data.back() = bad;
      SCOPED_TRACE(::testing::Message() << "value " << bad << " source "
                                        << static_cast<int>(source));
      ExpectError(Update(Scores(1, source, 1, data)),
                  absl::StatusCode::kInvalidArgument, {"layer 1", what});
    }
  }
  // A NaN and an infinity in one row sum to NaN: still refused.
  std::vector<float> both(4, 0.1f);
  both[0] = inf;
  both[1] = nan;
  ExpectError(Update(Scores(0, ScoreSource::kReduced, 1, both)),
              absl::StatusCode::kInvalidArgument, {"NaN or infinity"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, ARowSummingToOneAndAHalfPerHead) {
  // Per head: head 2 sums to 1.5, the others to 1.
  std::vector<float> per_head(kQueryHeads * 4, 0.25f);
  for (int s = 0; s < 4; ++s) per_head[2 * 4 + s] = 0.375f;
  ExpectError(Update(Scores(0, ScoreSource::kPerHead, 1, per_head)),
              absl::StatusCode::kInvalidArgument, {"summing to 1.5"});
  // Reduced: 1.5 per head over 4 heads is 6.
  const std::vector<float> reduced = {1.5f, 1.5f, 1.5f, 1.5f};
  ExpectError(Update(Scores(1, ScoreSource::kReduced, 1, reduced)),
              absl::StatusCode::kInvalidArgument, {"summing to 6"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, NonFiniteQueries) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    std::vector<float> q(kQueryHeads * kHeadDim, 0.5f);
    q[7] = bad;
    ExpectError(Update(Scores(1, ScoreSource::kQueries, 1, q)),
                absl::StatusCode::kInvalidArgument, {"layer 1", "queries"});
  }
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, StaleVersion) {
  const std::vector<float> row = {0.25f, 0.25f, 0.25f, 0.25f};
  for (uint64_t version : {before_.tables[0].version - 1,
                           before_.tables[0].version + 1, uint64_t{0}}) {
    LayerScores s = Scores(0, ScoreSource::kReduced, 1, row);
    s.version = version;
    ExpectError(Update(s), absl::StatusCode::kFailedPrecondition,
                {"stale", "layer 0"});
  }
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, LayerOutOfRange) {
  const std::vector<float> row = {0.25f, 0.25f, 0.25f, 0.25f};
  for (int32_t layer : {-1, 2, 1000}) {
    LayerScores s = Scores(0, ScoreSource::kReduced, 1, row);
    s.layer = layer;
    ExpectError(Update(s), absl::StatusCode::kInvalidArgument,
                {"outside [0, 2)"});
    ExpectError(h_.store().GetBlockTable(id_, layer),
                absl::StatusCode::kInvalidArgument, {"outside"});
    ExpectError(h_.store().ReadLayer(id_, layer),
                absl::StatusCode::kInvalidArgument, {"outside"});
  }
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, TheSameLayerTwice) {
  const std::vector<float> row = {0.25f, 0.25f, 0.25f, 0.25f};
  const std::vector<LayerScores> scores = {
      Scores(1, ScoreSource::kReduced, 1, row),
      Scores(0, ScoreSource::kReduced, 1, row),
      Scores(1, ScoreSource::kReduced, 1, row)};
  ExpectError(h_.store().UpdateScores(id_, scores),
              absl::StatusCode::kInvalidArgument, {"layer 1", "twice"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, PolicyThatTakesNoScores) {
  // CompressPrompt on an h2o session.
  const std::vector<float> row = {0.25f, 0.25f, 0.25f, 0.25f};
  LayerScores s = Scores(0, ScoreSource::kReduced, 1, row);
  ExpectError(h_.store().CompressPrompt(id_, std::span(&s, 1)),
              absl::StatusCode::kFailedPrecondition, {"snapkv"});
  ExpectUnchangedAndWorking();
}

TEST_F(BadInputTest, QueriesOnAPreRopeLayout) {
  KV_ASSIGN_OR_FAIL(SessionId pre, h_.Open("pre", "h2o", {}, 2));
  KV_ASSERT_OK(h_.Append(pre, "pre", {0, 1, 2}));
  Snapshot pre_before = Take(h_, pre);
  const std::vector<float> q(2 * 4, 0.5f);
  LayerScores s{0, pre_before.tables[0].version, ScoreSource::kQueries, 1, q};
  ExpectError(h_.store().UpdateScores(pre, std::span(&s, 1)),
              absl::StatusCode::kFailedPrecondition, {"RoPE", "pre"});
  ExpectSame(pre_before, Take(h_, pre));
  // Probabilities still work there.
  const std::vector<float> probs = {.5f, .5f, 0.f, .5f, .5f, 0.f};
  LayerScores p{0, pre_before.tables[0].version, ScoreSource::kPerHead, 1,
                probs};
  KV_ASSIGN_OR_FAIL(StepResult r,
                    h_.store().UpdateScores(pre, std::span(&p, 1)));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(2));
  KV_ASSERT_OK(h_.store().CloseSession(pre));
  ExpectUnchangedAndWorking();
}

// A bad entry for layer 1 in a two-layer step leaves layer 0 untouched too:
// its attention is not folded in, nothing is evicted, no version moves.
TEST(AllOrNothing, ABadLayerInAMultiLayerStepChangesNoLayer) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<std::string, LayerScores>> bad_layer1 = {
      {"NaN", LayerScores{1, 0, ScoreSource::kReduced, 1, {}}},
      {"wrong size", LayerScores{1, 0, ScoreSource::kReduced, 1, {}}},
      {"stale", LayerScores{1, 0, ScoreSource::kReduced, 1, {}}},
      {"negative", LayerScores{1, 0, ScoreSource::kReduced, 1, {}}},
      {"rows 0", LayerScores{1, 0, ScoreSource::kReduced, 0, {}}},
      {"nan query", LayerScores{1, 0, ScoreSource::kQueries, 1, {}}},
      {"row sum", LayerScores{1, 0, ScoreSource::kPerHead, 1, {}}},
  };
  for (const auto& [what, template_scores] : bad_layer1) {
    SCOPED_TRACE(what);
    Harness h({MakeLayout("l", 2, 2, 1, 2, 4)});
    KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "h2o", {}, 3));
    KV_ASSERT_OK(h.Append(id, "l", {0, 1, 2, 3}));
    const Snapshot before = Take(h, id);
    // Layer 0's entry is valid and, if applied, would evict p1 (p0 .9).
    const std::vector<float> good0 = {.9f, 0.f, 0.f, .1f};
    std::vector<float> bad1 = {.25f, .25f, .25f, .25f};
    LayerScores s1 = template_scores;
    s1.version = before.tables[1].version;
    if (what == "NaN") bad1[2] = nan;
    if (what == "wrong size") bad1.push_back(0.f);
    if (what == "stale") s1.version -= 1;
    if (what == "negative") bad1[3] = -1.f;
    if (what == "nan query") bad1 = {0, 0, 0, 0, 0, nan, 0, 0};
    if (what == "row sum") bad1 = {.5f, .5f, .5f, .5f, .1f, .1f, .1f, .1f};
    s1.data = bad1;
    const std::vector<LayerScores> step = {
        LayerScores{0, before.tables[0].version, ScoreSource::kReduced, 1,
                    good0},
        s1};
    absl::StatusOr<StepResult> r = h.store().UpdateScores(id, step);
    EXPECT_FALSE(r.ok());
    ExpectSame(before, Take(h, id));
    // Only the valid step's attention counts: p0 .1 is the lowest, not p1.
    KV_ASSIGN_OR_FAIL(StepResult ok,
                      h.AttendAll(id, 2,
                                  {{{0, .1f}, {1, .2f}, {2, .3f}, {3, .4f}},
                                   {{0, .4f}, {1, .3f}, {2, .2f}, {3, .1f}}}));
    EXPECT_THAT(ok.layers[0].evicted_positions, ElementsAre(0));
    EXPECT_THAT(ok.layers[1].evicted_positions, ElementsAre(3));
  }
}

TEST(AllOrNothing, ABadCompressionLeavesThePromptUncompressed) {
  Harness h({MakeLayout("l", 2, 2)});
  KV_ASSIGN_OR_FAIL(
      SessionId id,
      h.Open("l", "snapkv", {{"window", "1"}, {"kernel", "1"}}, 2));
  KV_ASSERT_OK(h.Append(id, "l", {0, 1, 2, 3}));
  const Snapshot before = Take(h, id);
  const std::vector<float> good = {.1f, .5f, .2f, .2f};
  const std::vector<float> bad = {.1f, -.5f, .2f, .2f};
  const std::vector<LayerScores> step = {
      LayerScores{0, before.tables[0].version, ScoreSource::kReduced, 1, good},
      LayerScores{1, before.tables[1].version, ScoreSource::kReduced, 1, bad}};
  ExpectError(h.store().CompressPrompt(id, step),
              absl::StatusCode::kInvalidArgument, {"layer 1", "negative"});
  ExpectSame(before, Take(h, id));
  // Compression is still possible, once.
  const std::vector<LayerScores> fixed = {
      step[0],
      LayerScores{1, before.tables[1].version, ScoreSource::kReduced, 1, good}};
  KV_ASSIGN_OR_FAIL(StepResult r, h.store().CompressPrompt(id, fixed));
  EXPECT_THAT(r.layers[0].evicted_positions, ElementsAre(0, 2));
  EXPECT_THAT(h.Resident(id, 1), ElementsAre(1, 3));
}

}  // namespace
}  // namespace kvkeep::store_testing
