// CacheStore: the sessions of every layout a store serves, their page pools,
// and the locking that lets different sessions proceed in parallel.
//
// Thread-safe. Calls on one session are serialised by that session's mutex;
// the session map's lock is held only to find, add or remove a session, never
// while a session works, so sessions do not wait on each other except for
// page allocation inside a pool.
//
// Every session has a lease (lease.h): each call that names it renews it,
// and one idle past its timeout is closed, by ExpireIdle (kvkeepd's reaper
// thread) or by the first call that finds it so, whichever comes first.
#ifndef KVKEEP_CACHE_STORE_CACHE_STORE_H_
#define KVKEEP_CACHE_STORE_CACHE_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/lease.h"
#include "cache_store/model_layout.h"
#include "cache_store/page_pool.h"
#include "cache_store/page_quota.h"
#include "cache_store/session.h"
#include "cache_store/session_snapshot.h"
#include "cache_store/session_types.h"
#include "cache_store/slot_spans.h"
#include "cache_store/store_observer.h"
#include "cache_store/tiers.h"

namespace kvkeep {

struct PoolSpec {
  ModelLayout layout;
  int64_t capacity_pages = 0;
  // Where idle sessions, or the least recently used one when the pool is
  // full, move to (tiers.h, docs/tiers.md); none by default.
  TierOptions tiers;
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
  // Session leases: the default and per-tenant idle timeouts, the clock.
  LeaseOptions lease;
  // Whether a tenant may publish a prefix every tenant can start from
  // (PrefixSpec::is_public); off: FAILED_PRECONDITION.
  bool allow_public_prefixes = false;
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
  int64_t expired_sessions = 0;  // closed by their lease, since the start
};

struct LayoutStats {
  ModelLayout layout;
  PoolStats pool;
  int64_t sessions = 0;
  // By tier (kPool: the sessions in the pool and its used bytes), and the
  // moves between them.
  TierStats tiers;
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

  // NOT_FOUND for an unknown layout; INVALID_ARGUMENT for a bad policy,
  // budget or idle timeout (ResolveIdleTimeout); RESOURCE_EXHAUSTED past
  // max_sessions or the tenant's limit. A
  // spec with an idempotency key that its tenant already used returns the
  // session that key created, if it is still open.
  absl::StatusOr<SessionId> CreateSession(const SessionSpec& spec);
  // Frees every page of the session (a page it shares with a fork stays
  // with the fork). NOT_FOUND if it does not exist.
  absl::Status CloseSession(SessionId id);

  // A new session of the parent's tenant and layout at the parent's current
  // state, sharing its pages copy-on-write (Session::Fork): nothing is
  // copied now; a page is copied when either side first writes into it.
  // The parent is unchanged. The child's policy and budget are the
  // parent's unless `spec` gives others. NOT_FOUND for an unknown parent;
  // UNAVAILABLE while the parent is being transferred (retry once the
  // transfer is done); INVALID_ARGUMENT for a bad policy or budget;
  // RESOURCE_EXHAUSTED past max_sessions or the tenant's session limit. The
  // fork waits for a call in flight on the parent, so it never sees one
  // half done (an append mid-compaction). A spec with an idempotency key
  // the tenant already used returns the session that key made, if open.
  absl::StatusOr<SessionId> ForkSession(SessionId parent, const ForkSpec& spec);

  // The session's whole state (session_snapshot.h), taken under its lock.
  // NOT_FOUND if it does not exist.
  absl::StatusOr<SessionSnapshot> ExportSession(SessionId id,
                                                bool with_bytes = true);
  // Session::ReadSlots under the session's lock (a frozen session too);
  // kivi_int4: Session::ReadKiviSlots (keys are the key blocks of the pages
  // of slots [first, first + n), which start a page).
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
  // OUT_OF_RANGE past the layer's resident slots. kivi_int4: the keys are
  // the whole key blocks of the pages touched, so `first` must start a page
  // (INVALID_ARGUMENT otherwise).
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
    // The next `values.size() / token bytes` slots of `layer`:
    // INVALID_ARGUMENT out of order, past the layer's slots, or with
    // mismatched sizes (kivi_int4: keys are the key blocks of the pages
    // written, and every write but a layer's last ends on a page's end).
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
  // layer's bytes are missing; INVALID_ARGUMENT for kivi_int4 key blocks
  // that are not valid or do not match the staging (Session::CheckKiviPages);
  // RESOURCE_EXHAUSTED past max_sessions or the tenant's session limit. On any
  // failure the reservation is freed.
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
  // With the lease's state. `renew_lease` false: a look that is not a
  // call on the session (a listing, a metrics scrape).
  absl::StatusOr<SessionStats> GetStats(SessionId id, bool renew_lease = true);

