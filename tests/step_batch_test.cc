// StepBatch (cache_store/step_batch.h) and how a session uses it: what a
// batch copies when recorded, the order its stages and kinds run in over host
// memory, and that a session call runs its page work as one batch (two when
// the store scores queries and the scores evict), freeing emptied pages only
// after the batch. The session cases run on KVKEEP_TEST_DEVICE, so the device
// check repeats them on the CUDA memory (tests/gpu/step_batch_test.cc compares
// the two memories batch for batch).
#include "cache_store/step_batch.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "cache_store/page_memory.h"
#include "cache_store/page_pool.h"
#include "cache_store/policy_registry.h"
#include "cache_store/session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/compaction.h"
#include "kernels/dtype.h"
#include "tests/test_device.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;

constexpr PageLayout kLayout{/*page_tokens=*/2, /*kv_heads=*/1,
                             /*head_dim=*/4, DType::kF32};

// A token's keys (values: the negation), recognisable by `tag`.
std::vector<std::byte> Token(float tag, bool values = false) {
  std::vector<std::byte> out(kLayout.token_bytes());
  for (int32_t i = 0; i < kLayout.head_dim; ++i) {
    StoreFromFloat(kLayout.dtype, out.data(), i,
                   (values ? -1.0f : 1.0f) * (tag + 0.125f * i));
  }
  return out;
}

// The tag of the keys in `slot` of the layer whose block table is `pages`.
float TagAt(std::byte* arena, std::span<const PageId> pages, int64_t slot) {
  float tag = 0;
  std::memcpy(&tag,
              arena + kLayout.key_offset(pages[slot / kLayout.page_tokens],
                                         slot % kLayout.page_tokens),
              sizeof tag);
  return tag;
}

TEST(StepBatchTest, CopiesTablesAndMovesAndKeepsOnlyTheWrittenPages) {
  StepBatch batch(kLayout);
  std::vector<PageId> pages = {7, 3, 9, 4};
  std::vector<SlotMove> moves = {{5, 1}};
  batch.AddMoves(pages, moves);
  // Slots 3..4 live in pages[1] and pages[2]: only they are kept, and slot 3
  // becomes slot 1 of the kept pages.
  batch.AddWrite(pages, 3, 2, nullptr, nullptr);
  pages.assign({0, 0, 0, 0});  // the session changes its table afterwards
  moves[0] = {0, 0};
  ASSERT_EQ(batch.moves().size(), 1u);
  EXPECT_THAT(batch.pages(batch.moves()[0].pages), ElementsAre(7, 3, 9, 4));
  EXPECT_THAT(batch.slot_moves(batch.moves()[0].moves),
              ElementsAre(SlotMove{5, 1}));
  ASSERT_EQ(batch.writes().size(), 1u);
  EXPECT_THAT(batch.pages(batch.writes()[0].pages), ElementsAre(3, 9));
  EXPECT_EQ(batch.writes()[0].first, 1);
  EXPECT_EQ(batch.writes()[0].n, 2);
}

TEST(StepBatchTest, EmptyEntriesAreNotRecordedAndClearForgetsAll) {
  StepBatch batch(kLayout);
  const std::vector<PageId> pages = {1};
  batch.NextStage();  // nothing recorded yet: still stage 0
  batch.AddMoves(pages, {});
  batch.AddWrite(pages, 0, 0, nullptr, nullptr);
  batch.AddScoring(pages, {}, /*slots=*/0, nullptr, std::vector<int64_t>{0}, 1,
                   nullptr);
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(batch.stages(), 0);
  batch.AddWrite(pages, 0, 1, nullptr, nullptr);
  batch.NextStage();
  batch.AddWrite(pages, 1, 1, nullptr, nullptr);
  EXPECT_EQ(batch.stages(), 2);
  EXPECT_EQ(batch.writes()[1].stage, 1);
  batch.Clear();
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(batch.stages(), 0);
}

