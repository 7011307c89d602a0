// StoreObserver: what the store tells monitoring about its work, through an
// interface narrow enough that cache_store/ needs no metrics library and its
// tests need no Prometheus. kvkeepd's implementation feeds Prometheus
// (services/metrics/); the default does nothing.
//
// Calls arrive on the thread doing the work. SessionOpened and SessionClosed
// are called under the store's session-map lock, so for one session they
// never cross; WorkDone is called under that session's lock, so one
// session's reports arrive in order. Implementations must therefore be
// thread-safe, O(1) and free of I/O, and must not call back into the store.
#ifndef KVKEEP_CACHE_STORE_STORE_OBSERVER_H_
#define KVKEEP_CACHE_STORE_STORE_OBSERVER_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_store/session_types.h"
#include "cache_store/tiers.h"

namespace kvkeep {

// The store operations that can change a session's tokens.
enum class StoreOperation { kAppend, kScores, kStep, kCompress };
inline constexpr StoreOperation kAllStoreOperations[] = {
    StoreOperation::kAppend, StoreOperation::kScores, StoreOperation::kStep,
    StoreOperation::kCompress};
absl::string_view OperationName(StoreOperation op);  // "append", ...

// A session's identity as the store lists and reports it.
struct SessionInfo {
  SessionId id = 0;
  std::string tenant;
  std::string layout;
  std::string policy;  // the policy's registry name
};

// Cumulative work of one session, since it was created.
struct SessionWork {
  int64_t evicted_tokens = 0;    // summed over layers
  double evicted_score = 0;      // the policy scores of evicted tokens, summed
  int64_t score_updates = 0;     // layer score updates applied
  int64_t evictions = 0;         // layer evictions that removed tokens
  int64_t pages_copied = 0;      // shared pages copied before a write
  absl::Duration scoring_time;   // validating and folding scores
  absl::Duration eviction_time;  // choosing victims, compacting, freeing
};

// What one successful operation did: the change in the session's SessionWork
// and the operation's time in the store (from taking the session's lock to
// its result). Failed operations change nothing and are not reported.
struct WorkReport {
  const SessionInfo* session = nullptr;  // valid during the call only
  StoreOperation operation = StoreOperation::kAppend;
  absl::Duration duration;
  SessionWork work;
};

// A session that moved between tiers (tiers.h), whole: out of the pool
// (from kPool) or back into it by a call (to kPool), with the bytes moved
// and the move's time (encoding and writing, or reading, checking and
// restoring).
struct TierMove {
  const SessionInfo* session = nullptr;  // valid during the call only
  Tier from = Tier::kPool;
  Tier to = Tier::kPool;
  int64_t bytes = 0;
  absl::Duration duration;
};

class StoreObserver {
 public:
  virtual ~StoreObserver() = default;
  virtual void SessionOpened(const SessionInfo& session) {}
  virtual void SessionClosed(const SessionInfo& session) {}
  virtual void WorkDone(const WorkReport& report) {}
  // Under the session's lock, like WorkDone.
  virtual void TierMoved(const TierMove& move) {}
  // A session's copy in `tier` failed its checksum (or vanished) on
  // restore: the session is lost. Under the session's lock.
  virtual void TierCopyLost(const SessionInfo& session, Tier tier) {}
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_STORE_OBSERVER_H_
