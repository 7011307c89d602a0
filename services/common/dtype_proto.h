// The kvkeep.v1 DType enum and the element type of kernels/dtype.h, both
// ways: for the server's conversions and for the clients, the CLI and the
// workers, which do not link the domain. Thread-safe (stateless).
#ifndef KVKEEP_SERVICES_COMMON_DTYPE_PROTO_H_
#define KVKEEP_SERVICES_COMMON_DTYPE_PROTO_H_

#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kvkeep/v1/kvkeep.pb.h"

namespace kvkeep {

v1::DType DTypeToProto(DType t);
// INVALID_ARGUMENT "unknown dtype N" for DTYPE_UNSPECIFIED and any value
// this build does not know.
absl::StatusOr<DType> DTypeFromProto(v1::DType t);
// The dtype a layout's appends are in: append_dtype, or dtype from a server
// that predates quantised layouts (and leaves append_dtype unset).
v1::DType AppendDTypeOf(const v1::Layout& layout);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_DTYPE_PROTO_H_
