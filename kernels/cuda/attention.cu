// Query scoring in three kernels, all on one stream:
//   1. QueryLogitsKernel: logits[r][h][s] = q[r][h] . K[s][h / G] * scale,
//      -inf where slot s is not visible to row r. One warp per (slot, kv
//      head, row): the warp reads the key once and dots it with every query
//      head of the group.
//   2. SoftmaxStatsKernel: per (r, h) the maximum logit and 1 / sum of
//      exp(logit - max): one block per (r, h).
//   3. SumHeadsKernel: out[r][s] = sum over h of exp(logits - max) / sum,
//      heads left to right as in the twin: one thread per (r, s).
// Workspace: logits [rows][query_heads][slots], then max and inverse
// denominators [rows][query_heads] each, all float32.
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention.h"

namespace kvkeep::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Kernel 1: 8 warps a block, 8 slots a warp.
constexpr int kLogitWarps = 8;
constexpr int kLogitThreads = kLogitWarps * kWarpSize;
constexpr int kSlotsPerBlock = kLogitWarps * 8;
// Kernels 2 and 3.
constexpr int kStatThreads = 256;
constexpr int kSumThreads = 256;

// Element i of an array of kType as float32; bit-identical to dtype.h's
// conversions (f16 -> f32 and bf16 -> f32 are exact, so any correct method
// gives the same float).
template <DType kType>
__device__ __forceinline__ float LoadElement(const std::byte* base, int i) {
  if constexpr (kType == DType::kF32) {
    return reinterpret_cast<const float*>(base)[i];
  } else if constexpr (kType == DType::kF16) {
    return __half2float(
        __ushort_as_half(reinterpret_cast<const unsigned short*>(base)[i]));
  } else {
    return __uint_as_float(
        static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(base)[i])
        << 16);
  }
}

// Element e (of [kv_heads][head_dim]) of one stored token's keys as float32:
// a plain load for f32/f16/bf16, and for a quantised dtype the code times its
// group's scale through kernels/quant_format.h, the functions the CPU twins
// (kernels/quantize.cc, kernels/kivi.cc) call, so the keys scored are
// bit-identical. `token` is the token's key record, or for kivi_int4 its
// codes' row in the key block that starts at `page` (channel e's scale and
// zero point are the block's).
template <DType kType>
__device__ __forceinline__ float LoadKey(const std::byte* page,
                                         const std::byte* token,
                                         const PageLayout& layout, int e) {
  if constexpr (kType == DType::kKiviInt4) {
    constexpr QuantSpec kSpec = SpecOf(DType::kInt4);
    const auto* block = reinterpret_cast<const uint8_t*>(page);
    const float scale = LoadScale(block + layout.key_scales_offset(), e);
    return DequantCode(kSpec,
                       LoadCode(4, reinterpret_cast<const uint8_t*>(token), e),
                       scale, block[layout.key_zeros_offset() + e]);
  } else if constexpr (!IsQuantized(kType)) {
    return LoadElement<kType>(token, e);
  } else {
    constexpr QuantSpec kSpec = SpecOf(kType);
    const auto* record = reinterpret_cast<const uint8_t*>(token);
    const int g = e / layout.group_size;
    const float scale = LoadScale(record + layout.scales_offset(), g);
    int32_t zero = kSpec.fp8 ? 0 : kSpec.fixed_zero();
    if constexpr (kSpec.asymmetric) zero = record[layout.zeros_offset() + g];
    return DequantCode(kSpec, LoadCode(kSpec.bits, record, e), scale, zero);
  }
}

