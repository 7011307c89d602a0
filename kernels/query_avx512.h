// Query scoring's (kernels/query_attention.cc) key loads and dot products in
// AVX-512: one kv head of a tile of token records widened into floats (the
// same floats kernels/quantize.h's WidenHead gives; f16: the same value, a
// signalling NaN comes back quiet, which no softmax can tell), and the dot
// products of a GQA group's query heads with a tile of keys in 4 x 4 register
// blocks (kernels/fold_lanes.h's order), reading f32, bf16, f16, int8, int4
// and fp8 keys from the pages and widening them in registers, or reading a
// widened tile. Compiled for AVX-512 (F, BW, DQ, VL)
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

// Where DotsAvx512 reads key t's head_dim elements: a tile of widened keys
// [keys][head_dim] when `tile` is set; otherwise in place in the pages,
// widened in registers (the same floats WidenTileAvx512 gives):
//   f32, bf16, f16: rows[t] = kv head `head`'s first element of key t;
//   int8, int4, fp8_e4m3 (FusedWidens): rows[t] = key t's whole token
//     record, read through `layout`'s geometry for kv head `head`;
//   kivi_int4 (FusedWidens): rows[t] = key t's codes row in its page's key
//     block, a page of `arena`, or `zeros`.
// A key that must read as zeros points at zero bytes (for a record: at
// least layout->token_bytes() of them; kivi_int4: at `zeros`).
struct KeyRows {
  DType kind = DType::kF32;
  const std::byte* const* rows = nullptr;
  const float* tile = nullptr;
  const PageLayout* layout = nullptr;  // int8, int4, fp8_e4m3, kivi_int4
  int32_t head = 0;
  const std::byte* arena = nullptr;  // kivi_int4: the pages
  const std::byte* zeros = nullptr;  // kivi_int4: rows that read as zeros
};

// Whether DotsAvx512 widens this layout's keys in registers from the
// pages (no tile): f16 with head_dim % 16 == 0; int8, int4 and fp8_e4m3
// where Avx512Widens says so and head_dim <= 512; kivi_int4 where it does
// and head_dim <= 128.
bool FusedWidens(const PageLayout& layout);

// dots[j * n + t] = q[j] . key(t) for j < heads, t < count; q [heads][dp],
// dp = head_dim, a multiple of 16. Keys [count, count rounded up to 8) must
// read as zeros (a tile's padding rows, or rows pointing at zeros).
void DotsAvx512(const float* q, int32_t heads, int32_t dp, const KeyRows& keys,
                int32_t count, float* dots, int64_t n);

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_QUERY_AVX512_H_