  // The tenant that created a session; NOT_FOUND if it does not exist (with
  // "expired" in the message for an expired one). Does not renew the lease:
  // the caller may not be the owner.
  absl::StatusOr<std::string> TenantOf(SessionId id);
  // The tenant of a session that expired, while the store remembers it.
  std::optional<std::string> ExpiredTenant(SessionId id) const;

  // Leases (lease.h). KeepAlive renews a session's lease and returns it;
  // NOT_FOUND as every call.
  absl::StatusOr<LeaseStatus> KeepAlive(SessionId id);
  // Holds a session's lease while a stream serves it: it cannot expire until
  // the hold is destroyed, and its idle time starts then. The hold must not
  // outlive the store.
  class LeaseHold;
  absl::StatusOr<std::unique_ptr<LeaseHold>> HoldLease(SessionId id);
  // Closes every session whose lease has run out, as CloseSession would,
  // and returns them, with those that calls found expired and closed since
  // the last ExpireIdle (each session is returned once). Cheap when none can
  // have: it only compares the clock with the earliest deadline it knows;
  // otherwise one pass over the map under its lock (reading each session's
  // lease; no session's lock).
  std::vector<ExpiredSession> ExpireIdle();
  // Until the earliest lease could run out, by the store's clock
  // (InfiniteDuration when no session has one running; never negative).
  absl::Duration TimeToNextExpiry() const;
  const LeaseOptions& lease_options() const { return options_.lease; }
  bool allow_public_prefixes() const { return options_.allow_public_prefixes; }

  // Named prefixes (docs/prefixes.md). PublishPrefix makes an immutable
  // prefix of the session's current state, sharing its pages copy-on-write
  // (the session lives on, unchanged); its pages are charged to the
  // publisher's tenant for as long as the prefix exists. INVALID_ARGUMENT
  // for a bad name; ALREADY_EXISTS for a name the tenant (or, public, the
  // store) already uses; FAILED_PRECONDITION for a public prefix when the
  // store does not allow them; NOT_FOUND and UNAVAILABLE as for a fork.
  absl::StatusOr<PrefixInfo> PublishPrefix(SessionId source,
                                           const PrefixSpec& spec);
  // Removes the name; the prefix's pages go back once no session started
  // from it is open. Returns the prefix as it is now (its holders).
  // NOT_FOUND for a name `tenant` cannot see; PERMISSION_DENIED for a public
  // prefix another tenant published.
  absl::StatusOr<PrefixInfo> UnpublishPrefix(const std::string& tenant,
                                             const std::string& name,
                                             bool is_public);
  // The prefixes `tenant` sees (its own, unpublished ones still held
  // included, and the published public ones); nullopt: every prefix. By
  // name, the tenant's own before public ones.
  std::vector<PrefixInfo> Prefixes(
      const std::optional<std::string>& tenant) const;

  // Tiers (tiers.h, docs/tiers.md). A session out of the pool keeps its id,
  // lease, tenant and prefix hold; the next call that needs its pages
  // (everything but KeepAlive, TenantOf and a look that does not renew)
  // moves it back first, making room as a full pool does.
  //
  // DemoteIdle moves down every session idle past its layout's idle_after
  // (by the store's clock) that can move: not held by a stream, not being
  // transferred, not sharing pages with a fork or prefix, not busy. Returns
  // how many moved. kvkeepd's reaper thread calls it.
  int64_t DemoteIdle();
  // Moves one session down a tier now. NOT_FOUND; FAILED_PRECONDITION when
  // its layout has no tiers, it shares pages, a stream holds it or it is
  // already out of the pool; UNAVAILABLE while transferred;
  // RESOURCE_EXHAUSTED when no tier has room; a disk error as
  // TierCopy::OnDisk says. A refused move leaves the session where it was.
  absl::Status Demote(SessionId id);
  // Where the session is now; does not renew or restore it. NOT_FOUND.
  absl::StatusOr<Tier> TierOf(SessionId id);

  // Sessions ForkSession made, since the start.
  int64_t forks() const { return forks_.load(std::memory_order_relaxed); }

  std::vector<SessionId> ListSessions() const;  // ascending ids
  std::vector<SessionInfo> Sessions() const;    // ascending ids
  std::vector<LayoutStats> Layouts() const;
  std::vector<TenantStats> Tenants() const;  // tenants seen so far

