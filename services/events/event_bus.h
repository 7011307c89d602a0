// EventBus: the store's events for routers (kvkeep.v1.KvKeep.WatchEvents,
// docs/events.md). The service publishes session events (created, forked,
// closed, expired, moved) and reports every call that changed a session's
// tokens; the bus batches those into one eviction summary per session per
// interval, samples pool pressure each interval, numbers every event, keeps
// the newest in a bounded ring, and serves watch streams from it.
//
// The publisher never waits for a watcher: a watcher is a cursor into the
// ring and one message in flight, so its memory is bounded whatever it
// does. One that falls behind the ring is ended with RESOURCE_EXHAUSTED
// when it next reads (a watcher that has stopped reading cannot be told:
// after the drop grace it is cancelled). A watcher that reconnects resumes
// from the last sequence it saw while the ring still holds the next one.
//
// Thread-safe. Publishing and RecordWork take one lock briefly; the gRPC
// calls (StartWrite, Finish, TryCancel) are made outside it. A ticker
// thread publishes the summaries and samples pool pressure; the destructor
// stops it. The gRPC server must have finished every watch stream (its
// Wait) before the bus is destroyed.
#ifndef KVKEEP_SERVICES_EVENTS_EVENT_BUS_H_
#define KVKEEP_SERVICES_EVENTS_EVENT_BUS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/lease.h"
#include "cache_store/session_types.h"
#include "grpcpp/support/server_callback.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/events/event_observer.h"

namespace kvkeep {

// One layout's pool, as the pressure sampler reads it.
struct PoolUse {
  std::string layout;
  int64_t capacity_pages = 0;
  int64_t free_pages = 0;
};

// A session event of what the store says of the session: its tenant,
// layout, policy and pages (and the parent of a fork).
v1::SessionEvent SessionEventOf(const SessionStats& stats,
                                const std::string& parent = "");
v1::SessionEvent SessionEventOf(const ExpiredSession& expired);

// The pool pressure thresholds (docs/events.md): LOW under 25% of the
// pages free, CRITICAL under 10%.
v1::PoolPressure::Level PressureLevel(const PoolUse& pool);

struct EventBusOptions {
  // Events held for resumes and slow watchers; a watcher further behind is
  // dropped. About 100 bytes each.
  size_t ring_events = 16384;
  size_t max_watchers = 256;  // more watch streams: RESOURCE_EXHAUSTED
  int batch_events = 256;     // events per WatchEventsResponse, at most
  // How often pending eviction summaries are published and pool pressure
  // sampled; InfiniteDuration: never (summaries then come only before a
  // session's end event, or from Tick).
  absl::Duration summary_interval = absl::Seconds(1);
  // How long a watcher that fell behind may go without reading before it
  // is cancelled (it cannot be sent its status while it does not read).
  absl::Duration drop_grace = absl::Seconds(30);
  // Reads the pools (outside the bus's lock); empty: no pressure events.
  std::function<std::vector<PoolUse>()> pool_use;
  EventObserver* observer = nullptr;  // may be null; must outlive the bus
  // A session's id in events; empty: SessionName (the bare 16 hex digits).
  std::function<std::string(SessionId)> session_name;
};

// Whose events a watcher sees: `tenant`'s sessions and every pool's
// pressure, or everything.
struct WatchScope {
  std::string tenant;
  bool all_tenants = false;
};

class EventBus {
 public:
  explicit EventBus(EventBusOptions options);
  ~EventBus();
  EventBus(const EventBus&) = delete;
  EventBus& operator=(const EventBus&) = delete;

  // Random and nonzero, fixed for the bus's life.
  uint64_t incarnation() const { return incarnation_; }

  // A session began here (created, forked, moved in): publishes the event
  // and starts tracking its work. `session.session_id` is set from `id`.
  void SessionStarted(v1::EventKind kind, SessionId id,
                      v1::SessionEvent session) ABSL_LOCKS_EXCLUDED(mu_);
  // A session ended here (closed, expired, moved out): publishes its
  // pending eviction summary, then the event.
  void SessionEnded(v1::EventKind kind, SessionId id, v1::SessionEvent session)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A call that changed a tracked session's tokens (a decode step's append
  // and `then` its scores' evictions): counted into its next summary.
  // O(layers); no event.
  void RecordWork(SessionId id, const StepResult& result,
                  const StepResult& then = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // The interval's work, now: publishes every pending summary, samples
  // pool pressure, cancels watchers stuck past the drop grace.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // Serves one WatchEvents call; `scope` is the caller's (an error status
  // ends the call with it).
  grpc::ServerWriteReactor<v1::WatchEventsResponse>* Watch(
      grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest& request,
      absl::StatusOr<WatchScope> scope) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every watch stream with UNAVAILABLE (one writing ends when its
  // write completes) and refuses new ones. For the server's drain.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // The newest sequence published (0 before the first).
  uint64_t latest_sequence() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Watcher;
  // A tracked session: its tenant and its work since its last summary.
  struct Tracked {
    std::string tenant;
    int64_t calls = 0;
    int64_t evicted_tokens = 0;
    int64_t resident_tokens = 0;
  };

  // A session's id as events give it (options_.session_name).
  std::string Name(SessionId id) const {
    return options_.session_name ? options_.session_name(id) : SessionName(id);
  }
  // Numbers, stamps and stores `event`, and adds the watchers it wakes to
  // `wake`.
  void PublishLocked(v1::Event event, std::vector<Watcher*>& wake)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishSummaryLocked(SessionId id, Tracked& tracked,
                            std::vector<Watcher*>& wake)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs each woken watcher's next action (outside the lock).
  void Wake(const std::vector<Watcher*>& wake) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t OldestLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();

  const EventBusOptions options_;
  const uint64_t incarnation_;
  mutable absl::Mutex mu_;
  std::deque<v1::Event> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t latest_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, Tracked> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, v1::PoolPressure::Level> pool_levels_
      ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread ticker_;  // last: starts once the rest is built
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_EVENTS_EVENT_BUS_H_
