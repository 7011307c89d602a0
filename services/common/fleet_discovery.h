// Finding a fleet's replicas (docs/fleet.md), shared by the C++ client
// (FleetClient) and kvkeepd (its peers, for a drain): one gRPC target with
// a scheme resolves to every replica (the headless Service's DNS name,
// "dns:///kvkeepd-fleet:50051"; "ipv4:a:p,b:q"), and ServerInfo asked over
// round_robin names them one by one; a plain host:port is one replica.
#ifndef KVKEEP_SERVICES_COMMON_FLEET_DISCOVERY_H_
#define KVKEEP_SERVICES_COMMON_FLEET_DISCOVERY_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvkeep/v1/kvkeep.pb.h"

namespace kvkeep {

// Whether `target` is a gRPC target that resolves to many addresses (it has
// a scheme), rather than one replica's host:port.
bool IsResolvedTarget(const std::string& target);

// Calls `ask` (GetServerInfo over a round_robin channel of a resolved
// target) until `quiet_calls` answers in a row name no replica `known`
// has not seen, and hands each new one to `found` (which makes it known).
// The first error of `ask` or `found` is returned.
absl::Status DiscoverReplicas(
    int quiet_calls, const std::function<absl::StatusOr<v1::ServerInfo>()>& ask,
    const std::function<bool(const std::string& replica)>& known,
    const std::function<absl::Status(const v1::ServerInfo&)>& found);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_FLEET_DISCOVERY_H_