// Within a stage moves run before writes, whatever the recording order; a
// later stage sees what an earlier one wrote.
TEST(StepBatchTest, MovesThenWritesWithinAStageAndStagesInOrder) {
  std::vector<std::byte> arena(4 * kLayout.page_bytes());
  const std::vector<PageId> pages = {2, 0, 3};
  const std::vector<std::byte> old_keys = Token(1), old_values = Token(1, true);
  const std::vector<std::byte> new_keys = Token(2), new_values = Token(2, true);
  StepBatch setup(kLayout);
  setup.AddWrite(pages, 4, 1, old_keys.data(), old_values.data());
  RunStepOnHost(arena.data(), setup);

  StepBatch batch(kLayout);
  batch.AddWrite(pages, 4, 1, new_keys.data(), new_values.data());
  const std::vector<SlotMove> first = {{4, 0}};
  batch.AddMoves(pages, first);  // recorded after the write, runs before it
  batch.NextStage();
  const std::vector<SlotMove> second = {{4, 1}};
  batch.AddMoves(pages, second);
  RunStepOnHost(arena.data(), batch);

  EXPECT_EQ(TagAt(arena.data(), pages, 0), 1.0f);  // the old token
  EXPECT_EQ(TagAt(arena.data(), pages, 1), 2.0f);  // the new one
  EXPECT_EQ(TagAt(arena.data(), pages, 4), 2.0f);
}

// A page copy (copy-on-write) runs first in its stage, whenever recorded:
// the moves and writes of that stage work on the copy, the source keeps its
// bytes, and a later stage copies what an earlier one wrote.
TEST(StepBatchTest, PageCopiesRunFirstInTheirStage) {
  std::vector<std::byte> arena(5 * kLayout.page_bytes());
  const std::vector<PageId> shared = {1};
  const std::vector<std::byte> a = Token(1), b = Token(2), c = Token(3);
  StepBatch setup(kLayout);
  setup.AddWrite(shared, 0, 1, a.data(), a.data());
  setup.AddWrite(shared, 1, 1, b.data(), b.data());
  RunStepOnHost(arena.data(), setup);

  const std::vector<PageId> own = {4};
  StepBatch batch(kLayout);
  const std::vector<SlotMove> moves = {{1, 0}};
  batch.AddMoves(own, moves);
  batch.AddWrite(own, 1, 1, c.data(), c.data());
  batch.AddPageCopy(1, 4);  // recorded last, runs first
  batch.NextStage();
  batch.AddPageCopy(4, 2);
  RunStepOnHost(arena.data(), batch);

  EXPECT_EQ(TagAt(arena.data(), shared, 0), 1.0f);  // the source: untouched
  EXPECT_EQ(TagAt(arena.data(), shared, 1), 2.0f);
  EXPECT_EQ(TagAt(arena.data(), own, 0), 2.0f);  // moved within the copy
  EXPECT_EQ(TagAt(arena.data(), own, 1), 3.0f);  // written into it
  const std::vector<PageId> again = {2};
  EXPECT_EQ(TagAt(arena.data(), again, 0), 2.0f);
  EXPECT_EQ(TagAt(arena.data(), again, 1), 3.0f);
}

