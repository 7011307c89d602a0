// EventObserver: what the event bus (event_bus.h) tells monitoring, through
// an interface narrow enough that the bus needs no metrics library and its
// tests need no Prometheus. kvkeepd's implementation is EventMetrics
// (services/metrics/event_metrics.h); the default does nothing.
//
// Calls arrive under the bus's lock: implementations must be thread-safe,
// O(1) and free of I/O, and must not call back into the bus.
#ifndef KVKEEP_SERVICES_EVENTS_EVENT_OBSERVER_H_
#define KVKEEP_SERVICES_EVENTS_EVENT_OBSERVER_H_

#include <cstdint>

namespace kvkeep {

// Why a watch stream ended early (not by its client or the shutdown).
enum class WatcherDrop {
  kLagged,  // fell behind the ring (RESOURCE_EXHAUSTED)
  kStuck,   // fell behind and then read nothing for the drop grace
};

class EventObserver {
 public:
  virtual ~EventObserver() = default;
  virtual void Published(int64_t events) {}
  virtual void WatchersConnected(int64_t watchers) {}  // the new count
  virtual void WatcherDropped(WatcherDrop why) {}
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_EVENTS_EVENT_OBSERVER_H_
