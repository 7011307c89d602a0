#include "services/metrics/transfer_metrics.h"

#include "services/metrics/rpc_metrics.h"
#include "services/metrics/store_metrics.h"

namespace kvkeep {

TransferMetrics::TransferMetrics(prometheus::Registry& registry)
    : transfers_(prometheus::BuildCounter()
                     .Name("kvkeep_transfers_total")
                     .Help("Session transfers by transport, direction (out: "
                           "sent from here; in: received) and status code")
                     .Register(registry)),
      bytes_(prometheus::BuildCounter()
                 .Name("kvkeep_transfer_bytes_total")
                 .Help("Key and value bytes of committed session transfers")
                 .Register(registry)),
      seconds_(prometheus::BuildHistogram()
                   .Name("kvkeep_transfer_duration_seconds")
                   .Help("One session transfer, from freeze (out) or header "
                         "(in) to its end")
                   .Register(registry)) {
  // The host transport's series exist from the start (zero until used), so
  // dashboards and alerts find them before the first transfer.
  for (const char* direction : {"out", "in"}) {
    transfers_.Add(
        {{"transport", "host"}, {"direction", direction}, {"code", "OK"}});
    bytes_.Add({{"transport", "host"}, {"direction", direction}});
    seconds_.Add({{"transport", "host"}, {"direction", direction}},
                 RpcLatencyBuckets());
  }
}

void TransferMetrics::Record(const std::string& transport, bool outgoing,
                             absl::StatusCode code, int64_t bytes,
                             absl::Duration duration) {
  const std::string direction = outgoing ? "out" : "in";
  // Family::Add returns the existing series for labels it has seen.
  transfers_
      .Add({{"transport", transport},
            {"direction", direction},
            {"code", StatusCodeName(static_cast<int>(code))}})
      .Increment();
  if (code == absl::StatusCode::kOk) {
    bytes_.Add({{"transport", transport}, {"direction", direction}})
        .Increment(static_cast<double>(bytes));
  }
  seconds_
      .Add({{"transport", transport}, {"direction", direction}},
           RpcLatencyBuckets())
      .Observe(absl::ToDoubleSeconds(duration));
}

DrainMetrics::DrainMetrics(prometheus::Registry& registry)
    : sessions_(prometheus::BuildCounter()
                    .Name("kvkeep_drain_sessions_total")
                    .Help("Sessions a drain (SIGTERM) moved to peers "
                          "(outcome=moved) or could not (outcome=unmoved)")
                    .Register(registry)),
      draining_(prometheus::BuildGauge()
                    .Name("kvkeep_draining")
                    .Help("1 while this replica drains (from SIGTERM on)")
                    .Register(registry)
                    .Add({})),
      seconds_(prometheus::BuildGauge()
                   .Name("kvkeep_drain_duration_seconds")
                   .Help("How long the last drain took to move its sessions")
                   .Register(registry)
                   .Add({})) {
  for (const char* outcome : {"moved", "unmoved"}) {
    sessions_.Add({{"outcome", outcome}});
  }
}

void DrainMetrics::Started() { draining_.Set(1); }

void DrainMetrics::Finished(int64_t moved, int64_t unmoved,
                            absl::Duration duration) {
  sessions_.Add({{"outcome", "moved"}}).Increment(static_cast<double>(moved));
  sessions_.Add({{"outcome", "unmoved"}})
      .Increment(static_cast<double>(unmoved));
  seconds_.Set(absl::ToDoubleSeconds(duration));
}

}  // namespace kvkeep
