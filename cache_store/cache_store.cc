#include "cache_store/cache_store.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache_store/budget.h"
#include "cache_store/policy_registry.h"
#include "cache_store/quote.h"
#include "kernels/quantize.h"

namespace kvkeep {

absl::string_view OperationName(StoreOperation op) {
  switch (op) {
    case StoreOperation::kAppend:
      return "append";
    case StoreOperation::kScores:
      return "scores";
    case StoreOperation::kStep:
      return "step";
    case StoreOperation::kCompress:
      return "compress";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<CacheStore>> CacheStore::Create(
    const StoreOptions& options) {
  if (options.pools.empty()) {
    return absl::InvalidArgumentError("a store needs at least one layout");
  }
  if (options.max_sessions < 1) {
    return absl::InvalidArgumentError("max_sessions must be at least 1");
  }
  if (absl::Status s = ValidateLeaseOptions(options.lease); !s.ok()) return s;
  std::unique_ptr<CacheStore> store(new CacheStore(options));
  absl::flat_hash_set<std::string> names;
  absl::flat_hash_set<std::string> disk_dirs;
  for (const PoolSpec& spec : options.pools) {
    if (absl::Status s = ValidateLayout(spec.layout); !s.ok()) return s;
    if (!names.insert(spec.layout.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout '", spec.layout.name, "' is defined twice"));
    }
    absl::StatusOr<std::unique_ptr<PagePool>> pool =
        PagePool::Create(spec.layout.page_layout(), spec.capacity_pages,
                         options.device, options.share_pools);
    if (!pool.ok()) {
      return absl::Status(pool.status().code(),
                          absl::StrCat("layout '", spec.layout.name,
                                       "': ", pool.status().message()));
    }
    // Each layout clears its directory at start: sharing one would delete
    // another layout's sessions.
    if (!spec.tiers.disk_dir.empty() &&
        !disk_dirs.insert(spec.tiers.disk_dir).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout '", spec.layout.name, "': disk tier directory ",
                       spec.tiers.disk_dir, " is another layout's too"));
    }
    if (absl::Status s = PrepareTiers(spec.tiers, spec.layout.name); !s.ok()) {
      return s;
    }
    store->pools_.push_back(Pool{spec.layout, *std::move(pool), spec.tiers,
                                 std::make_unique<TierCounters>()});
  }
  return store;
}

absl::StatusOr<const CacheStore::Pool*> CacheStore::FindPool(
    const std::string& layout) const {
  for (const Pool& p : pools_) {
    if (p.layout.name == layout) return &p;
  }
  return absl::NotFoundError(absl::StrCat("unknown layout ", Quote(layout)));
}

absl::StatusOr<PageMemory*> CacheStore::MemoryOf(
    const std::string& layout) const {
  absl::StatusOr<const Pool*> pool = FindPool(layout);
  if (!pool.ok()) return pool.status();
  return &(*pool)->pages->memory();
}

absl::StatusOr<PoolMapping> CacheStore::SharePool(
    const std::string& layout) const {
  absl::StatusOr<const Pool*> pool = FindPool(layout);
  if (!pool.ok()) return pool.status();
  if (!options_.share_pools) {
    return absl::FailedPreconditionError(
        "this store does not share its pools (start kvkeepd with "
        "--share_pools: any process that maps a pool reads every session of "
        "its layout)");
  }
  const PagePool& pages = *(*pool)->pages;
  absl::StatusOr<SharedPool> handle = pages.memory().Share();
  if (!handle.ok()) return handle.status();
  return PoolMapping{(*pool)->layout, pages.memory().device(),
                     pages.capacity_pages(), pages.memory().bytes(),
                     *std::move(handle)};
}

absl::StatusOr<std::shared_ptr<PageQuota>> CacheStore::Admit(
    const std::string& tenant_name) {
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the store already holds its maximum of ",
                     options_.max_sessions, " sessions"));
  }
  Tenant& tenant = tenants_[tenant_name];
  const bool limited = options_.unlimited_tenant.empty() ||
                       tenant_name != options_.unlimited_tenant;
  if (tenant.quota == nullptr) {
    tenant.quota = std::make_shared<PageQuota>(
        tenant_name, limited ? options_.max_bytes_per_tenant : 0);
  }
  if (limited && options_.max_sessions_per_tenant > 0 &&
      tenant.sessions >= options_.max_sessions_per_tenant) {
    tenant.quota->CountRejection();
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant '", tenant_name, "' already holds its maximum of ",
                     options_.max_sessions_per_tenant, " sessions"));
  }
  return tenant.quota;
}

