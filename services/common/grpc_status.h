// The one place an absl::Status becomes a grpc::Status. absl's codes are
// gRPC's codes, so a client can tell a full pool (RESOURCE_EXHAUSTED) from a
// missing session (NOT_FOUND) from a stale version (FAILED_PRECONDITION).
// Thread-safe (stateless).
#ifndef KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_
#define KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvkeep {

// A message travels in the grpc-message trailer, which clients bound (8 KiB
// of metadata by default): a longer one would fail the client's whole
// channel instead of one call. Messages quote client values bounded
// (cache_store/quote.h); this is the backstop.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// `status` with its code; its message cut to kMaxStatusMessageBytes (and
// the number of bytes cut) when longer.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_GRPC_STATUS_H_
