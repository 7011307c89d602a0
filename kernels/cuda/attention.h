// LaunchQueryAttention: query scoring over a layer's paged keys on the GPU,
// the CUDA twin of QueryAttention (kernels/attention.h). Same contract:
//   out[r][s] = sum over query heads h of
//               softmax_s( q[r][h] . K[s][h / group] / sqrt(head_dim) )
// over the slots s with order[s] <= row_order[r] (causal), exactly 0
// elsewhere; a row that sees no slot is all zeros. Keys of any layout dtype
// (quantised ones read as their twins read them, bit for bit), float32
// arithmetic, the softmax shifted by its maximum. The summation order of the
// dot products and of the softmax denominator differs from the twin's, so the
// two agree to float32 rounding, not bit for bit.
// Stateless; thread-safe. The launcher enqueues on the given stream and never
// synchronises.
#ifndef KVKEEP_KERNELS_CUDA_ATTENTION_H_
#define KVKEEP_KERNELS_CUDA_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep::cuda {

// The resident keys of one layer; every pointer is a device pointer.
struct DevicePagedKeys {
  const std::byte* arena = nullptr;  // the page arena (see page_layout.h)
  PageLayout layout;
  const PageId* pages = nullptr;  // [ceil(slots / page_tokens)] block table
  // [slots] causal order (arrival index); null: every slot is visible to
  // every row (the twin's empty order).
  const int64_t* order = nullptr;
  int64_t slots = 0;
};

// Bytes of device workspace LaunchQueryAttention needs for these sizes:
// the logits [rows][query_heads][slots] and two floats of softmax statistics
// per (row, query head). 0 when there is nothing to compute.
size_t QueryAttentionWorkspaceBytes(int32_t rows, int32_t query_heads,
                                    int64_t slots);

// Head dims the kernel is built for (a template constant each).
bool QueryAttentionSupportsHeadDim(int32_t head_dim);

// Enqueues query scoring for `rows` queries:
//   queries: [rows][query_heads][head_dim] float32
//   row_order: [rows], the causal order of each query's token
//   out: [rows][slots] (overwritten)
//   workspace: QueryAttentionWorkspaceBytes(rows, query_heads, keys.slots)
//              bytes, 4-byte aligned, not shared with a concurrent launch.
// cudaErrorInvalidValue for an unsupported head dim or dtype, query_heads not
// a positive multiple of kv_heads, page_tokens < 1, rows or kv_heads above
// 65535 (grid limits), or a null workspace that is needed; cudaSuccess
// without launching when rows or slots is 0.
cudaError_t LaunchQueryAttention(const DevicePagedKeys& keys,
                                 const float* queries, const int64_t* row_order,
                                 int32_t rows, int32_t query_heads, float* out,
                                 void* workspace, cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_ATTENTION_H_
