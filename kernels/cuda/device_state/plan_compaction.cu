#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/block_primitives.cuh"
#include "kernels/cuda/device_state/plan_compaction.h"

namespace kvkeep::cuda {
namespace {

using internal::Align256;
using internal::BitonicSort;
using internal::BlockExclusiveScan;
using internal::Pow2Ceil;

constexpr int kPlanThreads = 256;
// Sorted victims up to this many (padded to a power of two) stay in shared
// memory, more go to the workspace.
constexpr int64_t kSharedPlanItems = 4096;

// Per-layer plan workspace: the sorted victims, then one flag per slot of the
// tail [new_size, slots) (it has exactly victim_count slots).
int64_t PlanStrideBytes(int32_t max_victims) {
  return Align256(Pow2Ceil(max_victims) *
                  static_cast<int64_t>(sizeof(int32_t))) +
         Align256(max_victims);
}

// Plans each layer's moves.
// grid: [num_layers] blocks, one per layer; block: kPlanThreads threads
// striding over the layer's victims. Work is O(v log^2 v) for v victims,
// independent of the layer's size: the holes are the smallest victims, and
// the sources are the tail slots [new_size, slots) that are not victims.
__global__ void __launch_bounds__(kPlanThreads)
    PlanCompactionKernel(const PlanLayer* layers, int32_t max_victims,
                         std::byte* workspace, int64_t layer_stride_bytes) {
  __shared__ int32_t shared_sorted[kSharedPlanItems];
  __shared__ uint32_t warp_sums[kPlanThreads / 32];
  __shared__ int bad;       // a victim outside [0, slots)
  __shared__ int repeated;  // a victim twice

  const PlanLayer layer = layers[blockIdx.x];
  const int32_t v = *layer.victim_count;
  if (v < 0 || v > max_victims || layer.slots < 0 || layer.slots > INT_MAX ||
      v > layer.slots) {
    if (threadIdx.x == 0) *layer.move_count = kPlanInvalidLayer;
    return;
  }
  if (v == 0) {
    if (threadIdx.x == 0) *layer.move_count = 0;
    return;
  }
  const int32_t n = static_cast<int32_t>(layer.slots);
  const int32_t new_size = n - v;
  std::byte* base = workspace + blockIdx.x * layer_stride_bytes;
  const uint32_t p = static_cast<uint32_t>(Pow2Ceil(v));
  int32_t* sorted =
      p <= kSharedPlanItems ? shared_sorted : reinterpret_cast<int32_t*>(base);
  uint8_t* tail_evicted = reinterpret_cast<uint8_t*>(
      base +
      Align256(Pow2Ceil(max_victims) * static_cast<int64_t>(sizeof(int32_t))));

  if (threadIdx.x == 0) {
    bad = 0;
    repeated = 0;
  }
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) tail_evicted[j] = 0;
  __syncthreads();
  for (uint32_t j = threadIdx.x; j < p; j += blockDim.x) {
    int32_t s = INT_MAX;  // padding sorts last
    if (j < static_cast<uint32_t>(v)) {
      s = layer.victims[j];
      if (s < 0 || s >= n) {
        bad = 1;
      } else if (s >= new_size) {
        tail_evicted[s - new_size] = 1;
      }
    }
    sorted[j] = s;
  }
  __syncthreads();
  if (bad) {  // uniform: read after the barrier
    if (threadIdx.x == 0) *layer.move_count = kPlanInvalidLayer;
    return;
  }
  BitonicSort(sorted, p);
  for (int64_t j = threadIdx.x; j + 1 < v; j += blockDim.x) {
    if (sorted[j] == sorted[j + 1]) repeated = 1;
  }
  __syncthreads();
  if (repeated) {
    if (threadIdx.x == 0) *layer.move_count = kPlanInvalidLayer;
    return;
  }
  // The r-th surviving tail slot (ascending) fills the r-th smallest victim:
  // the h surviving tail slots pair with the h victims below new_size, which
  // are the h smallest. r comes from a block-wide scan over the tail flags.
  uint32_t moved = 0;
  for (int64_t chunk = 0; chunk < v; chunk += blockDim.x) {
    const int64_t j = chunk + threadIdx.x;
    const uint32_t is_source = (j < v && tail_evicted[j] == 0) ? 1u : 0u;
    uint32_t chunk_sources = 0;
    const uint32_t r =
        moved + BlockExclusiveScan(is_source, warp_sums, &chunk_sources);
    if (is_source) {
      layer.moves[r] = SlotMove{static_cast<int32_t>(new_size + j), sorted[r]};
    }
    moved += chunk_sources;
  }
  if (threadIdx.x == 0) *layer.move_count = static_cast<int32_t>(moved);
}

}  // namespace

size_t PlanCompactionWorkspaceBytes(int32_t num_layers, int32_t max_victims) {
  if (num_layers <= 0 || max_victims <= 0) return 0;
  return static_cast<size_t>(num_layers) *
         static_cast<size_t>(PlanStrideBytes(max_victims));
}

cudaError_t LaunchPlanCompaction(const PlanLayer* layers_on_device,
                                 int32_t num_layers, int32_t max_victims,
                                 void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (num_layers < 0 || max_victims < 0) return cudaErrorInvalidValue;
  if (num_layers == 0) return cudaSuccess;
  const size_t need = PlanCompactionWorkspaceBytes(num_layers, max_victims);
  if (layers_on_device == nullptr || workspace_bytes < need ||
      (need > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  PlanCompactionKernel<<<num_layers, kPlanThreads, 0, stream>>>(
      layers_on_device, max_victims, static_cast<std::byte*>(workspace),
      PlanStrideBytes(max_victims));
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
