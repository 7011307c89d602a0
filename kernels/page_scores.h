// Page aggregation for page-level eviction (h2o_page): per full page of a
// layer, the mean score of its tokens, its oldest token and whether it may be
// evicted whole. The CPU twin of LaunchPageScores in
// kernels/cuda/device_state/pooling.h. Thread-safe (no shared state); the
// caller owns every array.
#ifndef KVKEEP_KERNELS_PAGE_SCORES_H_
#define KVKEEP_KERNELS_PAGE_SCORES_H_

#include <cstdint>

#include "kernels/page_layout.h"  // KVKEEP_HOST_DEVICE

namespace kvkeep {

// The tokens no policy may evict (see cache_store/eviction_policy.h): the
// first `sinks` tokens ever appended to the layer and the `recent` most
// recently appended ones, by arrival order.
struct ProtectedTokens {
  int64_t sinks = 0;
  int64_t recent = 0;
  int64_t appended = 0;  // tokens ever appended to the layer

  KVKEEP_HOST_DEVICE bool contains(int64_t arrival) const {
    return arrival < sinks || arrival >= appended - recent;
  }
};

// Pages whose every slot is resident: slot s lives in page s / page_tokens,
// so only the last page can be partly filled, and it is not counted.
KVKEEP_HOST_DEVICE inline int64_t FullPages(int64_t slots,
                                            int32_t page_tokens) {
  return slots / page_tokens;
}

// For every full page i in [0, FullPages(slots, page_tokens)), with P =
// page_tokens and its slots s in [i*P, (i+1)*P):
//   mean[i]     = (0 + score[i*P] + score[i*P+1] + ...) / P, summed left to
//                 right in float32, then one division (the CUDA kernel does
//                 the same, so the two agree bit for bit);
//   oldest[i]   = min arrival[s];
//   eligible[i] = 1 if no arrival[s] is protected, else 0.
//   score, arrival: [slots]; mean, oldest, eligible: [full pages].
// Requires page_tokens >= 1.
void PageScores(const float* score, const int64_t* arrival, int64_t slots,
                int32_t page_tokens, ProtectedTokens protect, float* mean,
                int64_t* oldest, uint8_t* eligible);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_PAGE_SCORES_H_
