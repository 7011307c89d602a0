#include "kernels/compaction.h"

#include <cstring>

namespace kvkeep {

std::vector<SlotMove> PlanCompaction(std::span<const int32_t> victims,
                                     int64_t n, std::vector<uint8_t>& evicted) {
  std::vector<SlotMove> moves;
  PlanCompaction(victims, n, evicted, moves);
  return moves;
}

void PlanCompaction(std::span<const int32_t> victims, int64_t n,
                    std::vector<uint8_t>& evicted,
                    std::vector<SlotMove>& moves) {
  const int64_t new_size = n - static_cast<int64_t>(victims.size());
  evicted.assign(n, 0);
  for (int32_t v : victims) evicted[v] = 1;
  moves.clear();
  int64_t hole = 0;
  for (int64_t src = new_size; src < n; ++src) {
    if (evicted[src]) continue;
    while (!evicted[hole]) ++hole;  // a hole below new_size exists for src
    moves.push_back({static_cast<int32_t>(src), static_cast<int32_t>(hole)});
    ++hole;
  }
}

void MoveSlotBytes(std::byte* arena, const PageLayout& layout,
                   std::span<const PageId> pages,
                   std::span<const SlotMove> moves) {
  const int32_t p = layout.page_tokens;
  const int64_t bytes = layout.token_bytes();
  for (const SlotMove& m : moves) {
    const PageId from_page = pages[m.from_slot / p];
    const PageId to_page = pages[m.to_slot / p];
    const int32_t from = m.from_slot % p;
    const int32_t to = m.to_slot % p;
    if (!IsKivi(layout.dtype)) {  // kivi_int4: key blocks re-quantised
      std::memcpy(arena + layout.key_offset(to_page, to),
                  arena + layout.key_offset(from_page, from), bytes);
    }
    std::memcpy(arena + layout.value_offset(to_page, to),
                arena + layout.value_offset(from_page, from), bytes);
  }
}

}  // namespace kvkeep
