// TransferMetrics: session transfers between stores, by transport and
// direction (out: sent from this store; in: received), in
//   kvkeep_transfers_total{transport,direction,code}
//   kvkeep_transfer_bytes_total{transport,direction}   (committed transfers)
//   kvkeep_transfer_duration_seconds{transport,direction}
// Thread-safe. The registry must outlive it.
#ifndef KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_
#define KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
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

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_TRANSFER_METRICS_H_
