#include "services/metrics/event_metrics.h"

namespace kvkeep {

EventMetrics::EventMetrics(prometheus::Registry& registry)
    : watchers_(prometheus::BuildGauge()
                    .Name("kvkeep_event_watchers")
                    .Help("WatchEvents streams open")
                    .Register(registry)
                    .Add({})),
      published_(prometheus::BuildCounter()
                     .Name("kvkeep_events_published_total")
                     .Help("Events published to WatchEvents (numbered, "
                           "whether or not anyone watches)")
                     .Register(registry)
                     .Add({})),
      dropped_(prometheus::BuildCounter()
                   .Name("kvkeep_event_watchers_dropped_total")
                   .Help("WatchEvents streams the server ended because the "
                         "watcher fell behind the event ring (lagged), or "
                         "fell behind and then read nothing for the drop "
                         "grace (stuck)")
                   .Register(registry)),
      lagged_(dropped_.Add({{"reason", "lagged"}})),
      stuck_(dropped_.Add({{"reason", "stuck"}})) {}

void EventMetrics::Published(int64_t events) {
  published_.Increment(static_cast<double>(events));
}

void EventMetrics::WatchersConnected(int64_t watchers) {
  watchers_.Set(static_cast<double>(watchers));
}

void EventMetrics::WatcherDropped(WatcherDrop why) {
  (why == WatcherDrop::kLagged ? lagged_ : stuck_).Increment();
}

}  // namespace kvkeep
