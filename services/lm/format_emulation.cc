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

std::vector<float> ThroughPerChannelInt4(const TokenBlock& s, int32_t group,
                                         const std::vector<float>& x,
                                         double* bits) {
  const QuantSpec spec = SpecOf(DType::kInt4);
  const int64_t whole = s.n / group * group;
  std::vector<float> out(x.size());
  std::vector<uint8_t> codes(group / 2 + 1);
  uint8_t scale[2], zero[1];
  for (int64_t t0 = 0; t0 < whole; t0 += group) {
    for (int64_t c = 0; c < s.width(); ++c) {
      auto load = [&](int32_t i) { return x[(t0 + i) * s.width() + c]; };
      if (QuantizeGroup(spec, load, group, codes.data(), 0, scale, zero) !=
          QuantError::kOk) {
        return {};
      }
      const float sc = LoadScale(scale, 0);
      for (int32_t i = 0; i < group; ++i) {
        out[(t0 + i) * s.width() + c] =
            DequantCode(spec, LoadCode(4, codes.data(), i), sc, zero[0]);
      }
    }
  }
  for (int64_t i = whole * s.width(); i < static_cast<int64_t>(x.size()); ++i) {
    out[i] = Bf16ToFloat(FloatToBf16(x[i]));
  }
  *bits = s.n == 0
              ? 0.0
              : (whole * (4.0 + 24.0 / group) + (s.n - whole) * 16.0) / s.n;
  return out;
}

}  // namespace kvkeep::lm
