// window and streaming_llm: content-blind eviction of the oldest unprotected
// tokens as new ones arrive. window is streaming_llm without sinks.
//
// Reference: mit-han-lab/streaming-llm StartRecentKVCache keeps the first
// `start_size` and the last `recent_size` tokens once the cache exceeds their
// sum; with budget = sinks + recent and slack 0 this policy keeps the same set
// after every token.
#include "cache_store/policy_registry.h"

namespace kvkeep {
namespace {

class RecencyPolicy final : public EvictionPolicy {
 public:
  RecencyPolicy(absl::string_view name, CommonParams common)
      : EvictionPolicy(common), name_(name) {}
  absl::string_view name() const override { return name_; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnAppend;
  }
  void SelectVictims(LayerTokens t, int64_t count,
                     std::vector<RankedItem>& scratch,
                     std::vector<int32_t>* victims) const override {
    // Equal keys: the tie rule (older first) makes this "oldest first".
    SelectLowestUnprotected(
        t, count, [](int64_t) { return 0.0f; }, scratch, victims);
  }

 private:
  const absl::string_view name_;
};

}  // namespace

PolicyPtr NewWindowPolicy(ParamReader& params) {
  return std::make_shared<RecencyPolicy>("window", params.Common());
}

PolicyPtr NewStreamingLlmPolicy(ParamReader& params) {
  return std::make_shared<RecencyPolicy>("streaming_llm", params.Common());
}

}  // namespace kvkeep
