// Score accumulation for one step, all layers at once: the CPU twin of
// kernels/cuda/device_state/accumulate.h. Each layer's attention probabilities
// are summed over query heads and query rows into the layer's per-slot scores
// (h2o's `score[j] += sum over h of attn[h][t][j]`) and, optionally, into
// per-kv-head scores (the sum over the query heads of each GQA group), for the
// per-head token sets that come later. It is the store's one accumulation:
// every policy folds its rows in through it (EvictionPolicy::AccumulateRows),
// or, for head-reduced rows on the decode hot path, through
// AccumulateCheckedRows below, which gives the same sums bit for bit.
// Thread-safe (no shared state); the caller owns every array.
#ifndef KVKEEP_KERNELS_ACCUMULATE_H_
#define KVKEEP_KERNELS_ACCUMULATE_H_

#include <cstdint>
#include <span>

#include "kernels/attention.h"

namespace kvkeep {

// One layer of a step. The same struct describes a layer to the CUDA kernel
// (there every pointer is a device pointer).
struct AccumulateLayer {
  const float* probs = nullptr;     // [query_heads][rows][slots]
  float* scores = nullptr;          // [slots], added to
  float* kv_head_scores = nullptr;  // [kv_heads][slots], added to; may be null
  int64_t slots = 0;                // 0: the layer is skipped
};

// For every layer, every slot s and every kv head g (G = query_heads /
// kv_heads query heads per kv head):
//   scores[s]            += sum over r, h of probs[h][r][s]
//   kv_head_scores[g][s] += sum over r, h in [g*G, (g+1)*G) of probs[h][r][s]
// Summation order, in float32 (the CUDA kernel uses the same order, so the
// two agree bit for bit, and so does summing the heads first with
// ReduceHeads and then the rows with query_heads = 1, as the policies do):
//   for r = 0 .. rows-1:
//     t = probs[0][r][s] + probs[1][r][s] + ...   (left to right over h)
//     scores[s] = scores[s] + t
//   and likewise, per group, with h over the group's heads only.
// Requires query_heads >= 1, kv_heads >= 1, query_heads % kv_heads == 0,
// rows >= 0; probs of a layer with slots > 0 and rows > 0 must be non-null;
// a layer's probs, scores and kv_head_scores must not overlap.
void AccumulateScores(std::span<const AccumulateLayer> layers,
                      int32_t query_heads, int32_t kv_heads, int32_t rows);

// Head-reduced rows checked and accumulated in one pass over them (the
// decode hot path reads each probability once): for every slot s < slots,
//   out[s] = (s < scored ? scores[s] : 0.0f) + rows[0][s] + rows[1][s] + ...
// added left to right, i.e. bit for bit AccumulateScores with query_heads 1
// on scores extended by zeros (the slots an append just added); and, over
// the rows, the smallest element and the largest row sum, as CheckRows
// (kernels/attention.h) reports them. `scores` is only read and `out` only
// written, so a caller whose check fails throws `out` away and its scores are
// as they were.
//   rows: [num_rows][slots], scores: [scored], out: [slots] (overwritten).
// Requires num_rows >= 1, 0 <= scored <= slots; out overlaps neither input.
RowCheck AccumulateCheckedRows(const float* rows, int32_t num_rows,
                               int64_t slots, const float* scores,
                               int64_t scored, float* out);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_ACCUMULATE_H_