void CacheStore::Register(std::unique_ptr<Session> session,
                          const std::string& tenant, PolicySpec policy,
                          const std::string& idempotency_key,
                          absl::Duration idle_timeout,
                          std::shared_ptr<PrefixHold> prefix) {
  const SessionId id = session->id();
  ++tenants_[tenant].sessions;
  const absl::Time now = clock_->Now();
  SessionInfo info{id, tenant, session->layout().name,
                   std::string(session->policy().name())};
  auto entry = std::make_shared<Entry>(std::move(info), std::move(policy),
                                       idempotency_key, idle_timeout, now,
                                       std::move(session), std::move(prefix));
  entry->quota = tenants_[tenant].quota;
  if (idle_timeout != absl::ZeroDuration()) {
    next_expiry_ = std::min(next_expiry_, now + idle_timeout);
  }
  if (options_.observer != nullptr) {
    options_.observer->SessionOpened(entry->info);
  }
  sessions_.emplace(id, std::move(entry));
  if (!idempotency_key.empty()) {
    idempotency_.emplace(std::pair(tenant, idempotency_key), id);
  }
}

absl::StatusOr<SessionId> CacheStore::CreateSession(const SessionSpec& spec) {
  if (!spec.prefix.empty()) return CreateFromPrefix(spec);
  absl::StatusOr<const Pool*> pool = FindPool(spec.layout);
  if (!pool.ok()) return pool.status();
  absl::StatusOr<PolicyPtr> policy = NewPolicy(spec.policy);
  if (!policy.ok()) return policy.status();
  absl::StatusOr<std::vector<int64_t>> budgets = LayerBudgets(
      spec.budget, (*pool)->layout.num_layers, (*policy)->protected_tokens());
  if (!budgets.ok()) return budgets.status();
  absl::StatusOr<absl::Duration> idle_timeout =
      ResolveIdleTimeout(options_.lease, spec.tenant, spec.idle_timeout);
  if (!idle_timeout.ok()) return idle_timeout.status();

  absl::MutexLock lock(&mu_);
  if (std::optional<SessionId> made =
          Idempotent(spec.tenant, spec.idempotency_key)) {
    return *made;
  }
  absl::StatusOr<std::shared_ptr<PageQuota>> quota = Admit(spec.tenant);
  if (!quota.ok()) return quota.status();
  const SessionId id = NewSessionId();
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Create(
      id, (*pool)->layout, (*pool)->pages.get(), *std::move(policy),
      *std::move(budgets), *std::move(quota));
  if (!session.ok()) return session.status();
  Register(*std::move(session), spec.tenant, spec.policy, spec.idempotency_key,
           *idle_timeout);
  return id;
}

SessionId CacheStore::NewSessionId() {
  SessionId id = 0;
  while (id == 0 || sessions_.contains(id) || prefix_owners_.contains(id)) {
    id = absl::Uniform<SessionId>(rng_);
  }
  return id;
}

