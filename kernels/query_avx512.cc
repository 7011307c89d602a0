#include "kernels/query_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/fold_lanes.h"

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
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") &&
                          std::getenv("KVKEEP_NO_AVX512") == nullptr;
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
    case DType::kKiviInt4:
      return layout.head_dim % 32 == 0;
    default:
      return false;
  }
}

bool FusedWidens(const PageLayout& layout) {
  switch (layout.dtype) {
    case DType::kF16:
      return Avx512Widens(layout);
    case DType::kInt8:
    case DType::kInt4:
    case DType::kFp8E4M3:  // a head's metadata in one vector per key
      return Avx512Widens(layout) && layout.head_dim <= 512;
    case DType::kKiviInt4:  // a page's channels in a stack table
      return Avx512Widens(layout) && layout.head_dim <= 128;
    default:
      return false;
  }
}

// Everything below is compiled for AVX-512 whatever the build's -march; the
// callers above it checked the CPU.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace {

// Zero points 0 <= zero < 2^8 in 32-bit lanes as the floats 2^23 + zero
// (2^23's bits in the high bits), for Dequant.
[[gnu::always_inline]] inline __m512 Biased(__m512i zero) {
  return _mm512_castsi512_ps(
      _mm512_or_si512(zero, _mm512_set1_epi32(0x4b000000)));
}

// float(code - zero) * scale for 16 codes in 32-bit lanes (DequantGroup's
// operations, in its order), `biased` = Biased(zero). code - zero without a
// conversion (which only the FMA port runs, next to the dot products'
// FMAs): (2^23 + code) - (2^23 + zero) is exact, +0 for equal ones: the
// bits of float(code - zero).
[[gnu::always_inline]] inline __m512 Dequant(__m512i codes, __m512 biased,
                                             __m512 scale) {
  return _mm512_mul_ps(_mm512_sub_ps(Biased(codes), biased), scale);
}

// int4: 32 elements from 16 bytes (element 2k in byte k's low nibble, 2k + 1
// in its high one), dequantised into out[0] (elements 0-15, with zero[0]
// and scale[0]) and out[1] (16-31, zero[1], scale[1]).
[[gnu::always_inline]] inline void DequantInt4(const uint8_t* codes,
                                               const __m512* zero,
                                               const __m512* scale,
                                               __m512* out) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_and_si128(b, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  out[0] = Dequant(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), zero[0],
                   scale[0]);
  out[1] = Dequant(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), zero[1],
                   scale[1]);
}

// fp8_e4m3: 16 codes times `scale256` (the group's scale times 2^8). Code
// s.eeee.mmm as binary16 bits s.0eeee.mmm0000000 (sign-extend, shift, clear
// bit 14): the E4M3 value / 2^8, exactly (subnormals included); 2^8 is in
// the scale, which is exact too (a power of two). 0x7f / 0xff (E4M3's NaN)
// become binary16's quiet NaN, which widens to the twin's 0x7fc00000 with
// the code's sign.
[[gnu::always_inline]] inline __m512 DequantFp8(const uint8_t* codes,
                                                __m512 scale256) {
  const __m128i low7 = _mm_set1_epi8(0x7f);
  const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xbfff));
  const __m256i qnan = _mm256_set1_epi16(0x7e00);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
  w = _mm256_and_si256(w, keep);
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, low7), low7);
  // (w & sign) | qnan: truth table 0xea over (w, sign, qnan).
  w = _mm256_mask_blend_epi16(nan, w,
                              _mm256_ternarylogic_epi32(w, sign, qnan, 0xea));
  return _mm512_mul_ps(_mm512_cvtph_ps(w), scale256);
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

// Where kv head `head`'s parts lie in a quantised token record, computed
// once per tile (the layout's offsets divide).
struct HeadGeometry {
  int64_t codes_at;   // byte of the head's first code
  int64_t scales_at;  // byte of its first group's scale
  int64_t zeros_at;   // byte of its first group's zero point
  int32_t groups;     // groups in the head
  int32_t group_size;
};

HeadGeometry GeometryOf(const PageLayout& lay, int32_t head) {
  const int64_t first = int64_t{head} * lay.head_dim;
  const int64_t g0 = first / lay.group_size;
  return HeadGeometry{lay.dtype == DType::kInt4 ? first / 2 : first,
                      lay.scales_offset() + 2 * g0, lay.zeros_offset() + g0,
                      lay.head_dim / lay.group_size, lay.group_size};
}

