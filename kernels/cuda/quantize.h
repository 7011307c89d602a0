// Quantise-on-write and dequantise-on-read on the device: twins of
// QuantizeTokens / DequantizeTokens (kernels/quantize.h), byte-exact by
// construction: each thread calls the same kernels/quant_format.h functions
// the CPU twin calls (IEEE float32 division, multiply and rintf; integer
// packing), so the GPU tests require equal bytes.
//
// Launchers are stateless and thread-safe; each enqueues on the stream it is
// given, checks the launch and never synchronises. All pointers are device
// pointers.
#ifndef KVKEEP_KERNELS_CUDA_QUANTIZE_H_
#define KVKEEP_KERNELS_CUDA_QUANTIZE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep::cuda {

// No group failed: what *failure holds after LaunchQuantizeTokens.
constexpr unsigned long long kNoQuantFailure = ~0ull;

// Quantises n tokens [n][kv_heads][head_dim] of in_type (f32, f16, bf16)
// into n token records of `layout` (a quantised dtype). *failure is set
// first (on the stream) to kNoQuantFailure, then to the smallest
// (token * groups + group) << 2 | QuantError of the groups that failed, the
// group the twin reports. Records of failed groups are left unwritten.
// cudaErrorInvalidValue for a non-quantised layout, a float in_type that is
// not f32/f16/bf16, a bad group size, negative n or a null pointer.
cudaError_t LaunchQuantizeTokens(const PageLayout& layout, DType in_type,
                                 const std::byte* in, int64_t n, std::byte* out,
                                 unsigned long long* failure,
                                 cudaStream_t stream);

// Reads n stored tokens of `layout` as [n][kv_heads][head_dim] of out_type
// (f32, f16 or bf16), as DequantizeTokens does.
cudaError_t LaunchDequantizeTokens(const PageLayout& layout,
                                   const std::byte* in, int64_t n,
                                   DType out_type, std::byte* out,
                                   cudaStream_t stream);

}  // namespace kvkeep::cuda

#endif  // KVKEEP_KERNELS_CUDA_QUANTIZE_H_
