// Compaction of a layer's slots after eviction: the CPU reference for the
// compaction kernel. Thread-safe (no shared state).
//
// Slots are dense in [0, n). After evicting a set V, the survivors must be
// dense in [0, n - |V|). Holes below the new end are filled by the survivors
// at or above it, matched in ascending order (lowest such survivor into the
// lowest hole), so the number of moves is minimal (at most |V|) and a run of
// consecutive slots moves as a run.
#ifndef KVKEEP_KERNELS_COMPACTION_H_
#define KVKEEP_KERNELS_COMPACTION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/page_layout.h"

namespace kvkeep {

struct SlotMove {
  int32_t from_slot;
  int32_t to_slot;
  friend bool operator==(const SlotMove&, const SlotMove&) = default;
};

// Plans the moves. `victims` are distinct slots in [0, n), any order.
// `evicted` is scratch of n bytes (reused to avoid a per-step allocation).
std::vector<SlotMove> PlanCompaction(std::span<const int32_t> victims,
                                     int64_t n, std::vector<uint8_t>& evicted);
// The same into `moves` (cleared first, its capacity reused).
void PlanCompaction(std::span<const int32_t> victims, int64_t n,
                    std::vector<uint8_t>& evicted,
                    std::vector<SlotMove>& moves);

// Copies the keys and values of each move's source slot over its target slot
// in the arena, in order. Byte-exact. kivi_int4: values only (the session
// re-quantises the key blocks of the pages the moves write).
//   pages: the layer's block table (slot s lives in pages[s / page_tokens]).
void MoveSlotBytes(std::byte* arena, const PageLayout& layout,
                   std::span<const PageId> pages,
                   std::span<const SlotMove> moves);

// Applies the moves to a per-slot array and truncates it to new_size.
template <typename T>
void MoveSlotValues(std::vector<T>& values, std::span<const SlotMove> moves,
                    int64_t new_size) {
  for (const SlotMove& m : moves) values[m.to_slot] = values[m.from_slot];
  values.resize(new_size);
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_COMPACTION_H_
