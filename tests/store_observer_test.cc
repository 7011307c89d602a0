// StoreObserver: the store reports every session it opens and closes, and
// every successful operation's work, with deltas that add up to the
// session's own stats; refused operations and failed opens report nothing.
#include "cache_store/store_observer.h"

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

struct Recorded {
  std::string event;  // "open", "close" or an operation name
  SessionInfo session;
  SessionWork work;
  absl::Duration duration;
};

// Records every call. Thread-safe.
class RecordingObserver : public StoreObserver {
 public:
  void SessionOpened(const SessionInfo& s) override { Add({"open", s}); }
  void SessionClosed(const SessionInfo& s) override { Add({"close", s}); }
  void WorkDone(const WorkReport& r) override {
    Add({std::string(OperationName(r.operation)), *r.session, r.work,
         r.duration});
  }
  std::vector<Recorded> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }

 private:
  void Add(Recorded r) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(r));
  }
  mutable absl::Mutex mu_;
  std::vector<Recorded> events_ ABSL_GUARDED_BY(mu_);
};

ModelLayout OneLayer() {
  ModelLayout l;
  l.name = "l1";
  l.num_layers = 1;
  l.kv_heads = 1;
  l.query_heads = 1;
  l.head_dim = 4;
  l.dtype = DType::kF32;
  l.page_tokens = 2;
  return l;
}

class StoreObserverTest : public ::testing::Test {
 protected:
  StoreObserverTest() {
    StoreOptions options;
    options.device = test_support::TestDevice();
    options.pools.push_back(PoolSpec{OneLayer(), 64});
    options.observer = &observer_;
    store_ = *CacheStore::Create(options);
  }

  SessionId Open(const std::string& policy, int64_t budget,
                 const std::string& tenant = "t") {
    SessionSpec spec;
    spec.layout = "l1";
    spec.tenant = tenant;
    spec.policy = PolicySpec{policy, {}};
    spec.budget.tokens = budget;
    absl::StatusOr<SessionId> id = store_->CreateSession(spec);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }

  absl::StatusOr<StepResult> Append(SessionId id, int64_t position) {
    const std::vector<int64_t> positions{position};
    const std::vector<std::byte> k =
        test_data::TokenBytes(OneLayer(), 0, positions, false);
    const std::vector<std::byte> v =
        test_data::TokenBytes(OneLayer(), 0, positions, true);
    const std::vector<LayerKv> layers{LayerKv{k, v}};
    return store_->Append(id, AppendRequest{positions, layers});
  }

  // Head-reduced attention favouring the oldest resident token.
  absl::StatusOr<StepResult> Attend(SessionId id, uint64_t version_offset = 0) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, 0);
    if (!table.ok()) return table.status();
    std::vector<float> row(table->positions.size(), 0.01f);
    row[0] = 0.5f;
    const LayerScores scores{0, table->version + version_offset,
                             ScoreSource::kReduced, 1, row};
    return store_->UpdateScores(id, std::span(&scores, 1));
  }

  RecordingObserver observer_;
  std::unique_ptr<CacheStore> store_;
};

TEST_F(StoreObserverTest, ReportsOpenAndCloseWithTheSessionsIdentity) {
  const SessionId id = Open("tova", 8, "team-a");
  SessionSpec bad;
  bad.layout = "l1";
  bad.policy = PolicySpec{"no_such_policy", {}};
  EXPECT_FALSE(store_->CreateSession(bad).ok());
  ASSERT_TRUE(store_->CloseSession(id).ok());
  EXPECT_FALSE(store_->CloseSession(id).ok());  // reports nothing

  const std::vector<Recorded> events = observer_.events();
  ASSERT_EQ(events.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(events[i].event, i == 0 ? "open" : "close");
    EXPECT_EQ(events[i].session.id, id);
    EXPECT_EQ(events[i].session.tenant, "team-a");
    EXPECT_EQ(events[i].session.layout, "l1");
    EXPECT_EQ(events[i].session.policy, "tova");
  }
}

TEST_F(StoreObserverTest, AnIdempotentRetryIsNotASecondOpen) {
  SessionSpec spec;
  spec.layout = "l1";
  spec.policy = PolicySpec{"full", {}};
  spec.idempotency_key = "k";
  const SessionId first = *store_->CreateSession(spec);
  EXPECT_EQ(*store_->CreateSession(spec), first);
  EXPECT_EQ(observer_.events().size(), 1u);
}

TEST_F(StoreObserverTest, WorkReportsAddUpToTheSessionsStats) {
  const SessionId id = Open("h2o", 4);
  for (int64_t p = 0; p < 40; ++p) {
    ASSERT_TRUE(Append(id, p).ok());
    ASSERT_TRUE(Attend(id).ok());
  }
  // Refused: a stale version. It changes nothing and is not reported.
  const size_t before_refusal = observer_.events().size();
  EXPECT_EQ(Attend(id, /*version_offset=*/7).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(observer_.events().size(), before_refusal);

  const SessionStats stats = *store_->GetStats(id);
  ASSERT_GT(stats.evicted_tokens, 0);
  SessionWork sum;
  int appends = 0;
  int scores = 0;
  for (const Recorded& r : observer_.events()) {
    if (r.event == "open") continue;
    appends += r.event == "append";
    scores += r.event == "scores";
    EXPECT_EQ(r.session.id, id);
    EXPECT_EQ(r.session.policy, "h2o");
    EXPECT_GE(r.duration, r.work.scoring_time + r.work.eviction_time);
    // Time is spent evicting exactly when something was evicted.
    EXPECT_EQ(r.work.evictions > 0, r.work.eviction_time > absl::ZeroDuration())
        << r.event;
    sum.evicted_tokens += r.work.evicted_tokens;
    sum.evicted_score += r.work.evicted_score;
    sum.score_updates += r.work.score_updates;
  }
  EXPECT_EQ(appends, 40);
  EXPECT_EQ(scores, 40);
  EXPECT_EQ(sum.evicted_tokens, stats.evicted_tokens);
  EXPECT_DOUBLE_EQ(sum.evicted_score, stats.evicted_score);
  EXPECT_EQ(sum.score_updates, stats.score_updates);
  EXPECT_EQ(stats.score_updates, 40);
}

TEST_F(StoreObserverTest, ConcurrentOpensAndClosesPairUp) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        const SessionId id = Open("window", 4);
        EXPECT_TRUE(Append(id, 0).ok());
        EXPECT_TRUE(store_->CloseSession(id).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int open = 0;
  int close = 0;
  for (const Recorded& r : observer_.events()) {
    open += r.event == "open";
    close += r.event == "close";
  }
  EXPECT_EQ(open, kThreads * kPerThread);
  EXPECT_EQ(close, kThreads * kPerThread);
}

}  // namespace
}  // namespace kvkeep
