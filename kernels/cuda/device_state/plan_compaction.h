// The compaction plan on the GPU, the twin of PlanCompaction
// (kernels/compaction.h), for every layer of a step in one launch, chained on
// the device after the selection and before the move, with no host round
// trip:
//   LaunchSelectLowest -> LaunchPlanCompaction -> LaunchCompactLayers.
// Not in the product (kvkeep::cuda_device_state, see kernels/CMakeLists.txt):
// the per-token state a device plan would start from lives on the host.
//
// Launchers are stateless and thread-safe; each enqueues on the stream it is
// given, checks the launch and never synchronises. All pointers are device
// pointers unless stated.
#ifndef KVKEEP_KERNELS_CUDA_DEVICE_STATE_PLAN_COMPACTION_H_
#define KVKEEP_KERNELS_CUDA_DEVICE_STATE_PLAN_COMPACTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/compaction.h"

namespace kvkeep::cuda {

// move_count of a layer whose victims were invalid (see LaunchPlanCompaction).
inline constexpr int32_t kPlanInvalidLayer = -1;

// One layer's compaction plan.
struct PlanLayer {
  const int32_t* victims;       // [*victim_count]: slots to evict, any order
  const int32_t* victim_count;  // e.g. SelectLayer::victim_count
  int64_t slots;                // slots before the eviction
  SlotMove* moves;              // out: room for *victim_count moves
  int32_t* move_count;          // out: moves written, or kPlanInvalidLayer
};

// Bytes of workspace LaunchPlanCompaction needs (0 when max_victims <= 0).
size_t PlanCompactionWorkspaceBytes(int32_t num_layers, int32_t max_victims);

// For each layer, writes the moves PlanCompaction(victims, slots) returns, in
// its order: the survivors at or above the new end slots - victims, ascending,
// into the victims below it, ascending. A layer whose victim_count is negative
// (kSelectInvalidLayer included) or above max_victims or slots, whose victims
// are not distinct slots in [0, slots), or whose slots is outside
// [0, INT32_MAX] gets move_count = kPlanInvalidLayer and no moves.
//   workspace: at least PlanCompactionWorkspaceBytes(num_layers, max_victims)
//     bytes of device memory; not shared with a concurrent launch.
cudaError_t LaunchPlanCompaction(const PlanLayer* layers_on_device,
                                 int32_t num_layers, int32_t max_victims,
                                 void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_DEVICE_STATE_PLAN_COMPACTION_H_
