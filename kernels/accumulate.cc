#include "kernels/accumulate.h"

#include <algorithm>

namespace kvkeep {
namespace {

// Slots per block: the running sums of one block (two rows of floats) stay in
// L1 while every head's row of that block streams past.
constexpr int64_t kBlockSlots = 256;

// Rows already summed over heads (query_heads == 1, no kv-head scores): the
// documented order is t = p, score = score + t, i.e. score += p row by row.
void AddRows(const AccumulateLayer& layer, int32_t rows) {
  const int64_t n = layer.slots;
  float* __restrict scores = layer.scores;
  for (int32_t r = 0; r < rows; ++r) {
    const float* __restrict p = layer.probs + static_cast<int64_t>(r) * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) scores[i] += p[i];
  }
}

void AccumulateOneLayer(const AccumulateLayer& layer, int32_t query_heads,
                        int32_t kv_heads, int32_t rows) {
  const int64_t n = layer.slots;
  if (query_heads == 1 && layer.kv_head_scores == nullptr) {
    AddRows(layer, rows);
    return;
  }
  const int32_t group = query_heads / kv_heads;
  float total[kBlockSlots];      // sum over the heads seen so far, row r
  float group_sum[kBlockSlots];  // the same over the current group's heads
  for (int64_t first = 0; first < n; first += kBlockSlots) {
    const int64_t len = std::min(kBlockSlots, n - first);
    for (int32_t r = 0; r < rows; ++r) {
      for (int32_t h = 0; h < query_heads; ++h) {
        const float* __restrict p =
            layer.probs + (static_cast<int64_t>(h) * rows + r) * n + first;
        // Left to right over h: t = p0, then t + p1, ... (the documented
        // order; starting from p0 rather than 0 + p0 keeps -0.0 intact, as
        // ReduceHeads does).
        if (h == 0) {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) total[i] = p[i];
        } else {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) total[i] += p[i];
        }
        if (layer.kv_head_scores == nullptr) continue;
        if (h % group == 0) {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) group_sum[i] = p[i];
        } else {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) group_sum[i] += p[i];
        }
        if (h % group == group - 1) {
          float* __restrict kv = layer.kv_head_scores +
                                 static_cast<int64_t>(h / group) * n + first;
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) kv[i] += group_sum[i];
        }
      }
      float* __restrict scores = layer.scores + first;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) scores[i] += total[i];
    }
  }
}

}  // namespace

void AccumulateScores(std::span<const AccumulateLayer> layers,
                      int32_t query_heads, int32_t kv_heads, int32_t rows) {
  for (const AccumulateLayer& layer : layers) {
    if (layer.slots <= 0 || rows <= 0) continue;
    AccumulateOneLayer(layer, query_heads, kv_heads, rows);
  }
}

}  // namespace kvkeep
