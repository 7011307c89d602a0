#include "kernels/slot_copy.h"

#include <algorithm>
#include <cstring>

namespace kvkeep {

// Both copies go a page-run at a time: the tokens of one page are contiguous
// in the arena (keys, then values), so a run is one memcpy each. kivi_int4's
// keys, when asked for, are the run's page's whole key block (block b of the
// dense buffer for the b-th page touched).
void WriteSlotBytes(std::byte* arena, const PageLayout& layout,
                    const PageId* pages, int64_t first, int64_t n,
                    const std::byte* keys, const std::byte* values) {
  const int64_t token_bytes = layout.token_bytes();
  const int64_t p = layout.page_tokens;
  const bool kivi = IsKivi(layout.dtype);
  for (int64_t i = 0; i < n;) {
    const int64_t slot = first + i;
    const int32_t in_page = static_cast<int32_t>(slot % p);
    const int64_t run = std::min<int64_t>(n - i, p - in_page);
    const PageId page = pages[slot / p];
    if (!kivi) {
      std::memcpy(arena + layout.key_offset(page, in_page),
                  keys + i * token_bytes, run * token_bytes);
    } else if (keys != nullptr) {
      WriteKeyBlockBytes(
          arena, layout, &page, 1,
          keys + (slot / p - first / p) * layout.key_block_bytes());
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
  const bool kivi = IsKivi(layout.dtype);
  for (int64_t i = 0; i < n;) {
    const int64_t slot = first + i;
    const int32_t in_page = static_cast<int32_t>(slot % p);
    const int64_t run = std::min<int64_t>(n - i, p - in_page);
    const PageId page = pages[slot / p];
    if (!kivi) {
      std::memcpy(keys + i * token_bytes,
                  arena + layout.key_offset(page, in_page), run * token_bytes);
    } else if (keys != nullptr) {
      ReadKeyBlockBytes(
          arena, layout, &page, 1,
          keys + (slot / p - first / p) * layout.key_block_bytes());
    }
    std::memcpy(values + i * token_bytes,
                arena + layout.value_offset(page, in_page), run * token_bytes);
    i += run;
  }
}

void ReadKeyBlockBytes(const std::byte* arena, const PageLayout& layout,
                       const PageId* pages, int64_t count, std::byte* blocks) {
  const int64_t bytes = layout.key_block_bytes();
  for (int64_t b = 0; b < count; ++b) {
    std::memcpy(blocks + b * bytes, arena + pages[b] * layout.page_bytes(),
                bytes);
  }
}

void WriteKeyBlockBytes(std::byte* arena, const PageLayout& layout,
                        const PageId* pages, int64_t count,
                        const std::byte* blocks) {
  const int64_t bytes = layout.key_block_bytes();
  for (int64_t b = 0; b < count; ++b) {
    std::memcpy(arena + pages[b] * layout.page_bytes(), blocks + b * bytes,
                bytes);
  }
}

void CopyPageBytes(std::byte* arena, const PageLayout& layout, PageId from,
                   PageId to) {
  const int64_t bytes = layout.page_bytes();
  std::memcpy(arena + static_cast<int64_t>(to) * bytes,
              arena + static_cast<int64_t>(from) * bytes, bytes);
}

}  // namespace kvkeep
