// The quantised token record: how one token's keys (or values) of all kv
// heads are stored for the int8, fp8_e4m3 and int4 layout dtypes. Written
// once, header-only, for the CPU twins (kernels/quantize.cc), the CUDA
// kernels (kernels/cuda/quantize.cu, attention.cu) and any process that
// reads pages in place through MapPool; docs/quantization.md says the same in
// words. Thread-safe (stateless).
//
// A token's keys are E = kv_heads * head_dim elements, [kv_heads][head_dim]
// flattened, cut into G = E / group_size groups of group_size consecutive
// elements (group_size divides head_dim, so a group never spans two heads).
// The record, all offsets in bytes from its start, no padding:
//   codes  [0, C)        int8 / fp8_e4m3: C = E, one byte per element;
//                        int4: C = E / 2, element 2i in the low nibble of
//                        byte i and element 2i + 1 in the high nibble
//   scales [C, C + 2G)   one IEEE binary16 scale per group, little-endian
//   zeros  [C + 2G, C + 3G)  one uint8 zero point per group (int8 and
//                        int4, which are asymmetric; none for fp8_e4m3)
// and element e of group g = e / group_size reads
//   int8, int4:  (code(e) - zero(g)) * scale(g)      (float32 multiply)
//   fp8_e4m3:    E4M3(code(e)) * scale(g)            (exact in float32)
// A page holds [2 (K, V)][page_tokens] such records (kernels/page_layout.h),
// so compaction and transfers move a token with everything needed to read
// it. kivi_int4 holds its values as int4 records and its keys as one block a
// page, each channel an asymmetric int4 group over the page's tokens with
// the arithmetic below (kernels/page_layout.h has the block, kernels/kivi.h
// its twins).
//
// Quantising one group of float32 values x (they come from f32, f16 or bf16,
// all exact in float32):
//   every x finite, else kNonFinite (nothing is stored)
//   symmetric integer (b bits, zero fixed at 2^(b-1), not stored):
//     scale = f16_up(max|x| / (2^(b-1) - 1)),  code = rne(x / scale) + zero
//   asymmetric integer (b bits, zero stored):
//     lo = min(min x, 0), hi = max(max x, 0)
//     scale = f16_up((hi - lo) / (2^b - 1)),  zero = rne(-lo / scale)
//     code = clamp(rne(x / scale) + zero, 0, 2^b - 1)
//   fp8_e4m3: scale = f16_up(max|x| / 448), code = e4m3_rne_sat(x / scale)
// where f16_up rounds toward +inf (so no x maps past the largest code), rne
// is round to nearest, ties to even (rintf in the default rounding mode), and
// a scale of 0 (an all-zero group) stores every code as the zero. A scale
// that overflows binary16 (hi - lo above 65504 * (2^b - 1) asymmetric,
// max|x| above 65504 * (2^(b-1) - 1) symmetric or 65504 * 448 fp8) is
// kOutOfRange. Every step is IEEE float32
// (division, multiply, rintf) or integer arithmetic, the same on host and
// device; no step can be contracted into an FMA, so the CUDA kernels that
// call these functions produce the twins' bytes exactly.
#ifndef KVKEEP_KERNELS_QUANT_FORMAT_H_
#define KVKEEP_KERNELS_QUANT_FORMAT_H_

#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvkeep {

// How one quantised dtype encodes a group.
struct QuantSpec {
  int32_t bits = 8;         // code bits: 8 or 4
  bool fp8 = false;         // codes are E4M3 (bits == 8)
  bool asymmetric = false;  // a zero point is stored per group

  KVKEEP_HOST_DEVICE int32_t max_code() const { return (1 << bits) - 1; }
  // The fixed zero of a symmetric integer format (unused by fp8).
  KVKEEP_HOST_DEVICE int32_t fixed_zero() const { return 1 << (bits - 1); }
  // Bytes of metadata per group: scale, and zero point when stored.
  KVKEEP_HOST_DEVICE int32_t meta_bytes() const { return asymmetric ? 3 : 2; }
};

// The format of each quantised dtype. int8 and int4 are asymmetric: on keys
// with outlier channels they halve (int8) or cut by 7-14% (int4) the error
// of the symmetric variant for one more byte per group
// (bench/quant_error_bench, docs/quantization.md). The symmetric variant
// (zero fixed at 2^(b-1)) stays here for that comparison.
KVKEEP_HOST_DEVICE constexpr QuantSpec SpecOf(DType t) {
  switch (t) {
    case DType::kInt8:
      return QuantSpec{8, false, true};
    case DType::kFp8E4M3:
      return QuantSpec{8, true, false};
    case DType::kInt4:
    case DType::kKiviInt4:  // its values; its keys: kernels/kivi.h
      return QuantSpec{4, false, true};
    default:
      return QuantSpec{};
  }
}

enum class QuantError : uint8_t { kOk = 0, kNonFinite = 1, kOutOfRange = 2 };

// Largest finite binary16, and E4M3's largest finite value.
constexpr float kF16Max = 65504.0f;
constexpr float kE4M3Max = 448.0f;

// binary32 (finite, >= 0) -> binary16 rounded toward +inf. 0x7c00 (inf)
// when v exceeds 65504.
KVKEEP_HOST_DEVICE inline uint16_t FloatToF16Up(float v) {
  uint16_t h = FloatToF16(v);
  if (F16ToFloat(h) < v) ++h;  // positive: the next binary16 up
  return h;
}

