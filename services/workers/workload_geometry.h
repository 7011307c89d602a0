// How a WorkloadSpec (workload.h) lays out its heads and its prompt: the
// rotary/content split of a head's dimensions, the content directions'
// indices, which kv heads are local, where the needles sit and when the
// first is asked. Shared by ValidateSpec (workload_spec.cc) and the
// generator (workload.cc), so both read a spec the same way.
//
// Internal to the kvkeep_workload target (compiled with -ffp-contract=off).
// Pure functions; thread-safe.
#ifndef KVKEEP_SERVICES_WORKERS_WORKLOAD_GEOMETRY_H_
#define KVKEEP_SERVICES_WORKERS_WORKLOAD_GEOMETRY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "services/workers/workload.h"

namespace kvkeep::workers::workload_internal {

// Content direction indices (after them: one per needle).
inline constexpr int32_t kSinkDir = 0;
inline constexpr int32_t kHeavyHitterDir = 1;
inline constexpr int32_t kFirstNeedleDir = 2;

// Dimensions [0, RotaryDims) of a head are rotated by RoPE; even.
inline int32_t RotaryDims(const WorkloadSpec& spec) {
  const double half = std::floor(spec.rotary_fraction * spec.head_dim / 2.0);
  return 2 * static_cast<int32_t>(std::clamp(half, 0.0, spec.head_dim / 2.0));
}

// The number of local kv heads in each layer.
inline int32_t LocalKvHeads(const WorkloadSpec& spec) {
  return static_cast<int32_t>(
      std::floor(spec.local_head_fraction * spec.kv_heads + 0.5));
}

// The prompt position of needle i.
inline int64_t NeedlePosition(const WorkloadSpec& spec, int32_t i) {
  return spec.prompt_tokens * (i + 1) / (spec.needles + 1);
}

// needle_once: the decode step that asks for the first needle.
inline int64_t FirstQuestionStep(const WorkloadSpec& spec) {
  return spec.needle_question_step >= 0 ? spec.needle_question_step
                                        : spec.decode_steps * 3 / 4;
}

}  // namespace kvkeep::workers::workload_internal

#endif  // KVKEEP_SERVICES_WORKERS_WORKLOAD_GEOMETRY_H_
