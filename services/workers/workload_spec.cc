// The WorkloadSpec side of workload.h: the named families and their presets
// (DefaultSpec), and ValidateSpec, which bounds every knob before the
// generator (workload.cc) sees it.
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/workers/workload.h"
#include "services/workers/workload_geometry.h"

namespace kvkeep::workers {
namespace {

using workload_internal::kFirstNeedleDir;
using workload_internal::LocalKvHeads;
using workload_internal::NeedlePosition;
using workload_internal::RotaryDims;

// Bounds that keep per-call scratch on the stack and tables small.
constexpr int64_t kMaxTotalTokens = int64_t{1} << 24;
// The shares of sinks and needles leave at least this much to the rest.
constexpr double kMaxReservedShare = 0.95;

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("workload spec: ", what));
}

bool Finite(double x) { return std::isfinite(x); }

constexpr std::array<WorkloadFamily, 7> kFamilies = {
    WorkloadFamily::kSinks,        WorkloadFamily::kLocality,
    WorkloadFamily::kHeavyHitters, WorkloadFamily::kNeedleRepeated,
    WorkloadFamily::kNeedleOnce,   WorkloadFamily::kHeadTypes,
    WorkloadFamily::kMixed,
};

}  // namespace

std::span<const WorkloadFamily> AllFamilies() { return kFamilies; }

std::string_view FamilyName(WorkloadFamily family) {
  switch (family) {
    case WorkloadFamily::kSinks:
      return "sinks";
    case WorkloadFamily::kLocality:
      return "locality";
    case WorkloadFamily::kHeavyHitters:
      return "heavy_hitters";
    case WorkloadFamily::kNeedleRepeated:
      return "needle_repeated";
    case WorkloadFamily::kNeedleOnce:
      return "needle_once";
    case WorkloadFamily::kHeadTypes:
      return "head_types";
    case WorkloadFamily::kMixed:
      return "mixed";
  }
  return "unknown";
}

absl::StatusOr<WorkloadFamily> ParseFamily(std::string_view name) {
  for (WorkloadFamily f : kFamilies) {
    if (FamilyName(f) == name) return f;
  }
  // std::string: this Abseil's string_view may not be std::string_view.
  std::vector<std::string> names;
  for (WorkloadFamily f : kFamilies) names.emplace_back(FamilyName(f));
  return absl::InvalidArgumentError(
      absl::StrCat("unknown workload family '", std::string(name),
                   "'; known: ", absl::StrJoin(names, ", ")));
}

WorkloadSpec DefaultSpec(WorkloadFamily family) {
  WorkloadSpec s;  // kMixed's values
  s.family = family;
  // Start from a blank slate: every content knob off, mild locality.
  s.sink_tokens = 0;
  s.sink_share = 0;
  s.locality = 4.0;
  s.heavy_hitter_fraction = 0;
  s.needles = 0;
  switch (family) {
    case WorkloadFamily::kSinks:
      s.sink_tokens = 1;
      s.sink_share = 0.4;
      break;
    case WorkloadFamily::kLocality:
      s.locality = 12.0;
      break;
    case WorkloadFamily::kHeavyHitters:
      s.locality = 2.0;
      s.heavy_hitter_fraction = 0.02;
      s.heavy_hitter_logit = 3.0;
      s.heavy_hitter_tail = 0.5;
      break;
    case WorkloadFamily::kNeedleRepeated:
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 4;
      break;
    case WorkloadFamily::kNeedleOnce:
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 0;
      break;
    case WorkloadFamily::kHeadTypes:
      s.local_head_fraction = 0.5;
      s.local_head_locality = 16.0;
      s.locality = 2.0;
      s.sink_tokens = 1;
      s.sink_share = 0.3;
      s.heavy_hitter_fraction = 0.02;
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 16;
      break;
    case WorkloadFamily::kMixed:
      s = WorkloadSpec{};
      break;
  }
  return s;
}

