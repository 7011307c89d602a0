// CacheStore: bad input (each refused with the right code, a message naming
// what was wrong, and nothing changed), unknown sessions and layouts, pool and
// session limits, closing, and concurrent use of one store.
#include "cache_store/cache_store.h"

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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectError;
using ::kvkeep::testing::StatusOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ListSessions() is in ascending id order, whatever order they were made in.
std::vector<SessionId> Sorted(std::vector<SessionId> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}

// NOT_FOUND, naming the session (its id in decimal or as 16 hex digits).
template <typename S>
void ExpectNotFound(const S& s, SessionId id) {
  const absl::Status status = StatusOf(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  const std::string message(status.message());
  EXPECT_THAT(message, HasSubstr("not found"));
  EXPECT_TRUE(message.find(std::to_string(id)) != std::string::npos ||
              message.find(absl::StrFormat("%016x", id)) != std::string::npos)
      << "the message does not name session " << id << ": " << message;
}

ModelLayout MakeLayout(std::string name, int32_t layers, int32_t page_tokens,
                       int32_t kv_heads = 1, int32_t query_heads = 1,
                       int32_t head_dim = 4, DType dtype = DType::kF32) {
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

using ::kvkeep::test_data::AppendBuffers;

class Harness {
 public:
  explicit Harness(std::vector<ModelLayout> layouts,
                   int64_t capacity_pages = 1024,
                   int64_t max_sessions = 1 << 16) {
    StoreOptions options;
    options.device = test_support::TestDevice();
    options.max_sessions = max_sessions;
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
  const ModelLayout& layout(const std::string& name) const {
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

  // Appends `positions` to a session of `layout`.
  absl::StatusOr<StepResult> Append(SessionId id, const std::string& layout,
                                    std::vector<int64_t> positions) {
    AppendBuffers b(layouts_.at(layout), std::move(positions));
    return store_->Append(id, b.request());
  }

  // One row of head-reduced attention for every layer: given by position
  // (0 for the others), in slot order, at the current versions.
  absl::StatusOr<StepResult> AttendAll(
      SessionId id, int32_t layers,
      const std::vector<std::map<int64_t, float>>& by_layer) {
    std::vector<std::vector<float>> rows(layers);
    std::vector<LayerScores> scores;
    for (int32_t layer = 0; layer < layers; ++layer) {
      absl::StatusOr<BlockTable> t = store_->GetBlockTable(id, layer);
      if (!t.ok()) return t.status();
      for (int64_t pos : t->positions) {
        auto it = by_layer[layer].find(pos);
        rows[layer].push_back(it == by_layer[layer].end() ? 0.0f : it->second);
      }
      scores.push_back(LayerScores{layer, t->version, ScoreSource::kReduced, 1,
                                   rows[layer]});
    }
    return store_->UpdateScores(id, scores);
  }

  std::vector<int64_t> Resident(SessionId id, int32_t layer) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
    EXPECT_TRUE(table.ok()) << table.status();
    if (!table.ok()) return {};
    std::vector<int64_t> p = table->positions;
    std::sort(p.begin(), p.end());
    return p;
  }

  PoolStats Pool(const std::string& layout) const {
    for (const LayoutStats& s : store_->Layouts()) {
      if (s.layout.name == layout) return s.pool;
    }
    ADD_FAILURE() << "no layout " << layout;
    return {};
  }

 private:
  std::map<std::string, ModelLayout> layouts_;
  std::unique_ptr<CacheStore> store_;
};

// Everything observable about a session and its pool.
struct Snapshot {
  SessionStats stats;
  std::vector<BlockTable> tables;
  std::vector<LayerKvCopy> data;
  PoolStats pool;
  std::vector<SessionId> sessions;
};

Snapshot Take(Harness& h, SessionId id) {
  Snapshot s;
  absl::StatusOr<SessionStats> stats = h.store().GetStats(id);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return s;
  s.stats = *stats;
  for (int32_t layer = 0; layer < h.layout(s.stats.layout).num_layers;
       ++layer) {
    absl::StatusOr<BlockTable> t = h.store().GetBlockTable(id, layer);
    absl::StatusOr<LayerKvCopy> kv = h.store().ReadLayer(id, layer);
    EXPECT_TRUE(t.ok() && kv.ok());
    if (!t.ok() || !kv.ok()) return s;
    s.tables.push_back(*t);
    s.data.push_back(*kv);
  }
  s.pool = h.Pool(s.stats.layout);
  s.sessions = h.store().ListSessions();
  return s;
}

void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.stats.resident_tokens, b.stats.resident_tokens);
  EXPECT_EQ(a.stats.pages, b.stats.pages);
  EXPECT_EQ(a.stats.bytes, b.stats.bytes);
  EXPECT_EQ(a.stats.evicted_tokens, b.stats.evicted_tokens);
  EXPECT_EQ(a.stats.evicted_score, b.stats.evicted_score);
  EXPECT_EQ(a.stats.score_updates, b.stats.score_updates);
  EXPECT_EQ(a.stats.compressed, b.stats.compressed);
  EXPECT_EQ(a.stats.layer_resident, b.stats.layer_resident);
  EXPECT_EQ(a.stats.layer_version, b.stats.layer_version);
  ASSERT_EQ(a.tables.size(), b.tables.size());
  for (size_t l = 0; l < a.tables.size(); ++l) {
    EXPECT_EQ(a.tables[l].version, b.tables[l].version) << "layer " << l;
    EXPECT_EQ(a.tables[l].pages, b.tables[l].pages) << "layer " << l;
    EXPECT_EQ(a.tables[l].positions, b.tables[l].positions) << "layer " << l;
    EXPECT_EQ(a.tables[l].cache_positions, b.tables[l].cache_positions);
    EXPECT_EQ(a.data[l].keys, b.data[l].keys) << "layer " << l;
    EXPECT_EQ(a.data[l].values, b.data[l].values) << "layer " << l;
  }
  EXPECT_EQ(a.pool.used_pages, b.pool.used_pages);
  EXPECT_EQ(a.pool.owners, b.pool.owners);
  EXPECT_EQ(a.sessions, b.sessions);
}

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

// ---------------------------------------------------------------------------
// Unknown sessions, layouts, policies and budgets.

TEST(UnknownSession, IsNotFoundForEveryOperation) {
  Harness h({MakeLayout("l", 1, 2)});
  KV_ASSIGN_OR_FAIL(SessionId closed, h.Open("l", "h2o", {}, 4));
  KV_ASSERT_OK(h.Append(closed, "l", {0}));
  KV_ASSERT_OK(h.store().CloseSession(closed));
  for (SessionId id : {closed, SessionId{0}, SessionId{12345}}) {
    SCOPED_TRACE(id);
    AppendBuffers b(h.layout("l"), {1});
    ExpectNotFound(h.store().Append(id, b.request()), id);
    const std::vector<float> row = {1.f};
    LayerScores s{0, 2, ScoreSource::kReduced, 1, row};
    ExpectNotFound(h.store().UpdateScores(id, std::span(&s, 1)), id);
    ExpectNotFound(h.store().CompressPrompt(id, std::span(&s, 1)), id);
    ExpectNotFound(h.store().GetBlockTable(id, 0), id);
    ExpectNotFound(h.store().ReadLayer(id, 0), id);
    ExpectNotFound(h.store().GetStats(id), id);
    ExpectNotFound(h.store().CloseSession(id), id);
  }
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
  EXPECT_EQ(h.Pool("l").used_pages, 0);
}

TEST(CreateSession, RefusesUnknownLayoutsPoliciesAndImpossibleBudgets) {
  Harness h({MakeLayout("l", 2, 2)});
  ExpectError(h.Open("nope", "h2o", {}, 4), absl::StatusCode::kNotFound,
              {"nope"});
  ExpectError(h.Open("l", "h3o", {}, 4), absl::StatusCode::kInvalidArgument,
              {"h3o", "h2o"});
  ExpectError(h.Open("l", "h2o", {{"recnet", "2"}}, 4),
              absl::StatusCode::kInvalidArgument, {"recnet"});
  ExpectError(h.Open("l", "h2o", {{"recent", "two"}}, 4),
              absl::StatusCode::kInvalidArgument, {"recent"});
  // budget < sinks + recent (+ slack).
  ExpectError(h.Open("l", "h2o", {{"sinks", "2"}, {"recent", "3"}}, 4),
              absl::StatusCode::kInvalidArgument, {"budget 4", "protected"});
  ExpectError(h.Open("l", "streaming_llm", {}, 3),
              absl::StatusCode::kInvalidArgument, {"sinks 4"});
  ExpectError(h.Open("l", "tova", {{"recent", "2"}, {"slack", "3"}}, 4),
              absl::StatusCode::kInvalidArgument, {"slack 3"});
  ExpectError(h.Open("l", "h2o", {}, 0), absl::StatusCode::kInvalidArgument,
              {"at least 1"});
  SessionSpec pyramid;
  pyramid.layout = "l";
  pyramid.policy = PolicySpec{"h2o", {{"sinks", "4"}, {"recent", "4"}}};
  pyramid.budget.tokens = 6;
  pyramid.budget.schedule = "pyramid";
  ExpectError(h.store().CreateSession(pyramid),
              absl::StatusCode::kInvalidArgument, {"pyramid", "protected"});
  pyramid.budget.schedule = "pyramidal";
  ExpectError(h.store().CreateSession(pyramid),
              absl::StatusCode::kInvalidArgument, {"pyramidal"});
  SessionSpec per_layer;
  per_layer.layout = "l";
  per_layer.policy = PolicySpec{"h2o", {}};
  per_layer.budget.per_layer = {4, 4, 4};
  ExpectError(h.store().CreateSession(per_layer),
              absl::StatusCode::kInvalidArgument, {"3 entries", "2 layers"});
  per_layer.budget.per_layer = {4, 0};
  ExpectError(h.store().CreateSession(per_layer),
              absl::StatusCode::kInvalidArgument, {"layer 1"});
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
  EXPECT_EQ(h.store().Layouts()[0].sessions, 0);
}

// snapkv's protected tokens are its observation window: a budget below it
// must be refused with a message that names the parameter the client set.
TEST(CreateSession, SnapKvBudgetBelowTheWindowNamesTheWindow) {
  Harness h({MakeLayout("l", 2, 2)});
  ExpectError(h.Open("l", "snapkv", {{"window", "8"}}, 4),
              absl::StatusCode::kInvalidArgument, {"budget 4", "window"});
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
}

TEST(CreateStore, RefusesBadOptions) {
  StoreOptions none;
  ExpectError(CacheStore::Create(none), absl::StatusCode::kInvalidArgument,
              {"layout"});
  StoreOptions twice;
  twice.pools = {PoolSpec{MakeLayout("a", 1, 2), 4},
                 PoolSpec{MakeLayout("a", 2, 2), 4}};
  ExpectError(CacheStore::Create(twice), absl::StatusCode::kInvalidArgument,
              {"'a'", "twice"});
  StoreOptions gqa;
  gqa.pools = {PoolSpec{MakeLayout("g", 1, 2, 3, 4), 4}};
  ExpectError(CacheStore::Create(gqa), absl::StatusCode::kInvalidArgument,
              {"multiple"});
  StoreOptions empty_pool;
  empty_pool.pools = {PoolSpec{MakeLayout("e", 1, 2), 0}};
  ExpectError(CacheStore::Create(empty_pool),
              absl::StatusCode::kInvalidArgument, {"'e'", "capacity"});
}

// ---------------------------------------------------------------------------
// Limits: pool capacity and max_sessions.

TEST(PoolExhausted, AppendChangesNothingAndSucceedsOncePagesAreFree) {
  Harness h({MakeLayout("l", 1, 2)}, /*capacity_pages=*/4);
  KV_ASSIGN_OR_FAIL(SessionId a, h.Open("l", "full", {}, 1));
  KV_ASSIGN_OR_FAIL(SessionId b, h.Open("l", "full", {}, 1));
  KV_ASSERT_OK(h.Append(a, "l", {0, 1, 2, 3, 4, 5}));
  KV_ASSERT_OK(h.Append(b, "l", {0, 1}));
  ASSERT_EQ(h.Pool("l").used_pages, 4);
  const Snapshot a_before = Take(h, a);
  const Snapshot b_before = Take(h, b);
  // Position 6 fits no page: refused, naming the shortfall.
  ExpectError(h.Append(a, "l", {6}), absl::StatusCode::kResourceExhausted,
              {"exhausted", "need 1", "0 of 4"});
  // A chunk that needs more pages than the pool has at all.
  ExpectError(h.Append(a, "l", {6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}),
              absl::StatusCode::kResourceExhausted, {"exhausted"});
  // b's only page is full too.
  ExpectError(h.Append(b, "l", {2}), absl::StatusCode::kResourceExhausted,
              {"exhausted"});
  ExpectSame(a_before, Take(h, a));
  ExpectSame(b_before, Take(h, b));
  EXPECT_EQ(h.Pool("l").allocation_failures, 3);

  KV_ASSERT_OK(h.store().CloseSession(b));
  EXPECT_EQ(h.Pool("l").used_pages, 3);
  KV_ASSIGN_OR_FAIL(StepResult r, h.Append(a, "l", {6}));
  EXPECT_EQ(r.layers[0].resident, 7);
  EXPECT_EQ(r.layers[0].pages_added.size(), 1u);
  KV_ASSERT_OK(h.Append(a, "l", {7}));  // fills the new page's second slot
  EXPECT_EQ(h.Pool("l").used_pages, 4);
  KV_ASSERT_OK(h.store().CloseSession(a));
  EXPECT_EQ(h.Pool("l").used_pages, 0);
}

// An h2o layer over budget (no scores since the last append) settles at the
// next append, and keeps the pages its settle empties for the new tokens.
// Layout: 2 layers, pages of 2; the session holds 3 tokens per layer (2 pages
// each, 4 in all), budget 2, and the pool has no page left.
class SettlingAppendTest : public ::testing::Test {
 protected:
  SettlingAppendTest() : h_({MakeLayout("l", 2, 2)}, /*capacity_pages=*/4) {}
  void SetUp() override {
    KV_ASSIGN_OR_FAIL(id_, h_.Open("l", "h2o", {}, 2));
    KV_ASSERT_OK(h_.Append(id_, "l", {0, 1, 2}));
    ASSERT_EQ(h_.Pool("l").used_pages, 4);
  }
  Harness h_;
  SessionId id_ = 0;
};

TEST_F(SettlingAppendTest, NeedsNoNewPageWhenItsSettleMakesRoom) {
  // 3 tokens -> settle to 2 (one page) -> append 1 -> 3 tokens on 2 pages.
  KV_ASSIGN_OR_FAIL(StepResult r, h_.Append(id_, "l", {3}));
  for (const LayerChange& c : r.layers) {
    EXPECT_THAT(c.evicted_positions, ElementsAre(0));
    EXPECT_EQ(c.resident, 3);
    EXPECT_EQ(c.pages_freed.size(), c.pages_added.size());
  }
  EXPECT_EQ(h_.Pool("l").used_pages, 4);
  EXPECT_EQ(h_.Pool("l").allocation_failures, 0);
  EXPECT_THAT(h_.Resident(id_, 1), ElementsAre(1, 2, 3));
}

TEST_F(SettlingAppendTest, ThatGrowsIsRefusedWhole) {
  // 3 tokens -> settle to 2 -> append 3 -> 5 tokens on 3 pages: one more
  // page per layer than the pool has. Refused; nothing settled either.
  const Snapshot before = Take(h_, id_);
  ExpectError(h_.Append(id_, "l", {3, 4, 5}),
              absl::StatusCode::kResourceExhausted, {"exhausted", "need 2"});
  ExpectSame(before, Take(h_, id_));
  EXPECT_EQ(h_.Pool("l").allocation_failures, 1);
  // The session still works: one token fits.
  KV_ASSERT_OK(h_.Append(id_, "l", {3}));
}

TEST(MaxSessions, RefusesPastTheLimitUntilOneCloses) {
  Harness h({MakeLayout("l", 1, 2)}, 16, /*max_sessions=*/2);
  KV_ASSIGN_OR_FAIL(SessionId a, h.Open("l", "window", {}, 4));
  KV_ASSIGN_OR_FAIL(SessionId b, h.Open("l", "window", {}, 4));
  ExpectError(h.Open("l", "window", {}, 4),
              absl::StatusCode::kResourceExhausted, {"maximum of 2"});
  EXPECT_THAT(h.store().ListSessions(), Sorted({a, b}));
  KV_ASSERT_OK(h.store().CloseSession(a));
  KV_ASSIGN_OR_FAIL(SessionId c, h.Open("l", "window", {}, 4));
  EXPECT_NE(c, a) << "ids are not reused";
  EXPECT_THAT(h.store().ListSessions(), Sorted({b, c}));
}

// ---------------------------------------------------------------------------
// Closing

TEST(Close, FreesEveryPageAndListSessionsFollows) {
  Harness h({MakeLayout("x", 2, 2), MakeLayout("y", 3, 4, 2, 4, 8)});
  KV_ASSIGN_OR_FAIL(SessionId a, h.Open("x", "h2o", {}, 5));
  KV_ASSIGN_OR_FAIL(SessionId b, h.Open("y", "window", {}, 6));
  KV_ASSIGN_OR_FAIL(SessionId c, h.Open("x", "full", {}, 1));
  EXPECT_THAT(h.store().ListSessions(), Sorted({a, b, c}));
  KV_ASSERT_OK(h.Append(a, "x", {0, 1, 2, 3, 4, 5, 6}));
  KV_ASSERT_OK(h.AttendAll(a, 2, {{{0, 1.f}}, {{1, 1.f}}}));
  KV_ASSERT_OK(h.Append(b, "y", {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  KV_ASSERT_OK(h.Append(c, "x", {0, 1, 2}));
  KV_ASSIGN_OR_FAIL(SessionStats sa, h.store().GetStats(a));
  KV_ASSIGN_OR_FAIL(SessionStats sb, h.store().GetStats(b));
  KV_ASSIGN_OR_FAIL(SessionStats sc, h.store().GetStats(c));
  EXPECT_EQ(sa.pages, 2 * 3);  // 5 tokens per layer, pages of 2
  EXPECT_EQ(sb.pages, 3 * 2);  // 6 tokens per layer, pages of 4
  EXPECT_EQ(sc.pages, 2 * 2);
  EXPECT_EQ(sa.bytes, sa.pages * h.Pool("x").page_bytes);
  EXPECT_EQ(h.Pool("x").used_pages, sa.pages + sc.pages);
  EXPECT_EQ(h.Pool("x").owners, 2);
  EXPECT_EQ(h.Pool("y").used_pages, sb.pages);
  std::vector<LayoutStats> layouts = h.store().Layouts();
  ASSERT_EQ(layouts.size(), 2u);
  EXPECT_EQ(layouts[0].layout.name, "x");
  EXPECT_EQ(layouts[0].sessions, 2);
  EXPECT_EQ(layouts[1].sessions, 1);

  KV_ASSERT_OK(h.store().CloseSession(a));
  EXPECT_EQ(h.Pool("x").used_pages, sc.pages);
  EXPECT_THAT(h.store().ListSessions(), Sorted({b, c}));
  KV_ASSERT_OK(h.store().CloseSession(b));
  EXPECT_EQ(h.Pool("y").used_pages, 0);
  EXPECT_THAT(h.store().ListSessions(), ElementsAre(c));
  KV_ASSERT_OK(h.store().CloseSession(c));
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
  for (const LayoutStats& s : h.store().Layouts()) {
    EXPECT_EQ(s.pool.used_pages, 0) << s.layout.name;
    EXPECT_EQ(s.pool.owners, 0) << s.layout.name;
    EXPECT_EQ(s.sessions, 0) << s.layout.name;
  }
}

// ---------------------------------------------------------------------------
// Concurrency

// Drives one session for `steps` decode steps: append, then (for policies
// that take them) scores over the resident slots. Returns the failures.
void DriveSession(Harness& h, SessionId id, const std::string& policy,
                  int64_t budget, int32_t layers, int64_t steps,
                  uint64_t seed) {
  const bool scored = policy != "window" && policy != "streaming_llm";
  for (int64_t pos = 0; pos < steps; ++pos) {
    absl::StatusOr<StepResult> a = h.Append(id, "c", {pos * 2 + 1});
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(a->layers.size(), static_cast<size_t>(layers));
    if (!scored) {
      for (const LayerChange& c : a->layers) {
        EXPECT_EQ(c.resident, std::min(pos + 1, budget));
      }
      continue;
    }
    std::vector<std::vector<float>> rows(layers);
    std::vector<LayerScores> scores;
    for (int32_t layer = 0; layer < layers; ++layer) {
      absl::StatusOr<BlockTable> t = h.store().GetBlockTable(id, layer);
      ASSERT_TRUE(t.ok()) << t.status();
      const int64_t n = static_cast<int64_t>(t->positions.size());
      for (int64_t s = 0; s < n; ++s) {
        rows[layer].push_back(static_cast<float>(
            (Noise(seed, pos, layer, static_cast<uint64_t>(t->positions[s])) +
             1.0) /
            (2.0 * static_cast<double>(n))));
      }
      scores.push_back(LayerScores{layer, t->version, ScoreSource::kReduced, 1,
                                   rows[layer]});
    }
    absl::StatusOr<StepResult> u = h.store().UpdateScores(id, scores);
    ASSERT_TRUE(u.ok()) << u.status();
    for (const LayerChange& c : u->layers) {
      EXPECT_EQ(c.resident, std::min(pos + 1, budget));
    }
  }
  absl::StatusOr<SessionStats> stats = h.store().GetStats(id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->resident_tokens, layers * std::min(steps, budget));
  EXPECT_EQ(stats->evicted_tokens,
            layers * std::max<int64_t>(0, steps - budget));
  EXPECT_EQ(stats->policy, policy);
}

TEST(Concurrency, ManyThreadsDriveTheirOwnSessionsOnOneStore) {
  constexpr int kThreads = 8;
  constexpr int kSessionsPerThread = 3;
  constexpr int64_t kSteps = 100;
  constexpr int32_t kLayers = 2;
  Harness h({MakeLayout("c", kLayers, 4, 2, 4, 8)}, /*capacity_pages=*/2048);
  const std::vector<std::string> policies = {"h2o", "tova", "window",
                                             "scissorhands", "streaming_llm"};
  std::atomic<bool> done{false};
  std::atomic<int64_t> observed{0};
  std::thread observer([&] {
    while (!done.load()) {
      for (const LayoutStats& s : h.store().Layouts()) {
        EXPECT_LE(s.pool.used_pages, s.pool.capacity_pages);
        EXPECT_GE(s.sessions, 0);
        EXPECT_LE(s.sessions, kThreads);
      }
      for (SessionId id : h.store().ListSessions()) {
        absl::StatusOr<SessionStats> stats = h.store().GetStats(id);
        if (!stats.ok()) {
          // Closed since it was listed.
          EXPECT_EQ(stats.status().code(), absl::StatusCode::kNotFound);
          continue;
        }
        EXPECT_EQ(stats->bytes, stats->pages * h.Pool("c").page_bytes);
        EXPECT_LE(stats->resident_tokens, kLayers * (12 + 1));
        ++observed;
      }
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int k = 0; k < kSessionsPerThread; ++k) {
        const std::string& policy = policies[(t + k) % policies.size()];
        const int64_t budget = 8 + (t + k) % 5;  // 8..12
        std::map<std::string, std::string> params;
        if (policy == "streaming_llm") params["sinks"] = "2";
        absl::StatusOr<SessionId> id = h.Open("c", policy, params, budget);
        ASSERT_TRUE(id.ok()) << id.status();
        DriveSession(h, *id, policy, budget, kLayers, kSteps,
                     static_cast<uint64_t>(t * 100 + k));
        EXPECT_TRUE(h.store().CloseSession(*id).ok());
        EXPECT_EQ(h.store().GetStats(*id).status().code(),
                  absl::StatusCode::kNotFound);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  done = true;
  observer.join();
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
  const PoolStats pool = h.Pool("c");
  EXPECT_EQ(pool.used_pages, 0);
  EXPECT_EQ(pool.owners, 0);
  EXPECT_EQ(pool.allocation_failures, 0);
  EXPECT_EQ(h.store().Layouts()[0].sessions, 0);
}

TEST(Concurrency, CloseWhileAnotherThreadAppendsIsSafe) {
  Harness h({MakeLayout("l", 2, 2)}, /*capacity_pages=*/256);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(round);
    KV_ASSIGN_OR_FAIL(SessionId id, h.Open("l", "window", {}, 8));
    std::atomic<int64_t> appended{0};
    std::atomic<bool> closed_seen{false};
    std::atomic<bool> appender_done{false};
    std::thread appender([&] {
      struct Done {
        std::atomic<bool>& flag;
        ~Done() { flag = true; }
      } done{appender_done};
      for (int64_t pos = 0; pos < 100000; ++pos) {
        absl::StatusOr<StepResult> r = h.Append(id, "l", {pos});
        if (r.ok()) {
          ++appended;
          EXPECT_LE(r->layers[0].resident, 8);
          continue;
        }
        EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
        closed_seen = true;
        // Gone for good.
        EXPECT_EQ(h.Append(id, "l", {pos + 1}).status().code(),
                  absl::StatusCode::kNotFound);
        return;
      }
    });
    std::thread reader([&] {
      while (!appender_done.load()) {
        absl::StatusOr<BlockTable> t = h.store().GetBlockTable(id, 1);
        if (!t.ok()) {
          EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
          return;
        }
        EXPECT_EQ(t->positions.size(), t->cache_positions.size());
      }
    });
    // Close once the appender is under way (rounds vary where it lands).
    while (appended.load() < 5 + round * 3 && !appender_done.load()) {
      std::this_thread::yield();
    }
    EXPECT_TRUE(h.store().CloseSession(id).ok());
    appender.join();
    reader.join();
    EXPECT_TRUE(closed_seen.load());
    EXPECT_EQ(h.Pool("l").used_pages, 0);
  }
  EXPECT_THAT(h.store().ListSessions(), IsEmpty());
}

// Step into one StepOutcome reused for every step (as a decode stream does)
// gives what a fresh outcome per step gives: nothing of an earlier step's
// evictions, moves or pages is left in the reused one. Two stores, the same
// calls: the same page ids.
TEST(StepIntoReusedOutcome, MatchesAFreshOutcomeEveryStep) {
  const ModelLayout l = MakeLayout("l", 2, 4);
  Harness fresh_store({l}), reused_store({l});
  const std::map<std::string, std::string> params = {
      {"sinks", "1"}, {"recent", "2"}, {"slack", "3"}};
  absl::StatusOr<SessionId> fresh_id = fresh_store.Open("l", "h2o", params, 8);
  absl::StatusOr<SessionId> reused_id =
      reused_store.Open("l", "h2o", params, 8);
  ASSERT_TRUE(fresh_id.ok() && reused_id.ok());
  absl::StatusOr<SessionStats> stats = fresh_store.store().GetStats(*fresh_id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  std::vector<uint64_t> version = stats->layer_version;
  std::vector<int64_t> resident = stats->layer_resident;
  StepOutcome reused;
  int64_t evicted = 0;
  for (int64_t step = 0; step < 60; ++step) {
    // Some steps send scores only, and some append only (the step after
    // those settles the layer over budget with scores only).
    const bool append = step % 7 != 6 && !(step > 0 && step % 11 == 0);
    const bool score = step % 11 != 10;
    const AppendBuffers buffers(
        l, append ? std::vector<int64_t>{step} : std::vector<int64_t>{});
    std::vector<std::vector<float>> rows(2);
    std::vector<LayerScores> scores;
    for (int32_t layer = 0; layer < 2 && score; ++layer) {
      const int64_t n = resident[layer] + (append ? 1 : 0);
      for (int64_t j = 0; j < n; ++j) {
        rows[layer].push_back(
            static_cast<float>(1 + (j * 7 + step * 3 + layer) % 5) /
            static_cast<float>(5 * n));
      }
      scores.push_back(LayerScores{layer, version[layer], ScoreSource::kReduced,
                                   1, rows[layer]});
    }
    const AppendRequest request = append ? buffers.request() : AppendRequest{};
    absl::StatusOr<StepOutcome> want =
        fresh_store.store().Step(*fresh_id, request, scores);
    ASSERT_TRUE(want.ok()) << "step " << step << ": " << want.status();
    ASSERT_TRUE(
        reused_store.store().Step(*reused_id, request, scores, reused).ok());
    for (const auto& [got, expected] :
         {std::pair(&reused.append, &want->append),
          std::pair(&reused.scores, &want->scores)}) {
      ASSERT_EQ(got->layers.size(), expected->layers.size());
      for (size_t i = 0; i < expected->layers.size(); ++i) {
        const LayerChange& g = got->layers[i];
        const LayerChange& e = expected->layers[i];
        SCOPED_TRACE(absl::StrFormat("step %d layer %d", step, i));
        EXPECT_EQ(g.layer, e.layer);
        EXPECT_EQ(g.version, e.version);
        EXPECT_EQ(g.resident, e.resident);
        EXPECT_EQ(g.evicted_positions, e.evicted_positions);
        EXPECT_EQ(g.moves, e.moves);
        EXPECT_EQ(g.pages_freed, e.pages_freed);
        EXPECT_EQ(g.pages_added, e.pages_added);
        evicted += static_cast<int64_t>(e.evicted_positions.size());
      }
    }
    // The scores' result has every layer's counts after the whole step.
    for (int32_t layer = 0; layer < 2; ++layer) {
      version[layer] = want->scores.layers[layer].version;
      resident[layer] = want->scores.layers[layer].resident;
    }
  }
  EXPECT_GT(evicted, 40);
}

}  // namespace
}  // namespace kvkeep
