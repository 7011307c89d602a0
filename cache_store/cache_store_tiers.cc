// CacheStore's tiers (tiers.h, docs/tiers.md): moving whole sessions out of
// their layout's pool into a host or disk tier, and back on their next call.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "cache_store/tier_file.h"

namespace kvkeep {
namespace {

absl::Duration Since(std::chrono::steady_clock::time_point start) {
  return absl::FromChrono(std::chrono::steady_clock::now() - start);
}

}  // namespace

absl::Status CacheStore::MoveDown(Entry& entry, const Pool& pool) {
  const SessionId id = entry.info.id;
  if (!pool.tiers.enabled()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout '", pool.layout.name, "' has no tiers to move sessions to"));
  }
  if (entry.session == nullptr) {
    if (entry.moved != nullptr) {
      return absl::FailedPreconditionError(
          SessionMessage(id, "is already in the ",
                         std::string(TierName(entry.moved->tier())), " tier"));
    }
    return NotFound(id);
  }
  if (entry.transferring) {
    return absl::UnavailableError(
        absl::StrCat(SessionLabel(id), entry.Transferring()));
  }
  if (entry.holds > 0) {
    return absl::FailedPreconditionError(
        SessionMessage(id, "is held by an open stream; it stays in the pool"));
  }
  const SessionStats stats = entry.session->stats();
  if (stats.shared_pages > 0) {
    // Moving a shared page would copy it out and back: no memory saved.
    return absl::FailedPreconditionError(SessionMessage(
        id, "shares ", stats.shared_pages,
        " pages with a fork or prefix; sessions sharing pages stay in the "
        "pool"));
  }
  const auto start = std::chrono::steady_clock::now();
  SessionSnapshot snapshot = entry.session->Snapshot(/*with_bytes=*/true);
  if (!entry.session->device_error().ok()) {
    return entry.session->device_error();
  }
  snapshot.tenant = entry.info.tenant;
  snapshot.policy = entry.policy_spec;
  snapshot.idle_timeout = entry.idle_timeout;
  std::vector<std::byte> bytes = EncodeTierFile(snapshot);
  const int64_t size = static_cast<int64_t>(bytes.size());
  TierCounters* counters = pool.tier_counters.get();
  absl::StatusOr<std::unique_ptr<TierCopy>> copy =
      absl::ResourceExhaustedError("no tier below the pool has room");
  if (pool.tiers.host_bytes > 0) {
    copy = TierCopy::InHost(std::move(bytes), pool.tiers.host_bytes, counters);
    if (!copy.ok() && !pool.tiers.disk_dir.empty()) {
      bytes = EncodeTierFile(snapshot);  // InHost took them
    }
  }
  if (!copy.ok() && !pool.tiers.disk_dir.empty()) {
    copy = TierCopy::OnDisk(pool.tiers.disk_dir, id, bytes, counters);
  }
  if (!copy.ok()) {
    counters->CountFailedMove();
    return absl::Status(
        copy.status().code(),
        SessionMessage(id, "stays in the pool: ", copy.status().message()));
  }
  entry.moved_stats = stats;
  entry.moved_stats.pages = 0;
  entry.moved_stats.bytes = 0;
  entry.session.reset();  // its pages and quota go back now
  entry.moved = *std::move(copy);
  counters->CountMove();
  if (options_.observer != nullptr) {
    options_.observer->TierMoved(TierMove{
        &entry.info, Tier::kPool, entry.moved->tier(), size, Since(start)});
  }
  return absl::OkStatus();
}

absl::Status CacheStore::EnsureResident(Entry& entry) {
  if (!entry.lost.ok()) return entry.lost;
  if (entry.session != nullptr || entry.moved == nullptr) {
    return absl::OkStatus();
  }
  const auto start = std::chrono::steady_clock::now();
  const Pool& pool = **FindPool(entry.info.layout);
  const TierCopy& copy = *entry.moved;
  absl::StatusOr<SessionSnapshot> snapshot = absl::UnknownError("");
  absl::StatusOr<std::vector<std::byte>> bytes = copy.Read();
  if (!bytes.ok() && !absl::IsDataLoss(bytes.status())) return bytes.status();
  snapshot = bytes.ok() ? DecodeTierFile(*bytes) : bytes.status();
  if (snapshot.ok() && snapshot->id != entry.info.id) {
    snapshot = absl::DataLossError(absl::StrCat(
        "it holds ", SessionLabel(snapshot->id), ", not this session"));
  }
  if (!snapshot.ok()) {
    // Never served: the session is lost, and says so to every call.
    entry.lost = absl::DataLossError(SessionMessage(
        entry.info.id, "cannot be restored: its copy in the ",
        std::string(TierName(copy.tier())), " tier",
        copy.path().empty() ? "" : absl::StrCat(" (", copy.path(), ")"),
        " is damaged: ", snapshot.status().message(),
        "; the session is lost: close it and start again"));
    std::fprintf(stderr, "event=tier_copy_lost session=%s tenant=\"%s\" %s\n",
                 SessionName(entry.info.id).c_str(), entry.info.tenant.c_str(),
                 std::string(entry.lost.message()).c_str());
    pool.tier_counters->CountCorrupt();
    if (options_.observer != nullptr) {
      options_.observer->TierCopyLost(entry.info, copy.tier());
    }
    entry.moved.reset();
    return entry.lost;
  }
  auto restore = [&]() -> absl::StatusOr<std::unique_ptr<Session>> {
    absl::StatusOr<PolicyPtr> policy = NewPolicy(entry.policy_spec);
    if (!policy.ok()) return policy.status();
    return Session::Restore(entry.info.id, pool.layout, pool.pages.get(),
                            *std::move(policy), *snapshot, entry.quota);
  };
  absl::StatusOr<std::unique_ptr<Session>> session = restore();
  while (absl::IsResourceExhausted(session.status()) && MakeRoom(entry)) {
    session = restore();
  }
  if (!session.ok()) {
    return absl::Status(
        session.status().code(),
        SessionMessage(
            entry.info.id, "is in the ", std::string(TierName(copy.tier())),
            " tier and cannot come back: ", session.status().message()));
  }
  const TierMove move{&entry.info, copy.tier(), Tier::kPool, copy.bytes(),
                      absl::ZeroDuration()};
  entry.session = *std::move(session);
  entry.moved.reset();
  pool.tier_counters->CountRestore();
  if (options_.observer != nullptr) {
    TierMove done = move;
    done.duration = Since(start);
    options_.observer->TierMoved(done);
  }
  return absl::OkStatus();
}

bool CacheStore::MakeRoom(const Entry& self) {
  absl::StatusOr<const Pool*> found = FindPool(self.info.layout);
  if (!found.ok()) return false;
  const Pool& pool = **found;
  if (!pool.tiers.enabled() || !pool.tiers.demote_when_full) return false;
  // When it is the tenant's own quota that is full, only its own sessions
  // moving out helps.
  const PageQuota* quota = self.quota.get();
  const bool own_only =
      quota != nullptr && quota->limit_bytes() > 0 &&
      quota->used_bytes() + pool.layout.page_layout().page_bytes() >
          quota->limit_bytes();
  std::vector<std::pair<int64_t, std::shared_ptr<Entry>>> candidates;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : sessions_) {
      if (entry.get() == &self || entry->info.layout != self.info.layout ||
          entry->holds > 0 || entry->transferring ||
          (own_only && entry->info.tenant != self.info.tenant)) {
        continue;
      }
      candidates.emplace_back(entry->last_call_ns.load(), entry);
    }
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [last_call, entry] : candidates) {
    // A busy session is not the least recently used one; never wait on it
    // (its call may be waiting for room too).
    if (!entry->mu.TryLock()) continue;
    const bool moved = entry->session != nullptr && MoveDown(*entry, pool).ok();
    entry->mu.Unlock();
    if (moved) return true;
  }
  return false;
}

