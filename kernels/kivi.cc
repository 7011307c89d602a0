#include "kernels/kivi.h"

#include <algorithm>
#include <cstring>

namespace kvkeep {
namespace {

constexpr QuantSpec kSpec = SpecOf(DType::kInt4);

// Channel c's scale and zero point from a block.
float ChannelScale(const PageLayout& layout, const uint8_t* block, int64_t c) {
  return LoadScale(block + layout.key_scales_offset(), c);
}
int32_t ChannelZero(const PageLayout& layout, const uint8_t* block, int64_t c) {
  return block[layout.key_zeros_offset() + c];
}
float KeyAt(const PageLayout& layout, const uint8_t* block, int32_t slot,
            int64_t c) {
  const uint8_t* row = block + slot * layout.code_bytes();
  return DequantCode(kSpec, LoadCode(4, row, c), ChannelScale(layout, block, c),
                     ChannelZero(layout, block, c));
}

}  // namespace

KiviResult QuantizeKiviKeys(const PageLayout& layout, const float* keys,
                            int32_t n, std::byte* out) {
  const int64_t e_count = layout.token_elements();
  std::vector<uint16_t> scale_bits(e_count);
  std::vector<uint8_t> zeros(e_count);
  std::vector<uint8_t> codes(layout.key_scales_offset(), 0);
  for (int64_t c = 0; c < e_count; ++c) {
    float lo = 0.0f, hi = 0.0f;  // the range always holds 0
    for (int32_t t = 0; t < n; ++t) {
      const float x = keys[t * e_count + c];
      if (!(x - x == 0.0f)) return KiviResult{QuantError::kNonFinite, t, c};
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    float scale;
    int32_t zero;
    if (const QuantError e =
            GroupScale(kSpec, lo, hi, &scale_bits[c], &scale, &zero);
        e != QuantError::kOk) {
      return KiviResult{e, 0, c};
    }
    zeros[c] = static_cast<uint8_t>(zero);
    for (int32_t t = 0; t < n; ++t) {
      const int32_t q = CodeOf(kSpec, keys[t * e_count + c], scale, zero);
      codes[t * layout.code_bytes() + c / 2] |=
          static_cast<uint8_t>((c & 1) ? q << 4 : q);
    }
  }
  auto* block = reinterpret_cast<uint8_t*>(out);
  std::memcpy(block, codes.data(), codes.size());
  uint8_t* scales = block + layout.key_scales_offset();
  for (int64_t c = 0; c < e_count; ++c) {
    scales[2 * c] = static_cast<uint8_t>(scale_bits[c] & 0xffu);
    scales[2 * c + 1] = static_cast<uint8_t>(scale_bits[c] >> 8);
  }
  std::memcpy(block + layout.key_zeros_offset(), zeros.data(), zeros.size());
  return KiviResult{};
}

void DequantizeKiviKeys(const PageLayout& layout, const std::byte* in,
                        int32_t first, int32_t n, DType out_type, void* out) {
  const auto* block = reinterpret_cast<const uint8_t*>(in);
  const int64_t e_count = layout.token_elements();
  for (int32_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < e_count; ++c) {
      StoreFromFloat(out_type, out, t * e_count + c,
                     KeyAt(layout, block, first + t, c));
    }
  }
}

void WidenKiviKeyHead(const PageLayout& layout, const std::byte* in,
                      int32_t slot, int32_t head, float* dst) {
  const auto* block = reinterpret_cast<const uint8_t*>(in);
  const int64_t first = static_cast<int64_t>(head) * layout.head_dim;
  for (int32_t i = 0; i < layout.head_dim; ++i) {
    dst[i] = KeyAt(layout, block, slot, first + i);
  }
}

void KiviOpenPage::Reset(const float* keys, int32_t n) {
  keys_.clear();
  if (n == 0) {
    keys_.shrink_to_fit();
    return;
  }
  keys_.reserve(
      static_cast<size_t>(layout_.page_tokens * layout_.token_elements()));
  keys_.assign(keys, keys + n * layout_.token_elements());
}

KiviResult KiviOpenPage::Append(const float* keys, int32_t n,
                                std::byte* block) {
  const size_t before = keys_.size();
  // A whole page's room at once, so the bytes held are page_tokens tokens'
  // while a page is open and none once it is full.
  keys_.reserve(
      static_cast<size_t>(layout_.page_tokens * layout_.token_elements()));
  keys_.insert(keys_.end(), keys, keys + n * layout_.token_elements());
  const KiviResult r = QuantizeKiviKeys(layout_, keys_.data(), tokens(), block);
  if (!r.ok()) {
    keys_.resize(before);
    return KiviResult{r.error, r.token, r.channel};
  }
  if (tokens() == layout_.page_tokens) {
    keys_.clear();
    keys_.shrink_to_fit();
  }
  return r;
}

}  // namespace kvkeep
