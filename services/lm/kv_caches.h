// The two places kvkeep-lm's forward pass reads a sequence's resident keys
// and values from (model.h's KvSource):
//
//  - SlotCache: the mirror of a kvkeepd session that the worker cannot
//    map, one contiguous buffer per layer in slot order: it follows each
//    call's LayerChange (moves, then the kept slots, then the kept new
//    tokens) with the bytes the worker sent, so it holds what the store
//    holds. (--local keeps its cache in a ContiguousKv, which never evicts.)
//  - MappedPool: kvkeepd's host pool mapped read-only from POSIX shared
//    memory (MapPool); a session's view of it is the block tables the
//    worker mirrors (client::BlockTableMirror). No byte is copied.
//
// Not thread-safe: one thread drives a sequence.
#ifndef KVKEEP_SERVICES_LM_KV_CACHES_H_
#define KVKEEP_SERVICES_LM_KV_CACHES_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/client/kvkeep_client.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

class SlotCache final : public KvSource {
 public:
  // token_bytes: one token's keys (or values) of one layer, all kv heads.
  SlotCache(int32_t layers, int64_t token_bytes);

  ResidentKv Layer(int32_t layer) const override;

  // Follows one call's change of every layer (a StepResult), in the
  // documented order. `positions`, `keys`, `values`: the call's new tokens
  // (keys[l] and values[l] are [n][kv_heads][head_dim]; empty for a call
  // that appended nothing). INVALID_ARGUMENT, nothing changed, when the
  // change does not fit.
  absl::Status Apply(const v1::StepResult& result,
                     absl::Span<const int64_t> positions = {},
                     absl::Span<const std::string> keys = {},
                     absl::Span<const std::string> values = {});

  int32_t num_layers() const { return static_cast<int32_t>(layers_.size()); }
  int64_t resident(int32_t layer) const {
    return static_cast<int64_t>(layers_[layer].positions.size());
  }
  const std::vector<int64_t>& positions(int32_t layer) const {
    return layers_[layer].positions;
  }
  // Slot s's keys and values (token_bytes each).
  const std::byte* key(int32_t layer, int64_t slot) const;
  const std::byte* value(int32_t layer, int64_t slot) const;
  // The same, writable (kivi_kv.h rewrites the keys of pages the store
  // quantised again); slots [s, s + k) are contiguous.
  std::byte* mutable_key(int32_t layer, int64_t slot) {
    return const_cast<std::byte*>(key(layer, slot));
  }
  std::byte* mutable_value(int32_t layer, int64_t slot) {
    return const_cast<std::byte*>(value(layer, slot));
  }
  int64_t token_bytes() const { return token_bytes_; }

 private:
  struct LayerSlots {
    // keys: [capacity][token_bytes], then values: [capacity][token_bytes].
    std::vector<std::byte> bytes;
    int64_t capacity = 0;
    std::vector<int64_t> positions;  // per slot
    int32_t page = 0;                // the one page id Layer() names
  };
  void Reserve(LayerSlots& layer, int64_t tokens);
  void Place(LayerSlots& layer, int64_t slot, int64_t position,
             const std::byte* key, const std::byte* value);

  int64_t token_bytes_;
  std::vector<LayerSlots> layers_;
};

// A host pool of kvkeepd mapped read-only. Thread-safe (immutable).
class MappedPool {
 public:
  // Maps the pool `response` (MapPool's answer) describes: a host pool in
  // POSIX shared memory. FAILED_PRECONDITION for a GPU pool.
  static absl::StatusOr<std::unique_ptr<MappedPool>> Map(
      const v1::MapPoolResponse& response);
  ~MappedPool();
  MappedPool(const MappedPool&) = delete;
  MappedPool& operator=(const MappedPool&) = delete;

  // OUT_OF_RANGE unless every page the mirror names lies in the pool.
  absl::Status CheckPages(const client::BlockTableMirror& mirror) const;
  // A session's layer as the mirror of its block tables names it.
  ResidentKv Layer(const client::BlockTableMirror& mirror, int32_t layer) const;

 private:
  MappedPool() = default;
  const std::byte* arena_ = nullptr;
  int64_t arena_bytes_ = 0;
  int64_t page_bytes_ = 0;
  int64_t capacity_pages_ = 0;
  int32_t page_tokens_ = 0;
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_KV_CACHES_H_
