#include "cache_store/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvkeep {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(std::string(what), ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return absl::FailedPreconditionError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvkeep
