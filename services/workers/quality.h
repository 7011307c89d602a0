// What eviction cost, measured against the full cache: per decode step, per
// layer and per query head, the attention loss, the top-k recall and the
// relative output error of attention over the resident tokens; needle
// survival; the mean / p95 / max of each over steps and heads; and the
// clairvoyant oracle (keep the tokens with the most future attention) with
// the per-step bound no policy at a budget can beat.
//
// All computations are in float64 over float32 inputs. The free functions are
// thread-safe (no shared state); QualityAggregator and OracleCache are plain
// values, not thread-safe.
#ifndef KVKEEP_SERVICES_WORKERS_QUALITY_H_
#define KVKEEP_SERVICES_WORKERS_QUALITY_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/workers/workload.h"

namespace kvkeep::workers {

inline constexpr int32_t kDefaultTopK = 10;

// One query head's quality at one step. p is the full cache's attention
// softmax(q K^T / sqrt(d)), S the resident set.
struct HeadQuality {
  // sum of p over tokens not in S (= 1 - retained mass); 0 when S is all.
  double attention_loss = 0;
  // |top-k of p  intersected with S| / k, k = min(top_k, tokens); ties in
  // p broken by lower position.
  double top_recall = 1;
  // || p V - p_S V_S || / || p V ||, p_S the softmax renormalised over S
  // (0 when S is all; 1 when S is empty; +inf if p V = 0 and p_S V_S != 0).
  double output_error = 0;
};

// The full cache of one layer at one step. Row i is the token at position i;
// the query may attend to every row (causality is the caller's: pass the
// tokens up to and including the query's own).
struct FullCache {
  std::span<const float> keys;    // [tokens][kv_heads][head_dim]
  std::span<const float> values;  // [tokens][kv_heads][head_dim]
  int64_t tokens = 0;
};

// Per query head (index h of the result), the quality of attending over the
// `resident` positions (any order, each in [0, tokens), no duplicates)
// instead of the full cache. queries: [query_heads][head_dim]. Query head h
// reads kv head h / group. INVALID_ARGUMENT on bad sizes or positions, or
// tokens < 1, or top_k < 1.
absl::StatusOr<std::vector<HeadQuality>> MeasureStep(
    const HeadShape& shape, std::span<const float> queries,
    const FullCache& full, std::span<const int64_t> resident,
    int32_t top_k = kDefaultTopK);

// For each position in `positions`: whether it is in `resident`.
std::vector<bool> Survives(std::span<const int64_t> positions,
                           std::span<const int64_t> resident);

// mean, nearest-rank p95, max (and min) of a sample.
struct Distribution {
  int64_t count = 0;
  double mean = 0;
  double p95 = 0;
  double max = 0;
  double min = 0;
};

// Nearest-rank percentile, q in (0, 1]: the ceil(q n)-th smallest sample
// (1-based), so at least a fraction q of the samples are <= it and it is
// always one of the samples. 0 for an empty sample.
double NearestRankPercentile(std::span<const double> samples, double q);
// All zero (count 0) for an empty sample.
Distribution Summarize(std::span<const double> samples);

// Collects HeadQuality samples (one per step x layer x head) and summarises
// each metric over all of them. Keeps every sample (3 doubles each).
class QualityAggregator {
 public:
  void Add(const HeadQuality& q);
  void Add(std::span<const HeadQuality> qs);
  int64_t count() const { return static_cast<int64_t>(loss_.size()); }
  Distribution attention_loss() const { return Summarize(loss_); }
  Distribution top_recall() const { return Summarize(recall_); }
  Distribution output_error() const { return Summarize(error_); }

 private:
  std::vector<double> loss_;
  std::vector<double> recall_;
  std::vector<double> error_;
};

// ---------------------------------------------------------------------------
// The oracle. A token's *future mass* in a layer is the attention it receives
// from the decode queries, summed over query heads and steps (full-cache
// softmax at each step). Two references come from it; sinks and recent
// tokens are not special in either.
//
// - The static oracle (TopByMass; OracleCache without Consume): after each
//   arrival, keep the `budget` tokens of largest total future mass among
//   those seen. A valid eviction sequence (a dropped token never outranks
//   the ones kept, so it is never needed back) and, among fixed sets of that
//   size, the one with the least attention loss summed over the decode.
// - The Belady oracle (OracleCache with Consume after every decode step):
//   over budget, evict the resident token with the least *remaining* future
//   mass (from the current step on). Also realisable, and never fooled by
//   attention already paid: it drops a needle after its last question and
//   keeps recent tokens while they are still to be attended. Neither is
//   provably optimal over a whole decode against a policy whose set moves.
// - BestPossibleLoss is the true bound: no set of `budget` tokens loses less
//   at that step, so no policy at that budget does (it need not be
//   realisable: its sets may take back tokens).
// Ranking: larger mass first, ties to the lower position.

// mass[j] += sum over query heads h of probs[h][j], probs the full-cache
// attention of `queries` ([query_heads][head_dim]) over keys
// [tokens][kv_heads][head_dim]. mass must hold at least `tokens` entries.
absl::Status AccumulateAttention(const HeadShape& shape,
                                 std::span<const float> queries,
                                 std::span<const float> keys, int64_t tokens,
                                 std::span<double> mass);

// The future mass of every token of `layer` (length total_tokens()): the
// attention the queries of tokens [from_token, total_tokens()) pay it, each
// over the keys up to and including its own token. from_token -1 means
// prompt_tokens (the decode steps only). Materialises the layer.
absl::StatusOr<std::vector<double>> FutureAttentionMass(
    const Workload& workload, int32_t layer, int64_t from_token = -1);

// The static oracle's resident set once positions [0, seen) have arrived:
// the top `budget` of mass[0, seen), ascending positions.
std::vector<int64_t> TopByMass(std::span<const double> mass, int64_t seen,
                               int64_t budget);

// The oracle, online. Tokens arrive in position order (Admit); over budget,
// the resident token with the least remaining mass goes. The remaining mass
// starts as the total future mass and drops by each step's attention that
// Consume reports. Without Consume the resident set after each arrival is
// TopByMass(future_mass, arrived, budget). O(budget) per eviction.
class OracleCache {
 public:
  // budget >= 1 (smaller is taken as 1).
  OracleCache(std::vector<double> future_mass, int64_t budget);
  // Admits the next position (0, 1, ...; at most future_mass.size()).
  // Returns the position evicted to stay within budget (possibly the new
  // one), or -1.
  int64_t Admit();
  // After a decode step has been measured: its full-cache attention summed
  // over query heads, [arrived()] or fewer entries (position order).
  // INVALID_ARGUMENT if longer than arrived().
  absl::Status Consume(std::span<const double> step_mass);
  int64_t arrived() const { return arrived_; }
  double remaining(int64_t position) const { return remaining_[position]; }
  // Ascending positions.
  std::vector<int64_t> Resident() const;

 private:
  std::vector<double> remaining_;
  int64_t budget_;
  int64_t arrived_ = 0;
  std::vector<int64_t> resident_;  // unordered
};

// A per-step lower bound on any policy's mean attention loss over heads:
// 1 - (the largest `budget` entries of head_summed) / query_heads, where
// head_summed[j] is this step's attention on token j summed over the query
// heads (as AccumulateAttention gives). No resident set of `budget` tokens
// loses less at this step.
double BestPossibleLoss(std::span<const double> head_summed,
                        int32_t query_heads, int64_t budget);

}  // namespace kvkeep::workers

#endif  // KVKEEP_SERVICES_WORKERS_QUALITY_H_