// float32 (finite) -> E4M3 (fn: no infinities; 0x7f is NaN and never made),
// round to nearest even, saturating at +-448.
KVKEEP_HOST_DEVICE inline uint8_t FloatToE4M3(float y) {
  const uint32_t bits = FloatToBits(y);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  const float a = BitsToFloat(abs);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (exact scaling)
    return static_cast<uint8_t>(sign |
                                static_cast<uint32_t>(rintf(a * 512.0f)));
  }
  // Keep 3 of the 23 mantissa bits, ties to even; a carry moves the exponent.
  const uint32_t r = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(sign | (r - ((127u - 7u) << 3)));
}

KVKEEP_HOST_DEVICE inline float E4M3ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xfu;
  const uint32_t mant = c & 0x7u;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 0.001953125f;  // m * 2^-9
    return sign ? -v : v;
  }
  if (exp == 0xfu && mant == 0x7u) return BitsToFloat(sign | 0x7fc00000u);
  return BitsToFloat(sign | (exp + 127u - 7u) << 23 | mant << 20);
}

// Reads the little-endian binary16 scale of group g.
KVKEEP_HOST_DEVICE inline float LoadScale(const uint8_t* scales, int64_t g) {
  const uint16_t h = static_cast<uint16_t>(scales[2 * g]) |
                     static_cast<uint16_t>(scales[2 * g + 1]) << 8;
  return F16ToFloat(h);
}

// Code of element e (int4: its nibble).
KVKEEP_HOST_DEVICE inline int32_t LoadCode(int32_t bits, const uint8_t* codes,
                                           int64_t e) {
  if (bits == 8) return codes[e];
  const uint8_t byte = codes[e >> 1];
  return (e & 1) ? byte >> 4 : byte & 0xf;
}

// Element value from its code and its group's scale and zero point.
KVKEEP_HOST_DEVICE inline float DequantCode(const QuantSpec& spec, int32_t code,
                                            float scale, int32_t zero) {
  if (spec.fp8) return E4M3ToFloat(static_cast<uint8_t>(code)) * scale;
  return static_cast<float>(code - zero) * scale;
}

// The scale (as binary16 bits and as float) and zero point of a group whose
// values span [lo, hi], lo <= 0 <= hi. kOutOfRange when the scale is not a
// finite binary16.
KVKEEP_HOST_DEVICE inline QuantError GroupScale(const QuantSpec& spec, float lo,
                                                float hi, uint16_t* scale_bits,
                                                float* scale, int32_t* zero) {
  const float abs_max = -lo > hi ? -lo : hi;
  float span;
  if (spec.fp8) {
    span = abs_max / kE4M3Max;
  } else if (spec.asymmetric) {
    span = (hi - lo) / static_cast<float>(spec.max_code());
  } else {
    span = abs_max / static_cast<float>(spec.fixed_zero() - 1);
  }
  *scale_bits = FloatToF16Up(span);
  if (*scale_bits >= 0x7c00u) return QuantError::kOutOfRange;
  *scale = F16ToFloat(*scale_bits);
  *zero = spec.fp8 ? 0 : spec.fixed_zero();
  if (spec.asymmetric) {
    *zero = *scale == 0.0f ? 0 : static_cast<int32_t>(rintf(-lo / *scale));
    *zero = *zero < 0 ? 0 : (*zero > spec.max_code() ? spec.max_code() : *zero);
  }
  return QuantError::kOk;
}

// The code of x in a group of that scale and zero point.
KVKEEP_HOST_DEVICE inline int32_t CodeOf(const QuantSpec& spec, float x,
                                         float scale, int32_t zero) {
  if (spec.fp8) return scale == 0.0f ? 0 : FloatToE4M3(x / scale);
  const int32_t q =
      scale == 0.0f ? zero : static_cast<int32_t>(rintf(x / scale)) + zero;
  return q < 0 ? 0 : (q > spec.max_code() ? spec.max_code() : q);
}

// Quantises one group: n values load(i), i < n, into their codes (element i
// goes to code index first + i of `codes`; for int4, first and n are even)
// and the group's scale (2 bytes at scale_at) and zero (1 byte at zero_at,
// asymmetric only). Writes nothing unless it returns kOk.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Load>
KVKEEP_HOST_DEVICE QuantError QuantizeGroup(const QuantSpec& spec, Load load,
                                            int32_t n, uint8_t* codes,
                                            int64_t first, uint8_t* scale_at,
                                            uint8_t* zero_at) {
  float lo = 0.0f, hi = 0.0f;  // the range always includes 0
  for (int32_t i = 0; i < n; ++i) {
    const float x = load(i);
    if (!(x - x == 0.0f)) return QuantError::kNonFinite;  // NaN or +-inf
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  uint16_t scale_bits;
  float scale;
  int32_t zero;
  if (const QuantError e = GroupScale(spec, lo, hi, &scale_bits, &scale, &zero);
      e != QuantError::kOk) {
    return e;
  }
  if (spec.bits == 8) {
    for (int32_t i = 0; i < n; ++i) {
      codes[first + i] =
          static_cast<uint8_t>(CodeOf(spec, load(i), scale, zero));
    }
  } else {
    for (int32_t i = 0; i + 1 < n; i += 2) {
      codes[(first + i) >> 1] =
          static_cast<uint8_t>(CodeOf(spec, load(i), scale, zero) |
                               CodeOf(spec, load(i + 1), scale, zero) << 4);
    }
  }
  scale_at[0] = static_cast<uint8_t>(scale_bits & 0xffu);
  scale_at[1] = static_cast<uint8_t>(scale_bits >> 8);
  if (spec.asymmetric) zero_at[0] = static_cast<uint8_t>(zero);
  return QuantError::kOk;
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_QUANT_FORMAT_H_
