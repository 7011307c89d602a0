// SlotSpans: where a run of a layer's slots lies in a host arena, keys and
// values each in pieces (one per page touched, adjacent pages merged). The
// store hands them out for a frozen session's pages (CacheStore::
// FrozenSlotSpans), so a transfer sends them without a copy, and a target
// receives into a reserved session's pages the same way. The spans borrow
// the arena: they stay valid while the pages stay allocated.
//
// Plain data; HostSlotSpans is a pure function.
#ifndef KVKEEP_CACHE_STORE_SLOT_SPANS_H_
#define KVKEEP_CACHE_STORE_SLOT_SPANS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/page_layout.h"

namespace kvkeep {

struct SlotSpans {
  std::vector<std::span<std::byte>> keys;
  std::vector<std::span<std::byte>> values;
};

// The pieces, in a host arena of pages of `layout`, of slots [first, first +
// n) of a layer whose block table is `pages` (appended to `out`). kivi_int4:
// the keys are the whole key blocks of the pages the slots touch, and
// `first` must start a page.
void HostSlotSpans(std::byte* arena, const PageLayout& layout,
                   std::span<const PageId> pages, int64_t first, int64_t n,
                   SlotSpans* out);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SLOT_SPANS_H_
