// What monitoring costs a decode step: the same store work with no observer,
// with an observer that does nothing (the cost of measuring and reporting),
// and with kvkeepd's Prometheus StoreMetrics (the cost of the counters and
// histograms too), in the same run. After the run a line gives each as a
// ratio of the no-observer time.
//
// A 32-layer model (8 kv / 32 query heads, head_dim 128, bf16, 16-token
// pages), h2o (sinks 4, recent 64, slack 16) at a budget of 2048 tokens per
// layer, in steady state. One iteration is one decode step through
// CacheStore::Step: one new token for every layer and head-reduced attention
// for every layer, which evicts a page's worth of tokens every 17 steps.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "cache_store/cache_store.h"
#include "prometheus/registry.h"
#include "services/metrics/store_metrics.h"

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 32;
constexpr int64_t kBudget = 2048;
constexpr int64_t kSteps = 17 * 32;  // whole eviction cycles

ModelLayout Layout() {
  ModelLayout l;
  l.name = "bench";
  l.num_layers = kLayers;
  l.kv_heads = 8;
  l.query_heads = 32;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  l.page_tokens = 16;
  return l;
}

class NullObserver : public StoreObserver {};

enum class Mode { kNone, kNull, kPrometheus };

// A store with one session filled to its budget, and a step generator.
class Decoder {
 public:
  explicit Decoder(Mode mode) : layout_(Layout()) {
    StoreOptions options;
    options.pools.push_back(PoolSpec{layout_, 8192});
    if (mode == Mode::kNull) options.observer = &null_;
    if (mode == Mode::kPrometheus) {
      metrics_ = std::make_unique<StoreMetrics>(registry_, 1000, "bench");
      options.observer = metrics_.get();
    }
    store_ = *CacheStore::Create(options);
    SessionSpec spec;
    spec.layout = "bench";
    spec.policy = {"h2o", {{"sinks", "4"}, {"recent", "64"}, {"slack", "16"}}};
    spec.budget.tokens = kBudget;
    id_ = *store_->CreateSession(spec);
    token_.assign(int64_t{8} * 128 * 2, std::byte{0});
    kv_.assign(kLayers, LayerKv{token_, token_});
    // Head-reduced rows: each entry at most 32 / (budget + 64), so a row of
    // any resident count sums to less than 32 heads' worth.
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    row_.resize(kBudget + 64);
    for (float& x : row_) x = uniform(rng) * 32.0f / (kBudget + 64);
    const SessionStats stats = *store_->GetStats(id_);
    version_ = stats.layer_version;
    resident_ = stats.layer_resident;
    for (int i = 0; i < kBudget + 64; ++i) Step();
  }

  // One decode step; the attention rows come from a buffer filled once, so
  // the time is the store's.
  void Step() {
    std::vector<LayerScores> scores(kLayers);
    for (int32_t l = 0; l < kLayers; ++l) {
      scores[l] =
          LayerScores{l, version_[l], ScoreSource::kReduced, 1,
                      std::span<const float>(row_).first(resident_[l] + 1)};
    }
    const AppendRequest append{std::span(&position_, 1), kv_};
    absl::StatusOr<StepOutcome> outcome = store_->Step(id_, append, scores);
    if (!outcome.ok()) std::abort();
    for (const LayerChange& c : outcome->scores.layers) {
      version_[c.layer] = c.version;
      resident_[c.layer] = c.resident;
    }
    ++position_;
  }

 private:
  const ModelLayout layout_;
  NullObserver null_;
  prometheus::Registry registry_;
  std::unique_ptr<StoreMetrics> metrics_;
  std::unique_ptr<CacheStore> store_;
  SessionId id_ = 0;
  std::vector<std::byte> token_;
  std::vector<LayerKv> kv_;
  std::vector<float> row_;
  std::vector<uint64_t> version_;
  std::vector<int64_t> resident_;
  int64_t position_ = 0;
};

void BM_Step(benchmark::State& state, Mode mode) {
  Decoder decoder(mode);
  for (auto _ : state) {
    for (int64_t i = 0; i < kSteps; ++i) decoder.Step();
  }
  state.SetItemsProcessed(state.iterations() * kSteps);
}

BENCHMARK_CAPTURE(BM_Step, no_observer, Mode::kNone)
    ->Unit(benchmark::kMillisecond)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);
BENCHMARK_CAPTURE(BM_Step, null_observer, Mode::kNull)
    ->Unit(benchmark::kMillisecond)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);
BENCHMARK_CAPTURE(BM_Step, prometheus, Mode::kPrometheus)
    ->Unit(benchmark::kMillisecond)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);

// Prints the usual table, then each mode's median time per step over the
// no-observer median.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.aggregate_name != "median") continue;
      // "BM_Step/MODE/repeats:3_median" -> MODE
      const std::string name = r.benchmark_name();
      const size_t from = name.find('/') + 1;
      const double us = r.GetAdjustedRealTime() * 1000.0 / kSteps;  // ms -> us
      medians_[name.substr(from, name.find('/', from) - from)] = us;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nmedian store time per decode step (32 layers):\n");
    const double base =
        medians_.count("no_observer") ? medians_["no_observer"] : 0;
    for (const auto& [name, us] : medians_) {
      std::printf("  %-24s %8.1f us  %.3fx no_observer\n", name.c_str(), us,
                  base > 0 ? us / base : 0.0);
    }
  }

 private:
  std::map<std::string, double> medians_;
};

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kvkeep::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
