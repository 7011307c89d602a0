#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvkeep {
namespace {

// Sums one row, tracks its minimum, and adds it into `acc` (or copies it when
// `first`). Written for `#pragma omp simd` so it vectorises without
// -ffast-math: the reductions are declared, nothing else is reassociated.
inline void AccumulateRow(const float* __restrict row, int64_t n, bool first,
                          float* __restrict acc, float* sum_out,
                          float* min_out) {
  float sum = 0.0f;
  float mn = std::numeric_limits<float>::infinity();
  if (first) {
#pragma omp simd reduction(+ : sum) reduction(min : mn)
    for (int64_t s = 0; s < n; ++s) {
      const float p = row[s];
      acc[s] = p;
      sum += p;
      mn = p < mn ? p : mn;
    }
  } else {
#pragma omp simd reduction(+ : sum) reduction(min : mn)
    for (int64_t s = 0; s < n; ++s) {
      const float p = row[s];
      acc[s] += p;
      sum += p;
      mn = p < mn ? p : mn;
    }
  }
  *sum_out = sum;
  *min_out = mn;
}

// NaN-propagating fold of one (sum, min) into the check.
inline void Fold(RowCheck& check, float sum, float mn) {
  // A NaN element makes the sum NaN; remember it in both fields.
  if (std::isnan(sum)) {
    check.min_value = std::numeric_limits<float>::quiet_NaN();
    check.max_row_sum = sum;
    return;
  }
  if (!std::isnan(check.max_row_sum)) {
    check.max_row_sum = std::max(check.max_row_sum, sum);
  }
  if (!std::isnan(check.min_value)) {
    check.min_value = std::min(check.min_value, mn);
  }
}

RowCheck EmptyCheck() {
  return RowCheck{std::numeric_limits<float>::infinity(), 0.0f};
}

}  // namespace

RowCheck ReduceHeads(const float* probs, int32_t heads, int32_t rows,
                     int64_t slots, float* out) {
  RowCheck check = EmptyCheck();
  if (heads == 0) std::fill(out, out + static_cast<int64_t>(rows) * slots, 0.f);
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t r = 0; r < rows; ++r) {
      float sum, mn;
      const float* row = probs + (static_cast<int64_t>(h) * rows + r) * slots;
      AccumulateRow(row, slots, h == 0, out + static_cast<int64_t>(r) * slots,
                    &sum, &mn);
      Fold(check, sum, mn);
    }
  }
  return check;
}

RowCheck CheckRows(const float* rows_data, int32_t rows, int64_t slots) {
  RowCheck check = EmptyCheck();
  for (int32_t r = 0; r < rows; ++r) {
    const float* row = rows_data + static_cast<int64_t>(r) * slots;
    float sum = 0.0f;
    float mn = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(+ : sum) reduction(min : mn)
    for (int64_t s = 0; s < slots; ++s) {
      sum += row[s];
      mn = row[s] < mn ? row[s] : mn;
    }
    Fold(check, sum, mn);
  }
  return check;
}

void QueryAttention(const PagedKeys& keys, const float* queries,
                    const int64_t* row_order, int32_t rows, int32_t query_heads,
                    float* out, float* scratch) {
  const PageLayout& lay = keys.layout;
  const int32_t d = lay.head_dim;
  const int32_t group = query_heads / lay.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t n = keys.slots;
  std::vector<float> key(d);
  for (int32_t r = 0; r < rows; ++r) {
    const float* q_row = queries + static_cast<int64_t>(r) * query_heads * d;
    float* logits = scratch;  // [query_heads][n]
    // Logits, one key load per (slot, kv head) shared by its query heads.
    for (int64_t s = 0; s < n; ++s) {
      const bool visible = keys.order[s] <= row_order[r];
      const PageId page = keys.pages[s / lay.page_tokens];
      const std::byte* k_base =
          keys.arena +
          lay.key_offset(page, static_cast<int32_t>(s % lay.page_tokens));
      for (int32_t g = 0; g < lay.kv_heads; ++g) {
        if (visible) {
          for (int32_t i = 0; i < d; ++i) {
            key[i] =
                LoadAsFloat(lay.dtype, k_base, static_cast<int64_t>(g) * d + i);
          }
        }
        for (int32_t j = 0; j < group; ++j) {
          const int32_t h = g * group + j;
          float dot = -std::numeric_limits<float>::infinity();
          if (visible) {
            const float* q = q_row + static_cast<int64_t>(h) * d;
            dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int32_t i = 0; i < d; ++i) dot += q[i] * key[i];
            dot *= scale;
          }
          logits[static_cast<int64_t>(h) * n + s] = dot;
        }
      }
    }
    // Numerically safe softmax per head, summed over heads into out[r].
    float* out_row = out + static_cast<int64_t>(r) * n;
    std::fill(out_row, out_row + n, 0.0f);
    for (int32_t h = 0; h < query_heads; ++h) {
      float* l = logits + static_cast<int64_t>(h) * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n; ++s) mx = std::max(mx, l[s]);
      if (mx == -std::numeric_limits<float>::infinity()) continue;
      float denom = 0.0f;
      for (int64_t s = 0; s < n; ++s) {
        l[s] = std::exp(l[s] - mx);  // exp(-inf) = 0 for masked slots
        denom += l[s];
      }
      const float inv = 1.0f / denom;
      for (int64_t s = 0; s < n; ++s) out_row[s] += l[s] * inv;
    }
  }
}

}  // namespace kvkeep
