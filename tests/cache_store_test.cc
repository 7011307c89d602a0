// CacheStore: unknown sessions and layouts, pool and session limits,
// closing, and concurrent use of one store (bad input to a live session:
// cache_store_bad_input_test.cc).
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
#include "tests/cache_store_harness.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep::store_testing {
namespace {

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
}  // namespace kvkeep::store_testing
