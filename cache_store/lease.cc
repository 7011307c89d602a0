#include "cache_store/lease.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"

namespace kvkeep {

const Clock* RealClock() {
  class Steady final : public Clock {
   public:
    absl::Time Now() const override {
      return absl::UnixEpoch() +
             absl::FromChrono(
                 std::chrono::steady_clock::now().time_since_epoch());
    }
  };
  static const Steady* const clock = new Steady();
  return clock;
}

namespace {

bool InRange(absl::Duration d) {
  return d >= kMinIdleTimeout && d <= kMaxIdleTimeout;
}

std::string Range() {
  return absl::StrCat("between ", absl::FormatDuration(kMinIdleTimeout),
                      " and ", absl::FormatDuration(kMaxIdleTimeout));
}

}  // namespace

absl::Status ValidateLeaseOptions(const LeaseOptions& options) {
  if (options.default_idle_timeout != absl::ZeroDuration() &&
      !InRange(options.default_idle_timeout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the default idle timeout (",
        absl::FormatDuration(options.default_idle_timeout), ") must be ",
        Range(), ", or zero (sessions never expire)"));
  }
  for (const auto& [tenant, max] : options.tenant_max_idle_timeout) {
    if (!InRange(max)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant ", Quote(tenant), ": the maximum idle timeout (",
                       absl::FormatDuration(max), ") must be ", Range()));
    }
  }
  if (options.remembered_expiries < 0) {
    return absl::InvalidArgumentError("remembered_expiries must be >= 0");
  }
  return absl::OkStatus();
}

absl::Duration MaxIdleTimeout(const LeaseOptions& options,
                              const std::string& tenant) {
  auto it = options.tenant_max_idle_timeout.find(tenant);
  return it == options.tenant_max_idle_timeout.end() ? kMaxIdleTimeout
                                                     : it->second;
}

absl::StatusOr<absl::Duration> ResolveIdleTimeout(const LeaseOptions& options,
                                                  const std::string& tenant,
                                                  absl::Duration requested) {
  const absl::Duration max = MaxIdleTimeout(options, tenant);
  if (requested == absl::ZeroDuration()) {
    const absl::Duration d = options.default_idle_timeout;
    // "Never" is past any maximum, so a tenant with one gets its maximum.
    if (d == absl::ZeroDuration()) {
      return max == kMaxIdleTimeout ? absl::ZeroDuration() : max;
    }
    return std::min(d, max);
  }
  if (requested < kMinIdleTimeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idle timeout ", absl::FormatDuration(requested),
        " is under the shortest lease, ", absl::FormatDuration(kMinIdleTimeout),
        " (0 asks for the server's default)"));
  }
  if (requested > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idle timeout ", absl::FormatDuration(requested), " is over ",
        max == kMaxIdleTimeout
            ? std::string("the longest lease, ")
            : absl::StrCat("tenant ", Quote(tenant), "'s longest lease, "),
        absl::FormatDuration(max)));
  }
  return requested;
}

absl::Duration ImportedIdleTimeout(const LeaseOptions& options,
                                   const std::string& tenant,
                                   std::optional<absl::Duration> carried) {
  const absl::Duration max = MaxIdleTimeout(options, tenant);
  if (!carried.has_value()) {
    // The default cannot fail to resolve.
    return ResolveIdleTimeout(options, tenant, absl::ZeroDuration())
        .value_or(absl::ZeroDuration());
  }
  // "Never" is past any maximum, so a tenant with one gets its maximum.
  if (*carried == absl::ZeroDuration()) {
    return max == kMaxIdleTimeout ? absl::ZeroDuration() : max;
  }
  return std::clamp(*carried, kMinIdleTimeout, max);
}

void ExpiredSessions::Add(SessionId id, std::string tenant,
                          absl::Duration idle_timeout) {
  if (capacity_ <= 0) return;
  // An id remembered already keeps its place (evicting for it would shrink
  // the memory by one).
  if (auto it = records_.find(id); it != records_.end()) {
    it->second = Record{std::move(tenant), idle_timeout};
    return;
  }
  if (static_cast<int64_t>(order_.size()) >= capacity_) {
    records_.erase(order_.front());
    order_.pop_front();
  }
  records_.emplace(id, Record{std::move(tenant), idle_timeout});
  order_.push_back(id);
}

const ExpiredSessions::Record* ExpiredSessions::Find(SessionId id) const {
  auto it = records_.find(id);
  return it == records_.end() ? nullptr : &it->second;
}

absl::Status ExpiredSessions::NotFound(SessionId id, const Record& record) {
  return absl::NotFoundError(absl::StrCat(
      SessionLabel(id), " not found: it expired after ",
      absl::FormatDuration(record.idle_timeout),
      " without a call (its idle timeout), and the store freed it"));
}

}  // namespace kvkeep