int64_t CacheStore::DemoteIdle() {
  if (std::none_of(pools_.begin(), pools_.end(), [](const Pool& p) {
        return p.tiers.idle_after > absl::ZeroDuration();
      })) {
    return 0;  // nothing to scan for
  }
  std::vector<std::pair<std::shared_ptr<Entry>, const Pool*>> idle;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (const auto& [id, entry] : sessions_) {
      const Pool* pool = *FindPool(entry->info.layout);
      if (pool->tiers.idle_after <= absl::ZeroDuration() || entry->holds > 0 ||
          entry->transferring ||
          now - entry->last_call() < pool->tiers.idle_after) {
        continue;
      }
      idle.emplace_back(entry, pool);
    }
  }
  int64_t moved = 0;
  for (const auto& [entry, pool] : idle) {
    if (!entry->mu.TryLock()) continue;  // busy: not idle after all
    if (entry->session != nullptr && MoveDown(*entry, *pool).ok()) ++moved;
    entry->mu.Unlock();
  }
  return moved;
}

absl::Status CacheStore::Demote(SessionId id) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id, Access::kPeek);
  if (!entry.ok()) return entry.status();
  absl::MutexLock lock(&(*entry)->mu);
  if (!(*entry)->lost.ok()) return (*entry)->lost;
  return MoveDown(**entry, **FindPool((*entry)->info.layout));
}

absl::StatusOr<Tier> CacheStore::TierOf(SessionId id) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id, Access::kPeek);
  if (!entry.ok()) return entry.status();
  absl::MutexLock lock(&(*entry)->mu);
  if (!(*entry)->lost.ok()) return (*entry)->lost;
  if ((*entry)->moved != nullptr) return (*entry)->moved->tier();
  if ((*entry)->session == nullptr) return NotFound(id);
  return Tier::kPool;
}

}  // namespace kvkeep
