// snapkv: one-shot prompt compression at the end of prefill. The last
// `window` prompt tokens (the observation window) are kept; every older token
// is scored by the attention the window's queries pay it (summed over window
// rows and query heads), smoothed by 1-D pooling along the sequence, and the
// top budget - window are kept. Nothing is evicted during decode.
//
// Reference: FasterDecoding/SnapKV snapkv/monkeypatch/snapkv_utils.py,
// SnapKVCluster.update_kv: attention of the window queries (causal inside the
// window), softmax in float32, summed over the window, avg_pool1d (zero
// padding counted) or max_pool1d with padding kernel/2, then topk(capacity -
// window). The reference keeps one set per head; kvkeep sums heads into one
// set per layer, which equals the reference for one head.
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "cache_store/policy_registry.h"
#include "kernels/pooling.h"

namespace kvkeep {
namespace {

class SnapKvPolicy final : public EvictionPolicy {
 public:
  // `sinks`: 0 unless a prefix protects its tokens (PolicySpec).
  SnapKvPolicy(int64_t sinks, int64_t window, int32_t kernel, Pooling pooling)
      : EvictionPolicy(CommonParams{sinks, window, 0}),
        kernel_(kernel),
        pooling_(pooling) {}
  absl::string_view name() const override { return "snapkv"; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnCompress;
  }
  absl::Status ValidateBudget(int64_t budget, int32_t) const override {
    if (budget < std::max<int64_t>(1, common().recent)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy 'snapkv': budget ", budget,
                       " cannot hold the observation window (window ",
                       common().recent, ")"));
    }
    if (budget < protected_tokens()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy 'snapkv': budget ", budget,
                       " cannot hold the protected tokens (sinks ",
                       common().sinks, " + window ", common().recent, ")"));
    }
    return absl::OkStatus();
  }

  // The window's attention replaces the score: compression is one-shot.
  void Observe(LayerTokens t, const StepAttention& step) const override {
    std::fill(t.score.begin(), t.score.end(), 0.0f);
    AccumulateRows(t, step);
  }

  void SelectVictims(LayerTokens t, int64_t count,
                     std::vector<RankedItem>& scratch,
                     std::vector<int32_t>* victims) const override {
    // Pooling runs along the sequence: lay the prefix (every token older
    // than the window) out in arrival order.
    std::vector<int32_t> prefix;
    for (int64_t i = 0; i < t.size(); ++i) {
      if (!IsProtected(t.arrival[i], t.appended)) {
        prefix.push_back(static_cast<int32_t>(i));
      }
    }
    std::sort(prefix.begin(), prefix.end(), [&](int32_t a, int32_t b) {
      return t.arrival[a] < t.arrival[b];
    });
    std::vector<float> seq(prefix.size()), pooled(prefix.size());
    for (size_t i = 0; i < prefix.size(); ++i) seq[i] = t.score[prefix[i]];
    Pool1d(seq, kernel_, pooling_, pooled);
    std::vector<int32_t> picked;
    SelectLowest(
        static_cast<int64_t>(prefix.size()), count,
        [&](int64_t i) { return pooled[i]; },
        [&](int64_t i) { return t.arrival[prefix[i]]; },
        [](int64_t) { return true; }, scratch, &picked);
    for (int32_t i : picked) victims->push_back(prefix[i]);
  }

 private:
  const int32_t kernel_;
  const Pooling pooling_;
};

}  // namespace

PolicyPtr NewSnapKvPolicy(ParamReader& params) {
  const int64_t window = params.Int("window");
  int64_t kernel = params.Int("kernel");
  if (kernel % 2 == 0) {
    params.Fail(absl::StrCat("kernel = ", kernel, " must be odd"));
    kernel = 1;  // unused: Finish reports the error
  }
  const std::string pooling = params.Choice("pooling");
  return std::make_shared<SnapKvPolicy>(
      params.Common().sinks, window, static_cast<int32_t>(kernel),
      pooling == "maxpool" ? Pooling::kMax : Pooling::kAvg);
}

}  // namespace kvkeep
