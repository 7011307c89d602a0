#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/block_primitives.cuh"
#include "kernels/cuda/device_state/selection.h"

namespace kvkeep::cuda {
namespace {

using internal::Align256;
using internal::BitonicSort;
using internal::kFullWarp;
using internal::Pow2Ceil;
using internal::WarpAggregatedAppend;
using internal::WarpAggregatedCount;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kRadixBins = 256;  // 8-bit digits: 8 passes over 64 bits
constexpr uint32_t kNoBin = kRadixBins;
// Slots a thread loads per loop iteration, all issued before any is used:
// one block per layer needs many loads in flight to approach the bandwidth
// of its SM.
constexpr int kBatch = 4;
// Gathered victims up to this many (after padding to a power of two) are
// sorted in shared memory, more in the workspace.
constexpr uint32_t kSharedSortItems = 2048;
// Never a real key: the high half of a real key is a mapped non-NaN float,
// at most Map(+inf) = 0xff800000.
constexpr uint64_t kIneligible = ~uint64_t{0};

// A slot with its rank key. Keys are unique when arrivals are; the slot
// breaks ties anyway so that the order is total whatever the input.
struct RankedSlot {
  uint64_t key;
  int32_t slot;
  __device__ bool operator<(const RankedSlot& o) const {
    return key != o.key ? key < o.key : slot < o.slot;
  }
};

// The rank (score ascending, then arrival ascending) as one unsigned key:
// the score's bits mapped so unsigned order is float order in the high half,
// (arrival - sinks) in the low half. Requires sinks <= arrival < sinks + 2^32.
__device__ inline uint64_t RankKey(float score, int64_t arrival,
                                   int64_t sinks) {
  // The CPU finds -0.0 == 0.0 and breaks the tie by arrival: one bit pattern
  // for both zeros makes the arrival half decide here too. Tested on the bits,
  // so a flush-to-zero build could not fold subnormals into zero.
  uint32_t bits = __float_as_uint(score);
  if ((bits & 0x7fffffffu) == 0) bits = 0;
  // Negative floats order reversed as integers: flip all bits; positive ones
  // go above every negative one: set the sign bit.
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) |
         static_cast<uint32_t>(arrival - sinks);
}

// The rank keys of the slots base + j * blockDim.x + threadIdx.x, j < kBatch
// (kIneligible for a protected slot or one at or past `slots`). Eligible:
// sinks <= arrival < end. Every load is issued before the first key is
// computed.
__device__ inline void LoadKeys(const SelectLayer& layer, int64_t slots,
                                int64_t sinks, int64_t end, int64_t base,
                                uint64_t (&key)[kBatch]) {
  bool in[kBatch];
  int64_t arrival[kBatch];
  float score[kBatch];
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int64_t i = base + j * blockDim.x + threadIdx.x;
    in[j] = i < slots;
    arrival[j] = in[j] ? layer.arrival[i] : 0;
    score[j] = in[j] ? layer.scores[i] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const bool eligible = in[j] && arrival[j] >= sinks && arrival[j] < end;
    key[j] = eligible ? RankKey(score[j], arrival[j], sinks) : kIneligible;
  }
}

// Per-layer workspace: the rank keys of all slots, then room to gather and
// sort the selected ones.
int64_t LayerStrideBytes(int64_t max_slots) {
  return Align256(max_slots * static_cast<int64_t>(sizeof(uint64_t))) +
         Align256(Pow2Ceil(max_slots) *
                  static_cast<int64_t>(sizeof(RankedSlot)));
}

struct LayerWorkspace {
  uint64_t* keys;        // [max_slots]: rank key, kIneligible if protected
  RankedSlot* gathered;  // [Pow2Ceil(max_slots)]
};

__device__ inline LayerWorkspace WorkspaceOf(std::byte* base,
                                             int64_t max_slots) {
  return {
      reinterpret_cast<uint64_t*>(base),
      reinterpret_cast<RankedSlot*>(
          base + Align256(max_slots * static_cast<int64_t>(sizeof(uint64_t))))};
}

// The smallest item over the block; the result is valid in thread 0.
// `warp_best`: shared scratch of kWarps items.
__device__ RankedSlot BlockMin(RankedSlot v, RankedSlot* warp_best) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int d = 16; d > 0; d >>= 1) {
    const RankedSlot o{
        static_cast<uint64_t>(__shfl_down_sync(
            kFullWarp, static_cast<unsigned long long>(v.key), d)),
        __shfl_down_sync(kFullWarp, v.slot, d)};
    if (o < v) v = o;
  }
  if (lane == 0) warp_best[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? warp_best[lane] : RankedSlot{kIneligible, INT_MAX};
    for (int d = 16; d > 0; d >>= 1) {
      const RankedSlot o{
          static_cast<uint64_t>(__shfl_down_sync(
              kFullWarp, static_cast<unsigned long long>(v.key), d)),
          __shfl_down_sync(kFullWarp, v.slot, d)};
      if (o < v) v = o;
    }
  }
  return v;
}

