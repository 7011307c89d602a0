// Session's kivi_int4 parts (cache_store/kivi_keys.h): the appended keys
// quantised with their pages, dequantised reads, snapshots (key blocks as
// stored, and the staging), and the policies the layout takes.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/session.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"

namespace kvkeep {

void Session::AppendKiviKeys(size_t l, const AppendPlan& plan,
                             const LayerKv& kv, int64_t n) {
  Layer& layer = layers_[l];
  const auto* keys = reinterpret_cast<const float*>(kv.keys.data());
  const int64_t e_count = page_layout_.token_elements();
  const int64_t first = layer.size();
  const int64_t tail = plan.drop_begin + plan.drop;
  const auto index = static_cast<int32_t>(l);
  kivi_->Append(index, layer.pages, first, keys, plan.drop_begin, batch_);
  kivi_->Append(index, layer.pages, first + plan.drop_begin,
                keys + tail * e_count, n - tail, batch_);
}

absl::StatusOr<LayerKvCopy> Session::ReadKiviLayerAs(int32_t index,
                                                     DType dtype) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  const Layer& layer = layers_[index];
  const int64_t n = layer.size();
  std::vector<std::byte> records(n * page_layout_.token_bytes());
  if (absl::Status s = DeviceCheck(pool_->memory().ReadSlots(
          page_layout_, layer.pages, 0, n, nullptr, records.data()));
      !s.ok()) {
    return s;
  }
  LayerKvCopy out;
  out.version = layer.version;
  out.positions = layer.position;
  out.dtype = dtype;
  const size_t bytes = static_cast<size_t>(n * page_layout_.token_elements() *
                                           DTypeBytes(dtype));
  out.keys.resize(bytes);
  out.values.resize(bytes);
  if (absl::Status s = DeviceCheck(
          kivi_->Read(layer.pages, n, pool_->memory(), dtype, out.keys.data()));
      !s.ok()) {
    return s;
  }
  DequantizeTokens(page_layout_, records.data(), n, dtype, out.values.data());
  return out;
}

void Session::SnapshotKivi(int32_t index, LayerSnapshot& out) const {
  const int64_t n = layers_[index].size();
  const int32_t p = page_layout_.page_tokens;
  out.keys.resize(
      static_cast<size_t>((n + p - 1) / p * page_layout_.key_block_bytes()));
  out.values.resize(static_cast<size_t>(n * page_layout_.token_bytes()));
  // A device error leaves the bytes unread; the caller sees device_error().
  ReadKiviSlots(index, 0, out.keys, out.values).IgnoreError();
}

absl::StatusOr<int64_t> Session::KiviRun(int32_t index, int64_t first,
                                         size_t key_bytes,
                                         size_t value_bytes) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  const int64_t size = layers_[index].size();
  const int32_t p = page_layout_.page_tokens;
  const int64_t token_bytes = page_layout_.token_bytes();
  const int64_t block_bytes = page_layout_.key_block_bytes();
  const int64_t n = static_cast<int64_t>(value_bytes) / token_bytes;
  if (static_cast<int64_t>(value_bytes) != n * token_bytes || first < 0 ||
      first % p != 0 || first + n > size ||
      ((first + n) % p != 0 && first + n != size) ||
      static_cast<int64_t>(key_bytes) != (n + p - 1) / p * block_bytes) {
    return absl::InvalidArgumentError(SessionMessage(
        id_, "layer ", index, ": ", key_bytes, " key and ", value_bytes,
        " value bytes at slot ", first,
        " are not whole kivi_int4 pages of its ", size, " slots (", block_bytes,
        " key block bytes a page, ", token_bytes,
        " value bytes a token, from a page's first slot to a page's end or "
        "the layer's)"));
  }
  return n;
}

absl::Status Session::ReadKiviSlots(int32_t index, int64_t first,
                                    std::span<std::byte> keys,
                                    std::span<std::byte> values) const {
  absl::StatusOr<int64_t> n = KiviRun(index, first, keys.size(), values.size());
  if (!n.ok()) return n.status();
  return DeviceCheck(pool_->memory().ReadSlots(page_layout_,
                                               layers_[index].pages, first, *n,
                                               keys.data(), values.data()));
}

absl::Status Session::WriteKiviSlots(int32_t index, int64_t first,
                                     std::span<const std::byte> keys,
                                     std::span<const std::byte> values) {
  absl::StatusOr<int64_t> n = KiviRun(index, first, keys.size(), values.size());
  if (!n.ok()) return n.status();
  return DeviceCheck(pool_->memory().WriteSlots(page_layout_,
                                                layers_[index].pages, first, *n,
                                                keys.data(), values.data()));
}

absl::Status Session::CheckKiviPages() const {
  if (kivi_ == nullptr) return absl::OkStatus();
  const int32_t p = page_layout_.page_tokens;
  const int64_t e_count = page_layout_.token_elements();
  const int64_t block_bytes = page_layout_.key_block_bytes();
  std::vector<std::byte> blocks;
  std::vector<std::byte> block(static_cast<size_t>(block_bytes));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    blocks.resize(layer.pages.size() * static_cast<size_t>(block_bytes));
    if (absl::Status s = DeviceCheck(pool_->memory().ReadKeyBlocks(
            page_layout_, layer.pages, blocks.data()));
        !s.ok()) {
      return s;
    }
    // Every block's scales (finite, not negative) and zero points (int4).
    for (size_t b = 0; b < layer.pages.size(); ++b) {
      const std::byte* at = blocks.data() + b * block_bytes;
      for (int64_t c = 0; c < e_count; ++c) {
        uint16_t scale = 0;
        std::memcpy(&scale, at + page_layout_.key_scales_offset() + 2 * c, 2);
        const auto zero =
            static_cast<uint8_t>(at[page_layout_.key_zeros_offset() + c]);
        if (!(F16ToFloat(scale) >= 0.0f) || (scale & 0x7c00) == 0x7c00 ||
            zero > 15) {
          return absl::InvalidArgumentError(SessionMessage(
              id_, "layer ", l, ": a kivi_int4 key block has channel ", c,
              " scale ", F16ToFloat(scale), " and zero point ", int{zero},
              " (scales are finite binary16, not negative; zero points 0-15)"));
        }
      }
    }
    const std::span<const float> staging =
        kivi_->staging(static_cast<int32_t>(l));
    if (staging.empty()) continue;
    const int64_t open = layer.size() / p;
    const KiviResult r =
        QuantizeKiviKeys(page_layout_, staging.data(),
                         static_cast<int32_t>(layer.size() % p), block.data());
    if (!r.ok() || std::memcmp(block.data(), blocks.data() + open * block_bytes,
                               block.size()) != 0) {
      return absl::InvalidArgumentError(SessionMessage(
          id_, "layer ", l,
          ": the open page's kivi_int4 key block is not the quantisation of "
          "its staging (damaged or mismatched snapshot bytes)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckKiviPolicy(const ModelLayout& layout,
                             absl::string_view policy) {
  if (!IsKivi(layout.dtype) || policy == "full" || policy == "h2o_page") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "layout '", layout.name,
      "' stores kivi_int4 (keys per channel by "
      "page), which takes the policies full and h2o_page only: policy '",
      policy,
      "' evicts token by token, and every token compaction moves "
      "re-quantises its new page from keys already rounded once "
      "(docs/quantization.md)"));
}

}  // namespace kvkeep
