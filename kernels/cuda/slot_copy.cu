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

// kivi_int4: the dense key block of the page slot `slot` lies in, when
// token t (slot first + t) is the first of that page the copy touches, else
// -1 (its page's block is another token's to copy, or keys are not asked for).
__device__ inline int64_t KiviBlockIndex(const PageLayout& layout,
                                         int64_t first, int64_t t,
                                         const void* keys) {
  const int64_t slot = first + t;
  if (keys == nullptr || (t > 0 && slot % layout.page_tokens != 0)) return -1;
  return slot / layout.page_tokens - first / layout.page_tokens;
}

// Dense -> paged.
// grid: [min(n, kMaxBlocks)] blocks, block b copying tokens b, b + gridDim.x,
// ...; block: kThreads threads over one token's K row, then its V row
// (kivi_int4: its page's key block, when KiviBlockIndex gives one).
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteSlotsKernel(std::byte* arena, PageLayout layout, const PageId* pages,
                     int64_t first, int64_t n, const std::byte* keys,
                     const std::byte* values) {
  const int64_t bytes = layout.token_bytes();
  const bool kivi = IsKivi(layout.dtype);
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t slot = first + t;
    const PageId page = pages[slot / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(slot % layout.page_tokens);
    if (!kivi) {
      BlockCopyRow<Word>(arena + layout.key_offset(page, in_page),
                         keys + t * bytes, bytes);
    } else if (const int64_t b = KiviBlockIndex(layout, first, t, keys);
               b >= 0) {
      BlockCopyRow<Word>(arena + page * layout.page_bytes(),
                         keys + b * layout.key_block_bytes(),
                         layout.key_block_bytes());
    }
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
  const bool kivi = IsKivi(layout.dtype);
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t slot = first + t;
    const PageId page = pages[slot / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(slot % layout.page_tokens);
    if (!kivi) {
      BlockCopyRow<Word>(keys + t * bytes,
                         arena + layout.key_offset(page, in_page), bytes);
    } else if (const int64_t b = KiviBlockIndex(layout, first, t, keys);
               b >= 0) {
      BlockCopyRow<Word>(keys + b * layout.key_block_bytes(),
                         arena + page * layout.page_bytes(),
                         layout.key_block_bytes());
    }
    BlockCopyRow<Word>(values + t * bytes,
                       arena + layout.value_offset(page, in_page), bytes);
  }
}

// kivi_int4's key blocks between `count` pages and a dense buffer.
// grid: [min(count, kMaxBlocks)] blocks, block b copying the blocks of pages
// b, b + gridDim.x, ...; block: kThreads threads over one block.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    ReadKeyBlocksKernel(const std::byte* arena, PageLayout layout,
                        const PageId* pages, int64_t count, std::byte* blocks) {
  const int64_t bytes = layout.key_block_bytes();
  for (int64_t b = blockIdx.x; b < count; b += gridDim.x) {
    BlockCopyRow<Word>(blocks + b * bytes,
                       arena + pages[b] * layout.page_bytes(), bytes);
  }
}
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteKeyBlocksKernel(std::byte* arena, PageLayout layout,
                         const PageId* pages, int64_t count,
                         const std::byte* blocks) {
  const int64_t bytes = layout.key_block_bytes();
  for (int64_t b = blockIdx.x; b < count; b += gridDim.x) {
    BlockCopyRow<Word>(arena + pages[b] * layout.page_bytes(),
                       blocks + b * bytes, bytes);
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
  if (arena == nullptr || pages == nullptr ||
      (keys == nullptr && !IsKivi(layout.dtype)) || values == nullptr) {
    return cudaErrorInvalidValue;
  }
  // Page, key block and token offsets are sums of multiples of token_bytes
  // and key_block_bytes, so the word divides every address the kernel
  // touches.
  const int word = CopyWordBytes(
      layout.token_bytes() | layout.key_block_bytes(), arena, keys, values);
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

namespace {

template <typename Kernel, typename Arena, typename Dense>
cudaError_t LaunchKeyBlocks(Kernel kernel_of_word, Arena* arena,
                            const PageLayout& layout, const PageId* pages,
                            int64_t count, Dense* blocks, cudaStream_t stream) {
  if (count < 0 || !IsKivi(layout.dtype) || !ValidArgs(layout, 0, 0)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  if (arena == nullptr || pages == nullptr || blocks == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int word = CopyWordBytes(layout.page_bytes() | layout.key_block_bytes(),
                                 arena, blocks, nullptr);
  return DispatchCopyWord(word, [&](auto tag) {
    kernel_of_word(tag)<<<Blocks(count), kThreads, 0, stream>>>(
        arena, layout, pages, count, blocks);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchReadKeyBlocks(const std::byte* arena,
                                const PageLayout& layout, const PageId* pages,
                                int64_t count, std::byte* blocks,
                                cudaStream_t stream) {
  return LaunchKeyBlocks(
      [](auto tag) { return &ReadKeyBlocksKernel<decltype(tag)>; }, arena,
      layout, pages, count, blocks, stream);
}

cudaError_t LaunchWriteKeyBlocks(std::byte* arena, const PageLayout& layout,
                                 const PageId* pages, int64_t count,
                                 const std::byte* blocks, cudaStream_t stream) {
  return LaunchKeyBlocks(
      [](auto tag) { return &WriteKeyBlocksKernel<decltype(tag)>; }, arena,
      layout, pages, count, blocks, stream);
}

}  // namespace kvkeep::cuda