std::optional<SessionId> CacheStore::Idempotent(const std::string& tenant,
                                                const std::string& key) const {
  if (key.empty()) return std::nullopt;
  auto it = idempotency_.find(std::pair(tenant, key));
  if (it == idempotency_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<SessionId> CacheStore::ForkSession(SessionId parent,
                                                  const ForkSpec& spec) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(parent);
  if (!entry.ok()) return entry.status();
  const SessionInfo& info = (*entry)->info;
  absl::StatusOr<const Pool*> pool = FindPool(info.layout);
  if (!pool.ok()) return pool.status();
  // Null and empty: the parent's own.
  PolicyPtr policy;
  std::vector<int64_t> budgets;
  PolicySpec policy_spec = spec.policy.value_or((*entry)->policy_spec);
  // A session started from a prefix passes its protection on.
  policy_spec.protect_first = (*entry)->policy_spec.protect_first;
  if (spec.policy.has_value() || spec.budget.has_value()) {
    absl::StatusOr<PolicyPtr> made = NewPolicy(policy_spec);
    if (!made.ok()) return made.status();
    policy = *std::move(made);
  }
  if (spec.budget.has_value()) {
    absl::StatusOr<std::vector<int64_t>> made = LayerBudgets(
        *spec.budget, (*pool)->layout.num_layers, policy->protected_tokens());
    if (!made.ok()) return made.status();
    budgets = *std::move(made);
  }
  absl::StatusOr<absl::Duration> idle_timeout =
      spec.idle_timeout == absl::ZeroDuration()
          ? (*entry)->idle_timeout
          : ResolveIdleTimeout(options_.lease, info.tenant, spec.idle_timeout);
  if (!idle_timeout.ok()) return idle_timeout.status();
  absl::StatusOr<Admission> admitted =
      AdmitNew(info.tenant, spec.idempotency_key);
  if (!admitted.ok()) return admitted.status();
  if (admitted->existing) return admitted->id;
  // The parent's lock only (never with the store's, as every call).
  std::shared_ptr<PrefixHold> prefix;
  absl::StatusOr<std::unique_ptr<Session>> child =
      ForkUnderLock(parent, admitted->id, std::move(policy), std::move(budgets),
                    admitted->quota, &prefix);
  if (!child.ok()) return child.status();
  absl::StatusOr<SessionId> enrolled =
      Enroll(*std::move(child), info.tenant, policy_spec, spec.idempotency_key,
             *idle_timeout, std::move(prefix));
  if (enrolled.ok()) forks_.fetch_add(1, std::memory_order_relaxed);
  return enrolled;
}

absl::StatusOr<CacheStore::Admission> CacheStore::AdmitNew(
    const std::string& tenant, const std::string& idempotency_key) {
  absl::MutexLock lock(&mu_);
  if (std::optional<SessionId> made = Idempotent(tenant, idempotency_key)) {
    return Admission{*made, true, nullptr};
  }
  absl::StatusOr<std::shared_ptr<PageQuota>> quota = Admit(tenant);
  if (!quota.ok()) return quota.status();
  return Admission{NewSessionId(), false, *std::move(quota)};
}

absl::StatusOr<SessionId> CacheStore::Enroll(
    std::unique_ptr<Session> made, const std::string& tenant, PolicySpec policy,
    const std::string& idempotency_key, absl::Duration idle_timeout,
    std::shared_ptr<PrefixHold> prefix) {
  const SessionId id = made->id();
  absl::MutexLock lock(&mu_);
  // Checked again: the limits may have filled, a create taken the id, or a
  // retry of this call won, meanwhile. A refused session lets its pages go.
  if (std::optional<SessionId> first = Idempotent(tenant, idempotency_key)) {
    return *first;
  }
  if (sessions_.contains(id)) {
    return absl::AbortedError(
        absl::StrCat(SessionLabel(id), " was taken meanwhile; try again"));
  }
  if (absl::Status s = Admit(tenant).status(); !s.ok()) return s;
  Register(std::move(made), tenant, std::move(policy), idempotency_key,
           idle_timeout, std::move(prefix));
  return id;
}

absl::StatusOr<std::unique_ptr<Session>> CacheStore::ForkUnderLock(
    SessionId parent, SessionId child, PolicyPtr policy,
    std::vector<int64_t> budgets, std::shared_ptr<PageQuota> quota,
    std::shared_ptr<PrefixHold>* prefix) {
  return WithEntry(parent,
                   [&](const Entry& entry,
                       Session& s) -> absl::StatusOr<std::unique_ptr<Session>> {
                     if (entry.transferring) {
                       return absl::UnavailableError(absl::StrCat(
                           SessionLabel(parent), entry.Transferring(),
                           "; fork it once the transfer is done"));
                     }
                     entry.mu.AssertHeld();  // WithEntry holds it
                     if (entry.prefix != nullptr) {
                       *prefix = HoldAgain(*entry.prefix);
                     }
                     return s.Fork(child, std::move(policy), std::move(budgets),
                                   std::move(quota));
                   });
}

absl::Status CacheStore::ReadSlots(SessionId id, int32_t layer, int64_t first,
                                   int64_t n, std::span<std::byte> keys,
                                   std::span<std::byte> values) {
  return WithSession(id, [&](Session& s) {
    if (IsKivi(s.layout().dtype)) {
      const int64_t token_bytes = s.layout().page_layout().token_bytes();
      if (static_cast<int64_t>(values.size()) != n * token_bytes) {
        return absl::InvalidArgumentError(SessionMessage(
            id, "layer ", layer, ": ", values.size(), " value bytes for ", n,
            " slots of ", token_bytes, " bytes"));
      }
      return s.ReadKiviSlots(layer, first, keys, values);
    }
    return s.ReadSlots(layer, first, n, keys, values);
  });
}

absl::StatusOr<SessionSnapshot> CacheStore::ExportSession(SessionId id,
                                                          bool with_bytes) {
  return WithEntry(
      id,
      [&](const Entry& entry, Session& s) -> absl::StatusOr<SessionSnapshot> {
        SessionSnapshot snapshot = s.Snapshot(with_bytes);
        if (!s.device_error().ok()) return s.device_error();
        snapshot.tenant = entry.info.tenant;
        snapshot.policy = entry.policy_spec;
        snapshot.idle_timeout = entry.idle_timeout;
        return snapshot;
      });
}

absl::StatusOr<SessionId> CacheStore::ImportSession(
    const SessionSnapshot& snapshot) {
  SessionSnapshot metadata = snapshot;
  for (LayerSnapshot& l : metadata.layers) {
    l.keys.clear();
    l.values.clear();
  }
  // The sizes are checked here, where the bytes are: a short layer must not
  // pass as "metadata only".
  absl::StatusOr<const Pool*> pool = FindPool(snapshot.layout);
  if (!pool.ok()) return pool.status();
  if (absl::Status s = ValidateSnapshot(snapshot, (*pool)->layout); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<PendingImport>> pending =
      PrepareImport(std::move(metadata));
  if (!pending.ok()) return pending.status();
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    if (absl::Status s =
            (*pending)->Write(static_cast<int32_t>(l), snapshot.layers[l].keys,
                              snapshot.layers[l].values);
        !s.ok()) {
      return s;
    }
  }
  return CommitImport(*std::move(pending));
}

absl::StatusOr<SessionSnapshot> CacheStore::FreezeForTransfer(SessionId id) {
  // A call like any other: it renews the lease (or finds it run out).
  if (absl::Status s = Find(id).status(); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return NotFoundLocked(id);
    // From here the transfer holds the lease (Expired).
    if (it->second->transferring.exchange(true)) {
      return absl::FailedPreconditionError(
          absl::StrCat(SessionLabel(id), " is already being transferred"));
    }
  }
  // An operation that began before the freeze finishes first (the lock).
  absl::StatusOr<SessionSnapshot> snapshot =
      ExportSession(id, /*with_bytes=*/false);
  if (!snapshot.ok()) {
    FinishTransfer(id, /*committed=*/false).IgnoreError();
  }
  return snapshot;
}

absl::StatusOr<SlotSpans> CacheStore::FrozenSlotSpans(SessionId id,
                                                      int32_t layer,
                                                      int64_t first,
                                                      int64_t n) {
  return WithEntry(
      id, [&](const Entry& entry, Session& s) -> absl::StatusOr<SlotSpans> {
        if (!entry.transferring) {
          return absl::FailedPreconditionError(
              absl::StrCat(SessionLabel(id), " is not frozen for a transfer"));
        }
        std::byte* arena = s.memory().host_data();
        if (arena == nullptr) {
          return absl::FailedPreconditionError(
              absl::StrCat(SessionLabel(id), "'s pool is not in host memory"));
        }
        if (layer < 0 || layer >= s.layout().num_layers) {
          return absl::OutOfRangeError(
              absl::StrCat(SessionLabel(id), ": no layer ", layer));
        }
        const PageLayout page_layout = s.layout().page_layout();
        if (IsKivi(page_layout.dtype) && first % page_layout.page_tokens != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              SessionLabel(id), ": layer ", layer, " slot ", first,
              " does not start a page; kivi_int4 pages move whole"));
        }
        const std::span<const PageId> pages = s.layer_pages(layer);
        const int64_t capacity =
            static_cast<int64_t>(pages.size()) * page_layout.page_tokens;
        if (first < 0 || n < 0 || first + n > capacity) {
          return absl::OutOfRangeError(
              absl::StrCat(SessionLabel(id), ": layer ", layer,
                           " has no slots [", first, ", ", first + n, ")"));
        }
        SlotSpans spans;
        HostSlotSpans(arena, page_layout, pages, first, n, &spans);
        return spans;
      });
}

