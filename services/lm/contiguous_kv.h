// ContiguousKv: one sequence's KV cache in plain memory, every layer one
// page that holds up to `capacity_tokens` slots (the layout of
// kernels/page_layout.h with page_tokens = capacity). Slots are appended in
// order and never evicted. For the dev tool, tests and benchmarks: the
// worker keeps its cache in kvkeepd.
//
// Owns its bytes; a view from Layer stays valid until the next Append or
// the cache's destruction. Not thread-safe.
#ifndef KVKEEP_SERVICES_LM_CONTIGUOUS_KV_H_
#define KVKEEP_SERVICES_LM_CONTIGUOUS_KV_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/dtype.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

class ContiguousKv : public KvSource {
 public:
  // A float format holds the bytes a step hands back; a quantised one the
  // token records the CPU twin makes of them (what kvkeepd would store).
  ContiguousKv(const ModelConfig& config, const KvFormat& format,
               int64_t capacity_tokens);

  // Appends the new keys and values a Forward wrote into `step`, with their
  // positions. OUT_OF_RANGE (nothing appended) past the capacity;
  // INVALID_ARGUMENT when the step's keys do not have this cache's shape.
  absl::Status Append(const SequenceStep& step);

  int64_t resident() const { return static_cast<int64_t>(positions_.size()); }
  int64_t capacity_tokens() const { return capacity_tokens_; }
  int64_t token_bytes() const { return token_bytes_; }
  // Layer `layer`'s arena: [2 (K, V)][capacity][kv_heads][head_dim].
  const std::vector<std::byte>& arena(int32_t layer) const {
    return arenas_[layer];
  }
  std::byte* mutable_arena(int32_t layer) { return arenas_[layer].data(); }
  // Every layer's resident keys and values, in bytes.
  int64_t held_bytes() const {
    return static_cast<int64_t>(arenas_.size()) * 2 * resident() * token_bytes_;
  }

  ResidentKv Layer(int32_t layer) const override;

 private:
  int64_t capacity_tokens_;
  PageLayout layout_;  // page_tokens unused
  DType append_dtype_;
  int64_t token_bytes_;                         // one token's keys as held
  int64_t append_bytes_;                        // ... as a step hands them back
  std::vector<std::vector<std::byte>> arenas_;  // [layer]
  std::vector<int64_t> positions_;              // [resident]
  static constexpr int32_t kPage[1] = {0};
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_CONTIGUOUS_KV_H_
