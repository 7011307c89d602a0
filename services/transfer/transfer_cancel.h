// TransferCancel: stops a transfer in progress from another thread (its
// caller cancelled, its time limit passed, or the store is draining). The
// sending thread binds what ends its current waits (the ReceiveSession call,
// the data socket); Cancel runs them, and those bound later at once.
//
// Thread-safe.
#ifndef KVKEEP_SERVICES_TRANSFER_TRANSFER_CANCEL_H_
#define KVKEEP_SERVICES_TRANSFER_TRANSFER_CANCEL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvkeep {

class TransferCancel {
 public:
  // Stops the transfer (the first call's `why` is kept; later calls do
  // nothing).
  // The stops run under the lock, so none runs once its binding is gone;
  // they must be quick and not call back here.
  void Cancel(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!why_.ok()) return;
    why_ = std::move(why);
    for (auto& [key, stop] : stops_) stop();
  }
  // OK until cancelled; then why.
  absl::Status why() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return why_;
  }

  // Runs `stop` on Cancel (now, if cancelled already) for as long as the
  // binding lives. `stop` may run on another thread while it does.
  class Binding {
   public:
    Binding(TransferCancel* cancel, std::function<void()> stop)
        : cancel_(cancel) {
      if (cancel_ != nullptr) key_ = cancel_->Bind(std::move(stop));
    }
    ~Binding() {
      if (cancel_ != nullptr) cancel_->Unbind(key_);
    }
    Binding(const Binding&) = delete;
    Binding& operator=(const Binding&) = delete;

   private:
    TransferCancel* const cancel_;
    int64_t key_ = 0;
  };

 private:
  int64_t Bind(std::function<void()> stop) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const int64_t key = ++next_;
    if (!why_.ok()) stop();
    stops_.emplace(key, std::move(stop));
    return key;
  }
  // After this returns, the stop bound as `key` no longer runs.
  void Unbind(int64_t key) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    stops_.erase(key);
  }

  mutable absl::Mutex mu_;
  absl::Status why_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int64_t, std::function<void()>> stops_
      ABSL_GUARDED_BY(mu_);
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_TRANSFER_CANCEL_H_
