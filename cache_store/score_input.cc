#include "cache_store/score_input.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/attention.h"

namespace kvkeep {

absl::string_view ScoreSourceName(ScoreSource source) {
  switch (source) {
    case ScoreSource::kPerHead:
      return "per-head probabilities";
    case ScoreSource::kReduced:
      return "head-reduced probabilities";
    case ScoreSource::kQueries:
      return "queries";
  }
  return "?";
}

int64_t ScoreInputFloats(ScoreSource source, int32_t rows,
                         const ScoreInputShape& shape) {
  switch (source) {
    case ScoreSource::kPerHead:
      return int64_t{shape.query_heads} * rows * shape.resident;
    case ScoreSource::kReduced:
      return int64_t{rows} * shape.resident;
    case ScoreSource::kQueries:
      return int64_t{rows} * shape.query_heads * shape.head_dim;
  }
  return -1;
}

std::string ScoreInputShapeText(ScoreSource source, int32_t rows,
                                const ScoreInputShape& shape) {
  switch (source) {
    case ScoreSource::kPerHead:
      return absl::StrCat("[query_heads ", shape.query_heads, "][rows ", rows,
                          "][resident ", shape.resident, "]");
    case ScoreSource::kReduced:
      return absl::StrCat("[rows ", rows, "][resident ", shape.resident, "]");
    case ScoreSource::kQueries:
      return absl::StrCat("[rows ", rows, "][query_heads ", shape.query_heads,
                          "][head_dim ", shape.head_dim, "]");
  }
  return "?";
}

absl::Status CheckScoreShape(const LayerScores& in,
                             const ScoreInputShape& shape) {
  if (in.rows < 1 || in.rows > shape.resident) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", in.layer, ": rows = ", in.rows,
        " must be in [1, resident tokens = ", shape.resident, "]"));
  }
  const int64_t expected = ScoreInputFloats(in.source, in.rows, shape);
  if (static_cast<int64_t>(in.data.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", in.layer, ": ", ScoreSourceName(in.source),
                     " have ", in.data.size(), " floats, expected ", expected,
                     " = ", ScoreInputShapeText(in.source, in.rows, shape)));
  }
  return absl::OkStatus();
}

absl::Status CheckScoreValues(const LayerScores& in,
                              const ScoreInputShape& shape,
                              std::span<float> head_sums) {
  if (in.source == ScoreSource::kQueries) {
    for (float q : in.data) {
      if (!std::isfinite(q)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", in.layer, ": queries contain a non-finite value"));
      }
    }
    return absl::OkStatus();
  }
  if (in.source == ScoreSource::kReduced) {
    return CheckProbabilityRows(
        in, shape, CheckRows(in.data.data(), in.rows, shape.resident));
  }
  const int64_t floats = int64_t{in.rows} * shape.resident;
  if (static_cast<int64_t>(head_sums.size()) < floats) {
    return absl::InternalError(
        absl::StrCat("layer ", in.layer, ": ", head_sums.size(),
                     " floats to sum heads into, need ", floats));
  }
  return CheckProbabilityRows(
      in, shape,
      ReduceHeads(in.data.data(), shape.query_heads, in.rows, shape.resident,
                  head_sums.data()));
}

absl::Status CheckProbabilityRows(const LayerScores& in,
                                  const ScoreInputShape& shape,
                                  const RowCheck& check) {
  // A per-head row is one head's; a head-reduced row sums query_heads.
  const float max_sum =
      in.source == ScoreSource::kPerHead
          ? 1.0f + kRowSumTolerance
          : static_cast<float>(shape.query_heads) * (1.0f + kRowSumTolerance);
  // min_value is NaN or -inf where an element is; a sum is inf where an
  // element is (per-head sums may hide a -inf, the minimum does not).
  if (!std::isfinite(check.min_value) || !std::isfinite(check.max_row_sum)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", in.layer, ": ",
                                                   ScoreSourceName(in.source),
                                                   " contain NaN or infinity"));
  }
  if (check.min_value < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", in.layer, ": ", ScoreSourceName(in.source),
                     " contain a negative value (", check.min_value, ")"));
  }
  if (check.max_row_sum > max_sum) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", in.layer, ": ", ScoreSourceName(in.source),
        " have a row summing to ", check.max_row_sum, ", more than ", max_sum,
        " (attention over resident tokens sums to at most 1 per head)"));
  }
  return absl::OkStatus();
}

absl::Status CheckScoreInput(const LayerScores& in,
                             const ScoreInputShape& shape,
                             std::span<float> head_sums) {
  if (absl::Status s = CheckScoreShape(in, shape); !s.ok()) return s;
  return CheckScoreValues(in, shape, head_sums);
}

}  // namespace kvkeep
