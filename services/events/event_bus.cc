#include "services/events/event_bus.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/server_context.h"

namespace kvkeep {
namespace {

const std::string* TenantOf(const v1::Event& event) {
  switch (event.detail_case()) {
    case v1::Event::kSession:
      return &event.session().tenant();
    case v1::Event::kEvictions:
      return &event.evictions().tenant();
    default:
      return nullptr;  // pool pressure: every watcher's
  }
}

uint64_t NewIncarnation() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen, 1, UINT64_MAX);
}

}  // namespace

v1::SessionEvent SessionEventOf(const SessionStats& stats,
                                const std::string& parent) {
  v1::SessionEvent event;
  event.set_session_id(SessionName(stats.id));
  event.set_tenant(stats.tenant);
  event.set_layout(stats.layout);
  event.set_policy(stats.policy);
  event.set_parent_session_id(parent);
  event.set_pages(stats.pages);
  return event;
}

v1::SessionEvent SessionEventOf(const ExpiredSession& expired) {
  v1::SessionEvent event;
  event.set_session_id(SessionName(expired.info.id));
  event.set_tenant(expired.info.tenant);
  event.set_layout(expired.info.layout);
  event.set_policy(expired.info.policy);
  event.set_pages(expired.freed_pages);
  return event;
}

v1::PoolPressure::Level PressureLevel(const PoolUse& pool) {
  // free / capacity < 10% (25%), in integers.
  if (pool.free_pages * 10 < pool.capacity_pages) {
    return v1::PoolPressure::LEVEL_CRITICAL;
  }
  if (pool.free_pages * 4 < pool.capacity_pages) {
    return v1::PoolPressure::LEVEL_LOW;
  }
  return v1::PoolPressure::LEVEL_OK;
}

