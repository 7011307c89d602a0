// CUDA twins of the sequence-wise kernels: page aggregation for page-level
// eviction (twin: PageScores, kernels/page_scores.h) and SnapKV's 1-D pooling
// (twin: Pool1d, kernels/pooling.h). Same contracts and the same float32
// operation order as the twins, so results agree bit for bit. Stateless;
// thread-safe. Launchers enqueue on the given stream and never synchronise;
// every pointer is a device pointer.
#ifndef KVKEEP_KERNELS_CUDA_DEVICE_STATE_POOLING_H_
#define KVKEEP_KERNELS_CUDA_DEVICE_STATE_POOLING_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/page_scores.h"
#include "kernels/pooling.h"

namespace kvkeep::cuda {

// PageScores of kernels/page_scores.h for one layer:
//   score, arrival: [slots]; mean, oldest, eligible: [slots / page_tokens].
// cudaErrorInvalidValue if page_tokens < 1 or slots < 0; cudaSuccess without
// launching when there is no full page.
cudaError_t LaunchPageScores(const float* score, const int64_t* arrival,
                             int64_t slots, int32_t page_tokens,
                             ProtectedTokens protect, float* mean,
                             int64_t* oldest, uint8_t* eligible,
                             cudaStream_t stream);

// Pool1d of kernels/pooling.h: out[i] = max or count_include_pad average of
// in[i - kernel/2 .. i + kernel/2] (clipped to [0, n)).
//   in, out: [n], must not overlap.
// cudaErrorInvalidValue if kernel < 1 or n < 0; cudaSuccess without launching
// when n == 0.
cudaError_t LaunchPool1d(const float* in, int64_t n, int32_t kernel,
                         Pooling pooling, float* out, cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_DEVICE_STATE_POOLING_H_
