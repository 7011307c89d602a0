#include "services/lm/contiguous_kv.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "kernels/quantize.h"

namespace kvkeep::lm {

ContiguousKv::ContiguousKv(const ModelConfig& config, const KvFormat& format,
                           int64_t capacity_tokens)
    : capacity_tokens_(capacity_tokens),
      layout_(format.Layout(config)),
      append_dtype_(format.append_dtype),
      token_bytes_(layout_.token_bytes()),
      append_bytes_(layout_.token_elements() * DTypeBytes(append_dtype_)),
      arenas_(config.layers,
              std::vector<std::byte>(2 * capacity_tokens * token_bytes_)) {}

absl::Status ContiguousKv::Append(const SequenceStep& step) {
  const int64_t n = static_cast<int64_t>(step.tokens.size());
  if (resident() + n > capacity_tokens_) {
    return absl::OutOfRangeError(
        absl::StrFormat("ContiguousKv: %d + %d tokens exceed the capacity %d",
                        resident(), n, capacity_tokens_));
  }
  if (step.keys.size() != arenas_.size() ||
      step.values.size() != arenas_.size() ||
      static_cast<int64_t>(step.positions.size()) != n) {
    return absl::InvalidArgumentError("ContiguousKv: step has no layers' keys");
  }
  for (size_t l = 0; l < arenas_.size(); ++l) {
    if (static_cast<int64_t>(step.keys[l].size()) != n * append_bytes_ ||
        step.values[l].size() != step.keys[l].size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("ContiguousKv: layer %d keys are %d bytes, want %d",
                          l, step.keys[l].size(), n * append_bytes_));
    }
  }
  for (size_t l = 0; l < arenas_.size(); ++l) {
    std::byte* keys = arenas_[l].data() + resident() * token_bytes_;
    std::byte* values = keys + capacity_tokens_ * token_bytes_;
    if (!IsQuantized(layout_.dtype)) {
      std::memcpy(keys, step.keys[l].data(), step.keys[l].size());
      std::memcpy(values, step.values[l].data(), step.values[l].size());
      continue;
    }
    // Past the resident slots: a refusal leaves nothing visible.
    if (!QuantizeTokens(layout_, append_dtype_, step.keys[l].data(), n, keys)
             .ok() ||
        !QuantizeTokens(layout_, append_dtype_, step.values[l].data(), n,
                        values)
             .ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("ContiguousKv: layer %d holds a value %s cannot", l,
                          std::string(DTypeName(layout_.dtype))));
    }
  }
  positions_.insert(positions_.end(), step.positions.begin(),
                    step.positions.end());
  return absl::OkStatus();
}

ResidentKv ContiguousKv::Layer(int32_t layer) const {
  ResidentKv v;
  v.arena = arenas_[layer].data();
  v.pages = kPage;
  v.page_tokens = static_cast<int32_t>(capacity_tokens_);
  v.page_bytes = 2 * capacity_tokens_ * token_bytes_;
  v.resident = resident();
  v.positions = positions_;
  return v;
}

}  // namespace kvkeep::lm
