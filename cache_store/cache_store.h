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
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/model_layout.h"
#include "cache_store/page_pool.h"
#include "cache_store/page_quota.h"
#include "cache_store/session.h"
#include "cache_store/session_snapshot.h"
#include "cache_store/session_types.h"
#include "cache_store/store_observer.h"

namespace kvkeep {

struct PoolSpec {
  ModelLayout layout;
  int64_t capacity_pages = 0;
};

struct StoreOptions {
  std::vector<PoolSpec> pools;  // one per layout; names must be unique
  int64_t max_sessions = 1 << 16;
  int64_t max_sessions_per_tenant = 0;  // 0: no limit
  int64_t max_bytes_per_tenant = 0;     // pages held, in bytes; 0: no limit
  // Told about sessions and their work (see StoreObserver); not owned, must
  // outlive the store. Null: nobody is told.
  StoreObserver* observer = nullptr;
};

struct TenantStats {
  std::string tenant;
  int64_t sessions = 0;
  int64_t bytes = 0;  // pages held, in bytes
  int64_t quota_rejections = 0;
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
  // budget; RESOURCE_EXHAUSTED past max_sessions or the tenant's limit. A
  // spec with an idempotency key that its tenant already used returns the
  // session that key created, if it is still open.
  absl::StatusOr<SessionId> CreateSession(const SessionSpec& spec);
  // Frees every page of the session. NOT_FOUND if it does not exist.
  absl::Status CloseSession(SessionId id);

  // The session's whole state (session_snapshot.h), taken under its lock.
  // NOT_FOUND if it does not exist.
  absl::StatusOr<SessionSnapshot> ExportSession(SessionId id);
  // Adds a session in the state `snapshot` describes, under its id, tenant
  // and policy; it answers every later call as the exported session would
  // have. NOT_FOUND for an unknown layout; ALREADY_EXISTS if the id is
  // taken; INVALID_ARGUMENT for an inconsistent snapshot or a bad policy;
  // RESOURCE_EXHAUSTED when the pool, max_sessions or the tenant's limits
  // cannot take it. A refused import holds nothing. The pages are written
  // without the store's lock held, so other sessions are not held up.
  absl::StatusOr<SessionId> ImportSession(const SessionSnapshot& snapshot);

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

  // The tenant that created a session; NOT_FOUND if it does not exist.
  absl::StatusOr<std::string> TenantOf(SessionId id) const;

  std::vector<SessionId> ListSessions() const;  // ascending ids
  std::vector<SessionInfo> Sessions() const;    // ascending ids
  std::vector<LayoutStats> Layouts() const;
  std::vector<TenantStats> Tenants() const;  // tenants seen so far

 private:
  struct Entry {
    Entry(SessionInfo session_info, PolicySpec policy, std::string idempotency)
        : info(std::move(session_info)),
          policy_spec(std::move(policy)),
          idempotency_key(std::move(idempotency)) {}
    // Immutable: read without the lock.
    const SessionInfo info;
    const PolicySpec policy_spec;  // as created (name and parameters)
    const std::string idempotency_key;
    absl::Mutex mu;
    std::unique_ptr<Session> session ABSL_GUARDED_BY(mu);
  };
  struct Pool {
    ModelLayout layout;
    std::unique_ptr<PagePool> pages;
  };

  struct Tenant {
    std::shared_ptr<PageQuota> quota;
    int64_t sessions = 0;
  };

  explicit CacheStore(const StoreOptions& options) : options_(options) {}
  absl::StatusOr<const Pool*> FindPool(const std::string& layout) const;
  // Whether one more session of `tenant` fits max_sessions and the tenant's
  // session limit (a refusal is counted against the tenant); its quota.
  absl::StatusOr<std::shared_ptr<PageQuota>> Admit(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a made session to the map, its tenant and the observer.
  void Register(std::unique_ptr<Session> session, const std::string& tenant,
                PolicySpec policy, const std::string& idempotency_key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Entry>> Find(SessionId id) const;
  // Runs fn(const Entry&, Session&) under the session's lock.
  template <typename Fn>
  auto WithEntry(SessionId id, Fn fn)
      -> decltype(fn(std::declval<const Entry&>(), std::declval<Session&>()));
  // Runs fn(Session&) under the session's lock.
  template <typename Fn>
  auto WithSession(SessionId id, Fn fn)
      -> decltype(fn(std::declval<Session&>()));
  // WithSession for an operation that can change the session's tokens:
  // reports its work to the observer when it succeeds.
  template <typename Fn>
  auto Work(SessionId id, StoreOperation op, Fn fn)
      -> decltype(fn(std::declval<Session&>()));

  const StoreOptions options_;
  std::vector<Pool> pools_;  // fixed after Create
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, std::shared_ptr<Entry>> sessions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(mu_);
  // (tenant, idempotency key) -> session.
  absl::flat_hash_map<std::pair<std::string, std::string>, SessionId>
      idempotency_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);  // session ids
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_CACHE_STORE_H_
