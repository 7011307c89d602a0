// CacheStore: the sessions of every layout a store serves, their page pools,
// and the locking that lets different sessions proceed in parallel.
//
// Thread-safe. Calls on one session are serialised by that session's mutex;
// the session map's lock is held only to find, add or remove a session, never
// while a session works, so sessions do not wait on each other except for
// page allocation inside a pool.
#ifndef KVKEEP_CACHE_STORE_CACHE_STORE_H_
#define KVKEEP_CACHE_STORE_CACHE_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/model_layout.h"
#include "cache_store/page_pool.h"
#include "cache_store/page_quota.h"
#include "cache_store/session.h"
#include "cache_store/session_snapshot.h"
#include "cache_store/session_types.h"
#include "cache_store/slot_spans.h"
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
  // A tenant the two per-tenant limits do not apply to (kvkeepd's start-up
  // self-check, which must not fail on a small quota); empty: none.
  std::string unlimited_tenant;
  // Told about sessions and their work (see StoreObserver); not owned, must
  // outlive the store. Null: nobody is told.
  StoreObserver* observer = nullptr;
  // Where every pool's pages live (ResolveDevice: host or cuda:N).
  Device device;
  // Pools another process on this machine can map (SharePool). Host pools
  // then live in POSIX shared memory.
  bool share_pools = false;
};

// How another process maps a layout's pool (CacheStore::SharePool).
struct PoolMapping {
  ModelLayout layout;
  Device device;
  int64_t capacity_pages = 0;
  int64_t arena_bytes = 0;
  SharedPool handle;
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

  // Where the pools live.
  const Device& device() const { return options_.device; }
  // The memory of a layout's pool; NOT_FOUND for an unknown layout.
  absl::StatusOr<PageMemory*> MemoryOf(const std::string& layout) const;
  // The handle of a layout's pool: NOT_FOUND for an unknown layout;
  // FAILED_PRECONDITION unless the store shares its pools.
  absl::StatusOr<PoolMapping> SharePool(const std::string& layout) const;

  // NOT_FOUND for an unknown layout; INVALID_ARGUMENT for a bad policy or
  // budget; RESOURCE_EXHAUSTED past max_sessions or the tenant's limit. A
  // spec with an idempotency key that its tenant already used returns the
  // session that key created, if it is still open.
  absl::StatusOr<SessionId> CreateSession(const SessionSpec& spec);
  // Frees every page of the session. NOT_FOUND if it does not exist.
  absl::Status CloseSession(SessionId id);

  // The session's whole state (session_snapshot.h), taken under its lock.
  // NOT_FOUND if it does not exist.
  absl::StatusOr<SessionSnapshot> ExportSession(SessionId id,
                                                bool with_bytes = true);
  // Session::ReadSlots under the session's lock (a frozen session too).
  absl::Status ReadSlots(SessionId id, int32_t layer, int64_t first, int64_t n,
                         std::span<std::byte> keys,
                         std::span<std::byte> values);
  // Adds a session in the state `snapshot` describes, under its id, tenant
  // and policy; it answers every later call as the exported session would
  // have. NOT_FOUND for an unknown layout; ALREADY_EXISTS if the id is
  // taken; INVALID_ARGUMENT for an inconsistent snapshot or a bad policy;
  // RESOURCE_EXHAUSTED when the pool, max_sessions or the tenant's limits
  // cannot take it. A refused import holds nothing. The pages are written
  // without the store's lock held, so other sessions are not held up.
  absl::StatusOr<SessionId> ImportSession(const SessionSnapshot& snapshot);

  // A session transfer between stores, in two phases on each side (the
  // transport that moves the bytes is the service's).
  //
  // Out: FreezeForTransfer stops the session changing (every operation that
  // would change it, and CloseSession, gets UNAVAILABLE naming the transfer;
  // reads still work) and returns its snapshot without the bytes (the
  // sender reads them with ReadSlots as it goes: the pages cannot change);
  // FinishTransfer then closes it (committed: the target holds it now) or thaws
  // it, unchanged (aborted). NOT_FOUND for an unknown session;
  // FAILED_PRECONDITION if it is already being transferred (Freeze) or is not
  // (Finish).
  absl::StatusOr<SessionSnapshot> FreezeForTransfer(SessionId id);
  absl::Status FinishTransfer(SessionId id, bool committed);
  // What the calls a frozen session refuses add to their message (the
  // transfer's id, whether its commit is in doubt); NOT_FOUND.
  absl::Status NoteTransfer(SessionId id, std::string note);
  // Where slots [first, first + n) of a frozen session's `layer` lie in its
  // pool's host arena, so a sender reads them in place (they cannot change
  // until FinishTransfer). NOT_FOUND; FAILED_PRECONDITION if the session is
  // not frozen or its pool is not in host memory (read with ReadSlots then);
  // OUT_OF_RANGE past the layer's resident slots.
  absl::StatusOr<SlotSpans> FrozenSlotSpans(SessionId id, int32_t layer,
                                            int64_t first, int64_t n);

