#include "cache_store/budget.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"

namespace kvkeep {

absl::StatusOr<std::vector<int64_t>> LayerBudgets(const BudgetSpec& spec,
                                                  int32_t num_layers,
                                                  int64_t protected_tokens) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout needs at least one layer, got ", num_layers));
  }
  if (!spec.per_layer.empty()) {
    if (static_cast<int32_t>(spec.per_layer.size()) != num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("per-layer budgets: got ", spec.per_layer.size(),
                       " entries for a layout of ", num_layers, " layers"));
    }
    return spec.per_layer;
  }
  if (spec.schedule == "uniform") {
    return std::vector<int64_t>(num_layers, spec.tokens);
  }
  if (spec.schedule != "pyramid") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown budget schedule ", Quote(spec.schedule),
                     " (expected uniform or pyramid)"));
  }
  if (!(spec.pyramid_beta >= 1.0) || !std::isfinite(spec.pyramid_beta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pyramid beta must be >= 1, got ", spec.pyramid_beta));
  }
  const int64_t free = spec.tokens - protected_tokens;
  if (free < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pyramid: budget ", spec.tokens, " cannot hold the ",
                     protected_tokens, " protected tokens"));
  }
  const int64_t lo = static_cast<int64_t>(
      std::floor(static_cast<double>(free) / spec.pyramid_beta));
  const int64_t hi = 2 * free - lo;
  const int64_t step = num_layers > 1 ? (hi - lo) / (num_layers - 1) : 0;
  std::vector<int64_t> budgets(num_layers);
  for (int32_t l = 0; l < num_layers; ++l) {
    budgets[l] =
        num_layers > 1 ? protected_tokens + hi - l * step : spec.tokens;
  }
  return budgets;
}

}  // namespace kvkeep
