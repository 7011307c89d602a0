// CPU twins of the quantisation kernels: quantise appended tokens into the
// token records of a quantised layout, and read any layout's tokens back as
// float values. The format is kernels/quant_format.h; the CUDA twins are in
// kernels/cuda/quantize.h and produce the same bytes. Thread-safe (no shared
// state).
#ifndef KVKEEP_KERNELS_QUANTIZE_H_
#define KVKEEP_KERNELS_QUANTIZE_H_

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep {

// The first group that could not be quantised, if any.
struct QuantizeResult {
  QuantError error = QuantError::kOk;
  int64_t token = 0;    // its token
  int64_t element = 0;  // its first element in [kv_heads * head_dim]
  bool ok() const { return error == QuantError::kOk; }
};

// Quantises n tokens of keys (or values) with `spec`.
//   in:  [n][kv_heads][head_dim] of in_type (f32, f16 or bf16)
//   out: [n][layout.token_bytes()] token records (layout.dtype quantised,
//        or any layout whose group_size and codes match `spec`)
// Stops at the first group with a NaN, an infinity or a value too large for
// a binary16 scale and reports it; `out` then holds garbage, so callers
// quantise into scratch before touching a page.
QuantizeResult QuantizeTokens(const PageLayout& layout, DType in_type,
                              const void* in, int64_t n, std::byte* out);
// The same with an explicit spec (benchmarks compare specs on one layout).
QuantizeResult QuantizeTokensWith(const PageLayout& layout,
                                  const QuantSpec& spec, DType in_type,
                                  const void* in, int64_t n, std::byte* out);

// Reads n stored tokens of `layout` (any dtype) as [n][kv_heads][head_dim]
// of out_type (f32, f16 or bf16): dequantised for a quantised layout,
// converted (round to nearest even) or copied otherwise.
void DequantizeTokens(const PageLayout& layout, const std::byte* in, int64_t n,
                      DType out_type, void* out);
void DequantizeTokensWith(const PageLayout& layout, const QuantSpec& spec,
                          const std::byte* in, int64_t n, DType out_type,
                          void* out);

// Head `head` of one stored token as head_dim float32 values (query
// scoring's key load): dst[i] = element (head * head_dim + i).
void WidenHead(const PageLayout& layout, const std::byte* token, int32_t head,
               float* dst);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_QUANTIZE_H_