template <DType kType>
[[gnu::always_inline]] inline void WidenQuantized(const HeadGeometry& geo,
                                                  const uint8_t* rec,
                                                  float* dst) {
  const int32_t gs = geo.group_size;
  const uint8_t* codes = rec + geo.codes_at;
  // Up to 16 groups' scales (and zero points) in one register each, a
  // group's broadcast by a permute: read back from a stack array, each
  // scalar load waited on the 64-byte store before it (no forwarding).
  __m512 scales = _mm512_setzero_ps();
  __m512i zeros = _mm512_setzero_si512();
  for (int32_t j = 0; j < geo.groups; ++j) {
    if (j % 16 == 0) {
      const int32_t left = std::min(16, geo.groups - j);
      const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
      scales = _mm512_cvtph_ps(
          _mm256_maskz_loadu_epi16(m, rec + geo.scales_at + 2 * j));
      if constexpr (kType != DType::kFp8E4M3) {
        zeros = _mm512_cvtepu8_epi32(
            _mm_maskz_loadu_epi8(m, rec + geo.zeros_at + j));
      }
    }
    const __m512i lane = _mm512_set1_epi32(j % 16);
    const __m512 scale = _mm512_permutexvar_ps(lane, scales);
    float* out = dst + j * gs;
    if constexpr (kType == DType::kFp8E4M3) {
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(256.0f));
      for (int32_t i = 0; i < gs; i += 16) {
        _mm512_storeu_ps(out + i, DequantFp8(codes + j * gs + i, s));
      }
    } else {
      const __m512 z = Biased(_mm512_permutexvar_epi32(lane, zeros));
      if constexpr (kType == DType::kInt8) {
        for (int32_t i = 0; i < gs; i += 16) {
          const __m128i b = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(codes + j * gs + i));
          _mm512_storeu_ps(out + i, Dequant(_mm512_cvtepu8_epi32(b), z, scale));
        }
      } else {
        for (int32_t i = 0; i < gs; i += 32) {
          __m512 v[2];
          const __m512 zz[2] = {z, z}, ss[2] = {scale, scale};
          DequantInt4(codes + (j * gs + i) / 2, zz, ss, v);
          _mm512_storeu_ps(out + i, v[0]);
          _mm512_storeu_ps(out + i + 16, v[1]);
        }
      }
    }
  }
}

// kivi_int4: a page's per-channel scales and zero points (Biased) of 16
// channels from `c` of its key block as floats.
[[gnu::always_inline]] inline void KiviChannels(const PageLayout& lay,
                                                const uint8_t* block, int64_t c,
                                                __m512* scale, __m512* zero) {
  *scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      block + lay.key_scales_offset() + 2 * c)));
  *zero = Biased(_mm512_cvtepu8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(block + lay.key_zeros_offset() + c))));
}

// kivi_int4: `row` is slot's codes row in its page's key block (`block`);
// key c reads (code(c) - zero(c)) * scale(c) with the page's per-channel
// scales and zeros (kernels/kivi.h's KeyAt, the same operations).
[[gnu::always_inline]] inline void WidenKivi(const PageLayout& lay,
                                             const uint8_t* block,
                                             const uint8_t* row, int32_t head,
                                             float* dst) {
  const int64_t first = int64_t{head} * lay.head_dim;
  for (int32_t i = 0; i < lay.head_dim; i += 32) {
    __m512 s[2], z[2], v[2];
    KiviChannels(lay, block, first + i, &s[0], &z[0]);
    KiviChannels(lay, block, first + i + 16, &s[1], &z[1]);
    DequantInt4(row + (first + i) / 2, z, s, v);
    _mm512_storeu_ps(dst + i, v[0]);
    _mm512_storeu_ps(dst + i + 16, v[1]);
  }
}

