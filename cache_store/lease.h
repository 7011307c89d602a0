// Session leases. Every session has an idle timeout: a session no call has
// touched for that long is closed by the store, which frees its pages and
// its tenant's quota, and from then on answers NOT_FOUND "expired" for it
// (while it still remembers the id). Agents crash without closing what they
// opened; a lease is how their sessions come back.
//
// The rules (CacheStore applies them; docs/sessions.md has the why):
//   - the length: what the create asked for, else the store's default;
//     both at most the tenant's maximum (a request beyond it is
//     INVALID_ARGUMENT, the default is clamped to it) and kMaxIdleTimeout;
//   - any call that names the session renews it (KeepAlive only renews);
//     listings and metric scrapes do not;
//   - an open stream on the session (Decode, AppendPrefill, ReadKv) or a
//     transfer out of it holds the lease: it cannot expire while held, and
//     its idle time starts when the last hold ends.
#ifndef KVKEEP_CACHE_STORE_LEASE_H_
#define KVKEEP_CACHE_STORE_LEASE_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_store/clock.h"
#include "cache_store/session_types.h"
#include "cache_store/store_observer.h"

namespace kvkeep {

// The shortest and the longest idle timeout a session may have. A minute-
// long lease is common; a month is the longest anything idle should hold
// memory, and beyond it a number is a mistake (an expiry that never comes).
inline constexpr absl::Duration kMinIdleTimeout = absl::Seconds(1);
inline constexpr absl::Duration kMaxIdleTimeout = absl::Hours(24 * 30);

struct LeaseOptions {
  // The idle timeout of a session whose create names none (clamped to its
  // tenant's maximum). ZeroDuration: such sessions never expire.
  absl::Duration default_idle_timeout = absl::Hours(1);
  // Per tenant, the longest idle timeout its sessions may have; a tenant not
  // named here has kMaxIdleTimeout.
  absl::flat_hash_map<std::string, absl::Duration> tenant_max_idle_timeout;
  // Where leases read the time; not owned, must outlive the store. Null:
  // RealClock().
  const Clock* clock = nullptr;
  // How many expired session ids the store remembers, to answer "expired"
  // instead of a bare "not found" (the oldest are forgotten first).
  int64_t remembered_expiries = 4096;
};

// INVALID_ARGUMENT for a default or a tenant maximum outside
// [kMinIdleTimeout, kMaxIdleTimeout] (zero allowed for the default: never),
// or a negative remembered_expiries.
absl::Status ValidateLeaseOptions(const LeaseOptions& options);

// The longest idle timeout `tenant`'s sessions may have.
absl::Duration MaxIdleTimeout(const LeaseOptions& options,
                              const std::string& tenant);

// The idle timeout a session of `tenant` imported from another store gets:
// the length it `carried` there, clamped to [kMinIdleTimeout, the tenant's
// maximum] ("never" becomes the maximum where the tenant has one); nullopt
// (the source did not say): this store's default.
absl::Duration ImportedIdleTimeout(const LeaseOptions& options,
                                   const std::string& tenant,
                                   std::optional<absl::Duration> carried);

// The idle timeout a session of `tenant` gets when its create asks for
// `requested` (ZeroDuration: nothing asked, the default). INVALID_ARGUMENT
// for a request under kMinIdleTimeout (negative included) or over the
// tenant's maximum. ZeroDuration in the result: it never expires.
absl::StatusOr<absl::Duration> ResolveIdleTimeout(const LeaseOptions& options,
                                                  const std::string& tenant,
                                                  absl::Duration requested);

// A session's lease as Stats and KeepAlive report it.
struct LeaseStatus {
  absl::Duration idle_timeout;  // ZeroDuration: it never expires
  // Until it expires if nothing calls it: idle_timeout while held (the idle
  // time starts when the hold ends); ZeroDuration if it never expires.
  absl::Duration left;
  bool held = false;  // an open stream or a transfer holds it
};

// A session the store closed because its lease ran out.
struct ExpiredSession {
  SessionInfo info;
  absl::Duration idle_timeout;
  int64_t freed_pages = 0;
};

// The ids of sessions that expired, with their tenants, remembered up to a
// capacity (the oldest forgotten first). Not thread-safe.
class ExpiredSessions {
 public:
  struct Record {
    std::string tenant;
    absl::Duration idle_timeout;
  };
  explicit ExpiredSessions(int64_t capacity) : capacity_(capacity) {}

  void Add(SessionId id, std::string tenant, absl::Duration idle_timeout);
  // Null if `id` is not remembered.
  const Record* Find(SessionId id) const;
  // The NOT_FOUND a call on an expired session gets: "session <id> not
  // found: it expired ...".
  static absl::Status NotFound(SessionId id, const Record& record);

 private:
  const int64_t capacity_;
  absl::flat_hash_map<SessionId, Record> records_;
  std::deque<SessionId> order_;  // oldest first
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_LEASE_H_
