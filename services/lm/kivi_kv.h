// KiviKv: a kvkeepd session of a kivi_int4 layout as kvkeep-lm's forward
// pass reads it: every resident slot's keys and values decoded to float32
// (kernels/kivi.h's key blocks, kernels/quantize.h's int4 value records), in
// a SlotCache of float32 tokens. The forward pass reads it as an f32 cache
// (KvFormat::Forward), so a step's own tokens stay unrounded in that step, as
// KIVI and the emulation (--emulate=kivi_int4/gG/tT/store) leave them.
//
// It follows each of the session's StepResults in one of two ways:
//  - mapped: the pages are decoded from kvkeepd's pool in place (MapPool),
//    those whose bytes changed since they were last decoded;
//  - mirrored: it does what the store does (cache_store/kivi_keys.h) to the
//    keys the worker sent (in the layout's append dtype): values quantised
//    per token, keys quantised per channel over their page from the open
//    page's exact keys (the store's staging, which it keeps too) on every
//    append, and after an eviction the key block of every page the moves
//    write quantised again from the moved keys (exact for the open page's,
//    decoded for the others), so it holds what the pool holds without
//    reading it.
// Not thread-safe: one thread drives a sequence.
#ifndef KVKEEP_SERVICES_LM_KIVI_KV_H_
#define KVKEEP_SERVICES_LM_KIVI_KV_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kivi.h"
#include "kernels/page_layout.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/lm/kv_caches.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

class KiviKv final : public KvSource {
 public:
  // layout: the session's (dtype kivi_int4, its page_tokens and group_size);
  // append_dtype: what the worker sends (f32, f16 or bf16); mapped: decode
  // the pool's pages (Decode) instead of quantising what was sent.
  KiviKv(const PageLayout& layout, int32_t layers, DType append_dtype,
         bool mapped);

  ResidentKv Layer(int32_t layer) const override { return slots_.Layer(layer); }

  // Follows one call's result as SlotCache::Apply does; `keys` and `values`
  // are the call's new tokens in the append dtype. Mirrored, the slots then
  // hold what the store made of them; mapped, the slots the result wrote
  // wait for Decode. INVALID_ARGUMENT, nothing changed, when the change
  // does not fit.
  absl::Status Apply(const v1::StepResult& result,
                     absl::Span<const int64_t> positions = {},
                     absl::Span<const std::string> keys = {},
                     absl::Span<const std::string> values = {});
  // Mapped, after the results of a call are applied: `pool` is every layer
  // of the session as MappedPool::Layer names it; the slots of every page
  // whose bytes changed since it was last decoded (or that a result wrote)
  // are decoded. INVALID_ARGUMENT when a layer's slots differ from the
  // results'.
  absl::Status Decode(absl::Span<const ResidentKv> pool);

 private:
  // A layer's compaction as the mirror redoes it: the keys of the pages it
  // quantises again (by page index), and the new open page's staging.
  struct KeyCompaction {
    std::vector<std::pair<int64_t, std::vector<float>>> pages;
    std::vector<float> staging;
    int32_t staging_tokens = 0;
  };
  // The call's new tokens widened to float32 ([n][E] per layer), values
  // through the int4 records when mirroring.
  absl::Status Widen(absl::Span<const int64_t> positions,
                     absl::Span<const std::string> keys,
                     absl::Span<const std::string> values,
                     std::vector<std::string>* keys_f32,
                     std::vector<std::string>* values_f32) const;
  // Mirrored, before SlotCache::Apply: layer l's compaction from its size
  // to new_size slots, from the keys before the moves (empty when the
  // change does not fit; SlotCache::Apply then refuses it).
  KeyCompaction Compact(int32_t l, const v1::LayerChange& change,
                        int64_t new_size) const;
  // Mirrored, after: the kept new keys of layer l ([n][E] float32) appended
  // at slot `first`, their pages quantised from the staging.
  absl::Status Append(int32_t l, int64_t first, const float* keys, int64_t n);
  // Mapped: the pages of layer l the result wrote are decoded whatever
  // their bytes (their slots' float32 came from elsewhere).
  void Invalidate(int32_t l, const v1::LayerChange& change, int64_t first);
  void DecodeLayer(int32_t l, const ResidentKv& view);

  PageLayout layout_;
  DType append_dtype_;
  bool mapped_;
  SlotCache slots_;  // float32 tokens
  // Mirrored: per layer, the open page's exact keys (the store's staging).
  std::vector<KiviOpenPage> open_;
  // Mapped: per layer and page index, the page's bytes and slots as last
  // decoded.
  struct SeenPage {
    std::vector<std::byte> bytes;
    int64_t slots = 0;
  };
  std::vector<std::vector<SeenPage>> seen_;
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_KIVI_KV_H_
