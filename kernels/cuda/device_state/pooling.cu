#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_state/pooling.h"

namespace kvkeep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride beyond

int64_t Blocks(int64_t items) {
  return std::min<int64_t>(kMaxBlocks, (items + kThreads - 1) / kThreads);
}

// Grid: x = blocks over full pages, grid-stride. Block: kThreads threads.
// Thread t handles pages i = t, t + stride, ... < pages, each one alone and
// in the twin's order: sum = 0, then + score[i*P], + score[i*P+1], ...;
// mean = sum / P (IEEE division: no fast math in this build). Min and the
// protected test are order-free.
//   score, arrival: [pages * page_tokens (at least)]
//   mean, oldest, eligible: [pages]
__global__ void PageScoresKernel(const float* __restrict__ score,
                                 const int64_t* __restrict__ arrival,
                                 int64_t pages, int32_t page_tokens,
                                 ProtectedTokens protect,
                                 float* __restrict__ mean,
                                 int64_t* __restrict__ oldest,
                                 uint8_t* __restrict__ eligible) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t page =
           static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       page < pages; page += stride) {
    const int64_t begin = page * page_tokens;
    float sum = 0.0f;
    int64_t first = INT64_MAX;
    bool ok = true;
    for (int64_t s = begin; s < begin + page_tokens; ++s) {
      sum += score[s];
      const int64_t a = arrival[s];
      first = a < first ? a : first;
      ok = ok && !protect.contains(a);
    }
    mean[page] = sum / static_cast<float>(page_tokens);
    oldest[page] = first;
    eligible[page] = ok ? 1 : 0;
  }
}

// Grid: x = blocks over outputs, grid-stride. Block: kThreads threads.
// Thread t writes out[i] for i = t, t + stride, ... < n, reading the window
// in[lo .. hi] left to right as the twin does: max keeps the twin's
// std::max(m, x) rule (m < x ? x : m, so a NaN input is skipped exactly as
// there), average sums from 0 and divides once by `kernel`. Neighbouring
// threads read overlapping windows, which L1 serves.
//   in, out: [n]
__global__ void Pool1dKernel(const float* __restrict__ in, int64_t n,
                             int32_t kernel, Pooling pooling,
                             float* __restrict__ out) {
  const int64_t half = kernel / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const int64_t lo = i - half < 0 ? 0 : i - half;
    const int64_t hi = i + half > n - 1 ? n - 1 : i + half;
    if (pooling == Pooling::kMax) {
      float m = -INFINITY;
      for (int64_t j = lo; j <= hi; ++j) {
        const float x = __ldg(in + j);
        m = m < x ? x : m;
      }
      out[i] = m;
    } else {
      float sum = 0.0f;
      for (int64_t j = lo; j <= hi; ++j) sum += __ldg(in + j);
      out[i] = sum / static_cast<float>(kernel);
    }
  }
}

}  // namespace

cudaError_t LaunchPageScores(const float* score, const int64_t* arrival,
                             int64_t slots, int32_t page_tokens,
                             ProtectedTokens protect, float* mean,
                             int64_t* oldest, uint8_t* eligible,
                             cudaStream_t stream) {
  if (page_tokens < 1 || slots < 0) return cudaErrorInvalidValue;
  const int64_t pages = FullPages(slots, page_tokens);
  if (pages == 0) return cudaSuccess;
  PageScoresKernel<<<static_cast<unsigned>(Blocks(pages)), kThreads, 0,
                     stream>>>(score, arrival, pages, page_tokens, protect,
                               mean, oldest, eligible);
  return cudaGetLastError();
}

cudaError_t LaunchPool1d(const float* in, int64_t n, int32_t kernel,
                         Pooling pooling, float* out, cudaStream_t stream) {
  if (kernel < 1 || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  Pool1dKernel<<<static_cast<unsigned>(Blocks(n)), kThreads, 0, stream>>>(
      in, n, kernel, pooling, out);
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
