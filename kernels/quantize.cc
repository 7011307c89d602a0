#include "kernels/quantize.h"

#include <array>
#include <cstring>

namespace kvkeep {
namespace {

// E4M3ToFloat of every code, looked up instead of decoded bit by bit (the
// same floats: the table is filled by E4M3ToFloat).
const std::array<float, 256>& E4M3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t;
    for (int c = 0; c < 256; ++c) t[c] = E4M3ToFloat(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// Group g of a token: its n values as float32, dst[i] for i < n.
void DequantGroup(const QuantSpec& spec, const PageLayout& layout,
                  const uint8_t* record, int64_t g, float* __restrict dst) {
  const int32_t n = layout.group_size;
  const float scale = LoadScale(record + layout.scales_offset(), g);
  const int32_t zero = spec.fp8          ? 0
                       : spec.asymmetric ? record[layout.zeros_offset() + g]
                                         : spec.fixed_zero();
  const int64_t first = g * n;
  if (spec.fp8) {
    const float* table = E4M3Table().data();
    for (int32_t i = 0; i < n; ++i) dst[i] = table[record[first + i]] * scale;
  } else if (spec.bits == 8) {
    const uint8_t* codes = record + first;
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) {
      dst[i] =
          static_cast<float>(static_cast<int32_t>(codes[i]) - zero) * scale;
    }
  } else {
    const uint8_t* codes = record + first / 2;
#pragma omp simd
    for (int32_t i = 0; i < n / 2; ++i) {
      dst[2 * i] = static_cast<float>((codes[i] & 0xf) - zero) * scale;
      dst[2 * i + 1] = static_cast<float>((codes[i] >> 4) - zero) * scale;
    }
  }
}

// QuantizeGroup on the CPU, in loops the compiler vectorises: the same
// range, GroupScale and codes bit for bit (an integer code is x / scale
// rounded to nearest even by adding and subtracting 1.5 * 2^23, which is
// rintf for |v| <= 2^22: here |x / scale| <= 2^8). quantize_test checks it
// against QuantizeGroup.
QuantError QuantizeGroupFast(const QuantSpec& spec, const float* __restrict x,
                             int32_t n, uint8_t* codes, int64_t first,
                             uint8_t* scale_at, uint8_t* zero_at) {
  float lo = 0.0f, hi = 0.0f;
  bool finite = true;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(&& : finite)
  for (int32_t i = 0; i < n; ++i) {
    finite = finite && (x[i] - x[i] == 0.0f);
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  if (!finite) return QuantError::kNonFinite;
  uint16_t scale_bits;
  float scale;
  int32_t zero;
  if (const QuantError e = GroupScale(spec, lo, hi, &scale_bits, &scale, &zero);
      e != QuantError::kOk) {
    return e;
  }
  int32_t q[1024];  // group_size <= head_dim <= 1024 (ValidateLayout)
  const int32_t max_code = spec.max_code();
  if (scale == 0.0f) {
    for (int32_t i = 0; i < n; ++i) q[i] = zero;
  } else if (spec.fp8) {
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) q[i] = FloatToE4M3(x[i] / scale);
  } else {
    constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) {
      const float v = (x[i] / scale + kRound) - kRound;
      const int32_t c = static_cast<int32_t>(v) + zero;
      q[i] = c < 0 ? 0 : (c > max_code ? max_code : c);
    }
  }
  if (spec.bits == 8) {
    for (int32_t i = 0; i < n; ++i)
      codes[first + i] = static_cast<uint8_t>(q[i]);
  } else {
    for (int32_t i = 0; i + 1 < n; i += 2) {
      codes[(first + i) >> 1] = static_cast<uint8_t>(q[i] | q[i + 1] << 4);
    }
  }
  scale_at[0] = static_cast<uint8_t>(scale_bits & 0xffu);
  scale_at[1] = static_cast<uint8_t>(scale_bits >> 8);
  if (spec.asymmetric) zero_at[0] = static_cast<uint8_t>(zero);
  return QuantError::kOk;
}

// Elements [first, first + n) of an array of float dtype `t` as float32.
void WidenGroup(DType t, const void* base, int64_t first, int32_t n,
                float* __restrict out) {
  switch (t) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(base) + first,
                  sizeof(float) * n);
      return;
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + first;
#pragma omp simd
      for (int32_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(src[i]);
      return;
    }
    default:
      for (int32_t i = 0; i < n; ++i) out[i] = LoadAsFloat(t, base, first + i);
      return;
  }
}

}  // namespace

