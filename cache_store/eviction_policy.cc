#include "cache_store/eviction_policy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvkeep {

absl::Status EvictionPolicy::ValidateBudget(int64_t budget,
                                            int32_t page_tokens) const {
  if (budget < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy '", name(),
                     "': budget must be at least 1 token, got ", budget));
  }
  if (budget - common_.slack < std::max<int64_t>(1, protected_tokens())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy '", name(), "': budget ", budget, " - slack ", common_.slack,
        " must keep at least one token and the protected tokens (sinks ",
        common_.sinks, " + recent ", common_.recent, ")"));
  }
  return absl::OkStatus();
}

void EvictionPolicy::OnAppend(LayerTokens tokens, int64_t first) const {
  std::fill(tokens.score.begin() + first, tokens.score.end(), 0.0f);
  if (!tokens.history.empty()) {
    std::fill(tokens.history.begin() + first, tokens.history.end(), 0);
  }
}

}  // namespace kvkeep