absl::Status CacheStore::FinishTransfer(SessionId id, bool committed) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  if (!(*entry)->transferring) {
    return absl::FailedPreconditionError(
        absl::StrCat(SessionLabel(id), " is not being transferred"));
  }
  if (committed) return Close(id, /*transferred=*/true);
  {
    absl::MutexLock lock(&(*entry)->note_mu);
    (*entry)->transfer_note.clear();
  }
  Unpin(**entry, Pin::kTransfer);  // its idle time starts now
  return absl::OkStatus();
}

absl::Status CacheStore::NoteTransfer(SessionId id, std::string note) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  absl::MutexLock lock(&(*entry)->note_mu);
  (*entry)->transfer_note = std::move(note);
  return absl::OkStatus();
}

absl::Status CacheStore::PendingImport::Write(
    int32_t layer, std::span<const std::byte> keys,
    std::span<const std::byte> values) {
  if (layer < 0 || layer >= static_cast<int32_t>(written_.size())) {
    return absl::InvalidArgumentError(SessionMessage(id(), "no layer ", layer));
  }
  const int64_t token_bytes = session_->layout().page_layout().token_bytes();
  absl::Status s = session_->WriteSlots(layer, written_[layer], keys, values);
  if (!s.ok()) return s;
  // Counted by the values: kivi_int4's keys are whole pages' key blocks.
  written_[layer] += static_cast<int64_t>(values.size()) / token_bytes;
  return absl::OkStatus();
}

