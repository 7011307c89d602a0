// CacheStore's registry of sessions: finding one (renewing its lease, lease.h
// and docs/sessions.md), expiring idle ones, holds and keep-alives, and the
// listings of sessions, tenants and layouts.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"

namespace kvkeep {

absl::StatusOr<std::shared_ptr<CacheStore::Entry>> CacheStore::Find(
    SessionId id, Access access) {
  std::shared_ptr<Entry> expired;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return NotFoundLocked(id);
    Entry& entry = *it->second;
    const absl::Time now = clock_->Now();
    if (!Expired(entry, now)) {
      if (access != Access::kPeek) {
        entry.last_call_ns = absl::ToUnixNanos(now);
      }
      if (access == Access::kHold) ++entry.holds;
      return it->second;
    }
    expired = Expire(it);
  }
  return FreeExpired(*expired);
}

absl::Status CacheStore::FreeExpired(Entry& entry) {
  ExpiredSession report{entry.info, entry.idle_timeout, Free(entry)};
  absl::MutexLock lock(&mu_);
  // Bounded like the memory of expired ids, should nobody drain it.
  if (static_cast<int64_t>(unreported_.size()) >=
      std::max<int64_t>(1, options_.lease.remembered_expiries)) {
    unreported_.erase(unreported_.begin());
  }
  unreported_.push_back(std::move(report));
  return NotFoundLocked(entry.info.id);
}

bool CacheStore::Expired(const Entry& entry, absl::Time now) {
  return entry.idle_timeout != absl::ZeroDuration() && entry.holds == 0 &&
         !entry.transferring && now - entry.last_call() >= entry.idle_timeout;
}

LeaseStatus CacheStore::LeaseOf(const Entry& entry, absl::Time now) {
  LeaseStatus lease;
  lease.idle_timeout = entry.idle_timeout;
  lease.held = entry.holds > 0 || entry.transferring;
  if (entry.idle_timeout == absl::ZeroDuration()) return lease;
  lease.left = lease.held
                   ? entry.idle_timeout
                   : std::max(absl::ZeroDuration(),
                              entry.last_call() + entry.idle_timeout - now);
  return lease;
}

std::shared_ptr<CacheStore::Entry> CacheStore::Expire(EntryMap::iterator it) {
  const Entry& entry = *it->second;
  expired_.Add(entry.info.id, entry.info.tenant, entry.idle_timeout);
  ++tenants_[entry.info.tenant].expired;
  return Unregister(it);
}

void CacheStore::Unpin(Entry& entry, Pin pin) {
  absl::MutexLock lock(&mu_);
  if (pin == Pin::kHold) {
    --entry.holds;
  } else {
    entry.transferring = false;
  }
  const absl::Time now = clock_->Now();
  entry.last_call_ns = absl::ToUnixNanos(now);
  if (entry.idle_timeout != absl::ZeroDuration()) {
    next_expiry_ = std::min(next_expiry_, now + entry.idle_timeout);
  }
}

absl::Status CacheStore::NotFoundLocked(SessionId id) const {
  if (const ExpiredSessions::Record* r = expired_.Find(id); r != nullptr) {
    return ExpiredSessions::NotFound(id, *r);
  }
  return absl::NotFoundError(absl::StrCat(SessionLabel(id), " not found"));
}

absl::Status CacheStore::NotFound(SessionId id) const {
  absl::MutexLock lock(&mu_);
  return NotFoundLocked(id);
}

std::optional<std::string> CacheStore::ExpiredTenant(SessionId id) const {
  absl::MutexLock lock(&mu_);
  const ExpiredSessions::Record* r = expired_.Find(id);
  if (r == nullptr) return std::nullopt;
  return r->tenant;
}

absl::StatusOr<LeaseStatus> CacheStore::KeepAlive(SessionId id) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  return LeaseOf(**entry, clock_->Now());
}

absl::StatusOr<std::unique_ptr<CacheStore::LeaseHold>> CacheStore::HoldLease(
    SessionId id) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id, Access::kHold);
  if (!entry.ok()) return entry.status();
  return std::unique_ptr<LeaseHold>(new LeaseHold(this, *std::move(entry)));
}

std::vector<ExpiredSession> CacheStore::ExpireIdle() {
  std::vector<std::shared_ptr<Entry>> expired;
  std::vector<ExpiredSession> out;
  {
    absl::MutexLock lock(&mu_);
    out.swap(unreported_);
    const absl::Time now = clock_->Now();
    if (now < next_expiry_) return out;
    absl::Time next = absl::InfiniteFuture();
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      const Entry& entry = *it->second;
      if (Expired(entry, now)) {
        expired.push_back(Expire(it++));  // erasing keeps `it` valid
        continue;
      }
      if (entry.idle_timeout != absl::ZeroDuration() && entry.holds == 0 &&
          !entry.transferring) {
        next = std::min(next, entry.last_call() + entry.idle_timeout);
      }
      ++it;
    }
    next_expiry_ = next;
  }
  for (const std::shared_ptr<Entry>& entry : expired) {
    out.push_back(
        ExpiredSession{entry->info, entry->idle_timeout, Free(*entry)});
  }
  return out;
}

absl::Duration CacheStore::TimeToNextExpiry() const {
  absl::MutexLock lock(&mu_);
  return std::max(absl::ZeroDuration(), next_expiry_ - clock_->Now());
}

absl::StatusOr<std::string> CacheStore::TenantOf(SessionId id) {
  absl::StatusOr<std::shared_ptr<Entry>> entry = Find(id, Access::kPeek);
  if (!entry.ok()) return entry.status();
  return (*entry)->info.tenant;
}

std::vector<SessionInfo> CacheStore::Sessions() const {
  std::vector<SessionInfo> out;
  {
    absl::MutexLock lock(&mu_);
    out.reserve(sessions_.size());
    for (const auto& [id, entry] : sessions_) {
      out.push_back(entry->info);
    }
  }
  std::sort(
      out.begin(), out.end(),
      [](const SessionInfo& a, const SessionInfo& b) { return a.id < b.id; });
  return out;
}

std::vector<TenantStats> CacheStore::Tenants() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantStats> out;
  for (const auto& [name, tenant] : tenants_) {
    out.push_back(TenantStats{name, tenant.sessions, tenant.quota->used_bytes(),
                              tenant.quota->rejections(), tenant.expired});
  }
  std::sort(out.begin(), out.end(),
            [](const TenantStats& a, const TenantStats& b) {
              return a.tenant < b.tenant;
            });
  return out;
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
    out.push_back(LayoutStats{p.layout, p.pages->stats(), 0,
                              p.tier_counters->Snapshot()});
  }
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : sessions_) {
      for (LayoutStats& s : out) {
        if (s.layout.name == entry->info.layout) ++s.sessions;
      }
    }
  }
  for (LayoutStats& s : out) {
    constexpr int kPool = static_cast<int>(Tier::kPool);
    s.tiers.sessions[kPool] = s.sessions;
    for (int t = kPool + 1; t < kTierCount; ++t) {
      s.tiers.sessions[kPool] -= s.tiers.sessions[t];
    }
    s.tiers.bytes[kPool] = s.pool.used_pages * s.pool.page_bytes;
  }
  return out;
}

}  // namespace kvkeep
