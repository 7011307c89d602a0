#include "kernels/widen_avx512.h"

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports the _mm512_undefined_* operands inside its own intrinsics
// as maybe-uninitialized (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define KVKEEP_WIDEN_AVX512 1
#else
#define KVKEEP_WIDEN_AVX512 0
#endif

namespace kvkeep {

#if KVKEEP_WIDEN_AVX512

bool CpuHasAvx512() {
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}

bool Avx512Widens(const PageLayout& layout) {
  if (!CpuHasAvx512()) return false;
  switch (layout.dtype) {
    case DType::kF16:
      return layout.head_dim % 16 == 0;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kFp8E4M3:
      return layout.group_size > 0 && layout.group_size % 32 == 0;
    default:
      return false;
  }
}

// Everything below is compiled for AVX-512 whatever the build's -march; the
// callers above it checked the CPU.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace {

// Groups a head holds at most: head_dim <= 1024 and group_size >= 32.
constexpr int32_t kMaxHeadGroups = 32;

// out[j] = binary16 scale j of the n at `scales` (little-endian), exactly
// (vcvtph2ps converts subnormals exactly); n <= kMaxHeadGroups. Masked loads:
// nothing past the n scales is read.
[[gnu::always_inline]] inline void LoadScales(const uint8_t* scales, int32_t n,
                                              float out[kMaxHeadGroups]) {
  for (int32_t j = 0; j < n; j += 16) {
    const int32_t left = std::min(16, n - j);
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(m, scales + 2 * j);
    _mm512_storeu_ps(out + j, _mm512_cvtph_ps(h));
  }
}

// float(code - zero) * scale for 16 codes in 32-bit lanes (DequantGroup's
// operations, in its order).
[[gnu::always_inline]] inline void StoreDequant(__m512i codes, __m512i zero,
                                                __m512 scale, float* dst) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, zero));
  _mm512_storeu_ps(dst, _mm512_mul_ps(v, scale));
}

// One token record's kv head `head` (head_dim floats) for each dtype.
[[gnu::always_inline]] inline void WidenF16(const PageLayout& lay,
                                            const uint8_t* rec, int32_t head,
                                            float* dst) {
  const auto* src =
      reinterpret_cast<const uint16_t*>(rec) + int64_t{head} * lay.head_dim;
  for (int32_t i = 0; i < lay.head_dim; i += 16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
}

template <DType kType>
[[gnu::always_inline]] inline void WidenQuantized(const PageLayout& lay,
                                                  const uint8_t* rec,
                                                  int32_t head, float* dst) {
  const int32_t d = lay.head_dim;
  const int32_t gs = lay.group_size;
  const int64_t first = int64_t{head} * d;
  const int64_t g0 = first / gs;
  const int32_t groups = d / gs;
  alignas(64) float scale[kMaxHeadGroups];
  LoadScales(rec + lay.scales_offset() + 2 * g0, groups, scale);
  for (int32_t j = 0; j < groups; ++j) {
    const int64_t at = first + int64_t{j} * gs;  // element index in the record
    float* out = dst + j * gs;
    if constexpr (kType == DType::kFp8E4M3) {
      // Code s.eeee.mmm as binary16 bits s.0eeee.mmm0000000 (sign-extend,
      // shift, clear bit 14): the E4M3 value / 2^8, exactly (subnormals
      // included); 2^8 goes into the scale, which is exact too (a power of
      // two). 0x7f / 0xff (E4M3's NaN) become binary16's quiet NaN, which
      // widens to the twin's 0x7fc00000 with the code's sign.
      const __m512 s = _mm512_set1_ps(scale[j] * 256.0f);
      const __m128i low7 = _mm_set1_epi8(0x7f);
      for (int32_t i = 0; i < gs; i += 16) {
        const __m128i b =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + at + i));
        __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
        w = _mm256_and_si256(w,
                             _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
        const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, low7), low7);
        const __m256i qnan = _mm256_or_si256(
            _mm256_and_si256(w,
                             _mm256_set1_epi16(static_cast<int16_t>(0x8000))),
            _mm256_set1_epi16(0x7e00));
        w = _mm256_mask_blend_epi16(nan, w, qnan);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtph_ps(w), s));
      }
    } else {
      const __m512 s = _mm512_set1_ps(scale[j]);
      const __m512i z = _mm512_set1_epi32(rec[lay.zeros_offset() + g0 + j]);
      if constexpr (kType == DType::kInt8) {
        for (int32_t i = 0; i < gs; i += 16) {
          const __m128i b =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + at + i));
          StoreDequant(_mm512_cvtepu8_epi32(b), z, s, out + i);
        }
      } else {  // int4: element 2k in byte k's low nibble, 2k + 1 in its high
        const __m128i nibble = _mm_set1_epi8(0x0f);
        for (int32_t i = 0; i < gs; i += 32) {
          const __m128i b = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(rec + (at + i) / 2));
          const __m128i lo = _mm_and_si128(b, nibble);
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
          StoreDequant(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), z, s,
                       out + i);
          StoreDequant(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), z, s,
                       out + i + 16);
        }
      }
    }
  }
}

template <DType kType>
void WidenRows(const PageLayout& lay, const std::byte* const* records,
               int32_t count, int32_t head, int32_t dp, float* tile) {
  const int32_t d = lay.head_dim;
  for (int32_t t = 0; t < count; ++t) {
    float* dst = tile + int64_t{t} * dp;
    const auto* rec = reinterpret_cast<const uint8_t*>(records[t]);
    if (rec == nullptr) {
      std::fill(dst, dst + dp, 0.0f);
      continue;
    }
    if constexpr (kType == DType::kF16) {
      WidenF16(lay, rec, head, dst);
    } else {
      WidenQuantized<kType>(lay, rec, head, dst);
    }
    std::fill(dst + d, dst + dp, 0.0f);
  }
}

}  // namespace

void WidenTileAvx512(const PageLayout& layout, const std::byte* const* records,
                     int32_t count, int32_t head, int32_t dp, float* tile) {
  switch (layout.dtype) {
    case DType::kF16:
      return WidenRows<DType::kF16>(layout, records, count, head, dp, tile);
    case DType::kInt8:
      return WidenRows<DType::kInt8>(layout, records, count, head, dp, tile);
    case DType::kInt4:
      return WidenRows<DType::kInt4>(layout, records, count, head, dp, tile);
    case DType::kFp8E4M3:
      return WidenRows<DType::kFp8E4M3>(layout, records, count, head, dp, tile);
    default:
      return;
  }
}

#pragma GCC pop_options

#else  // no AVX-512 code in this build

bool CpuHasAvx512() { return false; }
bool Avx512Widens(const PageLayout&) { return false; }
void WidenTileAvx512(const PageLayout&, const std::byte* const*, int32_t,
                     int32_t, int32_t, float*) {}

#endif

}  // namespace kvkeep
