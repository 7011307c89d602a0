#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/kivi.h"
#include "kernels/quantize.h"

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

// The same for four heads' rows at once: acc is read and written once per
// four heads instead of once per head. The additions into acc keep the
// one-head order (acc + p0 + p1 + p2 + p3), so the result is bit-identical.
template <bool kFirst>
void AccumulateRows4(const float* __restrict p0, const float* __restrict p1,
                     const float* __restrict p2, const float* __restrict p3,
                     int64_t n, float* __restrict acc, float sums[4],
                     float mins[4]) {
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float m0 = kInf, m1 = kInf, m2 = kInf, m3 = kInf;
#pragma omp simd reduction(+ : s0, s1, s2, s3) reduction(min : m0, m1, m2, m3)
  for (int64_t s = 0; s < n; ++s) {
    const float a = p0[s], b = p1[s], c = p2[s], d = p3[s];
    float t = a;
    if constexpr (!kFirst) t = acc[s] + a;
    t += b;
    t += c;
    t += d;
    acc[s] = t;
    s0 += a;
    s1 += b;
    s2 += c;
    s3 += d;
    m0 = a < m0 ? a : m0;
    m1 = b < m1 ? b : m1;
    m2 = c < m2 ? c : m2;
    m3 = d < m3 ? d : m3;
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
  mins[0] = m0, mins[1] = m1, mins[2] = m2, mins[3] = m3;
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

// The identity of Fold. An input with no (head, row) reports the struct's
// defaults instead (Finish).
RowCheck EmptyCheck() {
  return RowCheck{std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity()};
}
RowCheck Finish(RowCheck check, int64_t folded) {
  return folded == 0 ? RowCheck{} : check;
}

}  // namespace

RowCheck ReduceHeads(const float* probs, int32_t heads, int32_t rows,
                     int64_t slots, float* out) {
  RowCheck check = EmptyCheck();
  if (heads == 0) std::fill(out, out + static_cast<int64_t>(rows) * slots, 0.f);
  auto row_of = [&](int32_t h, int32_t r) {
    return probs + (static_cast<int64_t>(h) * rows + r) * slots;
  };
  for (int32_t r = 0; r < rows; ++r) {
    float* acc = out + static_cast<int64_t>(r) * slots;
    int32_t h = 0;
    for (; h + 4 <= heads; h += 4) {
      float sums[4], mins[4];
      (h == 0 ? AccumulateRows4<true>
              : AccumulateRows4<false>)(row_of(h, r), row_of(h + 1, r),
                                        row_of(h + 2, r), row_of(h + 3, r),
                                        slots, acc, sums, mins);
      for (int i = 0; i < 4; ++i) Fold(check, sums[i], mins[i]);
    }
    for (; h < heads; ++h) {
      float sum, mn;
      AccumulateRow(row_of(h, r), slots, h == 0, acc, &sum, &mn);
      Fold(check, sum, mn);
    }
  }
  return Finish(check, int64_t{heads} * rows);
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
  return Finish(check, rows);
}

void QueryAttention(const PagedKeys& keys, const float* queries,
                    const int64_t* row_order, int32_t rows, int32_t query_heads,
                    float* out, float* scratch) {
  const PageLayout& lay = keys.layout;
  const int32_t d = lay.head_dim;
  const int32_t group = query_heads / lay.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t n = keys.slots;
  float* key = scratch + static_cast<int64_t>(query_heads) * n;  // [d]
  for (int32_t r = 0; r < rows; ++r) {
    const float* q_row = queries + static_cast<int64_t>(r) * query_heads * d;
    float* logits = scratch;  // [query_heads][n]
    // Logits, one key load per (slot, kv head) shared by its query heads.
    for (int64_t s = 0; s < n; ++s) {
      const bool visible = keys.order.empty() || keys.order[s] <= row_order[r];
      const PageId page = keys.pages[s / lay.page_tokens];
      const std::byte* k_base =
          keys.arena +
          lay.key_offset(page, static_cast<int32_t>(s % lay.page_tokens));
      for (int32_t g = 0; g < lay.kv_heads; ++g) {
        if (visible && IsKivi(lay.dtype)) {  // keys: the page's block
          WidenKiviKeyHead(lay, keys.arena + int64_t{page} * lay.page_bytes(),
                           static_cast<int32_t>(s % lay.page_tokens), g, key);
        } else if (visible) {
          WidenHead(lay, k_base, g, key);
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
#pragma omp simd reduction(max : mx)
      for (int64_t s = 0; s < n; ++s) mx = l[s] > mx ? l[s] : mx;
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