absl::Status CacheStore::PendingImport::Fill(int32_t layer, int64_t n,
                                             const SlotFill& fill) {
  if (layer < 0 || layer >= static_cast<int32_t>(written_.size()) || n < 0 ||
      written_[layer] + n > snapshot_.layers[layer].resident()) {
    return absl::InvalidArgumentError(SessionMessage(
        id(), "layer ", layer, ": ", n, " slots do not fit what it reserved"));
  }
  if (absl::Status s =
          fill(session_->memory(), session_->layout().page_layout(),
               session_->layer_pages(layer), written_[layer], n);
      !s.ok()) {
    return s;
  }
  written_[layer] += n;
  return absl::OkStatus();
}

bool CacheStore::PendingImport::complete() const {
  for (size_t l = 0; l < written_.size(); ++l) {
    if (written_[l] != snapshot_.layers[l].resident()) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>>
CacheStore::PrepareImport(SessionSnapshot snapshot) {
  if (snapshot.id == 0) {
    return absl::InvalidArgumentError("a session snapshot needs an id");
  }
  absl::StatusOr<const Pool*> pool = FindPool(snapshot.layout);
  if (!pool.ok()) return pool.status();
  absl::StatusOr<PolicyPtr> policy = NewPolicy(snapshot.policy);
  if (!policy.ok()) return policy.status();
  std::shared_ptr<PageQuota> quota;
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.contains(snapshot.id)) {
      return absl::AlreadyExistsError(
          absl::StrCat(SessionLabel(snapshot.id), " already exists here"));
    }
    absl::StatusOr<std::shared_ptr<PageQuota>> q = Admit(snapshot.tenant);
    if (!q.ok()) return q.status();
    quota = *std::move(q);
  }
  // Pages are reserved outside the store's lock.
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Restore(
      snapshot.id, (*pool)->layout, (*pool)->pages.get(), *std::move(policy),
      snapshot, quota, /*bytes_follow=*/true);
  if (!session.ok()) return session.status();
  return std::unique_ptr<PendingImport>(
      new PendingImport(std::move(snapshot), *std::move(session)));
}

absl::StatusOr<SessionId> CacheStore::CommitImport(
    std::unique_ptr<PendingImport> pending) {
  if (!pending->complete()) {
    return absl::FailedPreconditionError(SessionMessage(
        pending->id(), "not every layer's keys and values have arrived"));
  }
  // Outside the store's lock: it re-quantises each open page.
  if (absl::Status s = pending->session_->CheckKiviPages(); !s.ok()) {
    return s;
  }
  const SessionSnapshot& snapshot = pending->snapshot_;
  absl::MutexLock lock(&mu_);
  // Checked again: another import or create may have come in between.
  if (sessions_.contains(snapshot.id)) {
    return absl::AlreadyExistsError(
        absl::StrCat(SessionLabel(snapshot.id), " already exists here"));
  }
  if (absl::Status s = Admit(snapshot.tenant).status(); !s.ok()) return s;
  const absl::Duration idle_timeout = ImportedIdleTimeout(
      options_.lease, snapshot.tenant, snapshot.idle_timeout);
  Register(std::move(pending->session_), snapshot.tenant, snapshot.policy, "",
           idle_timeout);
  return snapshot.id;
}