 private:
  // A published prefix: an immutable session no call reaches, and the
  // count of open sessions started from it (prefixes.cc).
  struct Prefix;
  class PrefixHold;
  struct Entry {
    // Made with its session, before anyone else sees it: taking `mu` under
    // the store's lock would order the two both ways (tiers take the
    // store's lock under a session's).
    Entry(SessionInfo session_info, PolicySpec policy, std::string idempotency,
          absl::Duration timeout, absl::Time now, std::unique_ptr<Session> made,
          std::shared_ptr<PrefixHold> held)
        : info(std::move(session_info)),
          policy_spec(std::move(policy)),
          idempotency_key(std::move(idempotency)),
          idle_timeout(timeout),
          last_call_ns(absl::ToUnixNanos(now)),
          session(std::move(made)),
          prefix(std::move(held)) {}
    // Immutable: read without the lock.
    const SessionInfo info;
    const PolicySpec policy_spec;  // as created (name and parameters)
    const std::string idempotency_key;
    const absl::Duration idle_timeout;  // ZeroDuration: never expires
    // The lease: the store's clock at the last call, and the open holds.
    // Written under the store's lock (so ExpireIdle sees a consistent
    // state); atomic so that Stats can read them without it.
    std::atomic<int64_t> last_call_ns;
    std::atomic<int32_t> holds{0};
    absl::Time last_call() const { return absl::FromUnixNanos(last_call_ns); }
    absl::Mutex mu;
    std::unique_ptr<Session> session ABSL_GUARDED_BY(mu);
    // Set by Register, before the entry is shared: the tenant's quota.
    std::shared_ptr<PageQuota> quota;
    // Out of the pool (session is null): the copy in a lower tier, and the
    // session's stats when it left (pages 0).
    std::unique_ptr<TierCopy> moved ABSL_GUARDED_BY(mu);
    SessionStats moved_stats ABSL_GUARDED_BY(mu);
    // DATA_LOSS once its tier copy was found damaged: every call gets it.
    absl::Status lost ABSL_GUARDED_BY(mu);
    // The prefix the session (or the session it was forked from) started
    // from: kept until the session is freed, so the prefix outlives it.
    std::shared_ptr<PrefixHold> prefix ABSL_GUARDED_BY(mu);
    // Set and cleared under the store's lock by FreezeForTransfer and
    // FinishTransfer; read by operations under `mu` and by CloseSession and
    // the lease checks under the store's lock.
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
    TierOptions tiers;
    std::unique_ptr<TierCounters> tier_counters;
  };

  struct Tenant {
    std::shared_ptr<PageQuota> quota;
    int64_t sessions = 0;
    int64_t expired = 0;
  };
  // How Find treats the session's lease.
  enum class Access { kPeek, kRenew, kHold };