// Scoring runs after the stage's writes, and an empty order (every slot
// visible) gives exactly what an order that hides nothing gives.
TEST(StepBatchTest, ScoringSeesTheStagesWritesAndEmptyOrderHidesNothing) {
  std::vector<std::byte> arena(4 * kLayout.page_bytes());
  const std::vector<PageId> pages = {1, 3};
  std::vector<std::byte> keys, values;
  for (int t = 0; t < 3; ++t) {
    const std::vector<std::byte> k = Token(0.5f * t), v = Token(t, true);
    keys.insert(keys.end(), k.begin(), k.end());
    values.insert(values.end(), v.begin(), v.end());
  }
  const int32_t query_heads = 2;
  std::vector<float> query(query_heads * kLayout.head_dim);
  std::iota(query.begin(), query.end(), -3.0f);
  const std::vector<int64_t> arrival = {0, 1, 2};
  const std::vector<int64_t> newest = {2};

  std::vector<float> batched(3), ordered(3), direct(3);
  StepBatch batch(kLayout);
  batch.AddScoring(pages, {}, 3, query.data(), newest, query_heads,
                   batched.data());
  batch.AddWrite(pages, 0, 3, keys.data(), values.data());
  RunStepOnHost(arena.data(), batch);

  batch.Clear();
  batch.AddScoring(pages, arrival, 3, query.data(), newest, query_heads,
                   ordered.data());
  RunStepOnHost(arena.data(), batch);

  std::vector<float> scratch(query_heads * 3 + kLayout.head_dim);
  QueryAttention(PagedKeys{arena.data(), kLayout, pages, arrival, 3},
                 query.data(), newest.data(), 1, query_heads, direct.data(),
                 scratch.data());
  EXPECT_EQ(batched, direct);
  EXPECT_EQ(ordered, direct);
  EXPECT_GT(direct[0], 0.0f);  // the keys were there when it scored
}

// ---------------------------------------------------------------------------
// A session's calls, counted in batches on its pool's memory.

class SessionBatchTest : public ::testing::Test {
 protected:
  static constexpr int32_t kLayers = 3;
  static constexpr int64_t kBudget = 8;

