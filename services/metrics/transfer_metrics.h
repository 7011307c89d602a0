// TransferMetrics: session transfers between stores, by transport and
// direction (out: sent from this store; in: received), in
//   kvkeep_transfers_total{transport,direction,code}
//   kvkeep_transfer_bytes_total{transport,direction}   (committed transfers)
//   kvkeep_transfer_duration_seconds{transport,direction}
// and a drain by migration (DrainMetrics, docs/fleet.md) in
//   kvkeep_drain_sessions_total{outcome}   (moved, unmoved)
//   kvkeep_draining                        (1 from SIGTERM until exit)
//   kvkeep_drain_duration_seconds          (the last drain's moves)
// Thread-safe. The registry must outlive it.
#ifndef KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_
#define KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvkeep {

class TransferMetrics {
 public:
  explicit TransferMetrics(prometheus::Registry& registry);
  void Record(const std::string& transport, bool outgoing,
              absl::StatusCode code, int64_t bytes, absl::Duration duration);

 private:
  prometheus::Family<prometheus::Counter>& transfers_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Histogram>& seconds_;
};

class DrainMetrics {
 public:
  explicit DrainMetrics(prometheus::Registry& registry);
  void Started();
  // One drain's count of sessions moved and not moved, and its time.
  void Finished(int64_t moved, int64_t unmoved, absl::Duration duration);

 private:
  prometheus::Family<prometheus::Counter>& sessions_;
  prometheus::Gauge& draining_;
  prometheus::Gauge& seconds_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_
