// CPU reference kernels for turning one step's attention into per-token
// scores. Each has the contract its CUDA twin will have: plain pointers, sizes
// in elements, float32 accumulation, no allocation except where stated.
// Thread-safe (no shared state).
#ifndef KVKEEP_KERNELS_ATTENTION_H_
#define KVKEEP_KERNELS_ATTENTION_H_

#include <cstdint>
#include <span>

#include "kernels/page_layout.h"

namespace kvkeep {

// What ReduceHeads saw, so the caller can reject bad input before using it.
struct RowCheck {
  float min_value = 0;    // smallest element (NaN if any element was NaN)
  float max_row_sum = 0;  // largest sum of one (head, row); NaN/inf if any
};

// out[r][s] = sum over h of probs[h][r][s].
//   probs: [heads][rows][slots], out: [rows][slots] (overwritten).
// Also reports the minimum element and the largest per-(head, row) sum.
RowCheck ReduceHeads(const float* probs, int32_t heads, int32_t rows,
                     int64_t slots, float* out);

// Checks an already-reduced input [rows][slots] the same way: min element and
// largest row sum.
RowCheck CheckRows(const float* rows_data, int32_t rows, int64_t slots);

// The resident keys of one layer, as the query-scoring kernel reads them.
struct PagedKeys {
  const std::byte* arena = nullptr;
  PageLayout layout;
  std::span<const PageId> pages;  // block table: slot s is in pages[s / P]
  // Per slot: causal order (arrival index). Empty: every slot is visible to
  // every row (a decode step's one row, the newest token, sees them all).
  std::span<const int64_t> order;
  int64_t slots = 0;
};

// Query scoring: out[r][s] = sum over query heads h of
//   softmax_s( q[r][h] . K[s][h / group] / sqrt(head_dim) )
// over the slots s with order[s] <= row_order[r] (causal), 0 elsewhere.
//   queries: [rows][query_heads][head_dim] float32
//   row_order: [rows], the causal order of each query's token
//   out: [rows][slots] (overwritten)
//   scratch: at least query_heads * slots + head_dim floats
// query_heads must be a multiple of layout.kv_heads (GQA group size).
// Implemented in kernels/query_attention.cc (blocked, vectorised; 48-59 KiB
// of stack; key loads and dot products in AVX-512 intrinsics where the CPU has
// them, kernels/query_avx512.cc); exp is kernels/fast_exp.h's polynomial
// (within 8.6e-8 relative), the keys are widened bit-identically to WidenHead,
// and the result is within 1e-5 relative of the exact one
// (attention_kernels_test).
void QueryAttention(const PagedKeys& keys, const float* queries,
                    const int64_t* row_order, int32_t rows, int32_t query_heads,
                    float* out, float* scratch);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_ATTENTION_H_
