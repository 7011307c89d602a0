// Per-decode-step cost of one layer's eviction machinery, in steady state,
// next to the memory-bound floor measured in the same run.
//
// One layer, 32 query heads, 8 kv heads, head_dim 128, bf16, pages of 16
// tokens; every session is at its budget (sinks 4, recent 64, slack one page)
// so evictions happen at their steady rate. One benchmark iteration is one
// decode step: Append one token, then (attention-driven policies) UpdateScores
// with that step's attention over the resident slots, which evicts and
// compacts when the layer is over budget. The "floor" benchmarks read the
// same attention input and a score array once each, as fast as the machine
// can: no policy can do a step in less. After the run a table gives each
// policy's time per step divided by the floor's. See bench/README.md.
//
// Iterations are fixed to whole eviction cycles (a token-level policy evicts
// 17 tokens every 17 steps, h2o_page 32 tokens every 32 steps; 544 steps is a
// multiple of both), so each number averages over an exact number of
// evictions. --cycles=N multiplies the step counts (default 1).
// --dtype=int8|fp8_e4m3|int4: the pages store that format (groups of 32,
// appended as bf16: each step's append is quantised); default bf16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "cache_store/cache_store.h"

namespace kvkeep {
namespace {

constexpr int32_t kQueryHeads = 32;
constexpr int32_t kKvHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kPageTokens = 16;
constexpr int64_t kSinks = 4;
constexpr int64_t kRecent = 64;
constexpr int64_t kSlack = kPageTokens;
// lcm(17, 32): whole eviction cycles of token-level policies (17 steps) and
// of h2o_page (32 steps).
constexpr int64_t kCycleSteps = 544;
constexpr int64_t kWarmupSteps = 64;
constexpr int64_t kPrefillChunk = 4096;

int64_t g_cycles = 1;
DType g_dtype = DType::kBF16;  // --dtype

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ModelLayout BenchLayout() {
  ModelLayout layout;
  layout.name = "bench";
  layout.num_layers = 1;
  layout.kv_heads = kKvHeads;
  layout.query_heads = kQueryHeads;
  layout.head_dim = kHeadDim;
  layout.dtype = g_dtype;
  if (IsQuantized(g_dtype)) {  // appended as bf16, groups of 32
    layout.group_size = 32;
    layout.append_dtype = DType::kBF16;
  }
  layout.page_tokens = kPageTokens;
  return layout;
}

// Steps per benchmark run: enough that the small sizes run long enough to
// time, few enough that 128k (16 MiB of attention per step) stays short.
int64_t StepsFor(int64_t budget) {
  const int64_t mult = budget <= 1024 ? 8 : budget <= 8192 ? 2 : 1;
  return kCycleSteps * mult * g_cycles;
}

// One step's attention, precomputed for the longest row a session at
// `budget` sees (budget + 1 slots, just after an append).
//   per_head: kQueryHeads * max_len floats. A step with n resident slots
//     passes the first kQueryHeads * n of them as [kQueryHeads][1][n].
//   reduced: max_len floats, per_head's rows summed over heads; a step passes
//     the first n as [1][n].
// Every head row is a softmax of noisy logits with shared heavy hitters,
// normalised over max_len; the whole buffer is then scaled so that ANY
// window of max_len consecutive floats sums to at most 1, so every
// [kQueryHeads][n] view of a prefix has rows summing to <= 1 as the store
// requires (a little less than 1 for n < max_len).
struct AttentionInput {
  int64_t max_len = 0;
  std::vector<float> per_head;
  std::vector<float> reduced;
};

const AttentionInput& InputFor(int64_t budget) {
  static auto* cache = new std::map<int64_t, AttentionInput>();
  const int64_t max_len = budget + 1;
  auto [it, inserted] = cache->try_emplace(max_len);
  AttentionInput& in = it->second;
  if (!inserted) return in;
  in.max_len = max_len;
  std::mt19937 rng(static_cast<uint32_t>(max_len));
  std::normal_distribution<float> noise(0.0f, 1.5f);
  std::bernoulli_distribution heavy(0.02);
  std::vector<float> boost(max_len);
  for (float& b : boost) b = heavy(rng) ? 4.0f : 0.0f;
  in.per_head.resize(kQueryHeads * max_len);
  for (int32_t h = 0; h < kQueryHeads; ++h) {
    float* row = in.per_head.data() + h * max_len;
    double sum = 0;
    for (int64_t s = 0; s < max_len; ++s) {
      row[s] = std::exp(noise(rng) + boost[s]);
      sum += row[s];
    }
    for (int64_t s = 0; s < max_len; ++s) {
      row[s] = static_cast<float>(row[s] / sum);
    }
  }
  double window = 0;
  for (int64_t i = 0; i < max_len; ++i) window += in.per_head[i];
  double worst = window;
  for (size_t i = max_len; i < in.per_head.size(); ++i) {
    window += in.per_head[i] - in.per_head[i - max_len];
    worst = std::max(worst, window);
  }
  if (worst > 1.0) {
    const float scale = static_cast<float>(1.0 / worst);
    for (float& p : in.per_head) p *= scale;
  }
  in.reduced.assign(max_len, 0.0f);
  for (int32_t h = 0; h < kQueryHeads; ++h) {
    for (int64_t s = 0; s < max_len; ++s) {
      in.reduced[s] += in.per_head[h * max_len + s];
    }
  }
  return in;
}

// A one-layer store holding one session at its budget.
struct SteadySession {
  std::unique_ptr<CacheStore> store;
  SessionId id = 0;
  int64_t next_position = 0;
  std::vector<std::byte> token_kv;  // one token's keys (also its values)
};

PolicySpec SpecFor(const std::string& policy) {
  PolicySpec spec{policy, {}};
  const std::string slack = std::to_string(kSlack);
  if (policy == "window") {
    spec.params = {{"slack", slack}};
  } else if (policy != "full") {
    spec.params = {{"sinks", std::to_string(kSinks)},
                   {"recent", std::to_string(kRecent)},
                   {"slack", slack}};
  }
  return spec;
}

// Fills the session to exactly `budget` tokens (no eviction yet).
// `extra_pages` is room for a policy that never evicts (full).
absl::StatusOr<SteadySession> NewSteadySession(const std::string& policy,
                                               int64_t budget,
                                               int64_t extra_pages) {
  const ModelLayout layout = BenchLayout();
  StoreOptions options;
  // +2: an append may reserve a page for a settle eviction next to the page
  // the new token needs.
  options.pools.push_back(
      PoolSpec{layout, CeilDiv(budget + 1, kPageTokens) + 2 + extra_pages});
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  if (!store.ok()) return store.status();
  SteadySession s;
  s.store = *std::move(store);
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = SpecFor(policy);
  spec.budget.tokens = budget;
  absl::StatusOr<SessionId> id = s.store->CreateSession(spec);
  if (!id.ok()) return id.status();
  s.id = *id;

  // One token's keys as appended (bf16 also for a quantised layout).
  const int64_t token_bytes = int64_t{kKvHeads} * kHeadDim * 2;
  std::vector<std::byte> chunk(kPrefillChunk * token_bytes);
  for (size_t i = 0; i < chunk.size(); ++i) {
    chunk[i] = static_cast<std::byte>(i * 131 % 251);
  }
  if (IsQuantized(layout.dtype)) {  // finite values only
    for (size_t i = 0; i < chunk.size(); i += 2) {
      const uint16_t h = FloatToBf16(static_cast<float>(i * 131 % 251) / 64);
      chunk[i] = static_cast<std::byte>(h & 0xff);
      chunk[i + 1] = static_cast<std::byte>(h >> 8);
    }
  }
  s.token_kv.assign(chunk.begin(), chunk.begin() + token_bytes);
  std::vector<int64_t> positions;
  while (s.next_position < budget) {
    const int64_t n = std::min(kPrefillChunk, budget - s.next_position);
    positions.resize(n);
    for (int64_t i = 0; i < n; ++i) positions[i] = s.next_position + i;
    const std::span<const std::byte> kv(chunk.data(), n * token_bytes);
    const LayerKv layer{kv, kv};
    absl::StatusOr<StepResult> r = s.store->Append(
        s.id, AppendRequest{positions, std::span<const LayerKv>(&layer, 1)});
    if (!r.ok()) return r.status();
    s.next_position += n;
  }
  return s;
}

enum class StepKind { kAppendOnly, kPerHead, kReduced };

// One decode step. Returns the tokens it evicted, or an error.
absl::StatusOr<int64_t> DecodeStep(SteadySession& s, const AttentionInput& in,
                                   StepKind kind) {
  const int64_t position = s.next_position++;
  const LayerKv layer{s.token_kv, s.token_kv};
  absl::StatusOr<StepResult> appended = s.store->Append(
      s.id, AppendRequest{std::span<const int64_t>(&position, 1),
                          std::span<const LayerKv>(&layer, 1)});
  if (!appended.ok()) return appended.status();
  const LayerChange& change = appended->layers[0];
  int64_t evicted = static_cast<int64_t>(change.evicted_positions.size());
  if (kind == StepKind::kAppendOnly) return evicted;
  const int64_t n = change.resident;
  LayerScores scores;
  scores.layer = 0;
  scores.version = change.version;
  scores.rows = 1;
  if (kind == StepKind::kPerHead) {
    scores.source = ScoreSource::kPerHead;
    scores.data = std::span<const float>(in.per_head.data(), kQueryHeads * n);
  } else {
    scores.source = ScoreSource::kReduced;
    scores.data = std::span<const float>(in.reduced.data(), n);
  }
  absl::StatusOr<StepResult> updated =
      s.store->UpdateScores(s.id, std::span<const LayerScores>(&scores, 1));
  if (!updated.ok()) return updated.status();
  evicted += static_cast<int64_t>(updated->layers[0].evicted_positions.size());
  return evicted;
}

void BM_PolicyStep(benchmark::State& state, const std::string& policy,
                   StepKind kind, int64_t budget) {
  static const AttentionInput* const kNoInput = new AttentionInput();
  const AttentionInput& in =
      kind == StepKind::kAppendOnly ? *kNoInput : InputFor(budget);
  const int64_t steps = state.max_iterations;
  // full never evicts: its resident grows by one token per step.
  const int64_t extra_pages =
      policy == "full" ? CeilDiv(steps + kWarmupSteps, kPageTokens) + 1 : 0;
  absl::StatusOr<SteadySession> session =
      NewSteadySession(policy, budget, extra_pages);
  if (!session.ok()) {
    state.SkipWithError(std::string(session.status().message()).c_str());
    return;
  }
  for (int64_t i = 0; i < kWarmupSteps; ++i) {
    if (absl::StatusOr<int64_t> r = DecodeStep(*session, in, kind); !r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      return;
    }
  }
  int64_t evicted = 0;
  for (auto _ : state) {
    absl::StatusOr<int64_t> r = DecodeStep(*session, in, kind);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    evicted += *r;
  }
  const int64_t attention_floats = kind == StepKind::kPerHead
                                       ? kQueryHeads * budget
                                   : kind == StepKind::kReduced ? budget
                                                                : 0;
  state.counters["evicted/step"] = benchmark::Counter(
      static_cast<double>(evicted), benchmark::Counter::kAvgIterations);
  state.counters["in_bytes"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * attention_floats * 4,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

// The floor: one vectorised pass that reads the step's attention
// (`floats` of it) and a score array of `n` once each. 32 independent
// partial sums, so the adds keep up with the loads and the pass is bound by
// memory, not by the latency of one accumulator.
float ReadOnce(const float* __restrict attention, int64_t floats,
               const float* __restrict score, int64_t n) {
  constexpr int kLanes = 32;
  float acc[kLanes] = {};
  const auto add = [&acc](const float* __restrict p, int64_t count) {
    int64_t i = 0;
    for (; i + kLanes <= count; i += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) acc[j] += p[i + j];
    }
    for (; i < count; ++i) acc[0] += p[i];
  };
  add(attention, floats);
  add(score, n);
  float sum = 0.0f;
  for (float a : acc) sum += a;
  return sum;
}

void BM_Floor(benchmark::State& state, StepKind kind, int64_t budget) {
  const AttentionInput& in = InputFor(budget);
  std::vector<float> score(budget + 1, 1.0f);
  const float* attention =
      kind == StepKind::kPerHead ? in.per_head.data() : in.reduced.data();
  const int64_t heads = kind == StepKind::kPerHead ? kQueryHeads : 1;
  // The resident counts a token-level policy's UpdateScores sees over one
  // eviction cycle: budget - slack + 1 .. budget + 1.
  int64_t n = budget - kSlack + 1;
  for (auto _ : state) {
    float sum = ReadOnce(attention, heads * n, score.data(), n);
    benchmark::DoNotOptimize(sum);
    n = n == budget + 1 ? budget - kSlack + 1 : n + 1;
  }
  // Same columns as the steps, so the console prints one table per size.
  state.counters["evicted/step"] = 0;
  state.counters["in_bytes"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * heads * budget * 4,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

std::string SourceName(StepKind kind) {
  switch (kind) {
    case StepKind::kAppendOnly:
      return "append_only";
    case StepKind::kPerHead:
      return "per_head";
    case StepKind::kReduced:
      return "reduced";
  }
  return "?";
}

// Benchmark names: "floor/<source>/<resident>" and
// "step/<source>/<policy>/<resident>".
void RegisterAll() {
  const std::vector<int64_t> budgets = {1024, 8192, 32768, 131072};
  const std::vector<std::string> appenders = {"full", "window",
                                              "streaming_llm"};
  const std::vector<std::string> scorers = {"h2o", "tova", "scissorhands",
                                            "h2o_page"};
  for (int64_t budget : budgets) {
    const int64_t steps = StepsFor(budget);
    for (StepKind kind : {StepKind::kPerHead, StepKind::kReduced}) {
      const std::string source = SourceName(kind);
      benchmark::RegisterBenchmark(
          absl::StrCat("floor/", source, "/", budget).c_str(), BM_Floor, kind,
          budget)
          ->Iterations(steps)
          ->Unit(benchmark::kMicrosecond);
      if (kind == StepKind::kPerHead) {
        for (const std::string& policy : appenders) {
          benchmark::RegisterBenchmark(
              absl::StrCat("step/append_only/", policy, "/", budget).c_str(),
              BM_PolicyStep, policy, StepKind::kAppendOnly, budget)
              ->Iterations(steps)
              ->Unit(benchmark::kMicrosecond);
        }
      }
      for (const std::string& policy : scorers) {
        benchmark::RegisterBenchmark(
            absl::StrCat("step/", source, "/", policy, "/", budget).c_str(),
            BM_PolicyStep, policy, kind, budget)
            ->Iterations(steps)
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
}

// Prints the usual console output, keeps every run, and after the run
// prints each step's CPU time against the floor of its source and size.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  // No colour codes: the output is meant to be pasted and diffed.
  RatioReporter() : ConsoleReporter(OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Iteration && !run.error_occurred &&
          run.iterations > 0) {
        ns_per_step_[run.run_name.function_name] =
            run.cpu_accumulated_time * 1e9 /
            static_cast<double>(run.iterations);
        order_.push_back(run.run_name.function_name);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void PrintTable() const {
    std::printf(
        "\nPer decode step, one layer, %d query heads, CPU ns; floor = one "
        "read of the step's attention + scores.\nappend_only rows are "
        "compared with the per_head floor.\n",
        kQueryHeads);
    std::printf("%-12s %-14s %9s %13s %13s %8s\n", "source", "policy",
                "resident", "ns/step", "floor ns", "ratio");
    for (const std::string& name : order_) {
      // step/<source>/<policy>/<resident>
      std::vector<std::string> parts;
      size_t start = 0;
      while (true) {
        const size_t slash = name.find('/', start);
        parts.push_back(name.substr(start, slash - start));
        if (slash == std::string::npos) break;
        start = slash + 1;
      }
      if (parts.size() != 4 || parts[0] != "step") continue;
      const std::string floor_source =
          parts[1] == "append_only" ? "per_head" : parts[1];
      const auto floor = ns_per_step_.find(
          absl::StrCat("floor/", floor_source, "/", parts[3]));
      const double step_ns = ns_per_step_.at(name);
      if (floor == ns_per_step_.end()) {
        std::printf("%-12s %-14s %9s %13.0f %13s %8s\n", parts[1].c_str(),
                    parts[2].c_str(), parts[3].c_str(), step_ns, "-", "-");
        continue;
      }
      std::printf("%-12s %-14s %9s %13.0f %13.0f %8.2f\n", parts[1].c_str(),
                  parts[2].c_str(), parts[3].c_str(), step_ns, floor->second,
                  step_ns / floor->second);
    }
  }

 private:
  std::map<std::string, double> ns_per_step_;
  std::vector<std::string> order_;
};

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  // Our own flag, removed before the library checks for unknown ones.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--cycles=", 9) == 0) {
      kvkeep::g_cycles = std::max(1L, std::strtol(argv[i] + 9, nullptr, 10));
    } else if (std::strncmp(argv[i], "--dtype=", 8) == 0) {
      const std::string name = argv[i] + 8;
      bool found = false;
      for (kvkeep::DType d : {kvkeep::DType::kBF16, kvkeep::DType::kInt8,
                              kvkeep::DType::kFp8E4M3, kvkeep::DType::kInt4}) {
        if (name == kvkeep::DTypeName(d)) kvkeep::g_dtype = d, found = true;
      }
      if (!found) {
        std::fprintf(stderr, "--dtype: bf16, int8, fp8_e4m3 or int4\n");
        return 2;
      }
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvkeep::RegisterAll();
  kvkeep::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintTable();
  benchmark::Shutdown();
  return 0;
}
