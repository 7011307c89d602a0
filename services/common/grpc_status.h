// The one place an absl::Status becomes a grpc::Status. absl's codes are
// gRPC's codes, so a client can tell a full pool (RESOURCE_EXHAUSTED) from a
// missing session (NOT_FOUND) from a stale version (FAILED_PRECONDITION).
// Thread-safe (stateless).
#ifndef KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_
#define KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvkeep {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_