template <DType kType>
void WidenRows(const PageLayout& lay, const std::byte* arena,
               const std::byte* const* records, int32_t count, int32_t head,
               int32_t dp, float* tile) {
  const int32_t d = lay.head_dim;
  HeadGeometry geo{};
  if constexpr (kType != DType::kF16 && kType != DType::kKiviInt4) {
    geo = GeometryOf(lay, head);
  }
  for (int32_t t = 0; t < count; ++t) {
    float* dst = tile + int64_t{t} * dp;
    const auto* rec = reinterpret_cast<const uint8_t*>(records[t]);
    if (rec == nullptr) {
      std::fill(dst, dst + dp, 0.0f);
      continue;
    }
    if constexpr (kType == DType::kF16) {
      WidenF16(lay, rec, head, dst);
    } else if constexpr (kType == DType::kKiviInt4) {
      const int64_t at = records[t] - arena;
      const int64_t page = at / lay.page_bytes();
      WidenKivi(
          lay,
          reinterpret_cast<const uint8_t*>(arena) + page * lay.page_bytes(),
          rec, head, dst);
    } else {
      WidenQuantized<kType>(geo, rec, dst);
    }
    std::fill(dst + d, dst + dp, 0.0f);
  }
}

using query_dots::FoldLanes;
using query_dots::LoadVec;
using query_dots::Vec;

// Key loaders for the register blocks: elements [i, i + kStep) of key t
// into k[0 .. kStep / 16).
struct TileLoad {
  static constexpr int kStep = 16;
  const float* tile;
  int32_t dp;
  void Prefetch(int32_t, int32_t) const {}  // written just now: in L1
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    LoadVec(k, tile + int64_t{t} * dp + i);
  }
};

struct F32Load {
  static constexpr int kStep = 16;
  const std::byte* const* rows;
  [[gnu::always_inline]] void Prefetch(int32_t t, int32_t i) const {
    _mm_prefetch(reinterpret_cast<const char*>(
                     reinterpret_cast<const float*>(rows[t]) + i),
                 _MM_HINT_T0);
  }
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    LoadVec(k, reinterpret_cast<const float*>(rows[t]) + i);
  }
};

// bf16 and f16: 16 bits per element, one line holds 32 of them.
struct HalfPrefetch {
  const std::byte* const* rows;
  [[gnu::always_inline]] void Prefetch(int32_t t, int32_t i) const {
    if (i % 32 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(
                       reinterpret_cast<const uint16_t*>(rows[t]) + i),
                   _MM_HINT_T0);
    }
  }
  [[gnu::always_inline]] __m256i Bits(int32_t t, int32_t i) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        reinterpret_cast<const uint16_t*>(rows[t]) + i));
  }
};

// The 16 bits: the high half of a float. One word permute (word k to word
// 2k + 1, zeros between) rather than a widening and a shift, which only the
// FMA port runs.
struct Bf16Load : HalfPrefetch {
  static constexpr int kStep = 16;
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    const __m512i to_high =
        _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                         7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    *k = (Vec)_mm512_maskz_permutexvar_epi16(
        0xaaaaaaaau, to_high, _mm512_castsi256_si512(Bits(t, i)));
  }
};

struct F16Load : HalfPrefetch {  // WidenF16's conversion
  static constexpr int kStep = 16;
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    *k = (Vec)_mm512_cvtph_ps(Bits(t, i));
  }
};

// Per key of a run of keys, for each 32 elements of its kv head, the group
// scale (fp8_e4m3: times 2^8) and zero point (Biased) as floats, for
// QuantLoad's broadcasts: up to 16 chunks (head_dim <= 512).
constexpr int32_t kMetaKeys = 64;
struct GroupMeta {
  alignas(64) float scale[kMetaKeys + 8][16];
  alignas(64) float zero[kMetaKeys + 8][16];
};

template <DType kType>
void FillMeta(const HeadGeometry& geo, const std::byte* const* rows,
              int32_t count, GroupMeta* meta) {
  const __mmask16 m = static_cast<__mmask16>((1u << geo.groups) - 1);
  // Chunk c (elements 32c ..) is in group 32c / group_size.
  alignas(64) int32_t group_of[16];
  for (int32_t c = 0; c < 16; ++c) {
    group_of[c] = std::min(c * 32 / geo.group_size, 15);
  }
  const __m512i chunk_group = _mm512_load_si512(group_of);
  for (int32_t t = 0; t < count; ++t) {
    const auto* rec = reinterpret_cast<const uint8_t*>(rows[t]);
    __m512 s =
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, rec + geo.scales_at));
    if constexpr (kType == DType::kFp8E4M3) {
      s = _mm512_mul_ps(s, _mm512_set1_ps(256.0f));
    } else {
      const __m512 z = Biased(
          _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, rec + geo.zeros_at)));
      _mm512_store_ps(meta->zero[t], _mm512_permutexvar_ps(chunk_group, z));
    }
    _mm512_store_ps(meta->scale[t], _mm512_permutexvar_ps(chunk_group, s));
  }
}

