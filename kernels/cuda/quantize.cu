// Quantise and dequantise kernels; the arithmetic is kernels/quant_format.h,
// shared with the CPU twin (kernels/quantize.cc).
#include "kernels/cuda/quantize.h"

namespace kvkeep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

int64_t Blocks(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return b < kMaxBlocks ? b : kMaxBlocks;
}

bool IsFloat(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

// grid: Blocks(n * groups) blocks striding over (token, group) pairs; one
// thread quantises one group with QuantizeGroup, as the twin does.
//   in: [n][kv_heads][head_dim] of in_type; out: [n][token_bytes]
__global__ void __launch_bounds__(kThreads)
    QuantizeKernel(PageLayout layout, QuantSpec spec, DType in_type,
                   const std::byte* in, int64_t n, std::byte* out,
                   unsigned long long* failure) {
  const int64_t groups = layout.groups();
  const int64_t total = n * groups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    const int64_t t = i / groups;
    const int64_t g = i % groups;
    auto* record = reinterpret_cast<uint8_t*>(out + t * layout.token_bytes());
    const int64_t first = g * layout.group_size;
    const int64_t base = t * layout.token_elements() + first;
    auto load = [&](int32_t j) { return LoadAsFloat(in_type, in, base + j); };
    const QuantError e =
        QuantizeGroup(spec, load, layout.group_size, record, first,
                      record + layout.scales_offset() + 2 * g,
                      record + layout.zeros_offset() + g);
    if (e != QuantError::kOk) {
      atomicMin(failure, static_cast<unsigned long long>(i) << 2 |
                             static_cast<unsigned long long>(e));
    }
  }
}

// grid: Blocks(n * elements) blocks striding over elements; one thread
// writes one output element.
//   in: [n][token_bytes]; out: [n][kv_heads][head_dim] of out_type
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(PageLayout layout, DType out_type, const std::byte* in,
                     int64_t n, std::byte* out) {
  const int64_t elements = layout.token_elements();
  const int64_t total = n * elements;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool quantized = IsQuantized(layout.dtype);
  const QuantSpec spec = SpecOf(layout.dtype);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    float v;
    if (quantized) {
      const int64_t t = i / elements;
      const int64_t e = i % elements;
      const auto* record =
          reinterpret_cast<const uint8_t*>(in + t * layout.token_bytes());
      const int64_t g = e / layout.group_size;
      const float scale = LoadScale(record + layout.scales_offset(), g);
      const int32_t zero = spec.fp8          ? 0
                           : spec.asymmetric ? record[layout.zeros_offset() + g]
                                             : spec.fixed_zero();
      v = DequantCode(spec, LoadCode(spec.bits, record, e), scale, zero);
    } else {
      v = LoadAsFloat(layout.dtype, in, i);
    }
    StoreFromFloat(out_type, out, i, v);
  }
}

}  // namespace

cudaError_t LaunchQuantizeTokens(const PageLayout& layout, DType in_type,
                                 const std::byte* in, int64_t n, std::byte* out,
                                 unsigned long long* failure,
                                 cudaStream_t stream) {
  if (!IsQuantized(layout.dtype) || !IsFloat(in_type) || n < 0 ||
      layout.group_size <= 0 || layout.head_dim % layout.group_size != 0 ||
      (layout.dtype == DType::kInt4 && layout.group_size % 2 != 0) ||
      failure == nullptr || (n > 0 && (in == nullptr || out == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (cudaError_t e = cudaMemsetAsync(failure, 0xff, sizeof *failure, stream);
      e != cudaSuccess) {
    return e;
  }
  const int64_t work = n * layout.groups();
  if (work == 0) return cudaSuccess;
  QuantizeKernel<<<static_cast<unsigned>(Blocks(work)), kThreads, 0, stream>>>(
      layout, SpecOf(layout.dtype), in_type, in, n, out, failure);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeTokens(const PageLayout& layout,
                                   const std::byte* in, int64_t n,
                                   DType out_type, std::byte* out,
                                   cudaStream_t stream) {
  if (!IsFloat(out_type) || n < 0 ||
      (IsQuantized(layout.dtype) &&
       (layout.group_size <= 0 || layout.head_dim % layout.group_size != 0)) ||
      (n > 0 && (in == nullptr || out == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int64_t work = n * layout.token_elements();
  if (work == 0) return cudaSuccess;
  if (out_type == layout.dtype) {  // the twin copies too
    return cudaMemcpyAsync(out, in, work * DTypeBytes(out_type),
                           cudaMemcpyDeviceToDevice, stream);
  }
  DequantizeKernel<<<static_cast<unsigned>(Blocks(work)), kThreads, 0,
                     stream>>>(layout, out_type, in, n, out);
  return cudaGetLastError();
}

}  // namespace kvkeep::cuda
