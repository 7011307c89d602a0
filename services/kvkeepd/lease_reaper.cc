#include "services/kvkeepd/lease_reaper.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace kvkeep {

LeaseReaper::LeaseReaper(CacheStore* store, absl::Duration max_wait,
                         OnExpired on_expired)
    : store_(store),
      max_wait_(max_wait),
      on_expired_(std::move(on_expired)),
      thread_([this] { Run(); }) {}

LeaseReaper::~LeaseReaper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void LeaseReaper::Run() {
  // Not sooner than this after a pass: a lease due "now" on a clock that
  // does not move (a test's) must not spin the thread.
  constexpr absl::Duration kMinWait = absl::Milliseconds(10);
  while (true) {
    const std::vector<ExpiredSession> expired = store_->ExpireIdle();
    // Idle sessions to their layout's cheaper tier, at the same cadence
    // (a pass a second at least: the idle times are seconds or more).
    store_->DemoteIdle();
    if (on_expired_) {
      for (const ExpiredSession& session : expired) on_expired_(session);
    }
    const absl::Duration wait =
        std::clamp(store_->TimeToNextExpiry(), kMinWait, max_wait_);
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), wait)) return;
  }
}

}  // namespace kvkeep
