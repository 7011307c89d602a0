#include "kernels/page_scores.h"

#include <algorithm>
#include <limits>

namespace kvkeep {

void PageScores(const float* score, const int64_t* arrival, int64_t slots,
                int32_t page_tokens, ProtectedTokens protect, float* mean,
                int64_t* oldest, uint8_t* eligible) {
  const int64_t p = page_tokens;
  const int64_t pages = FullPages(slots, page_tokens);
  for (int64_t page = 0; page < pages; ++page) {
    float sum = 0.0f;
    int64_t first = std::numeric_limits<int64_t>::max();
    bool ok = true;
    for (int64_t s = page * p; s < (page + 1) * p; ++s) {
      sum += score[s];
      first = std::min(first, arrival[s]);
      ok = ok && !protect.contains(arrival[s]);
    }
    mean[page] = sum / static_cast<float>(page_tokens);
    oldest[page] = first;
    eligible[page] = ok ? 1 : 0;
  }
}

}  // namespace kvkeep
