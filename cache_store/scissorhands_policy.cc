// scissorhands: persistence of importance. At every step a token is
// "unimportant" when its head-averaged attention is below threshold / n (n:
// resident tokens, so threshold 1 means "less than a uniform share"). Each
// token keeps one bit per step for the last `history` steps (at most 64);
// over budget, the unprotected tokens unimportant most often in that window
// go first, ties to the older token.
//
// There is no official reference implementation; this follows the paper's
// Algorithm (Liu et al., 2023): counts of low attention over a history window,
// a protected recent window, and a drop amount (here: slack + 1).
#include <bit>

#include "cache_store/policy_registry.h"

namespace kvkeep {
namespace {

class ScissorhandsPolicy final : public EvictionPolicy {
 public:
  ScissorhandsPolicy(CommonParams common, int history, double threshold)
      : EvictionPolicy(common),
        window_mask_(history == 64 ? ~uint64_t{0}
                                   : (uint64_t{1} << history) - 1),
        threshold_(static_cast<float>(threshold)) {}
  absl::string_view name() const override { return "scissorhands"; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnAttention;
  }
  bool uses_history() const override { return true; }

  void Observe(LayerTokens t, const StepAttention& step) const override {
    if (step.num_slots == 0) return;
    // row[s] sums query_heads heads: compare against heads * threshold / n.
    const float cut = threshold_ * static_cast<float>(step.query_heads) /
                      static_cast<float>(step.num_slots);
    AccumulateRows(t, step);
    for (int32_t r = 0; r < step.num_rows; ++r) {
      const float* row = step.row(r);
      for (int64_t s = 0; s < step.num_slots; ++s) {
        t.history[s] = (t.history[s] << 1) | (row[s] < cut ? 1u : 0u);
      }
    }
  }
  void SelectVictims(LayerTokens t, int64_t count,
                     std::vector<RankedItem>& scratch,
                     std::vector<int32_t>* victims) const override {
    SelectLowestUnprotected(
        t, count,
        [&](int64_t i) {
          return -static_cast<float>(
              std::popcount(t.history[i] & window_mask_));
        },
        scratch, victims);
  }

 private:
  const uint64_t window_mask_;
  const float threshold_;
};

}  // namespace

PolicyPtr NewScissorhandsPolicy(ParamReader& params) {
  const CommonParams common = params.Common();
  const int history = static_cast<int>(params.Int("history"));
  const double threshold = params.Double("threshold");
  return std::make_shared<ScissorhandsPolicy>(common, history, threshold);
}

}  // namespace kvkeep
