// Element types of stored keys and values, and exact conversions to and from
// float32. Plain functions usable from host and device code (the CUDA kernels
// call the same conversions, so they agree bit for bit with the CPU twins).
// Thread-safe (stateless).
#ifndef KVKEEP_KERNELS_DTYPE_H_
#define KVKEEP_KERNELS_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string_view>

#if defined(__CUDACC__)
#define KVKEEP_HOST_DEVICE __host__ __device__
#else
#define KVKEEP_HOST_DEVICE
#endif

namespace kvkeep {

// f32, f16 and bf16 are stored as they are. int8, fp8_e4m3 and int4 are
// quantised: the store quantises what workers append (in the layout's
// append dtype) into token records with per-group scales
// (kernels/quant_format.h, docs/quantization.md). kivi_int4 stores values as
// int4 does and a page's keys as one block quantised per channel over the
// page's tokens (KIVI; kernels/kivi.h).
enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kInt8 = 3,
  kFp8E4M3 = 4,
  kInt4 = 5,
  kKiviInt4 = 6,
};

constexpr bool IsQuantized(DType t) {
  return t == DType::kInt8 || t == DType::kFp8E4M3 || t == DType::kInt4 ||
         t == DType::kKiviInt4;
}

// Keys per channel by page (kernels/kivi.h): a page's keys are not token
// records, so per-token copies of keys do not apply.
constexpr bool IsKivi(DType t) { return t == DType::kKiviInt4; }

// Bytes of one element of a float dtype (f32, f16, bf16). A quantised dtype
// has no per-element size (int4 packs two codes a byte and every group has
// its scale): PageLayout::token_bytes() is the size of its token records.
constexpr int DTypeBytes(DType t) {
  return t == DType::kF32 ? 4 : (t == DType::kF16 || t == DType::kBF16) ? 2 : 1;
}

constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kInt8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kInt4:
      return "int4";
    case DType::kKiviInt4:
      return "kivi_int4";
  }
  return "?";
}

KVKEEP_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

KVKEEP_HOST_DEVICE inline uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

KVKEEP_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even, as torch does; NaN stays NaN.
KVKEEP_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// IEEE 754 binary16 -> binary32, exact (subnormals, infinities, NaN).
KVKEEP_HOST_DEVICE inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 |
             (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return BitsToFloat(bits);
}

// IEEE binary16 -> binary32, bit-identical to F16ToFloat (NaN
// payloads included) but branch-free (Maratyszcza's FP16 method, plus a
// select for infinities and NaNs), so a loop over it vectorises (the
// kernels' query scoring, services/lm). Host only.
inline float HalfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized =
      BitsToFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = BitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  // Infinities and NaNs directly: the multiplication would quiet a
  // signalling NaN.
  const uint32_t inf_nan = 0x7f800000u | ((two_w >> 4) & 0x007fe000u);
  uint32_t bits =
      two_w < (1u << 27) ? FloatToBits(denormalized) : FloatToBits(normalized);
  bits = two_w >= 0xf8000000u ? inf_nan : bits;
  return BitsToFloat(sign | bits);
}

// binary32 -> binary16, round to nearest even.
KVKEEP_HOST_DEVICE inline uint16_t FloatToF16(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow -> inf
  if (abs < 0x38800000u) {                        // subnormal or zero
    if (abs < 0x33000000u) return sign;           // below half the min
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

// Reads element i of an array of float dtype `t` as float32 (0 for a
// quantised dtype, which has no plain arrays: see kernels/quantize.h).
KVKEEP_HOST_DEVICE inline float LoadAsFloat(DType t, const void* base,
                                            int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    default:
      return 0.0f;
  }
}

// Writes f as element i of an array of float dtype `t` (rounded to nearest
// even); nothing for a quantised dtype.
KVKEEP_HOST_DEVICE inline void StoreFromFloat(DType t, void* base, int64_t i,
                                              float f) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = f;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = FloatToF16(f);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBf16(f);
      return;
    default:
      return;
  }
}

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_DTYPE_H_
