// KiviKeys: the keys of one kivi_int4 session (KIVI: keys int4 per channel
// over a page's tokens; kernels/kivi.h has the key block). Per layer it keeps
// the float32 keys of the open (last, partly filled) page, the store's form
// of KIVI's full-precision window, and records into the session's StepBatch
// the key blocks of every page whose tokens change:
//   - an append re-quantises the open page from its tokens' exact inputs
//     and quantises every page it fills, so a page in the pool is always a
//     valid kivi page (a MapPool reader never needs the staging);
//   - compaction moves values as records (kernels/compaction.h) and
//     re-quantises the key block of every page the moves write, from the
//     moved tokens' keys: exact for those of the open page, dequantised
//     (rounded once before) for the others, so their error compounds; the
//     new open page's staging is rebuilt the same way.
// The blocks it reads (compaction's sources, reads) come from the pool's
// PageMemory, host or device, one ReadKeyBlocks call each, unless the batch
// being recorded already replaces them.
// One per session, used under the session's lock; not thread-safe.
#ifndef KVKEEP_CACHE_STORE_KIVI_KEYS_H_
#define KVKEEP_CACHE_STORE_KIVI_KEYS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_store/page_memory.h"
#include "cache_store/step_batch.h"
#include "kernels/compaction.h"
#include "kernels/kivi.h"
#include "kernels/page_layout.h"

namespace kvkeep {

class KiviKeys {
 public:
  KiviKeys(const PageLayout& layout, int32_t layers);

  // Keys [n][E] float32 (finite, |x| <= AppendQuantizer::kKiviKeyMax) of n
  // tokens appended at slots [first, first + n) of `layer`, whose block
  // table `pages` covers them; `first` is the layer's size before.
  void Append(int32_t layer, std::span<const PageId> pages, int64_t first,
              const float* keys, int64_t n, StepBatch& batch);
  // After `moves` (PlanCompaction over old_size slots of `pages`, leaving
  // new_size) are recorded into `batch`. Fails only on a device error
  // reading `memory` (nothing is recorded then).
  absl::Status Compact(int32_t layer, std::span<const PageId> pages,
                       std::span<const SlotMove> moves, int64_t old_size,
                       int64_t new_size, PageMemory& memory, StepBatch& batch);
  // Keys of slots [0, n) of `layer` as [n][E] of out_type (f32, f16, bf16).
  // Fails only on a device error.
  absl::Status Read(std::span<const PageId> pages, int64_t n,
                    PageMemory& memory, DType out_type, void* out) const;

  // Host bytes of the staging (counted in the session's resident bytes),
  // and the most it can hold: an open page per layer
  // (KiviOpenPage::OpenBytes).
  int64_t staging_bytes() const;
  int64_t max_staging_bytes() const {
    return MaxStagingBytes(layout_, static_cast<int32_t>(open_.size()));
  }
  static int64_t MaxStagingBytes(const PageLayout& layout, int32_t layers) {
    return int64_t{layers} * KiviOpenPage::OpenBytes(layout);
  }
  // The batch has run: the blocks it borrowed are released.
  void BatchDone();
  // The batch copies page `from` to `to` before anything writes `to`
  // (copy-on-write): until it has run, `to`'s keys are read from `from`.
  void PageCopied(PageId from, PageId to) {
    pending_.push_back(Pending{to, nullptr, from});
  }
  // A fork's keys: `parent`'s staging (same layout and layers), so the
  // child re-quantises its open pages as the parent would.
  void CopyStaging(const KiviKeys& parent) { open_ = parent.open_; }
  // A layer's staging as a snapshot carries it ([tokens][E] float32), and
  // back (a restored session's; n tokens, < page_tokens).
  std::span<const float> staging(int32_t layer) const {
    const KiviOpenPage& open = open_[layer];
    return {open.keys(),
            static_cast<size_t>(open.tokens() * layout_.token_elements())};
  }
  void RestoreStaging(int32_t layer, std::span<const float> keys) {
    open_[layer].Reset(keys.data(),
                       static_cast<int32_t>(static_cast<int64_t>(keys.size()) /
                                            layout_.token_elements()));
  }

 private:
  // What the batch recorded so far does to a page's block: writes `block`
  // (a buffer in blocks_), or copies page `from`'s over it.
  struct Pending {
    PageId page = 0;
    const std::byte* block = nullptr;
    PageId from = 0;
  };
  // The blocks of `pages` as the batch will leave them so
  // far, in order: pending ones from their buffers, the rest read from
  // `memory` with one call into `fetched`.
  absl::StatusOr<std::vector<const std::byte*>> BlocksOf(
      std::span<const PageId> pages, PageMemory& memory,
      std::vector<std::byte>& fetched) const;
  // A block buffer that stays valid until BatchDone.
  std::byte* NewBlock(PageId page, StepBatch& batch);

  const PageLayout layout_;
  std::vector<KiviOpenPage> open_;
  std::deque<std::vector<std::byte>> blocks_;
  std::vector<Pending> pending_;
  std::vector<float> scratch_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_KIVI_KEYS_H_