// Sum or max over the 32 lanes of a warp; every lane gets the result. All
// 32 lanes must call it.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}
// The twin's rule, x > m ? x : m, so a NaN never becomes the maximum there
// or here.
__device__ __forceinline__ float MaxOf(float m, float x) {
  return x > m ? x : m;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = MaxOf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Sum (kMax false) or max over the block; every thread gets the result.
// blockDim.x must be a multiple of 32 and at most 1024; `shared` holds 32
// floats. Safe to call repeatedly with the same `shared`.
template <bool kMax>
__device__ float BlockReduce(float v, float* shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = kMax ? WarpMax(v) : WarpSum(v);
  __syncthreads();  // a previous call may still be reading `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / kWarpSize;
  v = lane < warps ? shared[lane] : (kMax ? -INFINITY : 0.0f);
  return kMax ? WarpMax(v) : WarpSum(v);
}

struct LogitsArgs {
  DevicePagedKeys keys;
  const float* queries;      // [rows][query_heads][head_dim]
  const int64_t* row_order;  // [rows]
  int32_t query_heads;
  float* logits;  // [rows][query_heads][slots]
};

// Grid: (x: tiles of kSlotsPerBlock slots, y: row r, z: kv head g).
// Block: kLogitWarps warps. Warp w of block (x, r, g) handles the slots
// s = x * kSlotsPerBlock + w + k * kLogitWarps of its tile; for each it
// writes logits[r][h][s] for the G query heads h = g*G .. g*G+G-1 of kv head
// g. Lane l holds key elements l, l + 32, ... (kPerLane of them; lanes past
// kHeadDim hold none), so one slot's key row (kHeadDim contiguous elements)
// is read coalesced, once per (row, kv head). s is warp-uniform, so the
// visibility branch and the shuffles see all 32 lanes.
//   keys: the arena page for slot s is pages[s / P], token s % P
template <int kHeadDim, DType kType>
__global__ void __launch_bounds__(kLogitThreads)
    QueryLogitsKernel(const LogitsArgs args) {
  constexpr int kPerLane = (kHeadDim + kWarpSize - 1) / kWarpSize;
  const DevicePagedKeys& keys = args.keys;
  const PageLayout& layout = keys.layout;
  const int64_t n = keys.slots;
  const int32_t r = blockIdx.y;
  const int32_t g = blockIdx.z;
  const int32_t group = args.query_heads / layout.kv_heads;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  // As the twin computes it: IEEE sqrt and division (no fast math here).
  const float scale = 1.0f / sqrtf(static_cast<float>(kHeadDim));
  const int64_t limit = args.row_order[r];
  const int64_t first_head = static_cast<int64_t>(r) * args.query_heads +
                             static_cast<int64_t>(g) * group;
  const float* q_group = args.queries + first_head * kHeadDim;
  float* logits_group = args.logits + first_head * n;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSlotsPerBlock;
  const int64_t end = begin + kSlotsPerBlock < n ? begin + kSlotsPerBlock : n;
  for (int64_t s = begin + warp; s < end; s += kLogitWarps) {
    if (keys.order != nullptr && keys.order[s] > limit) {  // -inf, as the twin
      for (int32_t j = lane; j < group; j += kWarpSize) {
        logits_group[static_cast<int64_t>(j) * n + s] = -INFINITY;
      }
      continue;
    }
    const PageId page = keys.pages[s / layout.page_tokens];
    const std::byte* page_start = keys.arena + page * layout.page_bytes();
    const std::byte* token =
        keys.arena +
        layout.key_offset(page, static_cast<int32_t>(s % layout.page_tokens));
    float k[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarpSize;
      k[i] = e < kHeadDim
                 ? LoadKey<kType>(page_start, token, layout, g * kHeadDim + e)
                 : 0.0f;
    }
    for (int32_t j = 0; j < group; ++j) {
      // The G query rows of this (r, g) are shared by every warp of the
      // block and stay in L1.
      const float* q = q_group + static_cast<int64_t>(j) * kHeadDim;
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + i * kWarpSize;
        if (e < kHeadDim) dot += __ldg(q + e) * k[i];
      }
      dot = WarpSum(dot);
      if (lane == 0) {
        logits_group[static_cast<int64_t>(j) * n + s] = dot * scale;
      }
    }
  }
}

// Grid: x = rows * query_heads, one block per logits row (r, h).
// Block: kStatThreads threads, each striding over the slots.
// Writes row_max[r*H + h] = max over s of logits[r][h][s] (-inf when no slot
// is visible) and row_inv[r*H + h] = 1 / sum over s of exp(logit - max) (0
// when no slot is visible). The denominator is at least exp(0) = 1, so the
// inverse is finite.
//   logits: [rows * query_heads][n]
__global__ void __launch_bounds__(kStatThreads)
    SoftmaxStatsKernel(const float* __restrict__ logits, int64_t n,
                       float* __restrict__ row_max,
                       float* __restrict__ row_inv) {
  __shared__ float shared[kWarpSize];
  const int64_t row = blockIdx.x;
  const float* l = logits + row * n;
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) mx = MaxOf(mx, l[s]);
  mx = BlockReduce<true>(mx, shared);
  float denom = 0.0f;
  if (mx != -INFINITY) {  // block-uniform
    for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
      denom += expf(l[s] - mx);  // exp(-inf) = 0 for masked slots
    }
  }
  denom = BlockReduce<false>(denom, shared);
  if (threadIdx.x == 0) {
    row_max[row] = mx;
    row_inv[row] = mx == -INFINITY ? 0.0f : 1.0f / denom;
  }
}

