// tova: Token Omission Via Attention. Each step, the token the current query
// attends least (attention averaged over query heads) goes; nothing
// accumulates across steps, and the newest token may itself be evicted.
//
// Reference: schwartz-lab-NLP/TOVA src/tova_cache.py, TOVACache.reduce: when
// the cache exceeds cache_size it keeps the cache_size tokens with the highest
// head-averaged attention of the last query. For a prefill chunk (several
// query rows) only the last row counts, as in the reference.
#include "cache_store/policy_registry.h"

namespace kvkeep {
namespace {

class TovaPolicy final : public EvictionPolicy {
 public:
  explicit TovaPolicy(CommonParams common) : EvictionPolicy(common) {}
  absl::string_view name() const override { return "tova"; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnAttention;
  }
  void Observe(LayerTokens t, const StepAttention& step) const override {
    if (step.num_rows == 0) return;
    const float* row = step.row(step.num_rows - 1);
    const float inv_heads = 1.0f / static_cast<float>(step.query_heads);
    for (int64_t s = 0; s < step.num_slots; ++s) {
      t.score[s] = row[s] * inv_heads;
    }
  }
  void SelectVictims(LayerTokens t, int64_t count,
                     std::vector<RankedItem>& scratch,
                     std::vector<int32_t>* victims) const override {
    // The CPU twin of the selection kernel (kernels/selection.h).
    ::kvkeep::SelectLowestUnprotected(t.score.data(), t.arrival.data(),
                                      t.size(), t.appended, common().sinks,
                                      common().recent, count, scratch, victims);
  }
};

}  // namespace

PolicyPtr NewTovaPolicy(ParamReader& params) {
  return std::make_shared<TovaPolicy>(params.Common());
}

}  // namespace kvkeep
