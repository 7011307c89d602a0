// Clock: the monotonic time the store measures session leases by, injected
// (StoreOptions::clock) so tests move time by hand instead of sleeping.
// Only differences between two readings of one clock mean anything; a
// reading is an absl::Time for its arithmetic, not a date.
//
// Thread-safe: RealClock and ManualClock may be read from any thread, and a
// ManualClock advanced from one while others read it.
#ifndef KVKEEP_CACHE_STORE_CLOCK_H_
#define KVKEEP_CACHE_STORE_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace kvkeep {

class Clock {
 public:
  virtual ~Clock() = default;
  // Never goes back.
  virtual absl::Time Now() const = 0;
};

// std::chrono::steady_clock (not the wall clock: a leap or an NTP step must
// not expire every session at once). A process-wide object; never null.
const Clock* RealClock();

// Time that moves only when a test advances it; starts at the Unix epoch.
class ManualClock final : public Clock {
 public:
  absl::Time Now() const override {
    return absl::FromUnixNanos(nanos_.load(std::memory_order_acquire));
  }
  // `d` must not be negative (a clock never goes back).
  void Advance(absl::Duration d) {
    nanos_.fetch_add(absl::ToInt64Nanoseconds(d), std::memory_order_acq_rel);
  }

 private:
  std::atomic<int64_t> nanos_{0};
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_CLOCK_H_
