// CacheStore: the sessions of every layout a store serves, their page pools,
// and the locking that lets different sessions proceed in parallel.
//
// Thread-safe. Calls on one session are serialised by that session's mutex;
// the session map's lock is held only to find, add or remove a session, never
// while a session works, so sessions do not wait on each other except for
// page allocation inside a pool.
#ifndef KVKEEP_CACHE_STORE_CACHE_STORE_H_
#define KVKEEP_CACHE_STORE_CACHE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/model_layout.h"
#include "cache_store/page_pool.h"
#include "cache_store/session.h"
#include "cache_store/session_types.h"

namespace kvkeep {

struct PoolSpec {
  ModelLayout layout;
  int64_t capacity_pages = 0;
};

struct StoreOptions {
  std::vector<PoolSpec> pools;  // one per layout; names must be unique
  int64_t max_sessions = 1 << 16;
};

struct LayoutStats {
  ModelLayout layout;
  PoolStats pool;
  int64_t sessions = 0;
};

class CacheStore {
 public:
  // INVALID_ARGUMENT for a bad layout, a duplicate name or no pools;
  // RESOURCE_EXHAUSTED if an arena cannot be reserved.
  static absl::StatusOr<std::unique_ptr<CacheStore>> Create(
      const StoreOptions& options);

  CacheStore(const CacheStore&) = delete;
  CacheStore& operator=(const CacheStore&) = delete;

  // NOT_FOUND for an unknown layout; INVALID_ARGUMENT for a bad policy or
  // budget; RESOURCE_EXHAUSTED past max_sessions.
  absl::StatusOr<SessionId> CreateSession(const SessionSpec& spec);
  // Frees every page of the session. NOT_FOUND if it does not exist.
  absl::Status CloseSession(SessionId id);

  // The session operations (see Session); NOT_FOUND for an unknown session.
  absl::StatusOr<StepResult> Append(SessionId id, const AppendRequest& request);
  absl::StatusOr<StepResult> UpdateScores(SessionId id,
                                          std::span<const LayerScores> scores);
  absl::StatusOr<StepOutcome> Step(SessionId id, const AppendRequest& append,
                                   std::span<const LayerScores> scores);
  absl::StatusOr<StepResult> CompressPrompt(
      SessionId id, std::span<const LayerScores> window);
  absl::StatusOr<BlockTable> GetBlockTable(SessionId id, int32_t layer);
  absl::StatusOr<LayerKvCopy> ReadLayer(SessionId id, int32_t layer);
  absl::StatusOr<SessionStats> GetStats(SessionId id);

  std::vector<SessionId> ListSessions() const;
  std::vector<LayoutStats> Layouts() const;

 private:
  struct Entry {
    explicit Entry(std::string layout_name) : layout(std::move(layout_name)) {}
    const std::string layout;  // immutable: read without the lock
    absl::Mutex mu;
    std::unique_ptr<Session> session ABSL_GUARDED_BY(mu);
  };
  struct Pool {
    ModelLayout layout;
    std::unique_ptr<PagePool> pages;
  };

  explicit CacheStore(int64_t max_sessions) : max_sessions_(max_sessions) {}
  absl::StatusOr<std::shared_ptr<Entry>> Find(SessionId id) const;
  // Runs fn(Session&) under the session's lock.
  template <typename Fn>
  auto WithSession(SessionId id, Fn fn)
      -> decltype(fn(std::declval<Session&>()));

  const int64_t max_sessions_;
  std::vector<Pool> pools_;  // fixed after Create
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, std::shared_ptr<Entry>> sessions_
      ABSL_GUARDED_BY(mu_);
  SessionId next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_CACHE_STORE_H_
