// The reference prefill and decode workers' logic, over the kvkeep C++
// client: what a model's workers do with kvkeepd, driven by a synthetic
// Workload instead of a model.
//
//  - Prefill creates a session and appends the workload's prompt. A policy
//    that scores by attention gets each chunk's attention with the chunk (one
//    Decode step per chunk: its tokens, then its rows of causal attention), as
//    a real prefill would; content-blind policies and snapkv get plain
//    AppendPrefill, and snapkv then compresses the prompt with its
//    observation window's attention.
//  - Decode streams one step per generated token: the token's K/V and its
//    attention over the resident tokens (probabilities per head, summed over
//    heads, or the query vectors for the store to score), follows every
//    eviction and slot move the store reports (BlockTableMirror), and in
//    evaluation mode keeps a shadow full cache to measure what eviction cost
//    (quality.h) at every step.
//
// A worker computes attention over the tokens it holds resident, in slot
// order, exactly as an attention kernel reading the store's pages would.
// Functions are thread-safe for different sessions; one session is driven by
// one thread.
#ifndef KVKEEP_SERVICES_WORKERS_SESSION_DRIVER_H_
#define KVKEEP_SERVICES_WORKERS_SESSION_DRIVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "services/client/kvkeep_client.h"
#include "services/workers/quality.h"
#include "services/workers/workload.h"

namespace kvkeep::workers {

// How a worker hands a step's attention to the store.
enum class ScoreMode {
  kPerHead,  // probabilities per query head: [query_heads][rows][resident]
  kReduced,  // probabilities summed over query heads: [rows][resident]
  kQueries,  // the query vectors; the store computes softmax(q K^T / sqrt(d))
};
// "per_head", "reduced", "queries".
std::string_view ScoreModeName(ScoreMode mode);
absl::StatusOr<ScoreMode> ParseScoreMode(std::string_view name);

// When a policy wants attention (docs/policies.md).
enum class PolicyInput { kNone, kPerStep, kCompress };
// What `policy` takes, as the server describes it (ServerInfo.policy_info).
// NOT_FOUND if `info` does not describe it.
absl::StatusOr<PolicyInput> InputOf(const v1::ServerInfo& info,
                                    std::string_view policy);

// The workload whose shape is `layout`'s (layers, kv and query heads, head
// dim), the rest from `spec`.
WorkloadSpec FitToLayout(WorkloadSpec spec, const v1::Layout& layout);

struct SessionPlan {
  std::string layout;  // a layout the server has; the workload's shape
  std::string policy;
  std::map<std::string, std::string> params;
  int64_t budget_tokens = 0;    // per layer
  int64_t prefill_chunk = 128;  // prompt tokens per message
  ScoreMode scores = ScoreMode::kReduced;
};

struct PrefilledSession {
  client::Session session;
  client::BlockTableMirror mirror;
};

// Creates the session and appends tokens [0, prompt_tokens) of `workload`
// (whose shape must be the layout's: FitToLayout).
absl::StatusOr<PrefilledSession> Prefill(const client::KvKeepClient& client,
                                         const Workload& workload,
                                         const SessionPlan& plan);

struct DecodeOptions {
  ScoreMode scores = ScoreMode::kReduced;
  int64_t steps = -1;  // -1: the workload's decode_steps
  // Keep a shadow full cache and measure, at every step and layer, each
  // query head's attention loss, top-10 recall and output error.
  bool evaluate = false;
  // Called after each step with (steps done, steps in all).
  std::function<void(int64_t, int64_t)> progress;
};

struct DecodeReport {
  int64_t steps = 0;
  // Each Decode step's round trip (send to reply), seconds.
  std::vector<double> step_seconds;
  // evaluate only: one sample per step x layer x query head.
  QualityAggregator quality;
  // Needles asked during the decode: (needle, asking step, layer) triples
  // whose needle was resident when asked, and all such triples.
  int64_t needle_hits = 0;
  int64_t needle_asks = 0;
  // Resident tokens per layer, averaged over steps and layers (what each
  // step's attention read), and the session's bytes at the end.
  double mean_resident_tokens = 0;
  int64_t final_resident_bytes = 0;
  // EvaluateOracle only: per step x layer, the least mean attention loss any
  // set of budget + 1 tokens could have at that step (BestPossibleLoss; the
  // + 1 is the step's own token, which the policies that evict after
  // scoring hold while their query attends).
  std::vector<double> bound_loss;
};

// Decodes tokens prompt_tokens, prompt_tokens + 1, ... of `workload` on one
// Decode stream, starting from `mirror` (the session's tables now).
absl::StatusOr<DecodeReport> Decode(const client::Session& session,
                                    client::BlockTableMirror& mirror,
                                    const Workload& workload,
                                    const DecodeOptions& options);

// The oracle at `budget` tokens per layer (quality.h's OracleCache, told
// each step's attention so it ranks by the attention still to come)
// measured as Decode measures a policy, and the per-step bound. No server.
absl::StatusOr<DecodeReport> EvaluateOracle(const Workload& workload,
                                            int64_t budget);

}  // namespace kvkeep::workers

#endif  // KVKEEP_SERVICES_WORKERS_SESSION_DRIVER_H_
