// Copies tokens' keys and values between a layer's slots in a page arena and
// a dense buffer: the CPU references for the scatter (append, restore) and
// gather (read, transfer) kernels; and whole pages within the arena.
// Thread-safe (no shared state).
//
// Dense buffers are [n][kv_heads][head_dim] of the layout's dtype, one for
// keys and one for values; slot s of the layer lives in pages[s / P] at
// s % P (P = layout.page_tokens), see page_layout.h.
#ifndef KVKEEP_KERNELS_SLOT_COPY_H_
#define KVKEEP_KERNELS_SLOT_COPY_H_

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep {

// Writes tokens [0, n) of `keys` and `values` into slots [first, first + n).
// `pages` must cover slot first + n - 1. kivi_int4, whose keys are whole
// per-page blocks (kernels/kivi.h): `keys` is null (values only) or holds
// the key blocks of the pages the slots touch, in order
// (layout.key_run_bytes(first, n) bytes), each written whole.
void WriteSlotBytes(std::byte* arena, const PageLayout& layout,
                    const PageId* pages, int64_t first, int64_t n,
                    const std::byte* keys, const std::byte* values);

// Reads slots [first, first + n) into tokens [0, n) of `keys` and `values`
// (kivi_int4: `keys` null, or the touched pages' whole key blocks).
void ReadSlotBytes(const std::byte* arena, const PageLayout& layout,
                   const PageId* pages, int64_t first, int64_t n,
                   std::byte* keys, std::byte* values);

// kivi_int4: the key blocks of `count` pages (layout.key_block_bytes()
// each, in the order of `pages`) out of the arena, and back.
void ReadKeyBlockBytes(const std::byte* arena, const PageLayout& layout,
                       const PageId* pages, int64_t count, std::byte* blocks);
void WriteKeyBlockBytes(std::byte* arena, const PageLayout& layout,
                        const PageId* pages, int64_t count,
                        const std::byte* blocks);

// Copies every byte of page `from` (keys, values and any scales) over page
// `to`: the copy-on-write of a page that forked sessions share.
void CopyPageBytes(std::byte* arena, const PageLayout& layout, PageId from,
                   PageId to);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_SLOT_COPY_H_
