// Exact, deterministic selection of the k lowest-ranked items: the CPU
// reference for the eviction selection kernel. Thread-safe (no shared state).
//
// Rank: ascending key; equal keys are broken by ascending `tie` (for tokens
// their arrival order, so the older of two equal tokens goes first), and tie
// values are unique, so the result is one set whatever the algorithm.
#ifndef KVKEEP_KERNELS_SELECTION_H_
#define KVKEEP_KERNELS_SELECTION_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace kvkeep {

struct RankedItem {
  float key;
  int32_t index;
  int64_t tie;
  friend bool operator<(const RankedItem& a, const RankedItem& b) {
    if (a.key != b.key) return a.key < b.key;
    return a.tie < b.tie;
  }
};

// Appends to *out the indices of the k lowest-ranked items i in [0, n) for
// which eligible(i) holds (fewer if fewer are eligible), in rank order.
// `scratch` is reused between calls to avoid an allocation per step.
template <typename KeyFn, typename TieFn, typename EligibleFn>
void SelectLowest(int64_t n, int64_t k, KeyFn key, TieFn tie,
                  EligibleFn eligible, std::vector<RankedItem>& scratch,
                  std::vector<int32_t>* out) {
  if (k <= 0) return;
  if (k == 1) {  // the decode-step common case: one linear scan
    bool found = false;
    RankedItem best{};
    for (int64_t i = 0; i < n; ++i) {
      if (!eligible(i)) continue;
      const RankedItem item{key(i), static_cast<int32_t>(i), tie(i)};
      if (!found || item < best) {
        best = item;
        found = true;
      }
    }
    if (found) out->push_back(best.index);
    return;
  }
  scratch.clear();
  if (k * 16 < n) {
    // Few victims among many tokens (a page per batch): keep the k best so
    // far in a max-heap, so most items cost one compare with its top.
    for (int64_t i = 0; i < n; ++i) {
      if (!eligible(i)) continue;
      const RankedItem item{key(i), static_cast<int32_t>(i), tie(i)};
      if (static_cast<int64_t>(scratch.size()) < k) {
        scratch.push_back(item);
        std::push_heap(scratch.begin(), scratch.end());
      } else if (item < scratch.front()) {
        std::pop_heap(scratch.begin(), scratch.end());
        scratch.back() = item;
        std::push_heap(scratch.begin(), scratch.end());
      }
    }
    std::sort_heap(scratch.begin(), scratch.end());
    for (const RankedItem& item : scratch) out->push_back(item.index);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (eligible(i)) {
      scratch.push_back({key(i), static_cast<int32_t>(i), tie(i)});
    }
  }
  const int64_t take = std::min<int64_t>(k, scratch.size());
  std::nth_element(scratch.begin(), scratch.begin() + take, scratch.end());
  std::sort(scratch.begin(), scratch.begin() + take);
  for (int64_t i = 0; i < take; ++i) out->push_back(scratch[i].index);
}

// Appends to *out the k lowest-ranked unprotected slots of a layer, in rank
// order: the CPU twin of the CUDA selection kernel
// (kernels/cuda/device_state/selection.h) and the rule
// EvictionPolicy::SelectLowestUnprotected applies.
//   scores, arrival: [slots]; arrival is the slot's 0-based arrival order in
//     the layer, unique per slot.
// A slot is eligible when sinks <= arrival < appended - recent (the first
// `sinks` and the last `recent` tokens ever appended are protected). Rank is
// ascending score, then ascending arrival; scores compare as floats, so -0.0
// and 0.0 are equal and their tie goes to the older token. Scores must not be
// NaN. Fewer than k slots are appended when fewer are eligible.
inline void SelectLowestUnprotected(const float* scores, const int64_t* arrival,
                                    int64_t slots, int64_t appended,
                                    int64_t sinks, int64_t recent, int64_t k,
                                    std::vector<RankedItem>& scratch,
                                    std::vector<int32_t>* out) {
  const int64_t end = appended - recent;
  SelectLowest(
      slots, k, [&](int64_t i) { return scores[i]; },
      [&](int64_t i) { return arrival[i]; },
      [&](int64_t i) { return arrival[i] >= sinks && arrival[i] < end; },
      scratch, out);
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_SELECTION_H_
