// BudgetSpec: how many tokens each layer of a session may keep, and the
// schedules that spread a budget across layers. Plain values; thread-safe.
#ifndef KVKEEP_CACHE_STORE_BUDGET_H_
#define KVKEEP_CACHE_STORE_BUDGET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvkeep {

struct BudgetSpec {
  // Tokens per layer (the mean, for the pyramid schedule).
  int64_t tokens = 0;
  // Explicit per-layer budgets; when non-empty it must have one entry per
  // layer and overrides `tokens` and `schedule`.
  std::vector<int64_t> per_layer;
  // "uniform": every layer gets `tokens`.
  // "pyramid": PyramidKV's schedule, more tokens in lower layers (below).
  std::string schedule = "uniform";
  double pyramid_beta = 20.0;  // pyramid: ratio of the top of the free share
};

// Per-layer budgets for num_layers layers. `protected_tokens` (sinks + recent,
// or SnapKV's window) is what every layer keeps in any case; the pyramid
// spreads only the rest. PyramidKV (Cai et al. 2024, reference
// PyramidKV/pyramidkv/pyramidkv_utils.py), without its clamp to the prompt
// length: free = tokens - protected, lo = free / beta, hi = 2 * free - lo,
// step = (hi - lo) / (L - 1), and layer l keeps protected + hi - l * step
// (integer division throughout, as the reference). The integer step drops the
// remainder rem = (hi - lo) % (L - 1), which the lower layers keep, so the
// mean is tokens + rem / 2: never below `tokens`, less than (L - 1) / 2
// above it. When hi - lo < L - 1 the step is 0 and every layer keeps
// protected + hi, as in the reference.
absl::StatusOr<std::vector<int64_t>> LayerBudgets(const BudgetSpec& spec,
                                                  int32_t num_layers,
                                                  int64_t protected_tokens);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_BUDGET_H_