// The radix bucket holding the target-th smallest candidate.
struct Bucket {
  uint32_t target;  // min(wanted, candidates): the rank looked for, 1-based
  uint32_t digit;   // the bucket
  uint32_t below;   // candidates in lower buckets (< target)
  uint32_t count;   // candidates in the bucket (>= target - below)
};

// Run by the 32 threads of warp 0: finds the bucket of the target-th
// candidate of the histogram, target = min(wanted, candidates). Writes
// target 0 when there are no candidates.
__device__ void FindBucket(const uint32_t* hist, uint32_t wanted, Bucket* out) {
  constexpr int kBinsPerLane = kRadixBins / 32;
  const int lane = threadIdx.x & 31;
  uint32_t local = 0;
  for (int j = 0; j < kBinsPerLane; ++j) local += hist[lane * kBinsPerLane + j];
  uint32_t inclusive = local;
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  const uint32_t total = __shfl_sync(kFullWarp, inclusive, 31);
  const uint32_t target = min(wanted, total);
  if (target == 0) {
    if (lane == 0) *out = Bucket{0, 0, 0, 0};
    return;
  }
  // Lanes own disjoint ranges (exclusive, inclusive] of ranks: one holds it.
  uint32_t below = inclusive - local;
  if (below < target && target <= inclusive) {
    for (int j = 0; j < kBinsPerLane; ++j) {
      const uint32_t bin = lane * kBinsPerLane + j;
      const uint32_t c = hist[bin];
      if (target <= below + c) {
        *out = Bucket{target, bin, below, c};
        return;
      }
      below += c;
    }
  }
}