// One WatchEvents stream: a cursor into the bus's ring and one message in
// flight. Its state is the bus's (guarded by the bus's lock); the gRPC
// calls are made outside that lock by whoever took the action (Next), and
// the pin count keeps the call alive until they return: OnDone waits for
// it to drop to zero. The methods that assert the bus's lock are called
// under it (the analysis cannot see that bus_->mu_ is the caller's mu_).
class EventBus::Watcher final
    : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
 public:
  enum class Action { kNone, kWrite, kFinish };

  Watcher(EventBus* bus, grpc::CallbackServerContext* ctx)
      : bus_(bus), ctx_(ctx) {}

  // Sets up the watch under the bus's lock: OK, or the status to end with.
  absl::Status Begin(const v1::WatchEventsRequest& request, WatchScope scope) {
    bus_->mu_.AssertHeld();
    if (bus_->shut_down_) {
      return absl::UnavailableError("kvkeepd is shutting down");
    }
    if (bus_->watchers_.size() >= bus_->options_.max_watchers) {
      return absl::ResourceExhaustedError(
          absl::StrCat("this server has its maximum of ",
                       bus_->options_.max_watchers, " watchers"));
    }
    for (int kind : request.kinds()) {
      if (kind <= v1::EVENT_KIND_UNSPECIFIED || !v1::EventKind_IsValid(kind)) {
        return absl::InvalidArgumentError(
            absl::StrCat("kinds: ", kind, " is not an event kind"));
      }
      kinds_ |= uint32_t{1} << kind;
    }
    if (request.incarnation() != 0 &&
        request.incarnation() != bus_->incarnation_) {
      return absl::OutOfRangeError(absl::StrCat(
          "incarnation ", request.incarnation(), " is not this server's (",
          bus_->incarnation_,
          "): it restarted; resync with ListSessions and watch from now"));
    }
    const uint64_t after = request.after_sequence();
    const uint64_t oldest = bus_->OldestLocked();
    if (after > bus_->latest_) {
      return absl::OutOfRangeError(absl::StrCat(
          "after_sequence ", after, " was never published here (the latest is ",
          bus_->latest_, "); resync with ListSessions and watch from now"));
    }
    if (after != 0 && after + 1 < oldest) {
      return absl::OutOfRangeError(
          absl::StrCat("events after sequence ", after,
                       " are no longer held: the oldest held is ", oldest,
                       "; resync with ListSessions and watch from now"));
    }
    cursor_ = after != 0 ? after : bus_->latest_;
    scope_ = std::move(scope);
    bus_->watchers_.insert(this);
    if (bus_->options_.observer != nullptr) {
      bus_->options_.observer->WatchersConnected(
          static_cast<int64_t>(bus_->watchers_.size()));
    }
    return absl::OkStatus();
  }

  // Ends a call that never began (no one else knows the watcher).
  void Refuse(const absl::Status& status) ABSL_LOCKS_EXCLUDED(bus_->mu_) {
    {
      absl::MutexLock lock(&bus_->mu_);
      finished_ = true;
    }
    Finish(grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message())));
  }

  // What this watcher does next: a write (its message filled), its finish
  // (finish_status_ set), or nothing (it waits for events). Pins it unless
  // kNone; Run then does the action and unpins.
  Action Next() {
    bus_->mu_.AssertHeld();
    if (finished_ || writing_) return Action::kNone;
    if (pending_finish_.has_value()) return PinFinish(*pending_finish_);
    const uint64_t oldest = bus_->OldestLocked();
    if (cursor_ + 1 < oldest) {
      const uint64_t behind = bus_->latest_ - cursor_;
      if (bus_->options_.observer != nullptr) {
        bus_->options_.observer->WatcherDropped(WatcherDrop::kLagged);
      }
      return PinFinish(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("watcher fell ", behind,
                       " events behind: the server holds the newest ",
                       bus_->options_.ring_events, " (oldest ", oldest,
                       "); resync with ListSessions and watch from now")));
    }
    message_.clear_events();
    const int batch = bus_->options_.batch_events;
    while (cursor_ < bus_->latest_ && message_.events_size() < batch) {
      const v1::Event& event = bus_->ring_[cursor_ + 1 - oldest];
      ++cursor_;
      if (Sees(event)) *message_.add_events() = event;
    }
    if (message_.events_size() == 0 && started_) return Action::kNone;
    started_ = true;
    behind_since_ = absl::InfiniteFuture();
    message_.set_incarnation(bus_->incarnation_);
    message_.set_oldest_sequence(oldest);
    message_.set_latest_sequence(bus_->latest_);
    writing_ = true;
    ++pins_;
    return Action::kWrite;
  }

  void Run(Action action) ABSL_LOCKS_EXCLUDED(bus_->mu_) {
    if (action == Action::kNone) return;
    if (action == Action::kWrite) {
      StartWrite(&message_);
    } else {
      Finish(finish_status_);
    }
    absl::MutexLock lock(&bus_->mu_);
    --pins_;
  }

  // Ends the stream with `status`: now, or when its write completes.
  Action Close(grpc::Status status) {
    bus_->mu_.AssertHeld();
    if (finished_) return Action::kNone;
    pending_finish_ = std::move(status);
    return Next();
  }

  // Whether it fell behind and read nothing for the drop grace: then it is
  // pinned, and the caller cancels it and unpins.
  bool Stuck(absl::Time now) {
    bus_->mu_.AssertHeld();
    if (finished_ || !writing_ || cancelled_) return false;
    if (cursor_ + 1 >= bus_->OldestLocked()) return false;
    if (behind_since_ == absl::InfiniteFuture()) behind_since_ = now;
    if (now - behind_since_ < bus_->options_.drop_grace) return false;
    cancelled_ = true;
    ++pins_;
    if (bus_->options_.observer != nullptr) {
      bus_->options_.observer->WatcherDropped(WatcherDrop::kStuck);
    }
    return true;
  }
  void Cancel() ABSL_LOCKS_EXCLUDED(bus_->mu_) {
    ctx_->TryCancel();
    absl::MutexLock lock(&bus_->mu_);
    --pins_;
  }

  void OnWriteDone(bool ok) override {
    Action action;
    {
      absl::MutexLock lock(&bus_->mu_);
      writing_ = false;
      action = ok ? Next()
                  : Close(grpc::Status(grpc::StatusCode::CANCELLED,
                                       "the watcher went away"));
    }
    Run(action);
  }

  void OnCancel() override {
    Action action;
    {
      absl::MutexLock lock(&bus_->mu_);
      action = Close(
          grpc::Status(grpc::StatusCode::CANCELLED, "the watch was cancelled"));
    }
    Run(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&bus_->mu_,
                           absl::Condition(this, &Watcher::Unpinned));
      if (bus_->watchers_.erase(this) > 0 &&
          bus_->options_.observer != nullptr) {
        bus_->options_.observer->WatchersConnected(
            static_cast<int64_t>(bus_->watchers_.size()));
      }
    }
    delete this;
  }

 private:
  bool Unpinned() const {
    bus_->mu_.AssertHeld();
    return pins_ == 0;
  }

  Action PinFinish(grpc::Status status) {
    bus_->mu_.AssertHeld();
    finished_ = true;
    finish_status_ = std::move(status);
    ++pins_;
    return Action::kFinish;
  }

  bool Sees(const v1::Event& event) const {
    bus_->mu_.AssertHeld();
    if (kinds_ != 0 && (kinds_ & (uint32_t{1} << event.kind())) == 0) {
      return false;
    }
    const std::string* tenant = TenantOf(event);
    return scope_.all_tenants || tenant == nullptr || *tenant == scope_.tenant;
  }

  EventBus* const bus_;
  grpc::CallbackServerContext* const ctx_;
  WatchScope scope_ ABSL_GUARDED_BY(bus_->mu_);
  uint32_t kinds_ ABSL_GUARDED_BY(bus_->mu_) = 0;    // bit per kind; 0: all
  uint64_t cursor_ ABSL_GUARDED_BY(bus_->mu_) = 0;   // the last seq passed
  bool started_ ABSL_GUARDED_BY(bus_->mu_) = false;  // first message sent
  bool writing_ ABSL_GUARDED_BY(bus_->mu_) = false;
  bool finished_ ABSL_GUARDED_BY(bus_->mu_) = false;   // Finish taken
  bool cancelled_ ABSL_GUARDED_BY(bus_->mu_) = false;  // TryCancel taken
  int pins_ ABSL_GUARDED_BY(bus_->mu_) = 0;
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(bus_->mu_);
  // When it was last seen behind the ring with a write in flight.
  absl::Time behind_since_ ABSL_GUARDED_BY(bus_->mu_) = absl::InfiniteFuture();
  // Written under the lock, read by the gRPC call it is handed to.
  grpc::Status finish_status_;
  v1::WatchEventsResponse message_;
};