// int8, int4, fp8_e4m3 records widened in registers, 32 elements (one
// group, or part of one) at a time: WidenQuantized's operations, the
// group's scale and zero point broadcast from `meta` (key t: meta row t,
// chunk i / 32).
template <DType kType>
struct QuantLoad {
  static constexpr int kStep = 32;
  const std::byte* const* rows;
  HeadGeometry geo;
  const GroupMeta* meta;
  void Prefetch(int32_t, int32_t) const {}  // RowLogits prefetches records
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    const auto* rec = reinterpret_cast<const uint8_t*>(rows[t]);
    const int32_t j = i / 32;  // meta's chunk
    const __m512 scale = _mm512_set1_ps(meta->scale[t][j]);
    const uint8_t* codes = rec + geo.codes_at;
    __m512 v[2];
    if constexpr (kType == DType::kFp8E4M3) {
      v[0] = DequantFp8(codes + i, scale);
      v[1] = DequantFp8(codes + i + 16, scale);
    } else {
      const __m512 z = _mm512_set1_ps(meta->zero[t][j]);
      if constexpr (kType == DType::kInt8) {
        for (int h = 0; h < 2; ++h) {
          const __m128i b = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(codes + i + 16 * h));
          v[h] = Dequant(_mm512_cvtepu8_epi32(b), z, scale);
        }
      } else {
        const __m512 zz[2] = {z, z}, ss[2] = {scale, scale};
        DequantInt4(codes + i / 2, zz, ss, v);
      }
    }
    k[0] = (Vec)v[0];
    k[1] = (Vec)v[1];
  }
};

// kivi_int4 keys widened in registers: per run of keys, each distinct key
// block's (page's) scales and zero points of kv head `head` as floats
// (KiviChannels), slot 0 zeros for the rows that read as zeros; key t reads
// its page's through slot[t].
constexpr int32_t kKiviRun = 32;      // keys per run (whole 8s)
constexpr int32_t kKiviSlots = 10;    // distinct pages per run, zeros too
constexpr int32_t kKiviMaxDim = 128;  // head_dim the stack tables hold
struct KiviMeta {
  alignas(64) float scale[kKiviSlots][kKiviMaxDim];
  alignas(64) float zero[kKiviSlots][kKiviMaxDim];
  uint8_t slot[kKiviRun];
};

struct KiviLoad {
  static constexpr int kStep = 32;
  const std::byte* const* rows;
  int64_t first;  // the kv head's first channel
  const KiviMeta* meta;
  void Prefetch(int32_t, int32_t) const {}  // RowLogits prefetches records
  [[gnu::always_inline]] void operator()(int32_t t, int32_t i, Vec* k) const {
    const int32_t m = meta->slot[t];
    __m512 s[2], z[2], v[2];
    for (int h = 0; h < 2; ++h) {
      s[h] = _mm512_load_ps(meta->scale[m] + i + 16 * h);
      z[h] = _mm512_load_ps(meta->zero[m] + i + 16 * h);
    }
    DequantInt4(reinterpret_cast<const uint8_t*>(rows[t]) + (first + i) / 2, z,
                s, v);
    k[0] = (Vec)v[0];
    k[1] = (Vec)v[1];
  }
};

