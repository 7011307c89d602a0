// EventMetrics: the event bus behind WatchEvents (docs/events.md), in
//   kvkeep_event_watchers                      (watch streams open)
//   kvkeep_events_published_total
//   kvkeep_event_watchers_dropped_total{reason} (lagged: fell behind the
//       ring; stuck: fell behind and read nothing for the drop grace)
// The bus's EventObserver. Thread-safe. The registry must outlive it.
#ifndef KVKEEP_SERVICES_METRICS_EVENT_METRICS_H_
#define KVKEEP_SERVICES_METRICS_EVENT_METRICS_H_

#include <cstdint>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "services/events/event_observer.h"

namespace kvkeep {

class EventMetrics final : public EventObserver {
 public:
  explicit EventMetrics(prometheus::Registry& registry);
  void Published(int64_t events) override;
  void WatchersConnected(int64_t watchers) override;
  void WatcherDropped(WatcherDrop why) override;

 private:
  prometheus::Gauge& watchers_;
  prometheus::Counter& published_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Counter& lagged_;
  prometheus::Counter& stuck_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_EVENT_METRICS_H_
