#include "cache_store/cache_store.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache_store/budget.h"
#include "cache_store/policy_registry.h"

namespace kvkeep {

absl::StatusOr<std::unique_ptr<CacheStore>> CacheStore::Create(
    const StoreOptions& options) {
  if (options.pools.empty()) {
    return absl::InvalidArgumentError("a store needs at least one layout");
  }
  if (options.max_sessions < 1) {
    return absl::InvalidArgumentError("max_sessions must be at least 1");
  }
  std::unique_ptr<CacheStore> store(new CacheStore(options.max_sessions));
  absl::flat_hash_set<std::string> names;
  for (const PoolSpec& spec : options.pools) {
    if (absl::Status s = ValidateLayout(spec.layout); !s.ok()) return s;
    if (!names.insert(spec.layout.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout '", spec.layout.name, "' is defined twice"));
    }
    absl::StatusOr<std::unique_ptr<PagePool>> pool =
        PagePool::Create(spec.layout.page_layout(), spec.capacity_pages);
    if (!pool.ok()) {
      return absl::Status(pool.status().code(),
                          absl::StrCat("layout '", spec.layout.name,
                                       "': ", pool.status().message()));
    }
    store->pools_.push_back(Pool{spec.layout, *std::move(pool)});
  }
  return store;
}

absl::StatusOr<SessionId> CacheStore::CreateSession(const SessionSpec& spec) {
  const Pool* pool = nullptr;
  for (const Pool& p : pools_) {
    if (p.layout.name == spec.layout) pool = &p;
  }
  if (pool == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("unknown layout '", spec.layout, "'"));
  }
  absl::StatusOr<PolicyPtr> policy = NewPolicy(spec.policy);
  if (!policy.ok()) return policy.status();
  absl::StatusOr<std::vector<int64_t>> budgets = LayerBudgets(
      spec.budget, pool->layout.num_layers, (*policy)->protected_tokens());
  if (!budgets.ok()) return budgets.status();

  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= max_sessions_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store already holds its maximum of ", max_sessions_, " sessions"));
  }
  const SessionId id = next_id_;
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Create(id, pool->layout, pool->pages.get(), *std::move(policy),
                      *std::move(budgets));
  if (!session.ok()) return session.status();
  ++next_id_;
  auto entry = std::make_shared<Entry>(pool->layout.name);
  {
    absl::MutexLock entry_lock(&entry->mu);
    entry->session = *std::move(session);
  }
  sessions_.emplace(id, std::move(entry));
  return id;
}

absl::StatusOr<std::shared_ptr<CacheStore::Entry>> CacheStore::Find(
    SessionId id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  }
  return it->second;
}

template <typename Fn>
auto CacheStore::WithSession(SessionId id, Fn fn)
    -> decltype(fn(std::declval<Session&>())) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  absl::MutexLock lock(&(*entry)->mu);
  // Closed between Find and the lock: the session is gone.
  if ((*entry)->session == nullptr) {
    return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  }
  return fn(*(*entry)->session);
}

absl::Status CacheStore::CloseSession(SessionId id) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
    }
    entry = std::move(it->second);
    sessions_.erase(it);
  }
  absl::MutexLock lock(&entry->mu);  // waits for a call in flight
  entry->session.reset();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> CacheStore::Append(SessionId id,
                                              const AppendRequest& request) {
  return WithSession(id, [&](Session& s) { return s.Append(request); });
}

absl::StatusOr<StepResult> CacheStore::UpdateScores(
    SessionId id, std::span<const LayerScores> scores) {
  return WithSession(id, [&](Session& s) { return s.UpdateScores(scores); });
}

absl::StatusOr<StepOutcome> CacheStore::Step(
    SessionId id, const AppendRequest& append,
    std::span<const LayerScores> scores) {
  return WithSession(id, [&](Session& s) { return s.Step(append, scores); });
}

absl::StatusOr<StepResult> CacheStore::CompressPrompt(
    SessionId id, std::span<const LayerScores> window) {
  return WithSession(id, [&](Session& s) { return s.CompressPrompt(window); });
}

absl::StatusOr<BlockTable> CacheStore::GetBlockTable(SessionId id,
                                                     int32_t layer) {
  return WithSession(id, [&](Session& s) { return s.GetBlockTable(layer); });
}

absl::StatusOr<LayerKvCopy> CacheStore::ReadLayer(SessionId id, int32_t layer) {
  return WithSession(id, [&](Session& s) { return s.ReadLayer(layer); });
}

absl::StatusOr<SessionStats> CacheStore::GetStats(SessionId id) {
  return WithSession(id, [&](Session& s) -> absl::StatusOr<SessionStats> {
    return s.stats();
  });
}

std::vector<SessionId> CacheStore::ListSessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionId> ids;
  ids.reserve(sessions_.size());
  for (const auto& [id, entry] : sessions_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<LayoutStats> CacheStore::Layouts() const {
  std::vector<LayoutStats> out;
  for (const Pool& p : pools_) {
    out.push_back(LayoutStats{p.layout, p.pages->stats(), 0});
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [id, entry] : sessions_) {
    for (LayoutStats& s : out) {
      if (s.layout.name == entry->layout) ++s.sessions;
    }
  }
  return out;
}

}  // namespace kvkeep
