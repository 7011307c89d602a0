#include "cache_store/kivi_keys.h"

#include <algorithm>
#include <cstring>

namespace kvkeep {

KiviKeys::KiviKeys(const PageLayout& layout, int32_t layers)
    : layout_(layout),
      open_(static_cast<size_t>(layers), KiviOpenPage(layout)) {}

absl::StatusOr<std::vector<const std::byte*>> KiviKeys::BlocksOf(
    std::span<const PageId> pages, PageMemory& memory,
    std::vector<std::byte>& fetched) const {
  std::vector<const std::byte*> blocks(pages.size(), nullptr);
  std::vector<PageId> reads;  // the pool pages to read, for blocks[read_for]
  std::vector<size_t> read_for;
  for (size_t i = 0; i < pages.size(); ++i) {
    // Newest first: a written block ends the search; a copy sends it on to
    // the page copied from, as it stood before the copy was recorded.
    PageId page = pages[i];
    for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
      if (it->page != page) continue;
      if (it->block != nullptr) {
        blocks[i] = it->block;
        break;
      }
      page = it->from;
    }
    if (blocks[i] == nullptr) {
      reads.push_back(page);
      read_for.push_back(i);
    }
  }
  if (reads.empty()) return blocks;
  const int64_t bytes = layout_.key_block_bytes();
  fetched.resize(static_cast<size_t>(bytes) * reads.size());
  if (absl::Status s = memory.ReadKeyBlocks(layout_, reads, fetched.data());
      !s.ok()) {
    return s;
  }
  for (size_t j = 0; j < reads.size(); ++j) {
    blocks[read_for[j]] = fetched.data() + j * bytes;
  }
  return blocks;
}

std::byte* KiviKeys::NewBlock(PageId page, StepBatch& batch) {
  std::vector<std::byte>& block =
      blocks_.emplace_back(static_cast<size_t>(layout_.key_block_bytes()));
  pending_.push_back(Pending{page, block.data(), 0});
  batch.AddKeyBlock(page, block.data());
  return block.data();
}

void KiviKeys::Append(int32_t layer, std::span<const PageId> pages,
                      int64_t first, const float* keys, int64_t n,
                      StepBatch& batch) {
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

absl::Status KiviKeys::Compact(int32_t layer, std::span<const PageId> pages,
                               std::span<const SlotMove> moves,
                               int64_t old_size, int64_t new_size,
                               PageMemory& memory, StepBatch& batch) {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  KiviOpenPage& open = open_[layer];
  const int64_t open_first = old_size - open.tokens();
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
  // Where each dirty slot's key comes from, and the blocks those below the
  // open page lie in, read before any block is replaced (sources are at or
  // above new_size, in the new open page at the earliest, which comes last).
  std::vector<int64_t> sources;
  std::vector<PageId> wanted;
  for (int64_t d : dirty) {
    const int64_t end = std::min<int64_t>((d + 1) * p, new_size);
    for (int64_t s = d * p; s < end; ++s) {
      const auto m = std::lower_bound(
          moves.begin(), moves.end(), s,
          [](const SlotMove& a, int64_t to) { return a.to_slot < to; });
      const int64_t from =
          m != moves.end() && m->to_slot == s ? m->from_slot : s;
      sources.push_back(from);
      if (from < open_first) wanted.push_back(pages[from / p]);
    }
  }
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::vector<std::byte> fetched;
  absl::StatusOr<std::vector<const std::byte*>> blocks =
      BlocksOf(wanted, memory, fetched);
  if (!blocks.ok()) return blocks.status();
  // Key of slot `slot` before the moves: the staging's exact value for the
  // open page, else the block's (dequantised).
  auto key_of = [&](int64_t slot, float* dst) {
    if (slot >= open_first) {
      std::memcpy(dst, open.keys() + (slot - open_first) * e_count,
                  sizeof(float) * e_count);
      return;
    }
    const size_t at = static_cast<size_t>(
        std::lower_bound(wanted.begin(), wanted.end(), pages[slot / p]) -
        wanted.begin());
    DequantizeKiviKeys(layout_, (*blocks)[at], static_cast<int32_t>(slot % p),
                       1, DType::kF32, dst);
  };
  std::vector<float> staging;
  size_t next = 0;
  for (int64_t d : dirty) {
    const int32_t count =
        static_cast<int32_t>(std::min<int64_t>(p, new_size - d * p));
    scratch_.resize(static_cast<size_t>(count * e_count));
    for (int32_t i = 0; i < count; ++i) {
      key_of(sources[next++], scratch_.data() + i * e_count);
    }
    if (d == new_open) staging = scratch_;
    // Dequantised keys lie within their old channel's range (a code's
    // step past it at most), so the new range fits a binary16 scale too.
    QuantizeKiviKeys(layout_, scratch_.data(), count,
                     NewBlock(pages[d], batch));
  }
  open.Reset(staging.data(),
             new_open >= 0 ? static_cast<int32_t>(new_size % p) : 0);
  return absl::OkStatus();
}

absl::Status KiviKeys::Read(std::span<const PageId> pages, int64_t n,
                            PageMemory& memory, DType out_type,
                            void* out) const {
  const int32_t p = layout_.page_tokens;
  const int64_t e_count = layout_.token_elements();
  const int64_t row_bytes = e_count * DTypeBytes(out_type);
  const auto used = static_cast<size_t>((n + p - 1) / p);
  std::vector<std::byte> fetched;
  absl::StatusOr<std::vector<const std::byte*>> blocks =
      BlocksOf(pages.first(used), memory, fetched);
  if (!blocks.ok()) return blocks.status();
  for (int64_t first = 0; first < n; first += p) {
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(p, n - first));
    DequantizeKiviKeys(layout_, (*blocks)[first / p], 0, count, out_type,
                       static_cast<std::byte*>(out) + first * row_bytes);
  }
  return absl::OkStatus();
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
