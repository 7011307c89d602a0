// The one conversion of a CUDA runtime error into an absl::Status (STYLE.md:
// convert each foreign error once). Built only with the CUDA backend.
// Thread-safe (stateless).
#ifndef KVKEEP_CACHE_STORE_CUDA_STATUS_H_
#define KVKEEP_CACHE_STORE_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvkeep {

// OK for cudaSuccess. Otherwise a status naming `what` and CUDA's own name
// and text for the error: RESOURCE_EXHAUSTED for device memory,
// FAILED_PRECONDITION for a missing device or driver, INVALID_ARGUMENT for
// an unsupported size, INTERNAL for the rest (a bug or a broken device).
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_CUDA_STATUS_H_
