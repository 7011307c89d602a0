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

// The error QuantizeKiviKeys reports for keys that cannot be quantised:
// channel by channel, the first token holding a NaN or an infinity, else
// the channel's range if it does not fit a binary16 scale.
KiviResult FirstError(const float* keys, int32_t n, int64_t e_count) {
  for (int64_t c = 0; c < e_count; ++c) {
    float lo = 0.0f, hi = 0.0f;
    for (int32_t t = 0; t < n; ++t) {
      const float x = keys[t * e_count + c];
      if (!(x - x == 0.0f)) return KiviResult{QuantError::kNonFinite, t, c};
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    uint16_t bits;
    float scale;
    int32_t zero;
    if (const QuantError e = GroupScale(kSpec, lo, hi, &bits, &scale, &zero);
        e != QuantError::kOk) {
      return KiviResult{e, 0, c};
    }
  }
  return KiviResult{};
}

}  // namespace

// Token by token over each row (the keys' own order), so the loops read and
// write contiguous memory; the arithmetic per channel is the same calls in
// any order (GroupScale over the channel's range, CodeOf per key).
KiviResult QuantizeKiviKeys(const PageLayout& layout, const float* keys,
                            int32_t n, std::byte* out) {
  const int64_t e_count = layout.token_elements();
  std::vector<float> lo(e_count, 0.0f), hi(e_count, 0.0f);  // ranges hold 0
  bool finite = true;
  for (int32_t t = 0; t < n; ++t) {
    const float* row = keys + t * e_count;
    for (int64_t c = 0; c < e_count; ++c) {
      const float x = row[c];
      finite = finite && x - x == 0.0f;
      lo[c] = x < lo[c] ? x : lo[c];
      hi[c] = x > hi[c] ? x : hi[c];
    }
  }
  if (!finite) return FirstError(keys, n, e_count);
  std::vector<uint16_t> scale_bits(e_count);
  std::vector<float> scales(e_count);
  std::vector<int32_t> zeros(e_count);
  for (int64_t c = 0; c < e_count; ++c) {
    if (GroupScale(kSpec, lo[c], hi[c], &scale_bits[c], &scales[c],
                   &zeros[c]) != QuantError::kOk) {
      return FirstError(keys, n, e_count);
    }
  }
  auto* block = reinterpret_cast<uint8_t*>(out);
  const int64_t code_bytes = layout.code_bytes();
  std::memset(block, 0, static_cast<size_t>(layout.key_scales_offset()));
  for (int32_t t = 0; t < n; ++t) {
    const float* row = keys + t * e_count;
    uint8_t* codes = block + t * code_bytes;
    for (int64_t i = 0; i < code_bytes; ++i) {  // channels 2i and 2i + 1
      const int64_t c = 2 * i;
      codes[i] = static_cast<uint8_t>(
          CodeOf(kSpec, row[c], scales[c], zeros[c]) |
          CodeOf(kSpec, row[c + 1], scales[c + 1], zeros[c + 1]) << 4);
    }
  }
  uint8_t* scale_out = block + layout.key_scales_offset();
  uint8_t* zero_out = block + layout.key_zeros_offset();
  for (int64_t c = 0; c < e_count; ++c) {
    scale_out[2 * c] = static_cast<uint8_t>(scale_bits[c] & 0xffu);
    scale_out[2 * c + 1] = static_cast<uint8_t>(scale_bits[c] >> 8);
    zero_out[c] = static_cast<uint8_t>(zeros[c]);
  }
  return KiviResult{};
}