  explicit CacheStore(const StoreOptions& options)
      : options_(options),
        clock_(options.lease.clock != nullptr ? options.lease.clock
                                              : RealClock()),
        expired_(options.lease.remembered_expiries) {}
  absl::StatusOr<const Pool*> FindPool(const std::string& layout) const;
  // CloseSession; `transferred` closes a frozen session too.
  absl::Status Close(SessionId id, bool transferred);
  // Whether one more session of `tenant` fits max_sessions and the tenant's
  // session limit (a refusal is counted against the tenant); its quota.
  absl::StatusOr<std::shared_ptr<PageQuota>> Admit(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An id no session has.
  SessionId NewSessionId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session `key` of `tenant` made, if any.
  std::optional<SessionId> Idempotent(const std::string& tenant,
                                      const std::string& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new session's id and its tenant's quota, or (existing) the session
  // the tenant's idempotency key already made; RESOURCE_EXHAUSTED past the
  // limits (Admit).
  struct Admission {
    SessionId id = 0;
    bool existing = false;
    std::shared_ptr<PageQuota> quota;
  };
  absl::StatusOr<Admission> AdmitNew(const std::string& tenant,
                                     const std::string& idempotency_key)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Registers a session made outside the store's lock (a fork's child, a
  // session from a prefix) after checking the limits and the idempotency
  // key again: its id, or the session a retry made meanwhile.
  absl::StatusOr<SessionId> Enroll(std::unique_ptr<Session> made,
                                   const std::string& tenant, PolicySpec policy,
                                   const std::string& idempotency_key,
                                   absl::Duration idle_timeout,
                                   std::shared_ptr<PrefixHold> prefix)
      ABSL_LOCKS_EXCLUDED(mu_);
  // ForkSession's child, made under the parent's lock; *prefix: a hold on
  // the prefix the parent started from, if any.
  absl::StatusOr<std::unique_ptr<Session>> ForkUnderLock(
      SessionId parent, SessionId child, PolicyPtr policy,
      std::vector<int64_t> budgets, std::shared_ptr<PageQuota> quota,
      std::shared_ptr<PrefixHold>* prefix);
  // One more hold on the prefix `other` holds (prefixes.cc).
  static std::shared_ptr<PrefixHold> HoldAgain(const PrefixHold& other);
  // Adds a made session to the map, its tenant and the observer; `prefix`:
  // its hold on the prefix it started from.
  void Register(std::unique_ptr<Session> session, const std::string& tenant,
                PolicySpec policy, const std::string& idempotency_key,
                absl::Duration idle_timeout,
                std::shared_ptr<PrefixHold> prefix = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a session out of the map, its tenant and the observer; the caller
  // frees it (Free) once the lock is released.
  using EntryMap = absl::flat_hash_map<SessionId, std::shared_ptr<Entry>>;
  std::shared_ptr<Entry> Unregister(EntryMap::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for a call in flight, then frees the session; its page count.
  static int64_t Free(Entry& entry);
  // Whether a session's lease has run out at `now` (a held one has not).
  static bool Expired(const Entry& entry, absl::Time now);
  static LeaseStatus LeaseOf(const Entry& entry, absl::Time now);
  // Unregisters an expired session, remembering it and counting it.
  std::shared_ptr<Entry> Expire(EntryMap::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees an expired session a call found, keeps it for ExpireIdle to
  // report, and returns the NOT_FOUND the call gets.
  absl::Status FreeExpired(Entry& entry) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a hold (a LeaseHold) or a transfer's pin and restarts the
  // session's idle time, in one step under the store's lock: ExpireIdle
  // must never see the pin gone with the old idle time.
  enum class Pin { kHold, kTransfer };
  void Unpin(Entry& entry, Pin pin) ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND for `id`: "expired" if it is remembered as such.
  absl::Status NotFound(SessionId id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status NotFoundLocked(SessionId id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The session, its lease renewed (or held) as `access` says; an expired
  // one is closed here and NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Entry>> Find(SessionId id,
                                              Access access = Access::kRenew);
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

  // Tiers (cache_store_tiers.cc). Moves the session down a tier.
  absl::Status MoveDown(Entry& entry, const Pool& pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry.mu);
  // Brings a moved session back into its pool (OK if it is there or
  // closed); DATA_LOSS, for good, if its copy is damaged.
  absl::Status EnsureResident(Entry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry.mu);
  // For a call on `self` that found its pool full: moves the least recently
  // used other session that can move down (of self's tenant when it is
  // self's quota that is full). Whether one moved.
  bool MakeRoom(const Entry& self) ABSL_LOCKS_EXCLUDED(mu_);
  // fn(), again after MakeRoom while it answers RESOURCE_EXHAUSTED.
  template <typename Fn>
  auto WithRoom(const Entry& self, Fn fn) -> decltype(fn());

  // CreateSession from spec.prefix (prefixes.cc).
  absl::StatusOr<SessionId> CreateFromPrefix(const SessionSpec& spec);
  // The prefix `name` as `tenant` sees it: its own first, then public.
  std::shared_ptr<Prefix> FindPrefix(const std::string& tenant,
                                     const std::string& name) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  static PrefixInfo InfoOf(const Prefix& prefix);
  // PublishPrefix's fork of `source` into the prefix's session, under the
  // source's lock.
  absl::Status ForkPrefix(Entry& source, Prefix& prefix,
                          std::shared_ptr<PageQuota> quota);

  const StoreOptions options_;
  const Clock* const clock_;
  std::vector<Pool> pools_;  // fixed after Create
  std::atomic<int64_t> forks_{0};
  mutable absl::Mutex mu_;
  EntryMap sessions_ ABSL_GUARDED_BY(mu_);
  ExpiredSessions expired_ ABSL_GUARDED_BY(mu_);
  // No lease runs out before this (a lower bound: calls only push deadlines
  // later; a new session or the end of a hold lowers it).
  absl::Time next_expiry_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // Sessions calls found expired and closed, not yet returned by ExpireIdle.
  std::vector<ExpiredSession> unreported_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(mu_);
  // (tenant, idempotency key) -> session.
  absl::flat_hash_map<std::pair<std::string, std::string>, SessionId>
      idempotency_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);  // session ids
  // Published prefixes by (is public, publishing tenant or "" if public,
  // name).
  using PrefixKey = std::tuple<bool, std::string, std::string>;
  absl::flat_hash_map<PrefixKey, std::shared_ptr<Prefix>> prefixes_
      ABSL_GUARDED_BY(mu_);
  // Every prefix still alive, published or not, by its owner id in the
  // pool (an id no session may take); dead ones are pruned as found.
  absl::flat_hash_map<SessionId, std::weak_ptr<Prefix>> prefix_owners_
      ABSL_GUARDED_BY(mu_);
};

class CacheStore::LeaseHold {
 public:
  ~LeaseHold() { store_->Unpin(*entry_, Pin::kHold); }
  LeaseHold(const LeaseHold&) = delete;
  LeaseHold& operator=(const LeaseHold&) = delete;

 private:
  friend class CacheStore;
  LeaseHold(CacheStore* store, std::shared_ptr<Entry> entry)
      : store_(store), entry_(std::move(entry)) {}
  CacheStore* const store_;
  const std::shared_ptr<Entry> entry_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_CACHE_STORE_H_