// Grid: (x: tiles of kSumThreads slots, y: row r). Block: kSumThreads.
// Thread t writes out[r][s] for s = x * kSumThreads + t < n: the sum over
// query heads h = 0, 1, ... (the twin's order) of exp(logit - max) * inv,
// skipping heads that see no slot. A slot masked for row r is masked for every
// head, so it gets exactly 0.
//   logits: [rows][query_heads][n]; row_max, row_inv: [rows][query_heads]
//   out: [rows][n]
__global__ void __launch_bounds__(kSumThreads)
    SumHeadsKernel(const float* __restrict__ logits,
                   const float* __restrict__ row_max,
                   const float* __restrict__ row_inv, int64_t n,
                   int32_t query_heads, float* __restrict__ out) {
  const int64_t r = blockIdx.y;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= n) return;
  float acc = 0.0f;
  for (int32_t h = 0; h < query_heads; ++h) {
    const int64_t row = r * query_heads + h;
    const float mx = row_max[row];
    if (mx == -INFINITY) continue;
    acc += expf(logits[row * n + s] - mx) * row_inv[row];
  }
  out[r * n + s] = acc;
}

// The one dispatch helper: calls fn(std::integral_constant<int, D>{}) for a
// supported head dim D, else returns cudaErrorInvalidValue.
template <typename Fn>
cudaError_t WithHeadDim(int32_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 64:
      return fn(std::integral_constant<int, 64>{});
    case 80:
      return fn(std::integral_constant<int, 80>{});
    case 96:
      return fn(std::integral_constant<int, 96>{});
    case 128:
      return fn(std::integral_constant<int, 128>{});
    case 256:
      return fn(std::integral_constant<int, 256>{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <int kHeadDim>
cudaError_t LaunchLogits(const LogitsArgs& args, dim3 grid,
                         cudaStream_t stream) {
  switch (args.keys.layout.dtype) {
    case DType::kF32:
      QueryLogitsKernel<kHeadDim, DType::kF32>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kF16:
      QueryLogitsKernel<kHeadDim, DType::kF16>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kBF16:
      QueryLogitsKernel<kHeadDim, DType::kBF16>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kInt8:
      QueryLogitsKernel<kHeadDim, DType::kInt8>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kFp8E4M3:
      QueryLogitsKernel<kHeadDim, DType::kFp8E4M3>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kInt4:
      QueryLogitsKernel<kHeadDim, DType::kInt4>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
    case DType::kKiviInt4:
      QueryLogitsKernel<kHeadDim, DType::kKiviInt4>
          <<<grid, kLogitThreads, 0, stream>>>(args);
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

size_t LogitsCount(int32_t rows, int32_t query_heads, int64_t slots) {
  return static_cast<size_t>(rows) * static_cast<size_t>(query_heads) *
         static_cast<size_t>(slots);
}

}  // namespace

size_t QueryAttentionWorkspaceBytes(int32_t rows, int32_t query_heads,
                                    int64_t slots) {
  if (rows <= 0 || query_heads <= 0 || slots <= 0) return 0;
  const size_t stats = static_cast<size_t>(rows) * query_heads;
  return sizeof(float) * (LogitsCount(rows, query_heads, slots) + 2 * stats);
}

bool QueryAttentionSupportsHeadDim(int32_t head_dim) {
  return WithHeadDim(head_dim, [](auto) { return cudaSuccess; }) == cudaSuccess;
}

cudaError_t LaunchQueryAttention(const DevicePagedKeys& keys,
                                 const float* queries, const int64_t* row_order,
                                 int32_t rows, int32_t query_heads, float* out,
                                 void* workspace, cudaStream_t stream) {
  const PageLayout& layout = keys.layout;
  if (rows < 0 || rows > 65535 || keys.slots < 0 || layout.page_tokens < 1 ||
      layout.kv_heads < 1 || layout.kv_heads > 65535 ||
      query_heads < layout.kv_heads || query_heads % layout.kv_heads != 0 ||
      !QueryAttentionSupportsHeadDim(layout.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t n = keys.slots;
  if (rows == 0 || n == 0) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  float* logits = static_cast<float*>(workspace);
  const size_t stats = static_cast<size_t>(rows) * query_heads;
  float* row_max = logits + LogitsCount(rows, query_heads, n);
  float* row_inv = row_max + stats;

  const LogitsArgs args{keys, queries, row_order, query_heads, logits};
  const dim3 logits_grid(
      static_cast<unsigned>((n + kSlotsPerBlock - 1) / kSlotsPerBlock),
      static_cast<unsigned>(rows), static_cast<unsigned>(layout.kv_heads));
  cudaError_t err = WithHeadDim(layout.head_dim, [&](auto dim) {
    return LaunchLogits<decltype(dim)::value>(args, logits_grid, stream);
  });
  if (err != cudaSuccess) return err;

  SoftmaxStatsKernel<<<static_cast<unsigned>(stats), kStatThreads, 0, stream>>>(
      logits, n, row_max, row_inv);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  const dim3 sum_grid(
      static_cast<unsigned>((n + kSumThreads - 1) / kSumThreads),
      static_cast<unsigned>(rows));
  SumHeadsKernel<<<sum_grid, kSumThreads, 0, stream>>>(logits, row_max, row_inv,
                                                       n, query_heads, out);
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
