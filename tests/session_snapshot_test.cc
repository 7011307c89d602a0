// Session snapshots: a session exported from one store and imported into
// another (a different pool, so different page ids) holds the same bytes in
// the same slots with the same versions, and answers the next steps exactly
// as the original does: the same evictions, moves, versions and stats, for
// every policy. A refused import (taken id, full pool, bad snapshot) holds
// nothing. The two-phase transfer: a frozen session takes no changes until
// the transfer is committed (closed) or aborted (thawed, unchanged); an
// import reserves its pages before any byte arrives and frees them unless
// committed.
#include "cache_store/session_snapshot.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

// 3 layers of bf16, 2 kv / 4 query heads, head_dim 8, 4-token pages.
ModelLayout Layout() {
  ModelLayout l;
  l.name = "snap";
  l.num_layers = 3;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 8;
  l.dtype = DType::kBF16;
  l.page_tokens = 4;
  return l;
}

std::unique_ptr<CacheStore> MakeStore(int64_t pages) {
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools.push_back(PoolSpec{Layout(), pages});
  return *CacheStore::Create(options);
}

struct Case {
  std::string policy;
  std::map<std::string, std::string> params;
  int64_t budget;
  bool scores;  // takes per-step attention
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.policy; }

// Drives sessions with identical, deterministic steps: one token per step
// and, for attention policies, head-reduced attention over the resident
// slots drawn from a seeded generator.
class Driver {
 public:
  explicit Driver(uint64_t seed) : rng_(seed) {}

  // One decode step on `id`; its StepOutcome (append part, scores part).
  absl::StatusOr<StepOutcome> Step(CacheStore& store, SessionId id,
                                   int64_t position, bool scores) {
    const ModelLayout l = Layout();
    const std::vector<int64_t> positions{position};
    keys_.clear();
    values_.clear();
    std::vector<LayerKv> kv;
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      keys_.push_back(test_data::TokenBytes(l, layer, positions, false));
      values_.push_back(test_data::TokenBytes(l, layer, positions, true));
    }
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      kv.push_back(LayerKv{keys_[layer], values_[layer]});
    }
    std::vector<LayerScores> layer_scores;
    rows_.assign(l.num_layers, {});
    if (scores) {
      absl::StatusOr<SessionStats> stats = store.GetStats(id);
      if (!stats.ok()) return stats.status();
      for (int32_t layer = 0; layer < l.num_layers; ++layer) {
        const int64_t n = stats->layer_resident[layer] + 1;
        std::uniform_real_distribution<float> u(0.0f, 4.0f / n);
        for (int64_t i = 0; i < n; ++i) rows_[layer].push_back(u(rng_));
        layer_scores.push_back(LayerScores{layer, stats->layer_version[layer],
                                           ScoreSource::kReduced, 1,
                                           rows_[layer]});
      }
    }
    return store.Step(id, AppendRequest{positions, kv}, layer_scores);
  }

 private:
  std::mt19937 rng_;
  std::vector<std::vector<std::byte>> keys_, values_;
  std::vector<std::vector<float>> rows_;
};

// What a worker sees of a call: evictions, moves, versions, resident counts
// (page ids belong to each store's pool and may differ).
void ExpectSameChanges(const StepResult& a, const StepResult& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerChange& x = a.layers[l];
    const LayerChange& y = b.layers[l];
    EXPECT_EQ(x.version, y.version) << "layer " << l;
    EXPECT_EQ(x.resident, y.resident) << "layer " << l;
    EXPECT_EQ(x.evicted_positions, y.evicted_positions) << "layer " << l;
    ASSERT_EQ(x.moves.size(), y.moves.size()) << "layer " << l;
    for (size_t m = 0; m < x.moves.size(); ++m) {
      EXPECT_EQ(x.moves[m].from_slot, y.moves[m].from_slot);
      EXPECT_EQ(x.moves[m].to_slot, y.moves[m].to_slot);
    }
    EXPECT_EQ(x.pages_freed.size(), y.pages_freed.size());
    EXPECT_EQ(x.pages_added.size(), y.pages_added.size());
  }
}

