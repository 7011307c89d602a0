#include <cstddef>
#include <cstdint>

#include "kernels/cuda/block_primitives.cuh"
#include "kernels/cuda/slot_copy.h"

namespace kvkeep::cuda {
namespace {

using internal::BlockCopyRow;
using internal::CopyWordBytes;
using internal::DispatchCopyWord;

constexpr int kThreads = 128;  // one token row of 8 x 128 bf16 = 128 uint4
// Blocks per launch at most; each block strides over tokens beyond it.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// Dense -> paged.
// grid: [min(n, kMaxBlocks)] blocks, block b copying tokens b, b + gridDim.x,
// ...; block: kThreads threads over one token's K row, then its V row.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteSlotsKernel(std::byte* arena, PageLayout layout, const PageId* pages,
                     int64_t first, int64_t n, const std::byte* keys,
                     const std::byte* values) {
  const int64_t bytes = layout.token_bytes();
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t slot = first + t;
    const PageId page = pages[slot / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(slot % layout.page_tokens);
    BlockCopyRow<Word>(arena + layout.key_offset(page, in_page),
                       keys + t * bytes, bytes);
    BlockCopyRow<Word>(arena + layout.value_offset(page, in_page),
                       values + t * bytes, bytes);
  }
}

// Paged -> dense. grid and block as WriteSlotsKernel.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    ReadSlotsKernel(const std::byte* arena, PageLayout layout,
                    const PageId* pages, int64_t first, int64_t n,
                    std::byte* keys, std::byte* values) {
  const int64_t bytes = layout.token_bytes();
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t slot = first + t;
    const PageId page = pages[slot / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(slot % layout.page_tokens);
    BlockCopyRow<Word>(keys + t * bytes,
                       arena + layout.key_offset(page, in_page), bytes);
    BlockCopyRow<Word>(values + t * bytes,
                       arena + layout.value_offset(page, in_page), bytes);
  }
}

bool ValidArgs(const PageLayout& layout, int64_t first, int64_t n) {
  return first >= 0 && n >= 0 && layout.page_tokens > 0 &&
         layout.kv_heads > 0 && layout.head_dim > 0;
}

unsigned Blocks(int64_t n) {
  return static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks);
}

}  // namespace

namespace {

// The launch both directions share: arguments checked, the widest copy word
// every address allows, one kernel instance per word.
template <template <typename> class Launch, typename Arena, typename Dense>
cudaError_t LaunchSlotCopy(Arena* arena, const PageLayout& layout,
                           const PageId* pages, int64_t first, int64_t n,
                           Dense* keys, Dense* values, cudaStream_t stream) {
  if (!ValidArgs(layout, first, n)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (arena == nullptr || pages == nullptr || keys == nullptr ||
      values == nullptr) {
    return cudaErrorInvalidValue;
  }
  // Page and token offsets are multiples of token_bytes, so the word divides
  // every address the kernel touches.
  const int word = CopyWordBytes(layout.token_bytes(), arena, keys, values);
  return DispatchCopyWord(word, [&](auto tag) {
    Launch<decltype(tag)>::Run(Blocks(n), stream, arena, layout, pages, first,
                               n, keys, values);
    return cudaGetLastError();
  });
}

template <typename Word>
struct WriteLaunch {
  static void Run(unsigned blocks, cudaStream_t stream, std::byte* arena,
                  const PageLayout& layout, const PageId* pages, int64_t first,
                  int64_t n, const std::byte* keys, const std::byte* values) {
    WriteSlotsKernel<Word><<<blocks, kThreads, 0, stream>>>(
        arena, layout, pages, first, n, keys, values);
  }
};

template <typename Word>
struct ReadLaunch {
  static void Run(unsigned blocks, cudaStream_t stream, const std::byte* arena,
                  const PageLayout& layout, const PageId* pages, int64_t first,
                  int64_t n, std::byte* keys, std::byte* values) {
    ReadSlotsKernel<Word><<<blocks, kThreads, 0, stream>>>(
        arena, layout, pages, first, n, keys, values);
  }
};

}  // namespace

cudaError_t LaunchWriteSlots(std::byte* arena, const PageLayout& layout,
                             const PageId* pages, int64_t first, int64_t n,
                             const std::byte* keys, const std::byte* values,
                             cudaStream_t stream) {
  return LaunchSlotCopy<WriteLaunch>(arena, layout, pages, first, n, keys,
                                     values, stream);
}

cudaError_t LaunchReadSlots(const std::byte* arena, const PageLayout& layout,
                            const PageId* pages, int64_t first, int64_t n,
                            std::byte* keys, std::byte* values,
                            cudaStream_t stream) {
  return LaunchSlotCopy<ReadLaunch>(arena, layout, pages, first, n, keys,
                                    values, stream);
}

}  // namespace kvkeep::cuda
