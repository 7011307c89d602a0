// h2o: Heavy-Hitter Oracle. Each token's score is the attention it has
// received so far, summed over query heads and steps (a token's score starts
// with the attention it pays itself). Over budget, the unprotected token with
// the lowest score goes; ties go to the older token.
//
// Reference: FMInference/H2O, h2o_hf/utils_real_drop/modify_llama.py,
// H2OKVCache_LayerWise: hh_score += attention summed over query rows; when the
// cache exceeds hh_size + recent_size it keeps the top hh_size scores among
// all but the last recent_size tokens, plus those. With sinks = 0, slack = 0
// and budget = heavy + recent this policy keeps exactly that set (the
// reference keeps one set per head; kvkeep sums heads into one set per layer,
// the seeds' rule, which equals the reference for one head).
#include "cache_store/policy_registry.h"

namespace kvkeep {
namespace {

class H2OPolicy final : public EvictionPolicy {
 public:
  explicit H2OPolicy(CommonParams common) : EvictionPolicy(common) {}
  absl::string_view name() const override { return "h2o"; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnAttention;
  }
  void Observe(LayerTokens t, const StepAttention& step) const override {
    AccumulateRows(t, step);
  }
  bool observe_adds_rows() const override { return true; }
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

PolicyPtr NewH2OPolicy(ParamReader& params) {
  return std::make_shared<H2OPolicy>(params.Common());
}

}  // namespace kvkeep
