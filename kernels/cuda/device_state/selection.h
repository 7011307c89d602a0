// Eviction selection on the GPU: for every layer of a step in one launch, the
// k lowest-ranked unprotected slots, the same slots in the same order as the
// CPU twin SelectLowestUnprotected (kernels/selection.h). Exact and
// deterministic: no floating-point arithmetic decides the result.
//
// Launchers are stateless and thread-safe; each enqueues on the stream it is
// given, checks the launch and never synchronises. All pointers are device
// pointers unless stated.
#ifndef KVKEEP_KERNELS_CUDA_DEVICE_STATE_SELECTION_H_
#define KVKEEP_KERNELS_CUDA_DEVICE_STATE_SELECTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvkeep::cuda {

// victim_count of a layer that was not selected (see LaunchSelectLowest).
inline constexpr int32_t kSelectInvalidLayer = -1;

// One layer's selection.
struct SelectLayer {
  const float* scores;     // [slots]; never NaN (validated before)
  const int64_t* arrival;  // [slots]; 0-based arrival order, unique per slot
  int64_t slots;           // resident slots, at most max_slots
  int64_t appended;        // tokens ever appended to the layer
  int64_t k;               // victims wanted; <= 0 selects none
  int32_t* victims;        // out: [min(k, eligible)] slots, in rank order
                           // (room for min(k, slots))
  int32_t* victim_count;   // out: min(k, eligible), or kSelectInvalidLayer
};

// Bytes of workspace LaunchSelectLowest needs for `num_layers` layers of at
// most `max_slots` slots (0 when there is nothing to select).
size_t SelectWorkspaceBytes(int32_t num_layers, int64_t max_slots);

// For each layer, writes the min(k, eligible) lowest-ranked eligible slots to
// victims in rank order and their number to *victim_count. A slot is eligible
// when sinks <= arrival < appended - recent; rank is ascending score, then
// ascending arrival, with -0.0 and 0.0 equal (as the CPU compares them).
//
// Arrival assumption: the 64-bit rank key holds (arrival - sinks) in 32 bits,
// which is exact while the eligible span appended - recent - sinks is at most
// 2^32 tokens. A layer beyond that, or with slots outside [0, max_slots], gets
// victim_count = kSelectInvalidLayer and no victims.
//
//   layers_on_device: [num_layers] SelectLayer, in device memory.
//   workspace: at least SelectWorkspaceBytes(num_layers, max_slots) bytes of
//     device memory, 16-byte aligned; not shared with a concurrent launch.
// Returns cudaErrorInvalidValue (and launches nothing) for negative sizes,
// sinks or recent, max_slots above INT32_MAX or a short workspace.
cudaError_t LaunchSelectLowest(const SelectLayer* layers_on_device,
                               int32_t num_layers, int64_t sinks,
                               int64_t recent, int64_t max_slots,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_DEVICE_STATE_SELECTION_H_