// Keys from t0 into meta's slots, as many whole 8-key groups as fit (at
// least one, up to kKiviRun keys); returns the keys taken. The keys up to
// count rounded up to 8 must be readable (zeros or real ones).
int32_t FillKiviMeta(const KeyRows& keys, int32_t t0, int32_t count,
                     KiviMeta* meta) {
  const PageLayout& lay = *keys.layout;
  const int32_t d = lay.head_dim;
  const int64_t first = int64_t{keys.head} * d;
  const std::byte* block[kKiviSlots] = {nullptr};  // slot 0: zeros
  std::fill_n(meta->scale[0], d, 0.0f);
  std::fill_n(meta->zero[0], d, 8388608.0f);  // Biased(0) = 2^23
  int32_t slots = 1, taken = 0;
  while (taken < kKiviRun && t0 + taken < count) {
    // The group's keys into slots, or no change at all if they do not fit.
    int32_t trial = slots;
    bool fits = true;
    uint8_t slot[8];
    for (int32_t t = 0; t < 8 && fits; ++t) {
      const std::byte* row = keys.rows[t0 + taken + t];
      const std::byte* b = nullptr;
      if (row != keys.zeros) {
        const int64_t page = (row - keys.arena) / lay.page_bytes();
        b = keys.arena + page * lay.page_bytes();
      }
      int32_t m = 0;
      while (m < trial && block[m] != b) ++m;
      if (m == trial) {
        fits = trial < kKiviSlots;
        if (fits) block[trial++] = b;
      }
      slot[t] = static_cast<uint8_t>(m);
    }
    if (!fits) break;  // the run ends before this group
    for (int32_t m = slots; m < trial; ++m) {
      for (int32_t c = 0; c < d; c += 16) {
        __m512 sv, zv;
        KiviChannels(lay, reinterpret_cast<const uint8_t*>(block[m]), first + c,
                     &sv, &zv);
        _mm512_store_ps(meta->scale[m] + c, sv);
        _mm512_store_ps(meta->zero[m] + c, zv);
      }
    }
    slots = trial;
    std::copy_n(slot, 8, meta->slot + taken);
    taken += 8;
  }
  return taken;
}

// out[j * kKeys + t] = q[j] . key(t0 + t) for kHeads rows of q [..][dp]:
// kHeads * kKeys accumulators (8 or 16), each key vector loaded once for the
// kHeads query heads, each query vector once for the kKeys keys. Each
// accumulator takes its 16-element chunks in order whatever the loader's
// step, so every loader gives the same sums for the same floats.
template <int kHeads, int kKeys, class Load>
[[gnu::always_inline]] inline void Block(const float* q, int32_t dp,
                                         const Load& load, int32_t t0,
                                         bool next, float* out) {
  constexpr int kAcc = kHeads * kKeys;
  constexpr int kSub = Load::kStep / 16;
  Vec acc[kAcc];
#pragma GCC unroll 16
  for (int m = 0; m < kAcc; ++m) acc[m] = Vec{};
  for (int32_t i = 0; i < dp; i += Load::kStep) {
    Vec k[kKeys][kSub];
#pragma GCC unroll 8
    for (int t = 0; t < kKeys; ++t) load(t0 + t, i, k[t]);
    // The next block's keys, one line each, while this one computes: four
    // or eight short streams 2-4 KiB apart, which the hardware prefetchers
    // do not start on soon enough (L2 to L1 was the limit at 256 keys).
    if (next) {
#pragma GCC unroll 8
      for (int t = 0; t < kKeys; ++t) load.Prefetch(t0 + kKeys + t, i);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j) {
#pragma GCC unroll 2
      for (int h = 0; h < kSub; ++h) {
        Vec qj;
        LoadVec(&qj, q + int64_t{j} * dp + i + 16 * h);
#pragma GCC unroll 8
        for (int t = 0; t < kKeys; ++t) acc[j * kKeys + t] += qj * k[t][h];
      }
    }
  }
#pragma GCC unroll 2
  for (int m = 0; m < kAcc; m += query_dots::kBlock) {
    FoldLanes(acc + m, out + m);
  }
}

template <int kHeads, int kKeys, class Load>
[[gnu::always_inline]] inline void BlockRows(const float* q, int32_t dp,
                                             const Load& load, int32_t count,
                                             float* dots, int64_t n) {
  for (int32_t t0 = 0; t0 < count; t0 += kKeys) {
    float out[kHeads * kKeys];
    Block<kHeads, kKeys>(q, dp, load, t0, t0 + 2 * kKeys <= count, out);
    const int32_t live = std::min(kKeys, count - t0);
    for (int j = 0; j < kHeads; ++j) {
      std::memcpy(dots + j * n + t0, out + j * kKeys, sizeof(float) * live);
    }
  }
}

template <class Load>
void DotsWith(const float* q, int32_t heads, int32_t dp, const Load& load,
              int32_t count, float* dots, int64_t n) {
  int32_t j = 0;
  for (; j + 4 <= heads; j += 4) {
    BlockRows<4, 4>(q + int64_t{j} * dp, dp, load, count, dots + j * n, n);
  }
  for (; j + 2 <= heads; j += 2) {
    BlockRows<2, 8>(q + int64_t{j} * dp, dp, load, count, dots + j * n, n);
  }
  for (; j < heads; ++j) {
    BlockRows<1, 8>(q + int64_t{j} * dp, dp, load, count, dots + j * n, n);
  }
}