// Each channel's scale and zero point decoded once, then the rows in order.
void DequantizeKiviKeys(const PageLayout& layout, const std::byte* in,
                        int32_t first, int32_t n, DType out_type, void* out) {
  const auto* block = reinterpret_cast<const uint8_t*>(in);
  const int64_t e_count = layout.token_elements();
  std::vector<float> scales(e_count);
  std::vector<int32_t> zeros(e_count);
  for (int64_t c = 0; c < e_count; ++c) {
    scales[c] = ChannelScale(layout, block, c);
    zeros[c] = ChannelZero(layout, block, c);
  }
  for (int32_t t = 0; t < n; ++t) {
    const uint8_t* row = block + (first + t) * layout.code_bytes();
    for (int64_t c = 0; c < e_count; ++c) {
      StoreFromFloat(
          out_type, out, t * e_count + c,
          DequantCode(kSpec, LoadCode(4, row, c), scales[c], zeros[c]));
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

void KiviOpenPage::Clear() {
  keys_.clear();
  keys_.shrink_to_fit();
  block_.clear();
  block_.shrink_to_fit();
  channels_.clear();
  channels_.shrink_to_fit();
  coded_ = false;
}

void KiviOpenPage::Open() {
  // A whole page's room at once, so the bytes held are OpenBytes while a
  // page is open and none once it is full.
  keys_.clear();
  keys_.reserve(
      static_cast<size_t>(layout_.page_tokens * layout_.token_elements()));
  block_.assign(static_cast<size_t>(layout_.key_block_bytes()), std::byte{0});
  channels_.assign(static_cast<size_t>(layout_.token_elements()), Channel{});
  coded_ = false;
}

void KiviOpenPage::Reset(const float* keys, int32_t n) {
  if (n == 0) {
    Clear();
    return;
  }
  Open();
  keys_.assign(keys, keys + n * layout_.token_elements());
}

KiviResult KiviOpenPage::QuantizeAll() {
  const KiviResult r =
      QuantizeKiviKeys(layout_, keys_.data(), tokens(), block_.data());
  if (!r.ok()) return r;
  const int64_t e_count = layout_.token_elements();
  const auto* block = reinterpret_cast<const uint8_t*>(block_.data());
  for (int64_t c = 0; c < e_count; ++c) {
    channels_[c] = Channel{0.0f, 0.0f, ChannelScale(layout_, block, c)};
  }
  for (int32_t t = 0; t < tokens(); ++t) {
    const float* row = keys_.data() + t * e_count;
    for (int64_t c = 0; c < e_count; ++c) {
      channels_[c].lo = std::min(channels_[c].lo, row[c]);
      channels_[c].hi = std::max(channels_[c].hi, row[c]);
    }
  }
  coded_ = true;
  return r;
}

bool KiviOpenPage::CodeIncrementally(int32_t old) {
  const int64_t e_count = layout_.token_elements();
  for (size_t i = static_cast<size_t>(old * e_count); i < keys_.size(); ++i) {
    if (!(keys_[i] - keys_[i] == 0.0f)) return false;  // NaN or +-inf
  }
  const int64_t code_bytes = layout_.code_bytes();
  auto* block = reinterpret_cast<uint8_t*>(block_.data());
  for (int64_t c = 0; c < e_count; ++c) {
    Channel& channel = channels_[c];
    float lo = channel.lo, hi = channel.hi;
    for (int32_t t = old; t < tokens(); ++t) {
      const float x = keys_[t * e_count + c];
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    if (lo == channel.lo && hi == channel.hi) continue;
    uint16_t bits;
    int32_t zero;
    if (GroupScale(kSpec, lo, hi, &bits, &channel.scale, &zero) !=
        QuantError::kOk) {
      return false;
    }
    channel.lo = lo;
    channel.hi = hi;
    block[layout_.key_scales_offset() + 2 * c] =
        static_cast<uint8_t>(bits & 0xffu);
    block[layout_.key_scales_offset() + 2 * c + 1] =
        static_cast<uint8_t>(bits >> 8);
    block[layout_.key_zeros_offset() + c] = static_cast<uint8_t>(zero);
    // Channel c is the low nibble of byte c / 2 when c is even.
    const int shift = c % 2 == 0 ? 0 : 4;
    for (int32_t t = 0; t < old; ++t) {
      uint8_t& byte = block[t * code_bytes + c / 2];
      const int32_t code =
          CodeOf(kSpec, keys_[t * e_count + c], channel.scale, zero);
      byte = static_cast<uint8_t>((byte & (0xf0u >> shift)) | code << shift);
    }
  }
  for (int32_t t = old; t < tokens(); ++t) {
    const float* row = keys_.data() + t * e_count;
    uint8_t* codes = block + t * code_bytes;
    for (int64_t i = 0; i < code_bytes; ++i) {  // channels 2i and 2i + 1
      const int64_t c = 2 * i;
      codes[i] =
          static_cast<uint8_t>(CodeOf(kSpec, row[c], channels_[c].scale,
                                      ChannelZero(layout_, block, c)) |
                               CodeOf(kSpec, row[c + 1], channels_[c + 1].scale,
                                      ChannelZero(layout_, block, c + 1))
                                   << 4);
    }
  }
  return true;
}

KiviResult KiviOpenPage::Append(const float* keys, int32_t n, std::byte* out) {
  const int32_t old = tokens();
  if (old == 0) Open();
  keys_.insert(keys_.end(), keys, keys + n * layout_.token_elements());
  if (!(coded_ && CodeIncrementally(old))) {
    // Nothing coded yet, or keys that cannot be quantised: the page at once,
    // which finds and reports the error. Then nothing is kept, and the
    // channels (perhaps half updated) are made again at the next append.
    if (const KiviResult r = QuantizeAll(); !r.ok()) {
      keys_.resize(static_cast<size_t>(old * layout_.token_elements()));
      coded_ = false;
      if (old == 0) Clear();
      return r;
    }
  }
  std::memcpy(out, block_.data(), block_.size());
  if (tokens() == layout_.page_tokens) Clear();
  return KiviResult{};
}

}  // namespace kvkeep