  void SetUp() override {
    layout_.name = "batch";
    layout_.num_layers = kLayers;
    layout_.kv_heads = 1;
    layout_.query_heads = 2;
    layout_.head_dim = 64;
    layout_.dtype = DType::kF32;
    layout_.page_tokens = 3;
    absl::StatusOr<std::unique_ptr<PagePool>> pool =
        PagePool::Create(layout_.page_layout(), 64, test_support::TestDevice());
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    absl::StatusOr<PolicyPtr> policy =
        NewPolicy(PolicySpec{"h2o", {{"sinks", "1"}, {"recent", "2"}}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    absl::StatusOr<std::unique_ptr<Session>> session =
        Session::Create(1, layout_, pool_.get(), *policy,
                        std::vector<int64_t>(kLayers, kBudget));
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
  }

  // Keys of `position` in `layer`: every element encodes both.
  std::vector<std::byte> Keys(int32_t layer, int64_t position) const {
    std::vector<std::byte> out(layout_.page_layout().token_bytes());
    for (int32_t i = 0; i < layout_.head_dim; ++i) {
      StoreFromFloat(layout_.dtype, out.data(), i,
                     0.01f * static_cast<float>(position) +
                         0.001f * static_cast<float>(layer * 64 + i));
    }
    return out;
  }

  // What a step sends besides its tokens.
  enum class Scores { kNone, kProbabilities, kQueries };

  // Appends `positions` to every layer, with one row of scores per layer.
  absl::StatusOr<StepOutcome> Step(std::vector<int64_t> positions,
                                   Scores with) {
    std::vector<std::vector<std::byte>> bytes(kLayers);
    std::vector<LayerKv> kv(kLayers);
    for (int32_t l = 0; l < kLayers; ++l) {
      for (int64_t p : positions) {
        const std::vector<std::byte> k = Keys(l, p);
        bytes[l].insert(bytes[l].end(), k.begin(), k.end());
      }
      kv[l] = LayerKv{bytes[l], bytes[l]};
    }
    const AppendRequest append{positions, kv};
    if (with == Scores::kNone) {
      absl::StatusOr<StepResult> appended = session_->Append(append);
      if (!appended.ok()) return appended.status();
      return StepOutcome{*std::move(appended), {}};
    }
    const SessionStats stats = session_->stats();
    const int64_t n = stats.layer_resident[0] + 1;
    std::vector<float> data;
    const ScoreSource source = with == Scores::kProbabilities
                                   ? ScoreSource::kReduced
                                   : ScoreSource::kQueries;
    if (source == ScoreSource::kReduced) {
      // Distinct scores, rising with the slot: the oldest unprotected goes.
      for (int64_t s = 0; s < n; ++s) data.push_back((s + 1.0f) / (n * n));
    } else {
      data.assign(layout_.query_heads * layout_.head_dim, 0.0f);
      data[0] = 1.0f;
    }
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < kLayers; ++l) {
      scores.push_back(LayerScores{l, stats.layer_version[l], source, 1,
                                   std::span<const float>(data)});
    }
    return session_->Step(append, scores);
  }

  // Every resident slot holds the keys of the position it claims.
  void ExpectBytesMatchPositions() {
    for (int32_t l = 0; l < kLayers; ++l) {
      absl::StatusOr<LayerKvCopy> copy = session_->ReadLayer(l);
      ASSERT_TRUE(copy.ok()) << copy.status();
      const int64_t token_bytes = layout_.page_layout().token_bytes();
      for (size_t s = 0; s < copy->positions.size(); ++s) {
        const std::vector<std::byte> want = Keys(l, copy->positions[s]);
        EXPECT_EQ(std::memcmp(copy->keys.data() + s * token_bytes, want.data(),
                              token_bytes),
                  0)
            << "layer " << l << " slot " << s;
      }
    }
  }

  int64_t Batches() const { return session_->memory().batches_run(); }

  ModelLayout layout_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<Session> session_;
};

TEST_F(SessionBatchTest, AnAppendIsOneBatchForEveryLayer) {
  const int64_t before = Batches();
  ASSERT_TRUE(Step({0, 1, 2, 3, 4, 5, 6}, Scores::kNone).ok());
  EXPECT_EQ(Batches() - before, 1);
  ExpectBytesMatchPositions();
}

TEST_F(SessionBatchTest, ADecodeStepWithProbabilitiesThatEvictsIsOneBatch) {
  ASSERT_TRUE(Step({0, 1, 2, 3, 4, 5, 6, 7}, Scores::kNone).ok());
  for (int64_t p = 8; p < 20; ++p) {
    const int64_t before = Batches();
    absl::StatusOr<StepOutcome> step = Step({p}, Scores::kProbabilities);
    ASSERT_TRUE(step.ok()) << step.status();
    // The append's write and the eviction's moves, every layer: one batch.
    EXPECT_EQ(Batches() - before, 1) << "position " << p;
    ASSERT_EQ(step->scores.layers[0].evicted_positions.size(), 1u);
    EXPECT_FALSE(step->scores.layers[0].moves.empty());
    ExpectBytesMatchPositions();
  }
}

TEST_F(SessionBatchTest, ADecodeStepWithQueriesWaitsOnceForScoresOnceForMoves) {
  ASSERT_TRUE(Step({0, 1, 2, 3, 4, 5, 6, 7}, Scores::kNone).ok());
  for (int64_t p = 8; p < 20; ++p) {
    const int64_t before = Batches();
    absl::StatusOr<StepOutcome> step = Step({p}, Scores::kQueries);
    ASSERT_TRUE(step.ok()) << step.status();
    // Writes and scoring of every layer, then every layer's moves.
    EXPECT_EQ(Batches() - before, 2) << "position " << p;
    ASSERT_EQ(step->scores.layers[0].evicted_positions.size(), 1u);
    ExpectBytesMatchPositions();
  }
}

TEST_F(SessionBatchTest, PagesEmptiedByAStepAreBackInThePoolAfterIt) {
  ASSERT_TRUE(Step({0, 1, 2, 3, 4, 5, 6, 7}, Scores::kNone).ok());
  for (int64_t p = 8; p < 30; ++p) {
    ASSERT_TRUE(Step({p}, Scores::kProbabilities).ok());
    EXPECT_EQ(pool_->stats().used_pages, session_->stats().pages);
  }
  // A prefill chunk over budget (h2o settles it at the next scores).
  absl::StatusOr<StepOutcome> step = Step({30, 31, 32, 33}, Scores::kNone);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(Step({34}, Scores::kNone).ok());  // settles first
  EXPECT_EQ(pool_->stats().used_pages, session_->stats().pages);
  ExpectBytesMatchPositions();
}

}  // namespace
}  // namespace kvkeep
