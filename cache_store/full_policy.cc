// full: keeps every token; the baseline every other policy is measured
// against.
#include "cache_store/policy_registry.h"

namespace kvkeep {
namespace {

class FullPolicy final : public EvictionPolicy {
 public:
  FullPolicy() : EvictionPolicy(CommonParams{}) {}
  absl::string_view name() const override { return "full"; }
  EvictionTrigger trigger() const override { return EvictionTrigger::kNever; }
  absl::Status ValidateBudget(int64_t, int32_t) const override {
    return absl::OkStatus();  // the budget is not used
  }
  void SelectVictims(LayerTokens, int64_t, std::vector<RankedItem>&,
                     std::vector<int32_t>*) const override {}
};

}  // namespace

PolicyPtr NewFullPolicy(ParamReader&) { return std::make_shared<FullPolicy>(); }

}  // namespace kvkeep