// Every layer holds the same tokens, bytes and versions in both stores.
void ExpectSameContents(CacheStore& a, SessionId ia, CacheStore& b,
                        SessionId ib) {
  for (int32_t l = 0; l < Layout().num_layers; ++l) {
    absl::StatusOr<LayerKvCopy> x = a.ReadLayer(ia, l);
    absl::StatusOr<LayerKvCopy> y = b.ReadLayer(ib, l);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(x->version, y->version) << "layer " << l;
    EXPECT_EQ(x->positions, y->positions) << "layer " << l;
    EXPECT_TRUE(x->keys == y->keys) << "layer " << l;
    EXPECT_TRUE(x->values == y->values) << "layer " << l;
  }
  const SessionStats sa = *a.GetStats(ia);
  const SessionStats sb = *b.GetStats(ib);
  EXPECT_EQ(sa.policy, sb.policy);
  EXPECT_EQ(sa.tenant, sb.tenant);
  EXPECT_EQ(sa.resident_tokens, sb.resident_tokens);
  EXPECT_EQ(sa.evicted_tokens, sb.evicted_tokens);
  EXPECT_DOUBLE_EQ(sa.evicted_score, sb.evicted_score);
  EXPECT_EQ(sa.score_updates, sb.score_updates);
  EXPECT_EQ(sa.layer_budget, sb.layer_budget);
}

class SnapshotTest : public ::testing::TestWithParam<Case> {};