template <typename Fn>
auto CacheStore::WithEntry(SessionId id, Fn fn)
    -> decltype(fn(std::declval<const Entry&>(), std::declval<Session&>())) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  {
    absl::MutexLock lock(&(*entry)->mu);
    if (absl::Status s = EnsureResident(**entry); !s.ok()) return s;
    if ((*entry)->session != nullptr) return fn(**entry, *(*entry)->session);
  }
  // Closed (or expired) between Find and the lock: the session is gone.
  return NotFound(id);
}

template <typename Fn>
auto CacheStore::WithSession(SessionId id, Fn fn)
    -> decltype(fn(std::declval<Session&>())) {
  return WithEntry(id, [&](const Entry&, Session& s) { return fn(s); });
}

namespace {
const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace

template <typename Fn>
auto CacheStore::WithRoom(const Entry& self, Fn fn) -> decltype(fn()) {
  auto result = fn();
  // A refused call changed nothing, so it can simply run again.
  while (absl::IsResourceExhausted(StatusOf(result)) && MakeRoom(self)) {
    result = fn();
  }
  return result;
}

template <typename Fn>
auto CacheStore::Work(SessionId id, StoreOperation op, Fn fn)
    -> decltype(fn(std::declval<Session&>())) {
  return WithEntry(id, [&](const Entry& entry, Session& session) {
    if (entry.transferring) {
      return decltype(fn(session))(absl::UnavailableError(
          absl::StrCat(SessionLabel(entry.info.id), entry.Transferring(),
                       "; it takes no changes until the transfer is done")));
    }
    auto run = [&] { return WithRoom(entry, [&] { return fn(session); }); };
    if (options_.observer == nullptr) return run();
    const SessionWork before = session.work();
    const auto start = std::chrono::steady_clock::now();
    auto result = run();
    if (!result.ok()) return result;
    const auto end = std::chrono::steady_clock::now();
    const SessionWork& after = session.work();
    WorkReport report;
    report.session = &entry.info;
    report.operation = op;
    report.duration = absl::FromChrono(end - start);
    report.work.evicted_tokens = after.evicted_tokens - before.evicted_tokens;
    report.work.evicted_score = after.evicted_score - before.evicted_score;
    report.work.score_updates = after.score_updates - before.score_updates;
    report.work.evictions = after.evictions - before.evictions;
    report.work.scoring_time = after.scoring_time - before.scoring_time;
    report.work.eviction_time = after.eviction_time - before.eviction_time;
    options_.observer->WorkDone(report);
    return result;
  });
}

absl::Status CacheStore::CloseSession(SessionId id) {
  return Close(id, /*transferred=*/false);
}

absl::Status CacheStore::Close(SessionId id, bool transferred) {
  std::shared_ptr<Entry> entry;
  bool expired = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return NotFoundLocked(id);
    if (it->second->transferring && !transferred) {
      return absl::UnavailableError(
          absl::StrCat(SessionLabel(id), it->second->Transferring(),
                       "; retry once the transfer is done"));
    }
    expired = Expired(*it->second, clock_->Now());
    entry = expired ? Expire(it) : Unregister(it);
  }
  if (expired) return FreeExpired(*entry);
  Free(*entry);
  return absl::OkStatus();
}

std::shared_ptr<CacheStore::Entry> CacheStore::Unregister(
    EntryMap::iterator it) {
  std::shared_ptr<Entry> entry = std::move(it->second);
  sessions_.erase(it);
  --tenants_[entry->info.tenant].sessions;
  if (!entry->idempotency_key.empty()) {
    idempotency_.erase(std::pair(entry->info.tenant, entry->idempotency_key));
  }
  if (options_.observer != nullptr) {
    options_.observer->SessionClosed(entry->info);
  }
  return entry;
}

int64_t CacheStore::Free(Entry& entry) {
  absl::MutexLock lock(&entry.mu);  // waits for a call in flight
  entry.moved.reset();              // a moved session's copy goes with it
  if (entry.session == nullptr) return 0;
  const int64_t pages = entry.session->stats().pages;
  entry.session.reset();
  entry.prefix.reset();  // after the session: the prefix is freed last
  return pages;
}

