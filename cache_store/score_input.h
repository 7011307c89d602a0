// The rules a layer's attention input for one step must follow before any of
// it is used (docs/policies.md, "Scores"): its shape, and values that
// attention can have. Pure functions of their arguments; thread-safe.
//
// Errors are INVALID_ARGUMENT and begin "layer <L>: "; the session prefixes
// its own name (InSession), so a client sees one message whichever check
// failed.
#ifndef KVKEEP_CACHE_STORE_SCORE_INPUT_H_
#define KVKEEP_CACHE_STORE_SCORE_INPUT_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_store/session_types.h"
#include "kernels/attention.h"

namespace kvkeep {

// How far a probability row may sum past 1: rounding only (bf16 attention
// sums to 1 +- 0.4%); anything more is a bug in the caller's input.
inline constexpr float kRowSumTolerance = 1e-2f;

// What a layer's input is checked against.
struct ScoreInputShape {
  int32_t query_heads = 0;
  int32_t head_dim = 0;
  int64_t resident = 0;  // slots the rows run over, after the step's append
};

// "per-head probabilities", "head-reduced probabilities" or "queries".
absl::string_view ScoreSourceName(ScoreSource source);

// Floats an input of `source` with `rows` rows must hold, and its shape as
// messages write it ("[rows 2][resident 9]").
int64_t ScoreInputFloats(ScoreSource source, int32_t rows,
                         const ScoreInputShape& shape);
std::string ScoreInputShapeText(ScoreSource source, int32_t rows,
                                const ScoreInputShape& shape);

// Cheap checks, made for every layer of a step before any value is read:
// rows in [1, resident] and exactly ScoreInputFloats floats.
absl::Status CheckScoreShape(const LayerScores& in,
                             const ScoreInputShape& shape);

// The values of an input whose shape passed CheckScoreShape:
// - queries: every value finite;
// - probabilities: every value finite and >= 0, and each (head, row) summing
//   to at most 1 + kRowSumTolerance; a head-reduced row holds query_heads
//   such rows, so its bound is query_heads x (1 + kRowSumTolerance).
// Rows may sum to less (a worker's attention may cover tokens the store does
// not hold). Per-head input is summed over heads in the same pass, into
// head_sums ([rows][resident], at least that many floats); for the other
// sources head_sums is not touched and may be empty.
absl::Status CheckScoreValues(const LayerScores& in,
                              const ScoreInputShape& shape,
                              std::span<float> head_sums);

// CheckScoreValues' verdict on probabilities (per-head or head-reduced)
// whose values `check` summarises: what ReduceHeads, CheckRows or
// AccumulateCheckedRows (kernels/accumulate.h, the fused path) saw of them.
absl::Status CheckProbabilityRows(const LayerScores& in,
                                  const ScoreInputShape& shape,
                                  const RowCheck& check);

// CheckScoreShape, then CheckScoreValues.
absl::Status CheckScoreInput(const LayerScores& in,
                             const ScoreInputShape& shape,
                             std::span<float> head_sums);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SCORE_INPUT_H_
