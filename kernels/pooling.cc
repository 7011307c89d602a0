#include "kernels/pooling.h"

#include <algorithm>
#include <limits>

namespace kvkeep {

void Pool1d(std::span<const float> in, int32_t kernel, Pooling pooling,
            std::span<float> out) {
  const int64_t n = static_cast<int64_t>(in.size());
  const int64_t half = kernel / 2;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = std::max<int64_t>(0, i - half);
    const int64_t hi = std::min<int64_t>(n - 1, i + half);
    if (pooling == Pooling::kMax) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= hi; ++j) m = std::max(m, in[j]);
      out[i] = m;
    } else {
      float sum = 0.0f;
      for (int64_t j = lo; j <= hi; ++j) sum += in[j];
      out[i] = sum / static_cast<float>(kernel);
    }
  }
}

}  // namespace kvkeep
