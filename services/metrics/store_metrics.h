// kvkeepd's Prometheus metrics for the store, in two parts:
//
//  - StoreMetrics is the store's StoreObserver: counters and histograms fed
//    as work happens (evictions, score updates, their latency, sessions
//    opened and closed), and the bounded set of sessions that get
//    per-session series (the first `max_session_series` open ones; the
//    others are counted in the totals and in kvkeep_sessions_untracked).
//  - StoreCollector reads gauges and per-session series from the store at
//    scrape time, so a scrape always agrees with the store's own stats, and
//    a closed session's series are gone from the next scrape.
//
// Every family is created once, in the constructors (STYLE: registered once,
// base units). Metric names: docs/metrics.md. Both classes are thread-safe.
#ifndef KVKEEP_SERVICES_METRICS_STORE_METRICS_H_
#define KVKEEP_SERVICES_METRICS_STORE_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/cache_store.h"
#include "cache_store/store_observer.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvkeep {

// Latency buckets, in seconds.
const prometheus::Histogram::BucketBoundaries& StoreLatencyBuckets();
const prometheus::Histogram::BucketBoundaries& RpcLatencyBuckets();

class StoreMetrics : public StoreObserver {
 public:
  // Registers the families in `registry`, which must outlive this object.
  // At most `max_session_series` sessions get per-session series (>= 0).
  StoreMetrics(prometheus::Registry& registry, int64_t max_session_series,
               const std::string& version);

  void SessionOpened(const SessionInfo& session) override;
  void SessionClosed(const SessionInfo& session) override;
  void WorkDone(const WorkReport& report) override;
  void TierMoved(const TierMove& move) override;

  // The open sessions that get per-session series, and how many open
  // sessions do not.
  std::vector<SessionId> TrackedSessions() const;
  int64_t UntrackedSessions() const;

 private:
  // One policy's series, made once so the hot path only looks them up.
  struct PolicySeries {
    prometheus::Counter* opened;
    prometheus::Counter* closed;
    prometheus::Counter* evicted_tokens;
    prometheus::Counter* evicted_mass;
    prometheus::Counter* score_updates;
    prometheus::Histogram* eviction_seconds;
    prometheus::Histogram* score_update_seconds;
  };
  PolicySeries* Series(const std::string& policy);

  const int64_t max_session_series_;
  // Keyed by every registered policy name; fixed after construction.
  absl::flat_hash_map<std::string, PolicySeries> policies_;
  // Indexed by StoreOperation.
  std::vector<prometheus::Histogram*> operation_seconds_;
  // [from][to] by Tier: the moves that happen (to or from the pool).
  prometheus::Histogram* tier_move_seconds_[kTierCount][kTierCount] = {};

  mutable absl::Mutex mu_;
  absl::flat_hash_set<SessionId> tracked_ ABSL_GUARDED_BY(mu_);
  int64_t untracked_ ABSL_GUARDED_BY(mu_) = 0;
};

class StoreCollector : public prometheus::Collectable {
 public:
  // Both must outlive the collector. `session_name` gives the `session`
  // label, the id as clients know it (empty: SessionName, the bare key).
  StoreCollector(CacheStore& store, const StoreMetrics& metrics,
                 std::function<std::string(SessionId)> session_name = {});
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  CacheStore& store_;
  const StoreMetrics& metrics_;
  const std::function<std::string(SessionId)> session_name_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_STORE_METRICS_H_
