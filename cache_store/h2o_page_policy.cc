// h2o_page: page-level H2O. Tokens accumulate attention exactly as in h2o; a
// page's score is the mean score of its tokens, and over budget the full
// pages holding no protected token are evicted whole, lowest mean first (ties
// to the page holding the older token). Evicting whole pages rounds the count
// up to a multiple of page_tokens, and after compaction every emptied page is
// back in the pool. If too few such pages exist (protected tokens spread over
// many pages), the rest is evicted token by token, as h2o would, so the
// budget always holds.
#include <cstdint>
#include <vector>

#include "cache_store/policy_registry.h"
#include "kernels/page_scores.h"

namespace kvkeep {
namespace {

// Per-thread buffers for one selection, so that a steady-state eviction
// allocates nothing (a policy is const and shared by a session's layers).
struct PageScratch {
  std::vector<float> mean;
  std::vector<int64_t> oldest;
  std::vector<uint8_t> eligible;
  std::vector<int32_t> pages;
  std::vector<uint8_t> taken;
};

PageScratch& ThreadPageScratch() {
  thread_local PageScratch scratch;
  return scratch;
}

class H2OPagePolicy final : public EvictionPolicy {
 public:
  explicit H2OPagePolicy(CommonParams common) : EvictionPolicy(common) {}
  absl::string_view name() const override { return "h2o_page"; }
  EvictionTrigger trigger() const override {
    return EvictionTrigger::kOnAttention;
  }
  void Observe(LayerTokens t, const StepAttention& step) const override {
    AccumulateRows(t, step);
  }
  bool observe_adds_rows() const override { return true; }
  void SelectVictims(LayerTokens t, int64_t count,
                     std::vector<RankedItem>& scratch,
                     std::vector<int32_t>* victims) const override {
    const int32_t p = t.page_tokens;
    const int64_t full_pages = FullPages(t.size(), p);
    PageScratch& buffers = ThreadPageScratch();
    std::vector<float>& mean = buffers.mean;
    std::vector<int64_t>& oldest = buffers.oldest;
    std::vector<uint8_t>& eligible = buffers.eligible;
    mean.resize(full_pages);
    oldest.resize(full_pages);
    eligible.resize(full_pages);
    PageScores(t.score.data(), t.arrival.data(), t.size(), p,
               ProtectedTokens{common().sinks, common().recent, t.appended},
               mean.data(), oldest.data(), eligible.data());
    std::vector<int32_t>& pages = buffers.pages;
    pages.clear();
    SelectLowest(
        full_pages, (count + p - 1) / p, [&](int64_t i) { return mean[i]; },
        [&](int64_t i) { return oldest[i]; },
        [&](int64_t i) { return eligible[i] != 0; }, scratch, &pages);
    const size_t before = victims->size();
    for (int32_t page : pages) {
      for (int64_t s = int64_t{page} * p; s < int64_t{page + 1} * p; ++s) {
        victims->push_back(static_cast<int32_t>(s));
      }
    }
    const int64_t chosen = static_cast<int64_t>(victims->size() - before);
    if (chosen >= count) return;
    // Not enough whole pages: finish token by token, outside chosen pages.
    std::vector<uint8_t>& taken = buffers.taken;
    taken.assign(t.size(), 0);
    for (size_t i = before; i < victims->size(); ++i) taken[(*victims)[i]] = 1;
    SelectLowest(
        t.size(), count - chosen, [&](int64_t i) { return t.score[i]; },
        [&](int64_t i) { return t.arrival[i]; },
        [&](int64_t i) {
          return !taken[i] && !IsProtected(t.arrival[i], t.appended);
        },
        scratch, victims);
  }
};

}  // namespace

PolicyPtr NewH2OPagePolicy(ParamReader& params) {
  return std::make_shared<H2OPagePolicy>(params.Common());
}

}  // namespace kvkeep
