// Small block-level building blocks shared by the selection, compaction and
// slot-copy kernels: a bitonic sort, an exclusive scan, warp-aggregated
// counters and a vectorised row copy. Device code only (include from .cu
// files). Every function here must be called by all threads of the block,
// with blockDim.x a multiple of 32, unless its comment says otherwise.
#ifndef KVKEEP_KERNELS_CUDA_BLOCK_PRIMITIVES_CUH_
#define KVKEEP_KERNELS_CUDA_BLOCK_PRIMITIVES_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace kvkeep::cuda::internal {

inline constexpr unsigned kFullWarp = 0xffffffffu;

// Smallest power of two >= n (1 for n <= 1). Host and device.
__host__ __device__ inline int64_t Pow2Ceil(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Rounds n up to a multiple of 256 bytes (workspace sub-buffer alignment).
__host__ __device__ inline int64_t Align256(int64_t n) {
  return (n + 255) / 256 * 256;
}

// Sorts items[0, n) ascending by T's operator<, n a power of two. Works on
// shared or global memory: __syncthreads() orders both within a block. The
// comparisons are a fixed network, so the result depends only on the values;
// with a strict total order (no two items equal) it is the unique sorted
// sequence.
template <typename T>
__device__ void BitonicSort(T* items, uint32_t n) {
  for (uint32_t size = 2; size <= n; size <<= 1) {
    for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t j = i ^ stride;
        if (j > i) {
          // Blocks of `size` alternate direction; the last merge (size == n)
          // is ascending because i < n has bit `n` clear.
          const bool ascending = (i & size) == 0;
          if ((items[j] < items[i]) == ascending) {
            const T t = items[i];
            items[i] = items[j];
            items[j] = t;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Exclusive prefix sum of one value per thread, in thread order; *total gets
// the block's sum. `warp_sums` is shared scratch of blockDim.x / 32 entries.
// Ends with a __syncthreads(), so warp_sums may be reused right after.
__device__ inline uint32_t BlockExclusiveScan(uint32_t value,
                                              uint32_t* warp_sums,
                                              uint32_t* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  uint32_t inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    uint32_t s = lane < warps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const uint32_t up = __shfl_up_sync(kFullWarp, s, d);
      if (lane >= d) s += up;
    }
    if (lane < warps) warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const uint32_t warp_base = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();
  return warp_base + inclusive - value;
}

// Adds 1 to counter[bin] for every lane of the warp whose bin != skip, with
// one shared-memory atomic per distinct bin (many equal scores would
// otherwise serialise 32 atomics on one address). All 32 lanes must call.
__device__ inline void WarpAggregatedCount(uint32_t* counter, uint32_t bin,
                                           uint32_t skip) {
  const unsigned peers = __match_any_sync(kFullWarp, bin);
  const int leader = __ffs(peers) - 1;
  const int lane = threadIdx.x & 31;
  if (bin != skip && lane == leader) {
    atomicAdd(&counter[bin], static_cast<uint32_t>(__popc(peers)));
  }
}

// Reserves one slot in a shared append buffer for every lane with `take`;
// returns the lane's index (undefined where !take). All 32 lanes must call.
__device__ inline uint32_t WarpAggregatedAppend(uint32_t* count, bool take) {
  const unsigned takers = __ballot_sync(kFullWarp, take);
  const int lane = threadIdx.x & 31;
  uint32_t base = 0;
  if (takers != 0 && lane == __ffs(takers) - 1) {
    base = atomicAdd(count, static_cast<uint32_t>(__popc(takers)));
  }
  if (takers != 0) base = __shfl_sync(kFullWarp, base, __ffs(takers) - 1);
  return base + __popc(takers & ((1u << lane) - 1u));
}

// Copies `bytes` (a multiple of sizeof(Word)) from src to dst with the
// block's threads, one Word at a time. dst and src must be Word-aligned and
// must not overlap. Needs no particular blockDim and no synchronisation.
template <typename Word>
__device__ inline void BlockCopyRow(std::byte* dst, const std::byte* src,
                                    int64_t bytes) {
  Word* d = reinterpret_cast<Word*>(dst);
  const Word* s = reinterpret_cast<const Word*>(src);
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
}

// The widest copy word (16, 8, 4, 2 or 1 bytes) that divides `bytes` and the
// addresses a, b and c (nullptr: ignored). Host code.
inline int CopyWordBytes(int64_t bytes, const void* a, const void* b,
                         const void* c) {
  const uint64_t bits =
      static_cast<uint64_t>(bytes) | reinterpret_cast<uintptr_t>(a) |
      reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c);
  for (int w : {16, 8, 4, 2}) {
    if (bits % w == 0) return w;
  }
  return 1;
}

// Calls launch(Word{}) with the unsigned type of `word_bytes` bytes (uint4
// for 16): the one place a runtime copy width becomes a template constant.
template <typename Launch>
cudaError_t DispatchCopyWord(int word_bytes, Launch&& launch) {
  switch (word_bytes) {
    case 16:
      return launch(uint4{});
    case 8:
      return launch(uint2{});
    case 4:
      return launch(uint32_t{});
    case 2:
      return launch(uint16_t{});
    case 1:
      return launch(uint8_t{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvkeep::cuda::internal

#endif  // KVKEEP_KERNELS_CUDA_BLOCK_PRIMITIVES_CUH_
