// Compaction on the GPU, the twin of MoveSlotBytes and MoveSlotValues
// (kernels/compaction.h): for every layer of a step in one launch, the moves
// of its keys and values (byte-exact) and, optionally, of its per-slot arrays.
// The CUDA page memory runs a step's compaction moves with it
// (cache_store/cuda_memory.cc); the moves are planned on the host
// (PlanCompaction), where the per-token state lives. The device plan
// (device_state/plan_compaction.h) chains after the device selection for when
// that state moves to the device.
//
// Launchers are stateless and thread-safe; each enqueues on the stream it is
// given, checks the launch and never synchronises. All pointers are device
// pointers unless stated.
#ifndef KVKEEP_KERNELS_CUDA_COMPACTION_H_
#define KVKEEP_KERNELS_CUDA_COMPACTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/compaction.h"
#include "kernels/page_layout.h"

namespace kvkeep::cuda {

// One layer's compaction: its block table, its moves and the per-slot arrays
// that move with the bytes. The moves run in parallel, so they must be
// independent: targets distinct, and no target is also a source. The moves
// of PlanCompaction are (sources at or above the new end, targets below it);
// for them the result equals MoveSlotBytes', which applies moves in order.
struct CompactLayer {
  const PageId* pages;        // the layer's block table
  const SlotMove* moves;      // [*move_count], e.g. PlanLayer::moves
  const int32_t* move_count;  // <= 0: no move (e.g. an invalid plan's -1)
  // Per-slot arrays, each nullable: values[to] = values[from] per move. The
  // arrays keep their length; the caller truncates to the new size.
  float* score;
  int64_t* arrival;
  int64_t* position;
  uint64_t* history;
};

// Applies every layer's moves to the arena (keys and values, byte-exact) and
// to the layer's per-slot arrays. All layers share `arena` and `layout` (one
// pool). `max_moves` sizes the grid (blocks per layer); a layer with more
// moves is still moved whole.
cudaError_t LaunchCompactLayers(std::byte* arena, const PageLayout& layout,
                                const CompactLayer* layers_on_device,
                                int32_t num_layers, int32_t max_moves,
                                cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_COMPACTION_H_
