#include "services/lm/kivi_kv.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/quantize.h"

namespace kvkeep::lm {
namespace {

// Which of the call's new tokens layer change `c` kept (in position order).
std::vector<int64_t> KeptNew(const v1::LayerChange& c,
                             absl::Span<const int64_t> positions) {
  std::vector<int64_t> kept;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (!std::binary_search(c.evicted_positions().begin(),
                            c.evicted_positions().end(), positions[i])) {
      kept.push_back(static_cast<int64_t>(i));
    }
  }
  return kept;
}

}  // namespace

KiviKv::KiviKv(const PageLayout& layout, int32_t layers, DType append_dtype,
               bool mapped)
    : layout_(layout),
      append_dtype_(append_dtype),
      mapped_(mapped),
      slots_(layers, layout.token_elements() * int64_t{sizeof(float)}),
      open_(static_cast<size_t>(layers), KiviOpenPage(layout)),
      seen_(static_cast<size_t>(layers)) {}

absl::Status KiviKv::Widen(absl::Span<const int64_t> positions,
                           absl::Span<const std::string> keys,
                           absl::Span<const std::string> values,
                           std::vector<std::string>* keys_f32,
                           std::vector<std::string>* values_f32) const {
  if (positions.empty()) return absl::OkStatus();
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t e_count = layout_.token_elements();
  const int64_t in_bytes = n * e_count * DTypeBytes(append_dtype_);
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "new keys for ", keys.size(), " layers, values for ", values.size()));
  }
  std::vector<std::byte> scratch(n * layout_.token_bytes());
  for (size_t l = 0; l < keys.size(); ++l) {
    if (static_cast<int64_t>(keys[l].size()) != in_bytes ||
        static_cast<int64_t>(values[l].size()) != in_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, ": ", keys[l].size(), " key and ", values[l].size(),
          " value bytes for ", n, " tokens of ", in_bytes / n));
    }
    for (int kind = 0; kind < 2; ++kind) {
      const std::string& in = kind == 0 ? keys[l] : values[l];
      std::string& out = (kind == 0 ? keys_f32 : values_f32)->emplace_back();
      out.resize(n * e_count * sizeof(float));
      if (kind == 1 && !mapped_) {  // what the store holds of the values
        if (!QuantizeTokens(layout_, append_dtype_, in.data(), n,
                            scratch.data())
                 .ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", l, ": a value the store would refuse"));
        }
        DequantizeTokens(layout_, scratch.data(), n, DType::kF32, out.data());
        continue;
      }
      for (int64_t e = 0; e < n * e_count; ++e) {
        StoreFromFloat(DType::kF32, out.data(), e,
                       LoadAsFloat(append_dtype_, in.data(), e));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KiviKv::Apply(const v1::StepResult& result,
                           absl::Span<const int64_t> positions,
                           absl::Span<const std::string> keys,
                           absl::Span<const std::string> values) {
  const int32_t layers = slots_.num_layers();
  std::vector<std::string> keys_f32, values_f32;
  if (absl::Status s = Widen(positions, keys, values, &keys_f32, &values_f32);
      !s.ok()) {
    return s;
  }
  // Mirrored: what each layer's compaction writes, from the keys before
  // the moves.
  std::vector<KeyCompaction> compactions(layers);
  std::vector<int64_t> before(layers);
  for (int32_t l = 0; l < layers; ++l) before[l] = slots_.resident(l);
  for (int32_t l = 0; !mapped_ && l < std::min(layers, result.layers_size());
       ++l) {
    const v1::LayerChange& c = result.layers(l);
    const int64_t kept_old =
        c.resident() - static_cast<int64_t>(KeptNew(c, positions).size());
    if (kept_old >= 0 && kept_old < before[l]) {
      compactions[l] = Compact(l, c, kept_old);
    }
  }
  if (absl::Status s = slots_.Apply(result, positions, keys_f32, values_f32);
      !s.ok()) {
    return s;
  }
  const int64_t row = layout_.token_elements() * int64_t{sizeof(float)};
  for (int32_t l = 0; l < layers; ++l) {
    const v1::LayerChange& c = result.layers(l);
    const std::vector<int64_t> kept = KeptNew(c, positions);
    const int64_t first = c.resident() - static_cast<int64_t>(kept.size());
    if (mapped_) {
      Invalidate(l, c, first);
      continue;
    }
    if (first < before[l]) {
      const KeyCompaction& k = compactions[l];
      for (const auto& [index, page_keys] : k.pages) {
        std::memcpy(slots_.mutable_key(l, index * layout_.page_tokens),
                    page_keys.data(), page_keys.size() * sizeof(float));
      }
      open_[l].Reset(k.staging.data(), k.staging_tokens);
    }
    if (kept.empty()) continue;
    std::vector<float> new_keys(kept.size() * layout_.token_elements());
    for (size_t j = 0; j < kept.size(); ++j) {
      std::memcpy(&new_keys[j * layout_.token_elements()],
                  keys_f32[l].data() + kept[j] * row, row);
    }
    if (absl::Status s = Append(l, first, new_keys.data(),
                                static_cast<int64_t>(kept.size()));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void KiviKv::Invalidate(int32_t l, const v1::LayerChange& change,
                        int64_t first) {
  const int32_t p = layout_.page_tokens;
  std::vector<SeenPage>& seen = seen_[l];
  const auto forget = [&](int64_t slot) {
    if (slot / p < static_cast<int64_t>(seen.size())) seen[slot / p].slots = -1;
  };
  for (const v1::SlotMove& m : change.moves()) forget(m.to_slot());
  for (int64_t s = first; s < change.resident(); s += p - s % p) forget(s);
}

KiviKv::KeyCompaction KiviKv::Compact(int32_t l, const v1::LayerChange& change,
                                      int64_t new_size) const {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  const int64_t old_size = slots_.resident(l);
  const KiviOpenPage& open = open_[l];
  const int64_t open_first = old_size - open.tokens();
  // Slot s's token before the moves, for every slot left.
  std::vector<int64_t> from(new_size);
  std::iota(from.begin(), from.end(), int64_t{0});
  std::vector<int64_t> dirty;  // page indexes, increasing
  for (const v1::SlotMove& m : change.moves()) {
    if (m.to_slot() < 0 || m.to_slot() >= new_size || m.from_slot() < 0 ||
        m.from_slot() >= old_size) {
      return {};  // SlotCache::Apply refuses it
    }
    from[m.to_slot()] = m.from_slot();
    if (dirty.empty() || dirty.back() != m.to_slot() / p) {
      dirty.push_back(m.to_slot() / p);
    }
  }
  const int64_t new_open = new_size % p != 0 ? new_size / p : -1;
  if (new_open >= 0 &&
      std::find(dirty.begin(), dirty.end(), new_open) == dirty.end()) {
    dirty.push_back(new_open);
  }
  KeyCompaction out;
  std::vector<std::byte> block(layout_.key_block_bytes());
  for (int64_t d : dirty) {
    const int64_t begin = d * p;
    const auto count =
        static_cast<int32_t>(std::min<int64_t>(p, new_size - begin));
    std::vector<float> gathered(count * e_count);
    for (int32_t i = 0; i < count; ++i) {
      const int64_t f = from[begin + i];
      // The staging's exact key for the open page, else the decoded one.
      const auto* src = f >= open_first
                            ? open.keys() + (f - open_first) * e_count
                            : reinterpret_cast<const float*>(slots_.key(l, f));
      std::memcpy(&gathered[i * e_count], src, e_count * sizeof(float));
    }
    // Decoded keys lie within their channel's old range, so this fits.
    QuantizeKiviKeys(layout_, gathered.data(), count, block.data());
    std::vector<float>& keys = out.pages.emplace_back(d, gathered).second;
    DequantizeKiviKeys(layout_, block.data(), 0, count, DType::kF32,
                       keys.data());
    if (d == new_open) {
      out.staging = std::move(gathered);
      out.staging_tokens = count;
    }
  }
  return out;
}

absl::Status KiviKv::Append(int32_t l, int64_t first, const float* keys,
                            int64_t n) {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  std::vector<std::byte> block(layout_.key_block_bytes());
  for (int64_t done = 0; done < n;) {
    const int64_t slot = first + done;
    const auto chunk =
        static_cast<int32_t>(std::min<int64_t>(n - done, p - slot % p));
    // The store's staging starts at the page's first slot, as this one.
    const int32_t rows = open_[l].tokens() + chunk;
    if (open_[l].tokens() != slot % p) {
      return absl::InternalError(
          absl::StrCat("layer ", l, ": the open page holds ", open_[l].tokens(),
                       " tokens where slot ", slot, " is appended"));
    }
    if (!open_[l].Append(keys + done * e_count, chunk, block.data()).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, ": a key of slot ", slot, "'s page the store refuses"));
    }
    DequantizeKiviKeys(layout_, block.data(), 0, rows, DType::kF32,
                       slots_.mutable_key(l, slot - slot % p));
    done += chunk;
  }
  return absl::OkStatus();
}

absl::Status KiviKv::Decode(absl::Span<const ResidentKv> pool) {
  if (static_cast<int32_t>(pool.size()) != slots_.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the pool names ", pool.size(), " layers of ", slots_.num_layers()));
  }
  for (int32_t l = 0; l < slots_.num_layers(); ++l) {
    if (pool[l].resident != slots_.resident(l) ||
        pool[l].page_tokens != layout_.page_tokens ||
        pool[l].page_bytes != layout_.page_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, ": the pool holds ", pool[l].resident,
          " slots in pages of ", pool[l].page_bytes, " bytes, the results ",
          slots_.resident(l), " in pages of ", layout_.page_bytes()));
    }
    DecodeLayer(l, pool[l]);
  }
  return absl::OkStatus();
}

void KiviKv::DecodeLayer(int32_t l, const ResidentKv& view) {
  const int32_t p = layout_.page_tokens;
  const int64_t n = view.resident;
  const int64_t pages = (n + p - 1) / p;
  std::vector<SeenPage>& seen = seen_[l];
  seen.resize(pages);
  for (int64_t i = 0; i < pages; ++i) {
    const int64_t count = std::min<int64_t>(p, n - i * p);
    const std::byte* page = view.arena + view.pages[i] * view.page_bytes;
    SeenPage& s = seen[i];
    if (s.slots == count &&
        std::memcmp(s.bytes.data(), page, s.bytes.size()) == 0) {
      continue;
    }
    s.bytes.assign(page, page + view.page_bytes);
    s.slots = count;
    DequantizeKiviKeys(layout_, page, 0, static_cast<int32_t>(count),
                       DType::kF32, slots_.mutable_key(l, i * p));
    DequantizeTokens(layout_, page + layout_.key_block_bytes(), count,
                     DType::kF32, slots_.mutable_value(l, i * p));
  }
}

}  // namespace kvkeep::lm