EventBus::EventBus(EventBusOptions options)
    : options_(std::move(options)), incarnation_(NewIncarnation()) {
  ticker_ = std::thread([this] { Run(); });
}

EventBus::~EventBus() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  ticker_.join();
}

void EventBus::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.summary_interval);
    if (stop_) break;
    mu_.Unlock();
    Tick();
    mu_.Lock();
  }
}

uint64_t EventBus::OldestLocked() const {
  return ring_.empty() ? latest_ + 1 : ring_.front().sequence();
}

uint64_t EventBus::latest_sequence() const {
  absl::MutexLock lock(&mu_);
  return latest_;
}

void EventBus::PublishLocked(v1::Event event, std::vector<Watcher*>& wake) {
  event.set_sequence(++latest_);
  event.set_time_unix_micros(absl::ToUnixMicros(absl::Now()));
  ring_.push_back(std::move(event));
  while (ring_.size() > options_.ring_events) ring_.pop_front();
  if (options_.observer != nullptr) options_.observer->Published(1);
  for (Watcher* w : watchers_) wake.push_back(w);
}

void EventBus::Wake(const std::vector<Watcher*>& wake) {
  if (wake.empty()) return;
  std::vector<std::pair<Watcher*, Watcher::Action>> actions;
  {
    absl::MutexLock lock(&mu_);
    for (Watcher* w : wake) {
      // Pinned by Next when it acts; one that ended since is still in
      // watchers_ until its OnDone, which waits for the lock.
      if (!watchers_.contains(w)) continue;
      Watcher::Action action = w->Next();
      if (action != Watcher::Action::kNone) actions.emplace_back(w, action);
    }
  }
  for (auto& [w, action] : actions) w->Run(action);
}

void EventBus::SessionStarted(v1::EventKind kind, SessionId id,
                              v1::SessionEvent session) {
  session.set_session_id(Name(id));
  std::vector<Watcher*> wake;
  {
    absl::MutexLock lock(&mu_);
    sessions_[id] = Tracked{.tenant = session.tenant()};
    v1::Event event;
    event.set_kind(kind);
    *event.mutable_session() = std::move(session);
    PublishLocked(std::move(event), wake);
  }
  Wake(wake);
}

