// Session semantics through the CacheStore API, policy by policy:
// hand-computed cases for window, streaming_llm, h2o, tova, scissorhands,
// snapkv, h2o_page and full, and the needle case. Every layout here is tiny
// so each expected result can be worked out by hand (the comments show the
// arithmetic). session_test.cc has the rest of the session's semantics.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_store_harness.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

using store_testing::Concat;
using store_testing::Harness;
using store_testing::MakeLayout;
using store_testing::Range;
using test_data::Noise;

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
  Harness h({MakeLayout("l", 1, 2, 1, 2)});
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
  EXPECT_EQ(h.Pool("l").used_pages, 4);
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
  EXPECT_EQ(h.Pool("l").used_pages, 3);
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
  EXPECT_EQ(h.Pool("l").used_pages, 2);
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
    EXPECT_EQ(h.Pool("l").used_pages, (c.resident + 3) / 4);
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
  EXPECT_EQ(h.Pool("l").used_pages, 2);
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
  EXPECT_EQ(h.Pool("l").used_pages, 10);
}

// ---------------------------------------------------------------------------
// The needle: a mid-sequence token that keeps receiving attention.

TEST(Needle, SurvivesH2OAtATwentyPercentBudgetButNotRecencyPolicies) {
  constexpr int64_t kSteps = 200;
  constexpr int64_t kBudget = 40;
  constexpr int64_t kNeedle = 100;
  constexpr int32_t kHeads = 2;
  Harness h({MakeLayout("l", 1, 4, 1, kHeads)});
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

}  // namespace
}  // namespace kvkeep
