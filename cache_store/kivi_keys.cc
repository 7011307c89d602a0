#include "cache_store/kivi_keys.h"

#include <algorithm>
#include <cstring>

namespace kvkeep {

KiviKeys::KiviKeys(const PageLayout& layout, int32_t layers)
    : layout_(layout),
      open_(static_cast<size_t>(layers), KiviOpenPage(layout)) {}

const std::byte* KiviKeys::BlockOf(PageId page, const std::byte* arena) const {
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    if (it->first == page) return it->second;
  }
  return arena + int64_t{page} * layout_.page_bytes();
}

std::byte* KiviKeys::NewBlock(PageId page, StepBatch& batch) {
  std::vector<std::byte>& block =
      blocks_.emplace_back(static_cast<size_t>(layout_.key_block_bytes()));
  pending_.emplace_back(page, block.data());
  batch.AddKeyBlock(page, block.data());
  return block.data();
}

void KiviKeys::Append(int32_t layer, std::span<const PageId> pages,
                      int64_t first, const float* keys, int64_t n,
                      const std::byte* arena, StepBatch& batch) {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  KiviOpenPage& open = open_[layer];
  for (int64_t done = 0; done < n;) {
    const int64_t slot = first + done;
    const int32_t chunk =
        static_cast<int32_t>(std::min<int64_t>(n - done, p - slot % p));
    // Checked on append (AppendQuantizer: finite, within kKiviKeyMax), so
    // every channel's range fits a binary16 scale.
    open.Append(keys + done * e_count, chunk, NewBlock(pages[slot / p], batch));
    done += chunk;
  }
}

void KiviKeys::Compact(int32_t layer, std::span<const PageId> pages,
                       std::span<const SlotMove> moves, int64_t old_size,
                       int64_t new_size, const std::byte* arena,
                       StepBatch& batch) {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  KiviOpenPage& open = open_[layer];
  const int64_t open_first = old_size - open.tokens();
  // Key of slot `slot` before the moves: the staging's exact value for the
  // open page, else the block's (dequantised).
  auto key_of = [&](int64_t slot, float* dst) {
    if (slot >= open_first) {
      std::memcpy(dst, open.keys() + (slot - open_first) * e_count,
                  sizeof(float) * e_count);
      return;
    }
    DequantizeKiviKeys(layout_, BlockOf(pages[slot / p], arena),
                       static_cast<int32_t>(slot % p), 1, DType::kF32, dst);
  };
  // Pages the moves write (moves come in increasing target order), and the
  // new open page, whose staging is rebuilt.
  std::vector<int64_t> dirty;
  for (const SlotMove& m : moves) {
    if (dirty.empty() || dirty.back() != m.to_slot / p) {
      dirty.push_back(m.to_slot / p);
    }
  }
  const int64_t new_open = new_size % p != 0 ? new_size / p : -1;
  if (new_open >= 0 &&
      !std::binary_search(dirty.begin(), dirty.end(), new_open)) {
    dirty.push_back(new_open);
  }
  std::vector<float> staging;
  for (int64_t d : dirty) {
    const int64_t begin = d * p;
    const int32_t count =
        static_cast<int32_t>(std::min<int64_t>(p, new_size - begin));
    scratch_.resize(static_cast<size_t>(count * e_count));
    for (int32_t i = 0; i < count; ++i) {
      const int64_t s = begin + i;
      const auto m = std::lower_bound(
          moves.begin(), moves.end(), s,
          [](const SlotMove& a, int64_t to) { return a.to_slot < to; });
      const int64_t from =
          m != moves.end() && m->to_slot == s ? m->from_slot : s;
      key_of(from, scratch_.data() + i * e_count);
    }
    if (d == new_open) staging = scratch_;
    // Dequantised keys lie within their old channel's range (a code's
    // step past it at most), so the new range fits a binary16 scale too.
    QuantizeKiviKeys(layout_, scratch_.data(), count,
                     NewBlock(pages[d], batch));
  }
  open.Reset(staging.data(),
             new_open >= 0 ? static_cast<int32_t>(new_size % p) : 0);
}

void KiviKeys::Read(std::span<const PageId> pages, int64_t n,
                    const std::byte* arena, DType out_type, void* out) const {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  const int64_t row_bytes = e_count * DTypeBytes(out_type);
  for (int64_t first = 0; first < n; first += p) {
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(p, n - first));
    DequantizeKiviKeys(layout_, BlockOf(pages[first / p], arena), 0, count,
                       out_type,
                       static_cast<std::byte*>(out) + first * row_bytes);
  }
}

int64_t KiviKeys::staging_bytes() const {
  int64_t bytes = 0;
  for (const KiviOpenPage& open : open_) bytes += open.bytes();
  return bytes;
}

void KiviKeys::BatchDone() {
  blocks_.clear();
  pending_.clear();
}

}  // namespace kvkeep