void EventBus::SessionEnded(v1::EventKind kind, SessionId id,
                            v1::SessionEvent session) {
  session.set_session_id(Name(id));
  std::vector<Watcher*> wake;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = sessions_.find(id); it != sessions_.end()) {
      PublishSummaryLocked(id, it->second, wake);
      sessions_.erase(it);
    }
    v1::Event event;
    event.set_kind(kind);
    *event.mutable_session() = std::move(session);
    PublishLocked(std::move(event), wake);
  }
  Wake(wake);
}

void EventBus::RecordWork(SessionId id, const StepResult& result,
                          const StepResult& then) {
  int64_t evicted = 0;
  for (const StepResult* r : {&result, &then}) {
    for (const LayerChange& layer : r->layers) {
      evicted += static_cast<int64_t>(layer.evicted_positions.size());
    }
  }
  // Resident after the call: its last result's.
  int64_t resident = 0;
  for (const LayerChange& layer :
       (then.layers.empty() ? result : then).layers) {
    resident += layer.resident;
  }
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;  // not one the service reported
  ++it->second.calls;
  it->second.evicted_tokens += evicted;
  it->second.resident_tokens = resident;
}

void EventBus::PublishSummaryLocked(SessionId id, Tracked& tracked,
                                    std::vector<Watcher*>& wake) {
  if (tracked.calls == 0) return;
  v1::Event event;
  event.set_kind(v1::EVENT_EVICTIONS);
  v1::EvictionSummary* summary = event.mutable_evictions();
  summary->set_session_id(Name(id));
  summary->set_tenant(tracked.tenant);
  summary->set_calls(tracked.calls);
  summary->set_evicted_tokens(tracked.evicted_tokens);
  summary->set_resident_tokens(tracked.resident_tokens);
  tracked.calls = 0;
  tracked.evicted_tokens = 0;
  PublishLocked(std::move(event), wake);
}

void EventBus::Tick() {
  std::vector<PoolUse> pools;
  if (options_.pool_use) pools = options_.pool_use();
  std::vector<Watcher*> wake;
  std::vector<Watcher*> stuck;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, tracked] : sessions_) {
      PublishSummaryLocked(id, tracked, wake);
    }
    for (const PoolUse& pool : pools) {
      const v1::PoolPressure::Level level = PressureLevel(pool);
      auto [it, inserted] =
          pool_levels_.try_emplace(pool.layout, v1::PoolPressure::LEVEL_OK);
      if (it->second == level) continue;
      it->second = level;
      v1::Event event;
      event.set_kind(v1::EVENT_POOL_PRESSURE);
      v1::PoolPressure* p = event.mutable_pool();
      p->set_layout(pool.layout);
      p->set_level(level);
      p->set_free_pages(pool.free_pages);
      p->set_capacity_pages(pool.capacity_pages);
      PublishLocked(std::move(event), wake);
    }
    const absl::Time now = absl::Now();
    for (Watcher* w : watchers_) {
      if (w->Stuck(now)) stuck.push_back(w);
    }
  }
  Wake(wake);
  for (Watcher* w : stuck) w->Cancel();
}

grpc::ServerWriteReactor<v1::WatchEventsResponse>* EventBus::Watch(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest& request,
    absl::StatusOr<WatchScope> scope) {
  auto* watcher = new Watcher(this, ctx);
  Watcher::Action action = Watcher::Action::kNone;
  absl::Status status = scope.status();
  {
    absl::MutexLock lock(&mu_);
    if (status.ok()) status = watcher->Begin(request, *std::move(scope));
    if (status.ok()) action = watcher->Next();  // the first message
  }
  if (!status.ok()) {
    watcher->Refuse(status);
    return watcher;
  }
  watcher->Run(action);
  return watcher;
}

void EventBus::Shutdown() {
  std::vector<std::pair<Watcher*, Watcher::Action>> actions;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    for (Watcher* w : watchers_) {
      Watcher::Action action = w->Close(grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "kvkeepd is shutting down; its sequences end with it (a restarted "
          "server is another incarnation): resync with ListSessions"));
      if (action != Watcher::Action::kNone) actions.emplace_back(w, action);
    }
  }
  for (auto& [w, action] : actions) w->Run(action);
}

}  // namespace kvkeep
