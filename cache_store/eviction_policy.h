// EvictionPolicy decides which of a layer's resident tokens to evict. It knows
// nothing of memory: the session owns the tokens' bytes and per-slot state and
// calls the policy to fold attention into that state and to pick victims.
//
// A policy object holds only its validated parameters; it is immutable after
// construction, shared by every layer of a session, and thread-safe.
//
// Protected tokens, common to every policy: the first `sinks` tokens ever
// appended to a layer (attention sinks) and the `recent` most recently
// appended ones. They are never evicted. "Older" and "more recent" always mean
// arrival order, which is position order (positions strictly increase).
#ifndef KVKEEP_CACHE_STORE_EVICTION_POLICY_H_
#define KVKEEP_CACHE_STORE_EVICTION_POLICY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/accumulate.h"
#include "kernels/selection.h"

namespace kvkeep {

// One layer's resident tokens as a policy sees them. Arrays are indexed by
// slot and all have size() entries.
struct LayerTokens {
  std::span<const int64_t> arrival;  // 0-based arrival order in this layer
  std::span<float> score;            // the policy's per-token score
  std::span<uint64_t> history;       // the policy's per-token bits
  int64_t appended = 0;              // tokens ever appended to the layer
  int32_t page_tokens = 0;           // slots per page (slot s: page s / P)

  int64_t size() const { return static_cast<int64_t>(arrival.size()); }
};

// One step's attention for one layer, already summed over query heads:
// rows[r][s] is the attention that query row r paid slot s. A decode step has
// one row; a prefill chunk has one row per query, oldest first.
struct StepAttention {
  const float* rows = nullptr;  // [num_rows][num_slots]
  int32_t num_rows = 0;
  int64_t num_slots = 0;
  int32_t query_heads = 1;  // heads summed into each row

  const float* row(int32_t r) const { return rows + int64_t{r} * num_slots; }
};

// When a policy evicts.
enum class EvictionTrigger {
  kNever,        // full: keeps everything
  kOnAppend,     // content-blind (window, streaming_llm): as tokens arrive
  kOnAttention,  // attention-driven: when a step's attention arrives
  kOnCompress,   // snapkv: once, when the prompt is compressed
};

// Parameters every policy understands.
struct CommonParams {
  int64_t sinks = 0;   // first tokens never evicted
  int64_t recent = 0;  // last tokens never evicted
  int64_t slack = 0;   // when over budget, evict down to budget - slack
};

class EvictionPolicy {
 public:
  explicit EvictionPolicy(CommonParams common) : common_(common) {}
  virtual ~EvictionPolicy() = default;

  virtual absl::string_view name() const = 0;
  virtual EvictionTrigger trigger() const = 0;
  // True when the policy keeps per-token history bits (LayerTokens::history).
  virtual bool uses_history() const { return false; }

  const CommonParams& common() const { return common_; }
  // Tokens of a layer that can never be evicted.
  int64_t protected_tokens() const { return common_.sinks + common_.recent; }

  // INVALID_ARGUMENT with a message unless a layer budget of `budget` tokens
  // can be honoured with these parameters and pages of `page_tokens`.
  virtual absl::Status ValidateBudget(int64_t budget,
                                      int32_t page_tokens) const;

  // Initialises the state of the slots [first, tokens.size()), just appended.
  virtual void OnAppend(LayerTokens tokens, int64_t first) const;

  // Folds one step's attention into the per-token state.
  virtual void Observe(LayerTokens tokens, const StepAttention& step) const {}
  // True when Observe is exactly AccumulateRows and OnAppend starts a score
  // at 0 (h2o, h2o_page): the session may then check head-reduced rows and
  // add them in one pass (AccumulateCheckedRows) instead of calling Observe.
  virtual bool observe_adds_rows() const { return false; }

  // Appends to *victims at least `count` distinct, unprotected slots to evict
  // (exactly `count` for token-level policies; page-level ones round up to
  // whole pages). Deterministic: the same state gives the same victims.
  // `scratch` is reused between calls.
  virtual void SelectVictims(LayerTokens tokens, int64_t count,
                             std::vector<RankedItem>& scratch,
                             std::vector<int32_t>* victims) const = 0;

 protected:
  // score[s] += every row's attention to s, row by row: the accumulation of
  // h2o and its relatives. The one accumulation there is, AccumulateScores
  // (kernels/accumulate.h, twin of
  // kernels/cuda/device_state/accumulate.h), with the rows
  // already summed over heads.
  static void AccumulateRows(LayerTokens& t, const StepAttention& step) {
    const AccumulateLayer layer{step.rows, t.score.data(), nullptr,
                                step.num_slots};
    AccumulateScores({&layer, 1}, /*query_heads=*/1, /*kv_heads=*/1,
                     step.num_rows);
  }
  bool IsProtected(int64_t arrival, int64_t appended) const {
    return arrival < common_.sinks || arrival >= appended - common_.recent;
  }
  // Selects the `count` unprotected slots with the lowest score(i), ties to the
  // older token: the shared rule of every score-ranked policy.
  template <typename ScoreFn>
  void SelectLowestUnprotected(const LayerTokens& t, int64_t count,
                               ScoreFn score, std::vector<RankedItem>& scratch,
                               std::vector<int32_t>* victims) const {
    SelectLowest(
        t.size(), count, score, [&](int64_t i) { return t.arrival[i]; },
        [&](int64_t i) { return !IsProtected(t.arrival[i], t.appended); },
        scratch, victims);
  }

 private:
  const CommonParams common_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_EVICTION_POLICY_H_
