// Query scoring's (kernels/query_attention.cc) key loads and dot products in
// AVX-512: one kv head of a tile of token records widened into floats (the
// same floats kernels/quantize.h's WidenHead gives; f16: the same value, a
// signalling NaN comes back quiet, which no softmax can tell), and the dot
// products of a GQA group's query heads with a tile of keys in 4 x 4 register
// blocks (kernels/fold_lanes.h's order). Compiled for AVX-512 (F, BW, DQ, VL)
// whatever the build's flags: call only where CpuHasAvx512() /
// Avx512Widens() say so (the caller chooses at run time). Thread-safe
// (stateless).
#ifndef KVKEEP_KERNELS_QUERY_AVX512_H_
#define KVKEEP_KERNELS_QUERY_AVX512_H_

#include <cstddef>
#include <cstdint>

#include "kernels/page_layout.h"

namespace kvkeep {

// Whether this CPU runs AVX-512 F/BW/DQ/VL (checked once), and the
// environment does not set KVKEEP_NO_AVX512: with it set, query scoring
// takes the portable path (the tests run it that way too, as `portable.*`).
bool CpuHasAvx512();

// Whether WidenTileAvx512 handles this layout on this CPU: f16 with head_dim
// % 16 == 0; int8, int4 and fp8_e4m3 with group_size % 32 == 0 (so head_dim
// too); kivi_int4 with head_dim % 32 == 0. Other dtypes (f32 and bf16 are
// read in place) and shapes: no.
bool Avx512Widens(const PageLayout& layout);

// tile [count][dp] <- kv head `head` of records[t] (a token's key record;
// kivi_int4: its codes row in its page's key block, pages of `arena`),
// head_dim floats each, then zeros up to dp (dp >= head_dim, a multiple of
// 16); a null record gives a row of zeros.
void WidenTileAvx512(const PageLayout& layout, const std::byte* arena,
                     const std::byte* const* records, int32_t count,
                     int32_t head, int32_t dp, float* tile);

// Where DotsAvx512 reads key t's head_dim elements: in place in the pages
// (f32 or bf16 records; rows[t] = the kv head's first element) or in a tile
// of widened keys [keys][head_dim].
struct KeyRows {
  DType kind = DType::kF32;  // kF32, kBF16: rows; anything else: tile
  const std::byte* const* rows = nullptr;
  const float* tile = nullptr;
};

// dots[j * n + t] = q[j] . key(t) for j < heads, t < count; q [heads][dp],
// dp = head_dim, a multiple of 16. Keys [count, count rounded up to 8) must
// read as zeros (a tile's padding rows, or rows pointing at zeros).
void DotsAvx512(const float* q, int32_t heads, int32_t dp, const KeyRows& keys,
                int32_t count, float* dots, int64_t n);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_QUERY_AVX512_H_
