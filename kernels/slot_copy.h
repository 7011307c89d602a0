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
// `pages` must cover slot first + n - 1. kivi_int4: values only (its keys
// are whole key blocks, written by the session: kernels/kivi.h).
void WriteSlotBytes(std::byte* arena, const PageLayout& layout,
                    const PageId* pages, int64_t first, int64_t n,
                    const std::byte* keys, const std::byte* values);

// Reads slots [first, first + n) into tokens [0, n) of `keys` and `values`
// (kivi_int4: values only; `keys` is left as it is).
void ReadSlotBytes(const std::byte* arena, const PageLayout& layout,
                   const PageId* pages, int64_t first, int64_t n,
                   std::byte* keys, std::byte* values);

// Copies every byte of page `from` (keys, values and any scales) over page
// `to`: the copy-on-write of a page that forked sessions share.
void CopyPageBytes(std::byte* arena, const PageLayout& layout, PageId from,
                   PageId to);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_SLOT_COPY_H_
