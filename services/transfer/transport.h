// Transport: how a session transfer moves its page bytes, parsed once from
// the API's `transport` string at the service edge; everything below works
// with the enum. kAuto lets the stores pick (NCCL between GPU pools, else
// the target's data socket, else chunk messages; docs/transfer.md).
//
// Plain values and pure functions.
#ifndef KVKEEP_SERVICES_TRANSFER_TRANSPORT_H_
#define KVKEEP_SERVICES_TRANSFER_TRANSPORT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvkeep {

enum class Transport {
  kAuto,  // requests only: the stores choose
  kHost,  // chunk messages on the gRPC stream
  kTcp,   // the target's data socket
  kNccl,  // pool to pool between GPUs
};

// "" and "auto" -> kAuto, "host", "tcp", "nccl"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Transport> ParseTransport(absl::string_view name);
// The API's (and the metrics') name: "auto", "host", "tcp", "nccl".
absl::string_view TransportName(Transport transport);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_TRANSPORT_H_