absl::Status ValidateSpec(const WorkloadSpec& s) {
  if (s.num_layers < 1) return Invalid("num_layers must be >= 1");
  if (s.kv_heads < 1) return Invalid("kv_heads must be >= 1");
  if (s.query_heads < s.kv_heads || s.query_heads % s.kv_heads != 0) {
    return Invalid("query_heads must be a positive multiple of kv_heads");
  }
  if (s.head_dim < 4 || s.head_dim > kMaxHeadDim) {
    return Invalid(absl::StrCat("head_dim must be in [4, ", kMaxHeadDim, "]"));
  }
  if (s.prompt_tokens < 1) return Invalid("prompt_tokens must be >= 1");
  if (s.decode_steps < 0) return Invalid("decode_steps must be >= 0");
  if (s.prompt_tokens > kMaxTotalTokens - s.decode_steps) {
    return Invalid(absl::StrCat("prompt_tokens + decode_steps must be <= ",
                                kMaxTotalTokens));
  }
  if (!Finite(s.noise_logit_std) || s.noise_logit_std < 0) {
    return Invalid("noise_logit_std must be >= 0");
  }
  if (s.sink_tokens < 0 || s.sink_tokens >= s.prompt_tokens) {
    return Invalid("sink_tokens must be in [0, prompt_tokens)");
  }
  if (!Finite(s.sink_share) || s.sink_share < 0 ||
      s.sink_share >= kMaxReservedShare) {
    return Invalid("sink_share must be in [0, 0.95)");
  }
  if ((s.sink_tokens > 0) != (s.sink_share > 0)) {
    return Invalid("sink_tokens and sink_share are both zero or both > 0");
  }
  if (!Finite(s.rope_base) || s.rope_base <= 1) {
    return Invalid("rope_base must be > 1");
  }
  if (!Finite(s.rotary_fraction) || s.rotary_fraction < 0 ||
      s.rotary_fraction > 1) {
    return Invalid("rotary_fraction must be in [0, 1]");
  }
  if (!Finite(s.locality) || s.locality < 0 || !Finite(s.local_head_locality) ||
      s.local_head_locality < 0) {
    return Invalid("locality and local_head_locality must be >= 0");
  }
  if (!Finite(s.local_head_fraction) || s.local_head_fraction < 0 ||
      s.local_head_fraction > 1) {
    return Invalid("local_head_fraction must be in [0, 1]");
  }
  const int32_t rotary = RotaryDims(s);
  const int32_t local = LocalKvHeads(s);
  if (rotary < 2 &&
      (s.locality > 0 || (local > 0 && s.local_head_locality > 0))) {
    return Invalid("locality needs at least one rotary pair (rotary_fraction)");
  }
  if (!Finite(s.heavy_hitter_fraction) || s.heavy_hitter_fraction < 0 ||
      s.heavy_hitter_fraction >= 1) {
    return Invalid("heavy_hitter_fraction must be in [0, 1)");
  }
  if (!Finite(s.heavy_hitter_logit) || s.heavy_hitter_logit < 0 ||
      s.heavy_hitter_logit > 30) {
    return Invalid("heavy_hitter_logit must be in [0, 30]");
  }
  if (!Finite(s.heavy_hitter_tail) || s.heavy_hitter_tail < 0 ||
      s.heavy_hitter_tail >= 1) {
    return Invalid("heavy_hitter_tail must be in [0, 1)");
  }
  if (s.needles < 0 || s.needles > kMaxNeedles) {
    return Invalid(absl::StrCat("needles must be in [0, ", kMaxNeedles, "]"));
  }
  if (s.head_dim - rotary < kFirstNeedleDir + s.needles + 1) {
    return Invalid(absl::StrCat(
        "the non-rotary dimensions (", s.head_dim - rotary,
        ") must hold 2 + needles content directions and noise: lower "
        "rotary_fraction"));
  }
  if (s.needles > 0) {
    if (!Finite(s.needle_share) || s.needle_share <= 0 ||
        s.sink_share + s.needle_share >= kMaxReservedShare) {
      return Invalid(
          "needle_share must be > 0 and sink_share + needle_share "
          "< 0.95");
    }
    if (local == s.kv_heads) {
      return Invalid(
          "needles need at least one retrieval head "
          "(local_head_fraction < 1)");
    }
    for (int32_t i = 0; i < s.needles; ++i) {
      const int64_t p = NeedlePosition(s, i);
      if (p < s.sink_tokens || (i > 0 && p == NeedlePosition(s, i - 1))) {
        return Invalid("prompt too short for its sinks and needles");
      }
    }
    if (s.needle_period < 0) return Invalid("needle_period must be >= 0");
    if (s.needle_period == 0) {
      if (s.decode_steps < 1) {
        return Invalid("needle_once needs decode_steps >= 1");
      }
      if (s.needle_question_step >= s.decode_steps ||
          s.needle_question_step < -1) {
        return Invalid(
            "needle_question_step must be -1 or in "
            "[0, decode_steps)");
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvkeep::workers
