// LeaseReaper: the thread in kvkeepd that closes a store's sessions whose
// leases ran out (CacheStore::ExpireIdle) and reports each one, so that a
// client that died without closing its sessions does not hold their pages
// until kvkeepd restarts; each pass also moves idle sessions down a tier
// (CacheStore::DemoteIdle, tiers.h). It wakes when the store's earliest lease
// could run out, and at least every `max_wait`; a wake with nothing due costs a
// clock read and one comparison under the store's lock.
//
// Thread-safe; the destructor stops the thread and waits for it (a pass in
// progress finishes first). The store must outlive the reaper.
#ifndef KVKEEP_SERVICES_KVKEEPD_LEASE_REAPER_H_
#define KVKEEP_SERVICES_KVKEEPD_LEASE_REAPER_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"

namespace kvkeep {

class LeaseReaper {
 public:
  // Called on the reaper's thread for every expired session (may be empty).
  using OnExpired = std::function<void(const ExpiredSession&)>;

  LeaseReaper(CacheStore* store, absl::Duration max_wait, OnExpired on_expired);
  ~LeaseReaper();
  LeaseReaper(const LeaseReaper&) = delete;
  LeaseReaper& operator=(const LeaseReaper&) = delete;

 private:
  void Run();

  CacheStore* const store_;
  const absl::Duration max_wait_;
  const OnExpired on_expired_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_LEASE_REAPER_H_