absl::StatusOr<StepResult> CacheStore::Append(SessionId id,
                                              const AppendRequest& request) {
  return Work(id, StoreOperation::kAppend,
              [&](Session& s) { return s.Append(request); });
}

absl::StatusOr<StepResult> CacheStore::UpdateScores(
    SessionId id, std::span<const LayerScores> scores) {
  return Work(id, StoreOperation::kScores,
              [&](Session& s) { return s.UpdateScores(scores); });
}

absl::StatusOr<StepOutcome> CacheStore::Step(
    SessionId id, const AppendRequest& append,
    std::span<const LayerScores> scores) {
  return Work(id, StoreOperation::kStep,
              [&](Session& s) { return s.Step(append, scores); });
}

absl::Status CacheStore::Step(SessionId id, const AppendRequest& append,
                              std::span<const LayerScores> scores,
                              StepOutcome& out) {
  return Work(id, StoreOperation::kStep,
              [&](Session& s) { return s.Step(append, scores, out); });
}

absl::StatusOr<StepResult> CacheStore::CompressPrompt(
    SessionId id, std::span<const LayerScores> window) {
  return Work(id, StoreOperation::kCompress,
              [&](Session& s) { return s.CompressPrompt(window); });
}

absl::StatusOr<BlockTable> CacheStore::GetBlockTable(SessionId id,
                                                     int32_t layer) {
  return WithSession(id, [&](Session& s) { return s.GetBlockTable(layer); });
}

absl::StatusOr<LayerKvCopy> CacheStore::ReadLayer(SessionId id, int32_t layer) {
  return WithSession(id, [&](Session& s) { return s.ReadLayer(layer); });
}

absl::StatusOr<LayerKvCopy> CacheStore::ReadLayerAs(SessionId id, int32_t layer,
                                                    DType dtype) {
  return WithSession(id, [&](Session& s) -> absl::StatusOr<LayerKvCopy> {
    const PageLayout page = s.layout().page_layout();
    if (IsQuantized(dtype) && dtype != page.dtype) {
      return absl::InvalidArgumentError(SessionMessage(
          id, "ReadKv as ", std::string(DTypeName(dtype)),
          ": the layout stores ", std::string(DTypeName(page.dtype)),
          "; ask for its own dtype, f32, f16 or bf16"));
    }
    if (IsKivi(page.dtype)) {
      if (dtype == page.dtype) return s.ReadLayer(layer);  // refused
      return s.ReadKiviLayerAs(layer, dtype);
    }
    absl::StatusOr<LayerKvCopy> stored = s.ReadLayer(layer);
    if (!stored.ok() || dtype == page.dtype) return stored;
    const int64_t n = static_cast<int64_t>(stored->positions.size());
    LayerKvCopy out;
    out.version = stored->version;
    out.positions = std::move(stored->positions);
    out.dtype = dtype;
    const size_t bytes =
        static_cast<size_t>(n * page.token_elements() * DTypeBytes(dtype));
    out.keys.resize(bytes);
    out.values.resize(bytes);
    DequantizeTokens(page, stored->keys.data(), n, dtype, out.keys.data());
    DequantizeTokens(page, stored->values.data(), n, dtype, out.values.data());
    return out;
  });
}

absl::StatusOr<SessionStats> CacheStore::GetStats(SessionId id,
                                                  bool renew_lease) {
  absl::StatusOr<std::shared_ptr<Entry>> entry =
      Find(id, renew_lease ? Access::kRenew : Access::kPeek);
  if (!entry.ok()) return entry.status();
  SessionStats stats;
  bool open = false;
  {
    absl::MutexLock lock(&(*entry)->mu);
    if (renew_lease) {
      if (absl::Status s = EnsureResident(**entry); !s.ok()) return s;
    }
    open = (*entry)->session != nullptr || (*entry)->moved != nullptr;
    if ((*entry)->session != nullptr) {
      stats = (*entry)->session->stats();
    } else if (open) {
      stats = (*entry)->moved_stats;  // a look does not bring it back
    }
  }
  if (!open) return NotFound(id);  // closed since Find
  stats.tenant = (*entry)->info.tenant;
  const LeaseStatus lease = LeaseOf(**entry, clock_->Now());
  stats.idle_timeout = lease.idle_timeout;
  stats.lease_left = lease.left;
  stats.lease_held = lease.held;
  return stats;
}

}  // namespace kvkeep
