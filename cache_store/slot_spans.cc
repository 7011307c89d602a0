#include "cache_store/slot_spans.h"

#include <algorithm>

namespace kvkeep {

void HostSlotSpans(std::byte* arena, const PageLayout& layout,
                   std::span<const PageId> pages, int64_t first, int64_t n,
                   SlotSpans* out) {
  const int64_t token_bytes = layout.token_bytes();
  auto add = [](std::vector<std::span<std::byte>>& side, std::byte* at,
                size_t bytes) {
    if (!side.empty() && side.back().data() + side.back().size() == at) {
      side.back() = {side.back().data(), side.back().size() + bytes};
    } else {
      side.emplace_back(at, bytes);
    }
  };
  const bool kivi = IsKivi(layout.dtype);
  for (int64_t slot = first; slot < first + n;) {
    const PageId page = pages[slot / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(slot % layout.page_tokens);
    const int64_t run =
        std::min<int64_t>(layout.page_tokens - in_page, first + n - slot);
    if (kivi) {  // the page's whole key block (in_page is 0)
      add(out->keys, arena + layout.key_offset(page, 0),
          static_cast<size_t>(layout.key_block_bytes()));
    } else {
      add(out->keys, arena + layout.key_offset(page, in_page),
          run * token_bytes);
    }
    add(out->values, arena + layout.value_offset(page, in_page),
        run * token_bytes);
    slot += run;
  }
}

}  // namespace kvkeep
