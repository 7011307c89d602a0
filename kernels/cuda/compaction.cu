#include <cstddef>
#include <cstdint>

#include "kernels/cuda/block_primitives.cuh"
#include "kernels/cuda/compaction.h"

namespace kvkeep::cuda {
namespace {

using internal::BlockCopyRow;
using internal::CopyWordBytes;
using internal::DispatchCopyWord;

constexpr int kCopyThreads = 128;  // one token row of 8 x 128 bf16 = 128 uint4
constexpr int kMaxGridY = 65535;

// Copies the K and V rows of one move (kivi_int4: the V row; its key blocks
// are re-quantised by the session). Called by all threads of a block.
template <typename Word>
__device__ inline void MoveOneSlot(std::byte* arena, const PageLayout& layout,
                                   const PageId* pages, SlotMove m) {
  const int32_t p = layout.page_tokens;
  const PageId from_page = pages[m.from_slot / p];
  const PageId to_page = pages[m.to_slot / p];
  const int32_t from = m.from_slot % p;
  const int32_t to = m.to_slot % p;
  const int64_t bytes = layout.token_bytes();
  // Independent moves: the source rows are never written in this launch.
  if (!IsKivi(layout.dtype)) {
    BlockCopyRow<Word>(arena + layout.key_offset(to_page, to),
                       arena + layout.key_offset(from_page, from), bytes);
  }
  BlockCopyRow<Word>(arena + layout.value_offset(to_page, to),
                     arena + layout.value_offset(from_page, from), bytes);
}

// Every layer's moves, bytes and per-slot values.
// grid: [blocks_per_layer, num_layers]; block: kCopyThreads threads. Block x
// of layer y moves moves x, x + gridDim.x, ... of that layer.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    CompactLayersKernel(std::byte* arena, PageLayout layout,
                        const CompactLayer* layers) {
  const CompactLayer layer = layers[blockIdx.y];
  const int32_t count = *layer.move_count;  // negative: an invalid plan
  for (int32_t i = blockIdx.x; i < count; i += gridDim.x) {
    const SlotMove m = layer.moves[i];
    MoveOneSlot<Word>(arena, layout, layer.pages, m);
    if (threadIdx.x == 0) {
      if (layer.score != nullptr)
        layer.score[m.to_slot] = layer.score[m.from_slot];
      if (layer.arrival != nullptr) {
        layer.arrival[m.to_slot] = layer.arrival[m.from_slot];
      }
      if (layer.position != nullptr) {
        layer.position[m.to_slot] = layer.position[m.from_slot];
      }
      if (layer.history != nullptr) {
        layer.history[m.to_slot] = layer.history[m.from_slot];
      }
    }
  }
}

bool ValidLayout(const PageLayout& layout) {
  return layout.page_tokens > 0 && layout.kv_heads > 0 && layout.head_dim > 0;
}

}  // namespace

cudaError_t LaunchCompactLayers(std::byte* arena, const PageLayout& layout,
                                const CompactLayer* layers_on_device,
                                int32_t num_layers, int32_t max_moves,
                                cudaStream_t stream) {
  if (num_layers < 0 || num_layers > kMaxGridY || max_moves < 0 ||
      !ValidLayout(layout)) {
    return cudaErrorInvalidValue;
  }
  if (num_layers == 0) return cudaSuccess;
  if (arena == nullptr || layers_on_device == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int word = CopyWordBytes(
      layout.token_bytes() | layout.key_block_bytes(), arena, nullptr, nullptr);
  // At least one block per layer: max_moves only sizes the grid.
  const dim3 grid(static_cast<unsigned>(max_moves > 0 ? max_moves : 1),
                  static_cast<unsigned>(num_layers));
  return DispatchCopyWord(word, [&](auto tag) {
    using Word = decltype(tag);
    CompactLayersKernel<Word>
        <<<grid, kCopyThreads, 0, stream>>>(arena, layout, layers_on_device);
    return cudaGetLastError();
  });
}

}  // namespace kvkeep::cuda
