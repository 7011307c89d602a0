#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_state/accumulate.h"

namespace kvkeep::cuda {
namespace {

constexpr int kThreads = 256;
// Loads issued before the first of them is used: enough bytes in flight per
// thread to keep HBM busy (8 x 16 B per thread on the vector path).
constexpr int kBatch = 8;
// Grid-stride cap on blocks per layer; beyond it threads loop.
constexpr int64_t kMaxBlocksPerLayer = 4096;

__device__ __forceinline__ float Add(float a, float b) { return a + b; }
__device__ __forceinline__ float4 Add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <typename T>
constexpr int64_t kWidth = sizeof(T) / sizeof(float);

// The AccumulateScores update for element i of a layer seen as an array of T
// (float: one slot; float4: slots 4i .. 4i+3, each lane independent). Every
// lane does exactly the CPU twin's additions in the twin's order:
//   for r: t = p[0][r] + p[1][r] + ... ; score = score + t
//   for r, g: kv[g] = kv[g] + (p[g*G][r] + ... + p[g*G+G-1][r])
// Only additions, so no FMA contraction can change a result.
template <typename T>
__device__ __forceinline__ void AccumulateElement(const AccumulateLayer& layer,
                                                  int64_t i,
                                                  int32_t query_heads,
                                                  int32_t group, int32_t rows) {
  const int64_t n = layer.slots / kWidth<T>;  // exact on the vector path
  const T* probs = reinterpret_cast<const T*>(layer.probs);
  T* scores = reinterpret_cast<T*>(layer.scores);
  T* kv = reinterpret_cast<T*>(layer.kv_head_scores);
  T score = scores[i];
  for (int32_t r = 0; r < rows; ++r) {
    T total{};
    T group_sum{};
    for (int32_t h0 = 0; h0 < query_heads; h0 += kBatch) {
      // Issue the batch's loads before using any: they are independent, and
      // the probabilities are read exactly once (streaming, evict-first).
      T p[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (h0 + b < query_heads) {
          p[b] =
              __ldcs(probs + (static_cast<int64_t>(h0 + b) * rows + r) * n + i);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int32_t h = h0 + b;
        if (h >= query_heads) break;
        total = h == 0 ? p[b] : Add(total, p[b]);
        if (kv != nullptr) {
          group_sum = h % group == 0 ? p[b] : Add(group_sum, p[b]);
          if (h % group == group - 1) {
            T* dst = kv + static_cast<int64_t>(h / group) * n + i;
            *dst = Add(*dst, group_sum);
          }
        }
      }
    }
    score = Add(score, total);
  }
  scores[i] = score;
}

__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Grid: (x: blocks over one layer's slots, grid-stride; y: layer).
// Block: kThreads threads. Thread x of layer y owns whole slots: either the
// float4 chunks c = x, x + stride, ... (slots 4c .. 4c+3) when the layer's
// arrays allow 16-byte loads (slots % 4 == 0 and every base 16-byte aligned),
// or single slots s = x, x + stride, ... otherwise. Each slot is owned by
// exactly one thread, so no atomics: each thread reads its slots' probs
// [query_heads][rows] (coalesced: neighbouring threads read neighbouring
// slots of the same (h, r) row) and read-modify-writes its scores.
//   layers: [gridDim.y] AccumulateLayer (device pointers)
__global__ void AccumulateKernel(const AccumulateLayer* __restrict__ layers,
                                 int32_t query_heads, int32_t kv_heads,
                                 int32_t rows) {
  const AccumulateLayer layer = layers[blockIdx.y];
  if (layer.slots <= 0) return;
  const int32_t group = query_heads / kv_heads;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vector =
      layer.slots % 4 == 0 && Aligned16(layer.probs) &&
      Aligned16(layer.scores) &&
      (layer.kv_head_scores == nullptr || Aligned16(layer.kv_head_scores));
  if (vector) {
    const int64_t chunks = layer.slots / 4;
    for (int64_t c = first; c < chunks; c += stride) {
      AccumulateElement<float4>(layer, c, query_heads, group, rows);
    }
  } else {
    for (int64_t s = first; s < layer.slots; s += stride) {
      AccumulateElement<float>(layer, s, query_heads, group, rows);
    }
  }
}

}  // namespace

cudaError_t LaunchAccumulate(const AccumulateLayer* layers_on_device,
                             int32_t num_layers, int32_t query_heads,
                             int32_t kv_heads, int32_t rows, int64_t max_slots,
                             cudaStream_t stream) {
  if (query_heads < 1 || kv_heads < 1 || query_heads % kv_heads != 0 ||
      num_layers < 0 || num_layers > 65535 || rows < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_layers == 0 || rows == 0 || max_slots <= 0) return cudaSuccess;
  if (layers_on_device == nullptr) return cudaErrorInvalidValue;
  // Size the grid for the vector path (4 slots a thread); the scalar path
  // loops more, which is still correct.
  const int64_t per_thread = (max_slots + 3) / 4;
  const int64_t blocks = std::min<int64_t>(
      kMaxBlocksPerLayer, (per_thread + kThreads - 1) / kThreads);
  const dim3 grid(static_cast<unsigned>(blocks),
                  static_cast<unsigned>(num_layers));
  AccumulateKernel<<<grid, kThreads, 0, stream>>>(layers_on_device, query_heads,
                                                  kv_heads, rows);
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