// Selects each layer's victims.
// grid: [num_layers] blocks, one per layer; block: kThreads threads striding
// over the layer's slots. Work per layer: k == 1 is one pass over scores and
// arrivals (a block minimum); otherwise a pass that writes the rank keys, up
// to 7 more radix passes over them (most layers stop after 2-4: a pass ends
// the search once the bucket holds exactly the victims still wanted), a
// gather of the keys <= the threshold found, and a bitonic sort of those.
__global__ void __launch_bounds__(kThreads, 1)
    SelectLowestKernel(const SelectLayer* layers, int64_t sinks, int64_t recent,
                       int64_t max_slots, std::byte* workspace,
                       int64_t layer_stride_bytes) {
  __shared__ uint32_t hist[kRadixBins];
  __shared__ RankedSlot shared_items[kSharedSortItems];
  __shared__ RankedSlot warp_best[kWarps];
  __shared__ Bucket bucket;
  __shared__ uint32_t gathered_count;

  const SelectLayer layer = layers[blockIdx.x];
  // Eligible: sinks <= arrival < end. appended >= 0 and recent >= 0 keep
  // `end` from overflowing; end > sinks >= 0 keeps end - sinks from it.
  const int64_t end = layer.appended - recent;
  if (layer.slots < 0 || layer.slots > max_slots || layer.appended < 0 ||
      (end > sinks && end - sinks > (int64_t{1} << 32))) {
    if (threadIdx.x == 0) *layer.victim_count = kSelectInvalidLayer;
    return;
  }
  const int64_t slots = layer.slots;  // <= max_slots <= INT32_MAX
  const int64_t k = min(layer.k, slots);
  if (k <= 0) {
    if (threadIdx.x == 0) *layer.victim_count = 0;
    return;
  }

  if (k == 1) {  // the decode-step common case: one pass, a block minimum
    RankedSlot best{kIneligible, INT_MAX};
    for (int64_t base = 0; base < slots; base += kBatch * blockDim.x) {
      uint64_t key[kBatch];
      LoadKeys(layer, slots, sinks, end, base, key);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const RankedSlot item{
            key[j], static_cast<int32_t>(base + j * blockDim.x + threadIdx.x)};
        if (key[j] != kIneligible && item < best) best = item;
      }
    }
    best = BlockMin(best, warp_best);
    if (threadIdx.x == 0) {
      const bool found = best.key != kIneligible;
      if (found) layer.victims[0] = best.slot;
      *layer.victim_count = found ? 1 : 0;
    }
    return;
  }

  const LayerWorkspace ws =
      WorkspaceOf(workspace + blockIdx.x * layer_stride_bytes, max_slots);
  for (uint32_t j = threadIdx.x; j < kRadixBins; j += blockDim.x) hist[j] = 0;
  if (threadIdx.x == 0) gathered_count = 0;
  __syncthreads();

  // Radix select of the k-th smallest key, 8 bits a pass from the top.
  // Invariant after each pass: the wanted keys are every key whose top bits
  // (under `mask`) are below `prefix`, plus the k_rem smallest of those whose
  // top bits equal it (the candidates). Every thread runs the same number of
  // iterations of each slot loop (base is uniform), so whole warps reach the
  // warp-aggregated counters. Slot i = base + j * blockDim.x + threadIdx.x.
  uint64_t prefix = 0;
  uint64_t mask = 0;
  uint32_t k_rem = static_cast<uint32_t>(k);
  uint32_t k_eff = 0;  // min(k, eligible), known after pass 0
  for (int pass = 0; pass < 8; ++pass) {
    const int shift = 56 - 8 * pass;
    for (int64_t base = 0; base < slots; base += kBatch * blockDim.x) {
      uint64_t key[kBatch];
      if (pass == 0) {  // computes and stores every slot's key
        LoadKeys(layer, slots, sinks, end, base, key);
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int64_t i = base + j * blockDim.x + threadIdx.x;
          if (i < slots) ws.keys[i] = key[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int64_t i = base + j * blockDim.x + threadIdx.x;
          key[j] = i < slots ? ws.keys[i] : kIneligible;
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        uint32_t bin = kNoBin;
        if (key[j] != kIneligible && (key[j] & mask) == prefix) {
          bin = static_cast<uint32_t>(key[j] >> shift) & (kRadixBins - 1);
        }
        WarpAggregatedCount(hist, bin, kNoBin);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) FindBucket(hist, k_rem, &bucket);
    __syncthreads();
    const Bucket b = bucket;
    if (b.target == 0) break;  // pass 0 only: nothing is eligible
    if (pass == 0) k_eff = b.target;
    k_rem = b.target - b.below;
    prefix |= static_cast<uint64_t>(b.digit) << shift;
    mask |= static_cast<uint64_t>(kRadixBins - 1) << shift;
    for (uint32_t j = threadIdx.x; j < kRadixBins; j += blockDim.x) {
      hist[j] = 0;
    }
    __syncthreads();  // also: everyone has read `bucket` before it changes
    if (b.count == k_rem) break;  // every candidate is wanted
  }
  if (k_eff == 0) {
    if (threadIdx.x == 0) *layer.victim_count = 0;
    return;
  }
  // The wanted keys are exactly those <= threshold (below the prefix range,
  // or inside it when the whole bucket is wanted). Only if two slots share an
  // arrival (outside the contract) can more than k_eff keys qualify; sorting
  // all of them and keeping k_eff stays deterministic and in bounds.
  const uint64_t threshold = prefix | ~mask;

  for (int64_t base = 0; base < slots; base += kBatch * blockDim.x) {
    uint64_t key[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = base + j * blockDim.x + threadIdx.x;
      key[j] = i < slots ? ws.keys[i] : kIneligible;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = base + j * blockDim.x + threadIdx.x;
      const bool take = key[j] != kIneligible && key[j] <= threshold;
      const uint32_t at = WarpAggregatedAppend(&gathered_count, take);
      // at < slots <= Pow2Ceil(max_slots): in bounds.
      if (take) ws.gathered[at] = RankedSlot{key[j], static_cast<int32_t>(i)};
    }
  }
  __syncthreads();
  const uint32_t gathered = gathered_count;  // >= k_eff
  const uint32_t n = static_cast<uint32_t>(Pow2Ceil(gathered));
  RankedSlot* items = n <= kSharedSortItems ? shared_items : ws.gathered;
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (j >= gathered) {
      items[j] = RankedSlot{kIneligible, INT_MAX};  // padding sorts last
    } else if (items != ws.gathered) {
      items[j] = ws.gathered[j];
    }
  }
  __syncthreads();
  BitonicSort(items, n);
  // gathered >= k_eff by the invariant; the min keeps every read in bounds
  // even if it were broken.
  const uint32_t count = min(k_eff, gathered);
  for (uint32_t j = threadIdx.x; j < count; j += blockDim.x) {
    layer.victims[j] = items[j].slot;
  }
  if (threadIdx.x == 0) *layer.victim_count = static_cast<int32_t>(count);
}

}  // namespace

size_t SelectWorkspaceBytes(int32_t num_layers, int64_t max_slots) {
  if (num_layers <= 0 || max_slots <= 0) return 0;
  return static_cast<size_t>(num_layers) *
         static_cast<size_t>(LayerStrideBytes(max_slots));
}

cudaError_t LaunchSelectLowest(const SelectLayer* layers_on_device,
                               int32_t num_layers, int64_t sinks,
                               int64_t recent, int64_t max_slots,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  if (num_layers < 0 || sinks < 0 || recent < 0 || max_slots < 0 ||
      max_slots > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_layers == 0) return cudaSuccess;
  const size_t need = SelectWorkspaceBytes(num_layers, max_slots);
  if (layers_on_device == nullptr || workspace_bytes < need ||
      (need > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  SelectLowestKernel<<<num_layers, kThreads, 0, stream>>>(
      layers_on_device, sinks, recent, max_slots,
      static_cast<std::byte*>(workspace), LayerStrideBytes(max_slots));
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
