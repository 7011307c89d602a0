#include "kernels/accumulate.h"

#include <algorithm>
#include <cmath>
#include <limits>

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

// One row of AccumulateCheckedRows: o[i] = in[i] + p[i] for i < scored,
// 0.0f + p[i] after; the row's sum and minimum go to *sum and *mn. in == o
// (rows after the first add to `out` in place) is fine: each element is read
// before it is written, at the same index.
void AddCheckedRow(const float* p, const float* in, int64_t scored,
                   int64_t slots, float* o, float* sum_out, float* mn_out) {
  float sum = 0.0f;
  float mn = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(+ : sum) reduction(min : mn)
  for (int64_t i = 0; i < scored; ++i) {
    const float v = p[i];
    sum += v;
    mn = v < mn ? v : mn;
    o[i] = in[i] + v;
  }
  for (int64_t i = scored; i < slots; ++i) {
    const float v = p[i];
    sum += v;
    mn = v < mn ? v : mn;
    o[i] = 0.0f + v;
  }
  *sum_out = sum;
  *mn_out = mn;
}

}  // namespace

RowCheck AccumulateCheckedRows(const float* rows, int32_t num_rows,
                               int64_t slots, const float* scores,
                               int64_t scored, float* out) {
  RowCheck check{std::numeric_limits<float>::infinity(),
                 -std::numeric_limits<float>::infinity()};
  for (int32_t r = 0; r < num_rows; ++r) {
    float sum, mn;
    // Row 0 starts from the scores; later rows add to what the earlier ones
    // left in `out` (every slot is then "scored").
    AddCheckedRow(rows + int64_t{r} * slots, r == 0 ? scores : out,
                  r == 0 ? scored : slots, slots, out, &sum, &mn);
    // As CheckRows folds a row: a NaN element makes its sum NaN, and then
    // both fields report NaN; a row's minimum never sees NaN (v < mn is
    // false), so the sum carries it.
    if (std::isnan(sum)) {
      check.min_value = std::numeric_limits<float>::quiet_NaN();
      check.max_row_sum = sum;
    }
    if (!std::isnan(check.max_row_sum)) {
      check.max_row_sum = std::max(check.max_row_sum, sum);
    }
    if (!std::isnan(check.min_value)) {
      check.min_value = std::min(check.min_value, mn);
    }
  }
  return check;
}

void AccumulateScores(std::span<const AccumulateLayer> layers,
                      int32_t query_heads, int32_t kv_heads, int32_t rows) {
  for (const AccumulateLayer& layer : layers) {
    if (layer.slots <= 0 || rows <= 0) continue;
    AccumulateOneLayer(layer, query_heads, kv_heads, rows);
  }
}

}  // namespace kvkeep
