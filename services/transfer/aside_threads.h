// AsideThreads: work run on threads of its own, off gRPC's threads (the
// cleanup after an abandoned transfer receive, which may wait for a peer),
// that never outlives its owner: the destructor waits for every one.
//
// Thread-safe.
#ifndef KVKEEP_SERVICES_TRANSFER_ASIDE_THREADS_H_
#define KVKEEP_SERVICES_TRANSFER_ASIDE_THREADS_H_

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvkeep {

class AsideThreads {
 public:
  AsideThreads() = default;
  AsideThreads(const AsideThreads&) = delete;
  AsideThreads& operator=(const AsideThreads&) = delete;
  ~AsideThreads() {
    absl::MutexLock lock(&mu_);
    for (Aside& a : threads_) a.thread.join();
  }

  void Run(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    // Threads that finished are joined here, so they do not pile up.
    std::erase_if(threads_, [](Aside& a) {
      if (!a.done->load(std::memory_order_acquire)) return false;
      a.thread.join();
      return true;
    });
    auto done = std::make_shared<std::atomic<bool>>(false);
    threads_.push_back(Aside{std::thread([fn = std::move(fn), done] {
                               fn();
                               done->store(true, std::memory_order_release);
                             }),
                             done});
  }

 private:
  struct Aside {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex mu_;
  std::list<Aside> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_ASIDE_THREADS_H_