  // In: PrepareImport checks a snapshot that carries no keys and values
  // (ValidateSnapshot with bytes_follow), the id and the limits, and reserves
  // every page it needs, so a full pool says RESOURCE_EXHAUSTED before any
  // byte moves. The bytes are then written layer by layer, in slot order;
  // CommitImport makes the session visible once all have come. Destroying a
  // PendingImport before committing frees everything it reserved.
  class PendingImport {
   public:
    SessionId id() const { return snapshot_.id; }
    // The next `keys.size() / token bytes` slots of `layer`:
    // INVALID_ARGUMENT out of order, past the layer's slots, or with
    // mismatched sizes.
    absl::Status Write(int32_t layer, std::span<const std::byte> keys,
                       std::span<const std::byte> values);
    bool complete() const;
    // Fills the next `n` slots of `layer` with `fill`, which gets the
    // memory, the page layout, the layer's pages and the slot range (as
    // Write, for bytes that do not pass through the host: NCCL).
    using SlotFill = std::function<absl::Status(
        PageMemory& memory, const PageLayout& layout,
        std::span<const PageId> pages, int64_t first, int64_t n)>;
    absl::Status Fill(int32_t layer, int64_t n, const SlotFill& fill);

   private:
    friend class CacheStore;
    PendingImport(SessionSnapshot snapshot, std::unique_ptr<Session> session)
        : snapshot_(std::move(snapshot)),
          session_(std::move(session)),
          written_(snapshot_.layers.size(), 0) {}
    SessionSnapshot snapshot_;  // metadata only
    std::unique_ptr<Session> session_;
    std::vector<int64_t> written_;  // per layer: slots written so far
  };
  absl::StatusOr<std::unique_ptr<PendingImport>> PrepareImport(
      SessionSnapshot snapshot);
  // ALREADY_EXISTS if the id was taken meanwhile; FAILED_PRECONDITION if a
  // layer's bytes are missing; RESOURCE_EXHAUSTED past max_sessions or the
  // tenant's session limit. On any failure the reservation is freed.
  absl::StatusOr<SessionId> CommitImport(
      std::unique_ptr<PendingImport> pending);

  // The session operations (see Session); NOT_FOUND for an unknown session.
  absl::StatusOr<StepResult> Append(SessionId id, const AppendRequest& request);
  absl::StatusOr<StepResult> UpdateScores(SessionId id,
                                          std::span<const LayerScores> scores);
  absl::StatusOr<StepOutcome> Step(SessionId id, const AppendRequest& append,
                                   std::span<const LayerScores> scores);
  // The same into `out`, reusing its buffers (Session::Step).
  absl::Status Step(SessionId id, const AppendRequest& append,
                    std::span<const LayerScores> scores, StepOutcome& out);
  absl::StatusOr<StepResult> CompressPrompt(
      SessionId id, std::span<const LayerScores> window);
  absl::StatusOr<BlockTable> GetBlockTable(SessionId id, int32_t layer);
  absl::StatusOr<LayerKvCopy> ReadLayer(SessionId id, int32_t layer);
  // The same as values of `dtype` (f32, f16 or bf16): dequantised from a
  // quantised layout, converted (round to nearest even) or copied otherwise.
  // INVALID_ARGUMENT for a quantised dtype other than the layout's own.
  absl::StatusOr<LayerKvCopy> ReadLayerAs(SessionId id, int32_t layer,
                                          DType dtype);
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
    // Set under the store's lock by FreezeForTransfer, cleared by
    // FinishTransfer; read by operations under `mu` and by CloseSession
    // under the store's lock.
    std::atomic<bool> transferring{false};
    // NoteTransfer's, while transferring.
    mutable absl::Mutex note_mu;
    std::string transfer_note ABSL_GUARDED_BY(note_mu);
    // "is being transferred to another store", and the note.
    std::string Transferring() const {
      absl::MutexLock lock(&note_mu);
      return transfer_note.empty()
                 ? std::string(" is being transferred to another store")
                 : absl::StrCat(" is being transferred to another store (",
                                transfer_note, ")");
    }
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
  // CloseSession; `transferred` closes a frozen session too.
  absl::Status Close(SessionId id, bool transferred);
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
