// Key widening for query scoring (kernels/query_attention.cc) in AVX-512
// intrinsics: one kv head of a tile of token records, dequantised into
// floats, the same floats kernels/quantize.h's WidenHead gives (f16: the
// same value; a signalling NaN comes back quiet, which no softmax can tell).
// The functions are compiled for AVX-512 (F, BW, DQ, VL) whatever the build's
// flags and must be called only where Avx512Widens() says they apply: the
// caller chooses at run time. Thread-safe (stateless).
#ifndef KVKEEP_KERNELS_WIDEN_AVX512_H_
#define KVKEEP_KERNELS_WIDEN_AVX512_H_

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep {

// Whether this CPU runs AVX-512 F/BW/DQ/VL (checked once).
bool CpuHasAvx512();

// Whether WidenTileAvx512 handles this layout on this CPU: f16 with head_dim
// % 16 == 0; int8, int4 and fp8_e4m3 with group_size % 32 == 0 (so head_dim
// too). Other dtypes (f32, bf16 and kivi_int4 have loads of their own) and
// shapes: no.
bool Avx512Widens(const PageLayout& layout);

// tile [count][dp] <- kv head `head` of records[t] (a token's key record),
// head_dim floats each, then zeros up to dp (dp >= head_dim, a multiple of
// 16); a null record gives a row of zeros.
void WidenTileAvx512(const PageLayout& layout, const std::byte* const* records,
                     int32_t count, int32_t head, int32_t dp, float* tile);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_WIDEN_AVX512_H_
