// Compaction on the GPU, the twins of kernels/compaction.h: the byte move of
// one layer (MoveSlotBytes), and for a whole step the plan (PlanCompaction)
// and the move of bytes and per-slot values of every layer, one launch each,
// chained on the device with no host round trip:
//   LaunchSelectLowest -> LaunchPlanCompaction -> LaunchCompactLayers.
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

// Copies the keys and values of each move's source slot over its target slot
// in the arena, byte-exact. The moves run in parallel, so they must be
// independent: targets distinct, and no target is also a source. The moves of
// PlanCompaction are (sources at or above the new end, targets below it); for
// them the result equals MoveSlotBytes', which applies moves in order.
//   pages: the layer's block table (slot s lives in pages[s / page_tokens]).
//   moves: [num_moves].
cudaError_t LaunchMoveSlotBytes(std::byte* arena, const PageLayout& layout,
                                const PageId* pages, const SlotMove* moves,
                                int32_t num_moves, cudaStream_t stream);

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

// One layer's compaction: its block table, its moves (independent, as for
// LaunchMoveSlotBytes) and the per-slot arrays that move with the bytes.
struct CompactLayer {
  const PageId* pages;        // the layer's block table
  const SlotMove* moves;      // [*move_count], e.g. PlanLayer::moves
  const int32_t* move_count;  // e.g. PlanLayer::move_count; <= 0: no move
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