TEST_P(SnapshotTest, ARestoredSessionDecodesExactlyAsTheOriginal) {
  const Case& c = GetParam();
  std::unique_ptr<CacheStore> a = MakeStore(512);
  std::unique_ptr<CacheStore> b = MakeStore(300);  // other page ids
  // Fragment b's pool so its pages are not handed out in a's order.
  SessionSpec filler{"snap", {"full", {}}, {}, "other"};
  const SessionId hole = *b->CreateSession(filler);
  Driver fill(99);
  for (int64_t p = 0; p < 9; ++p)
    ASSERT_TRUE(fill.Step(*b, hole, p, false).ok());

  SessionSpec spec{"snap", {c.policy, c.params}, {}, "tenant-x"};
  spec.budget.tokens = c.budget;
  const SessionId id = *a->CreateSession(spec);
  Driver driver(7);
  int64_t position = 0;
  for (int step = 0; step < 40; ++step, position += 1 + step % 2) {
    ASSERT_TRUE(driver.Step(*a, id, position, c.scores).ok()) << step;
  }
  absl::StatusOr<SessionSnapshot> snapshot = a->ExportSession(id);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->tenant, "tenant-x");
  EXPECT_EQ(snapshot->policy.name, c.policy);
  absl::StatusOr<SessionId> imported = b->ImportSession(*snapshot);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(*imported, id);
  ExpectSameContents(*a, id, *b, id);

  // The same next steps on both: the same answers, step by step.
  Driver on_a(11), on_b(11);
  for (int step = 0; step < 60; ++step, position += 1 + step % 3) {
    absl::StatusOr<StepOutcome> x = on_a.Step(*a, id, position, c.scores);
    absl::StatusOr<StepOutcome> y = on_b.Step(*b, id, position, c.scores);
    ASSERT_TRUE(x.ok() && y.ok()) << step;
    SCOPED_TRACE(step);
    ExpectSameChanges(x->append, y->append);
    ExpectSameChanges(x->scores, y->scores);
  }
  ExpectSameContents(*a, id, *b, id);
  ASSERT_TRUE(b->CloseSession(id).ok());
  ASSERT_TRUE(b->CloseSession(hole).ok());
  EXPECT_EQ(b->Layouts()[0].pool.used_pages, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, SnapshotTest,
    ::testing::Values(
        Case{"full", {}, 0, false}, Case{"window", {{"slack", "3"}}, 12, false},
        Case{"streaming_llm", {{"sinks", "2"}}, 12, false},
        Case{
            "h2o", {{"recent", "4"}, {"sinks", "1"}, {"slack", "2"}}, 14, true},
        Case{"tova", {}, 10, true},
        Case{"scissorhands", {{"history", "8"}, {"recent", "3"}}, 12, true},
        Case{"h2o_page", {{"recent", "4"}}, 16, true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return info.param.policy;
    });

// snapkv: a snapshot taken before compression compresses identically after
// the move (the prompt's state and the one-shot flag travel).
TEST(SnapshotSnapKvTest, CompressionAfterTheMoveMatches) {
  std::unique_ptr<CacheStore> a = MakeStore(512);
  std::unique_ptr<CacheStore> b = MakeStore(512);
  SessionSpec spec{"snap", {"snapkv", {{"window", "4"}, {"kernel", "3"}}}, {}};
  spec.budget.tokens = 10;
  const SessionId id = *a->CreateSession(spec);
  Driver driver(3);
  for (int64_t p = 0; p < 30; ++p)
    ASSERT_TRUE(driver.Step(*a, id, p, false).ok());
  ASSERT_TRUE(b->ImportSession(*a->ExportSession(id)).ok());
  std::vector<std::vector<float>> rows(3);
  std::vector<LayerScores> window;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 0.1f);
  for (int32_t l = 0; l < 3; ++l) {
    for (int i = 0; i < 4 * 30; ++i) rows[l].push_back(u(rng));
    window.push_back(LayerScores{l, a->GetStats(id)->layer_version[l],
                                 ScoreSource::kReduced, 4, rows[l]});
  }
  absl::StatusOr<StepResult> x = a->CompressPrompt(id, window);
  absl::StatusOr<StepResult> y = b->CompressPrompt(id, window);
  ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
  ExpectSameChanges(*x, *y);
  ExpectSameContents(*a, id, *b, id);
  // Compressed on both: a second compression is refused on both.
  EXPECT_EQ(b->CompressPrompt(id, window).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SnapshotImportTest, RefusedImportsHoldNothing) {
  std::unique_ptr<CacheStore> a = MakeStore(512);
  SessionSpec spec{"snap", {"h2o", {{"recent", "4"}}}, {}};
  spec.budget.tokens = 64;
  const SessionId id = *a->CreateSession(spec);
  Driver driver(1);
  for (int64_t p = 0; p < 40; ++p)
    ASSERT_TRUE(driver.Step(*a, id, p, true).ok());
  const SessionSnapshot snapshot = *a->ExportSession(id);

  // The id is taken (importing into the store it came from).
  EXPECT_EQ(a->ImportSession(snapshot).status().code(),
            absl::StatusCode::kAlreadyExists);

  // A pool too small for it: RESOURCE_EXHAUSTED, no page held.
  std::unique_ptr<CacheStore> small = MakeStore(20);  // needs 3 x 10 pages
  EXPECT_EQ(small->ImportSession(snapshot).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small->Layouts()[0].pool.used_pages, 0);
  EXPECT_TRUE(small->ListSessions().empty());

  // Inconsistent or foreign snapshots.
  std::unique_ptr<CacheStore> b = MakeStore(512);
  struct Bad {
    std::string why;
    std::function<void(SessionSnapshot&)> spoil;
    absl::StatusCode code;
  };
  const std::vector<Bad> bad = {
      {"layers", [](SessionSnapshot& s) { s.layers.pop_back(); },
       absl::StatusCode::kInvalidArgument},
      {"lengths", [](SessionSnapshot& s) { s.layers[1].score.pop_back(); },
       absl::StatusCode::kInvalidArgument},
      {"bytes", [](SessionSnapshot& s) { s.layers[2].keys.pop_back(); },
       absl::StatusCode::kInvalidArgument},
      {"positions",
       [](SessionSnapshot& s) {
         s.layers[0].position[1] = s.layers[0].position[0];
       },
       absl::StatusCode::kInvalidArgument},
      {"future", [](SessionSnapshot& s) { s.layers[0].position[0] = 1000; },
       absl::StatusCode::kInvalidArgument},
      {"layout", [](SessionSnapshot& s) { s.layout = "other"; },
       absl::StatusCode::kNotFound},
      {"policy", [](SessionSnapshot& s) { s.policy.name = "h3o"; },
       absl::StatusCode::kInvalidArgument},
      {"id", [](SessionSnapshot& s) { s.id = 0; },
       absl::StatusCode::kInvalidArgument},
      // Scores as live input may give them, no others: a NaN would later
      // be sorted by an eviction.
      {"NaN score",
       [](SessionSnapshot& s) {
         s.layers[1].score[2] = std::numeric_limits<float>::quiet_NaN();
       },
       absl::StatusCode::kInvalidArgument},
      {"infinite score",
       [](SessionSnapshot& s) {
         s.layers[0].score[0] = std::numeric_limits<float>::infinity();
       },
       absl::StatusCode::kInvalidArgument},
      {"negative score",
       [](SessionSnapshot& s) { s.layers[2].score[3] = -0.5f; },
       absl::StatusCode::kInvalidArgument},
      {"NaN evicted score",
       [](SessionSnapshot& s) {
         s.work.evicted_score = std::numeric_limits<double>::quiet_NaN();
       },
       absl::StatusCode::kInvalidArgument},
      {"negative count", [](SessionSnapshot& s) { s.work.evicted_tokens = -1; },
       absl::StatusCode::kInvalidArgument},
  };
  for (const Bad& c : bad) {
    SessionSnapshot spoiled = snapshot;
    c.spoil(spoiled);
    EXPECT_EQ(b->ImportSession(spoiled).status().code(), c.code) << c.why;
  }
  EXPECT_EQ(b->Layouts()[0].pool.used_pages, 0);
  EXPECT_TRUE(b->ListSessions().empty());
  // And the good one still goes in.
  EXPECT_TRUE(b->ImportSession(snapshot).ok());
}

SessionId OpenH2O(CacheStore& store, int steps) {
  SessionSpec spec{"snap", {"h2o", {{"recent", "4"}}}, {}};
  spec.budget.tokens = 16;
  const SessionId id = *store.CreateSession(spec);
  Driver driver(21);
  for (int64_t p = 0; p < steps; ++p) {
    EXPECT_TRUE(driver.Step(store, id, p, true).ok());
  }
  return id;
}

TEST(TransferFreezeTest, AFrozenSessionTakesNoChangesUntilTheTransferEnds) {
  std::unique_ptr<CacheStore> store = MakeStore(512);
  const SessionId id = OpenH2O(*store, 30);
  const LayerKvCopy before = *store->ReadLayer(id, 1);
  absl::StatusOr<SessionSnapshot> snapshot = store->FreezeForTransfer(id);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->layers[1].position, before.positions);

  Driver driver(5);
  const absl::Status step = driver.Step(*store, id, 100, true).status();
  EXPECT_EQ(step.code(), absl::StatusCode::kUnavailable) << step;
  EXPECT_THAT(std::string(step.message()), HasSubstr("being transferred"));
  EXPECT_EQ(store->CloseSession(id).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->FreezeForTransfer(id).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(store->GetStats(id).ok());  // reads still work
  EXPECT_TRUE(store->GetBlockTable(id, 0).ok());

  // Aborted: the session serves again, exactly as it was.
  ASSERT_TRUE(store->FinishTransfer(id, /*committed=*/false).ok());
  const LayerKvCopy after = *store->ReadLayer(id, 1);
  EXPECT_EQ(after.positions, before.positions);
  EXPECT_TRUE(after.keys == before.keys);
  EXPECT_TRUE(driver.Step(*store, id, 100, true).ok());
  EXPECT_EQ(store->FinishTransfer(id, true).code(),
            absl::StatusCode::kFailedPrecondition);

  // Committed: the session is gone from here, its pages with it.
  ASSERT_TRUE(store->FreezeForTransfer(id).ok());
  ASSERT_TRUE(store->FinishTransfer(id, /*committed=*/true).ok());
  EXPECT_EQ(store->GetStats(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  EXPECT_EQ(store->FreezeForTransfer(id).status().code(),
            absl::StatusCode::kNotFound);
}

// The metadata of a snapshot, without its bytes (what a transfer sends
// first).
SessionSnapshot Metadata(SessionSnapshot s) {
  for (LayerSnapshot& l : s.layers) {
    l.keys.clear();
    l.values.clear();
  }
  return s;
}

TEST(PendingImportTest, PagesAreReservedFirstAndFreedUnlessCommitted) {
  std::unique_ptr<CacheStore> source = MakeStore(512);
  const SessionId id = OpenH2O(*source, 30);
  const SessionSnapshot snapshot = *source->ExportSession(id);
  const int64_t pages = source->GetStats(id)->pages;

  // Too small a pool says so before any byte moves.
  std::unique_ptr<CacheStore> small = MakeStore(pages - 1);
  EXPECT_EQ(small->PrepareImport(Metadata(snapshot)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small->Layouts()[0].pool.used_pages, 0);
  // Bytes in what should be metadata only.
  std::unique_ptr<CacheStore> target = MakeStore(512);
  EXPECT_EQ(target->PrepareImport(snapshot).status().code(),
            absl::StatusCode::kInvalidArgument);

  {
    // Reserved, invisible, then dropped: everything goes back.
    absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>> pending =
        target->PrepareImport(Metadata(snapshot));
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_EQ(target->Layouts()[0].pool.used_pages, pages);
    EXPECT_TRUE(target->ListSessions().empty());
  }
  EXPECT_EQ(target->Layouts()[0].pool.used_pages, 0);

  // Incomplete: the commit is refused and frees the reservation.
  absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>> partial =
      target->PrepareImport(Metadata(snapshot));
  ASSERT_TRUE(partial.ok());
  ASSERT_TRUE((*partial)
                  ->Write(0, snapshot.layers[0].keys, snapshot.layers[0].values)
                  .ok());
  EXPECT_EQ(target->CommitImport(*std::move(partial)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(target->Layouts()[0].pool.used_pages, 0);

  // In chunks of 5 slots, in order: committed, identical to the source.
  absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>> pending =
      target->PrepareImport(Metadata(snapshot));
  ASSERT_TRUE(pending.ok());
  const int64_t token_bytes = Layout().page_layout().token_bytes();
  for (int32_t l = 0; l < 3; ++l) {
    const LayerSnapshot& layer = snapshot.layers[l];
    for (int64_t slot = 0; slot < layer.resident(); slot += 5) {
      const int64_t n = std::min<int64_t>(5, layer.resident() - slot);
      const std::span<const std::byte> keys(
          layer.keys.data() + slot * token_bytes, n * token_bytes);
      const std::span<const std::byte> values(
          layer.values.data() + slot * token_bytes, n * token_bytes);
      ASSERT_TRUE((*pending)->Write(l, keys, values).ok());
    }
    // Past the layer's slots.
    EXPECT_EQ((*pending)
                  ->Write(l, std::span(layer.keys).first(token_bytes),
                          std::span(layer.values).first(token_bytes))
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE((*pending)->complete());
  ASSERT_TRUE(target->CommitImport(*std::move(pending)).ok());
  ExpectSameContents(*source, id, *target, id);
}

}  // namespace
}  // namespace kvkeep
