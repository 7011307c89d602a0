#include "kernels/slot_copy.h"

#include <algorithm>
#include <cstring>

namespace kvkeep {

// Both copies go a page-run at a time: the tokens of one page are contiguous
// in the arena (keys, then values), so a run is one memcpy each.
void WriteSlotBytes(std::byte* arena, const PageLayout& layout,
                    const PageId* pages, int64_t first, int64_t n,
                    const std::byte* keys, const std::byte* values) {
  const int64_t token_bytes = layout.token_bytes();
  const int64_t p = layout.page_tokens;
  for (int64_t i = 0; i < n;) {
    const int64_t slot = first + i;
    const int32_t in_page = static_cast<int32_t>(slot % p);
    const int64_t run = std::min<int64_t>(n - i, p - in_page);
    const PageId page = pages[slot / p];
    if (!IsKivi(layout.dtype)) {  // kivi_int4's keys: whole key blocks
      std::memcpy(arena + layout.key_offset(page, in_page),
                  keys + i * token_bytes, run * token_bytes);
    }
    std::memcpy(arena + layout.value_offset(page, in_page),
                values + i * token_bytes, run * token_bytes);
    i += run;
  }
}

void ReadSlotBytes(const std::byte* arena, const PageLayout& layout,
                   const PageId* pages, int64_t first, int64_t n,
                   std::byte* keys, std::byte* values) {
  const int64_t token_bytes = layout.token_bytes();
  const int64_t p = layout.page_tokens;
  for (int64_t i = 0; i < n;) {
    const int64_t slot = first + i;
    const int32_t in_page = static_cast<int32_t>(slot % p);
    const int64_t run = std::min<int64_t>(n - i, p - in_page);
    const PageId page = pages[slot / p];
    if (!IsKivi(layout.dtype)) {
      std::memcpy(keys + i * token_bytes,
                  arena + layout.key_offset(page, in_page), run * token_bytes);
    }
    std::memcpy(values + i * token_bytes,
                arena + layout.value_offset(page, in_page), run * token_bytes);
    i += run;
  }
}

void CopyPageBytes(std::byte* arena, const PageLayout& layout, PageId from,
                   PageId to) {
  const int64_t bytes = layout.page_bytes();
  std::memcpy(arena + static_cast<int64_t>(to) * bytes,
              arena + static_cast<int64_t>(from) * bytes, bytes);
}

}  // namespace kvkeep
