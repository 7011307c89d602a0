// Copies tokens' keys and values between a layer's slots in a device page
// arena and dense device buffers: the scatter (append, restore) and gather
// (read, transfer) kernels, twins of WriteSlotBytes / ReadSlotBytes
// (kernels/slot_copy.h) with the same contract, byte-exact.
//
// Launchers are stateless and thread-safe; each enqueues on the stream it is
// given, checks the launch and never synchronises. All pointers are device
// pointers. Dense buffers are [n][kv_heads][head_dim] of layout.dtype; slot s
// of the layer lives in pages[s / page_tokens] at s % page_tokens. kivi_int4's
// `keys` is null (values only) or the whole key blocks of the pages the slots
// touch, as in the twins.
#ifndef KVKEEP_KERNELS_CUDA_SLOT_COPY_H_
#define KVKEEP_KERNELS_CUDA_SLOT_COPY_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep::cuda {

// Writes tokens [0, n) of `keys` and `values` into slots [first, first + n).
// `pages` must cover slot first + n - 1; the dense buffers must not overlap
// the arena. n == 0 enqueues nothing. cudaErrorInvalidValue for negative
// first or n, a layout with a non-positive size, or a null pointer (but
// kivi_int4's keys).
cudaError_t LaunchWriteSlots(std::byte* arena, const PageLayout& layout,
                             const PageId* pages, int64_t first, int64_t n,
                             const std::byte* keys, const std::byte* values,
                             cudaStream_t stream);

// Reads slots [first, first + n) into tokens [0, n) of `keys` and `values`.
cudaError_t LaunchReadSlots(const std::byte* arena, const PageLayout& layout,
                            const PageId* pages, int64_t first, int64_t n,
                            std::byte* keys, std::byte* values,
                            cudaStream_t stream);

// kivi_int4: the key blocks of `count` pages (layout.key_block_bytes()
// each, in the order of `pages`) into dense `blocks`, and back; twins of
// ReadKeyBlockBytes / WriteKeyBlockBytes. cudaErrorInvalidValue for another
// dtype, a negative count or a null pointer.
cudaError_t LaunchReadKeyBlocks(const std::byte* arena,
                                const PageLayout& layout, const PageId* pages,
                                int64_t count, std::byte* blocks,
                                cudaStream_t stream);
cudaError_t LaunchWriteKeyBlocks(std::byte* arena, const PageLayout& layout,
                                 const PageId* pages, int64_t count,
                                 const std::byte* blocks, cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_SLOT_COPY_H_
