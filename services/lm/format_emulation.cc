#include "services/lm/format_emulation.h"

#include <cstddef>

#include "kernels/quant_format.h"
#include "kernels/quantize.h"

namespace kvkeep::lm {

std::vector<float> ThroughPerToken(const TokenBlock& s, DType dtype,
                                   int32_t group, const std::vector<float>& x,
                                   double* bits) {
  const PageLayout layout{1, s.kv_heads, s.head_dim, dtype, group};
  *bits = 8.0 * layout.token_bytes() / s.width();
  std::vector<float> out(x.size());
  if (!IsQuantized(dtype)) {
    for (size_t i = 0; i < x.size(); ++i) {
      out[i] = Bf16ToFloat(FloatToBf16(x[i]));
    }
    return out;
  }
  std::vector<std::byte> records(s.n * layout.token_bytes());
  if (!QuantizeTokens(layout, DType::kF32, x.data(), s.n, records.data())
           .ok()) {
    return {};
  }
  DequantizeTokens(layout, records.data(), s.n, DType::kF32, out.data());
  return out;
}

namespace {

// Quantises the n values load(i) as one group of `spec` and hands each
// value's reading back to put(i, value). False when a value is not finite.
template <class Load, class Put>
bool RoundGroup(const QuantSpec& spec, Load load, int32_t n, Put put) {
  // Codes as nibbles (int2's too: only their values matter here).
  std::vector<uint8_t> codes(n / 2 + 1);
  uint8_t scale[2], zero[1];
  if (QuantizeGroup(spec, load, n, codes.data(), 0, scale, zero) !=
      QuantError::kOk) {
    return false;
  }
  const float sc = LoadScale(scale, 0);
  for (int32_t i = 0; i < n; ++i) {
    put(i, DequantCode(spec, LoadCode(spec.bits == 8 ? 8 : 4, codes.data(), i),
                       sc, zero[0]));
  }
  return true;
}

}  // namespace

std::vector<float> ThroughPerTokenInt(int32_t code_bits, int32_t group,
                                      const std::vector<float>& x,
                                      double* bits) {
  const QuantSpec spec{code_bits, false, true};
  std::vector<float> out(x.size());
  for (size_t g0 = 0; g0 < x.size(); g0 += group) {
    if (!RoundGroup(
            spec, [&](int32_t i) { return x[g0 + i]; }, group,
            [&](int32_t i, float v) { out[g0 + i] = v; })) {
      return {};
    }
  }
  *bits = code_bits + 8.0 * spec.meta_bytes() / group;
  return out;
}

std::vector<float> ThroughPerChannel(const TokenBlock& s, int32_t code_bits,
                                     int32_t group, const std::vector<float>& x,
                                     double* bits) {
  const QuantSpec spec{code_bits, false, true};
  const int64_t whole = s.n / group * group;
  std::vector<float> out(x.size());
  for (int64_t t0 = 0; t0 < whole; t0 += group) {
    for (int64_t c = 0; c < s.width(); ++c) {
      const auto at = [&](int32_t i) { return (t0 + i) * s.width() + c; };
      if (!RoundGroup(
              spec, [&](int32_t i) { return x[at(i)]; }, group,
              [&](int32_t i, float v) { out[at(i)] = v; })) {
        return {};
      }
    }
  }
  for (int64_t i = whole * s.width(); i < static_cast<int64_t>(x.size()); ++i) {
    out[i] = Bf16ToFloat(FloatToBf16(x[i]));
  }
  *bits = s.n == 0 ? 0.0
                   : (whole * (code_bits + 8.0 * spec.meta_bytes() / group) +
                      (s.n - whole) * 16.0) /
                         s.n;
  return out;
}

}  // namespace kvkeep::lm