QuantizeResult QuantizeTokensWith(const PageLayout& layout,
                                  const QuantSpec& spec, DType in_type,
                                  const void* in, int64_t n, std::byte* out) {
  const int64_t elements = layout.token_elements();
  const int64_t groups = layout.groups();
  const int64_t record_bytes = layout.token_bytes();
  // Each group widened to float32 once, its dtype's loop chosen once: the
  // quantiser reads every value twice (range, then codes), and a per-value
  // dtype switch cost more than the rest of it.
  float group[1024];  // group_size <= head_dim <= 1024 (ValidateLayout)
  for (int64_t t = 0; t < n; ++t) {
    auto* record = reinterpret_cast<uint8_t*>(out + t * record_bytes);
    const int64_t base = t * elements;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * layout.group_size;
      WidenGroup(in_type, in, base + first, layout.group_size, group);
      uint8_t* scale_at = record + layout.scales_offset() + 2 * g;
      uint8_t* zero_at = record + layout.zeros_offset() + g;
      const QuantError e = QuantizeGroupFast(spec, group, layout.group_size,
                                             record, first, scale_at, zero_at);
      if (e != QuantError::kOk) return QuantizeResult{e, t, first};
    }
  }
  return QuantizeResult{};
}

QuantizeResult QuantizeTokens(const PageLayout& layout, DType in_type,
                              const void* in, int64_t n, std::byte* out) {
  return QuantizeTokensWith(layout, SpecOf(layout.dtype), in_type, in, n, out);
}

void DequantizeTokensWith(const PageLayout& layout, const QuantSpec& spec,
                          const std::byte* in, int64_t n, DType out_type,
                          void* out) {
  const int64_t elements = layout.token_elements();
  const int64_t record_bytes = layout.token_bytes();
  float group[1024];  // group_size <= head_dim <= 1024 (ValidateLayout)
  for (int64_t t = 0; t < n; ++t) {
    const auto* record =
        reinterpret_cast<const uint8_t*>(in + t * record_bytes);
    for (int64_t g = 0; g < layout.groups(); ++g) {
      DequantGroup(spec, layout, record, g, group);
      const int64_t at = t * elements + g * layout.group_size;
      if (out_type == DType::kF32) {
        std::memcpy(static_cast<float*>(out) + at, group,
                    sizeof(float) * layout.group_size);
        continue;
      }
      for (int32_t i = 0; i < layout.group_size; ++i) {
        StoreFromFloat(out_type, out, at + i, group[i]);
      }
    }
  }
}

void DequantizeTokens(const PageLayout& layout, const std::byte* in, int64_t n,
                      DType out_type, void* out) {
  if (IsQuantized(layout.dtype)) {
    DequantizeTokensWith(layout, SpecOf(layout.dtype), in, n, out_type, out);
    return;
  }
  const int64_t count = n * layout.token_elements();
  if (out_type == layout.dtype) {
    std::memcpy(out, in, static_cast<size_t>(count * DTypeBytes(out_type)));
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    StoreFromFloat(out_type, out, i, LoadAsFloat(layout.dtype, in, i));
  }
}

void WidenHead(const PageLayout& layout, const std::byte* token, int32_t head,
               float* __restrict dst) {
  const int32_t d = layout.head_dim;
  const int64_t first = static_cast<int64_t>(head) * d;
  switch (layout.dtype) {
    case DType::kF32: {
      const float* src = reinterpret_cast<const float*>(token) + first;
      for (int32_t i = 0; i < d; ++i) dst[i] = src[i];
      return;
    }
    case DType::kBF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(token) + first;
#pragma omp simd
      for (int32_t i = 0; i < d; ++i) dst[i] = Bf16ToFloat(src[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(token) + first;
      for (int32_t i = 0; i < d; ++i) dst[i] = F16ToFloat(src[i]);
      return;
    }
    case DType::kInt8:
    case DType::kFp8E4M3:
    case DType::kInt4: {
      const QuantSpec spec = SpecOf(layout.dtype);
      const auto* record = reinterpret_cast<const uint8_t*>(token);
      const int32_t per_head = d / layout.group_size;
      for (int32_t j = 0; j < per_head; ++j) {
        DequantGroup(spec, layout, record,
                     static_cast<int64_t>(head) * per_head + j,
                     dst + static_cast<int64_t>(j) * layout.group_size);
      }
      return;
    }
    case DType::kKiviInt4:  // keys are a page block: WidenKiviKeyHead
      for (int32_t i = 0; i < d; ++i) dst[i] = 0.0f;
      return;
  }
}

}  // namespace kvkeep