// DotsWith over QuantLoad, kMetaKeys keys at a time (each run's metadata
// first, its padding keys included).
template <DType kType>
void DotsQuantized(const float* q, int32_t heads, int32_t dp,
                   const KeyRows& keys, int32_t count, float* dots, int64_t n) {
  const HeadGeometry geo = GeometryOf(*keys.layout, keys.head);
  GroupMeta meta;
  for (int32_t t0 = 0; t0 < count; t0 += kMetaKeys) {
    const int32_t run = std::min(kMetaKeys, count - t0);
    FillMeta<kType>(geo, keys.rows + t0, (run + 7) / 8 * 8, &meta);
    DotsWith(q, heads, dp, QuantLoad<kType>{keys.rows + t0, geo, &meta}, run,
             dots + t0, n);
  }
}

// DotsWith over KiviLoad, a run of keys at a time.
void DotsKivi(const float* q, int32_t heads, int32_t dp, const KeyRows& keys,
              int32_t count, float* dots, int64_t n) {
  KiviMeta meta;
  for (int32_t t0 = 0; t0 < count;) {
    const int32_t taken = FillKiviMeta(keys, t0, count, &meta);
    const int32_t run = std::min(taken, count - t0);
    DotsWith(q, heads, dp,
             KiviLoad{keys.rows + t0,
                      int64_t{keys.head} * keys.layout->head_dim, &meta},
             run, dots + t0, n);
    t0 += taken;
  }
}

}  // namespace

void DotsAvx512(const float* q, int32_t heads, int32_t dp, const KeyRows& keys,
                int32_t count, float* dots, int64_t n) {
  if (keys.tile != nullptr) {
    return DotsWith(q, heads, dp, TileLoad{keys.tile, dp}, count, dots, n);
  }
  switch (keys.kind) {
    case DType::kF32:
      return DotsWith(q, heads, dp, F32Load{keys.rows}, count, dots, n);
    case DType::kBF16:
      return DotsWith(q, heads, dp, Bf16Load{{keys.rows}}, count, dots, n);
    case DType::kF16:
      return DotsWith(q, heads, dp, F16Load{{keys.rows}}, count, dots, n);
    case DType::kInt8:
      return DotsQuantized<DType::kInt8>(q, heads, dp, keys, count, dots, n);
    case DType::kInt4:
      return DotsQuantized<DType::kInt4>(q, heads, dp, keys, count, dots, n);
    case DType::kFp8E4M3:
      return DotsQuantized<DType::kFp8E4M3>(q, heads, dp, keys, count, dots, n);
    case DType::kKiviInt4:
      return DotsKivi(q, heads, dp, keys, count, dots, n);
    default:
      return;
  }
}

void WidenTileAvx512(const PageLayout& layout, const std::byte* arena,
                     const std::byte* const* records, int32_t count,
                     int32_t head, int32_t dp, float* tile) {
  switch (layout.dtype) {
    case DType::kKiviInt4:
      return WidenRows<DType::kKiviInt4>(layout, arena, records, count, head,
                                         dp, tile);
    case DType::kF16:
      return WidenRows<DType::kF16>(layout, arena, records, count, head, dp,
                                    tile);
    case DType::kInt8:
      return WidenRows<DType::kInt8>(layout, arena, records, count, head, dp,
                                     tile);
    case DType::kInt4:
      return WidenRows<DType::kInt4>(layout, arena, records, count, head, dp,
                                     tile);
    case DType::kFp8E4M3:
      return WidenRows<DType::kFp8E4M3>(layout, arena, records, count, head, dp,
                                        tile);
    default:
      return;
  }
}

#pragma GCC pop_options

#else  // no AVX-512 code in this build

bool CpuHasAvx512() { return false; }
bool Avx512Widens(const PageLayout&) { return false; }
bool FusedWidens(const PageLayout&) { return false; }
void WidenTileAvx512(const PageLayout&, const std::byte*,
                     const std::byte* const*, int32_t, int32_t, int32_t,
                     float*) {}
void DotsAvx512(const float*, int32_t, int32_t, const KeyRows&, int32_t, float*,
                int64_t) {}

#endif

}  // namespace kvkeep
