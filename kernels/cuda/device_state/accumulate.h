// LaunchAccumulate: one step's score accumulation for every layer in one
// launch. The CUDA twin of AccumulateScores (kernels/accumulate.h): same
// contract, same summation order, so the two agree bit for bit.
// Stateless; thread-safe. Launchers enqueue on the given stream and never
// synchronise.
#ifndef KVKEEP_KERNELS_CUDA_DEVICE_STATE_ACCUMULATE_H_
#define KVKEEP_KERNELS_CUDA_DEVICE_STATE_ACCUMULATE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/accumulate.h"

namespace kvkeep::cuda {

// For every layer y in [0, num_layers) of `layers_on_device` (a device array
// of AccumulateLayer whose pointers are device pointers), performs the
// AccumulateScores update of kernels/accumulate.h. `max_slots` only sizes the
// grid (the kernel loops over each layer's own slots), so any value >= 1
// gives the right answer; the largest layer's slots gives the best one.
// Layers must not share scores or kv_head_scores arrays (they run
// concurrently). Returns cudaErrorInvalidValue for bad shapes (query_heads or
// kv_heads < 1, query_heads % kv_heads != 0, num_layers > 65535), cudaSuccess
// without launching when there is nothing to do, else the launch's status.
cudaError_t LaunchAccumulate(const AccumulateLayer* layers_on_device,
                             int32_t num_layers, int32_t query_heads,
                             int32_t kv_heads, int32_t rows, int64_t max_slots,
                             cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_DEVICE_STATE_ACCUMULATE_H_
