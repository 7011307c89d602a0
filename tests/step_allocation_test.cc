// Steady-state decode steps through the store allocate nothing (issue 21):
// CacheStore::Step(..., StepOutcome&) with a token and one row of attention
// for every layer, counted by replacing the global operator new. A warm-up
// runs a few eviction cycles first, so every buffer has reached its size.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

// ASan brings its own operator new and delete, which a replacement here
// would mismatch: under ASan the count does not run (the plain build runs
// it).
#if defined(__SANITIZE_ADDRESS__)
#define KVKEEP_COUNT_ALLOCATIONS 0
#else
#define KVKEEP_COUNT_ALLOCATIONS 1
#endif

namespace {

// Counted while set: every thread's operator new calls.
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};

#if KVKEEP_COUNT_ALLOCATIONS
void* Allocate(std::size_t n, std::size_t align) {
  if (g_counting.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  if (n == 0) n = 1;
  void* p = align <= alignof(std::max_align_t)
                ? std::malloc(n)
                : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
#endif

}  // namespace

#if KVKEEP_COUNT_ALLOCATIONS
void* operator new(std::size_t n) { return Allocate(n, 0); }
void* operator new[](std::size_t n) { return Allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return Allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return Allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
#endif  // KVKEEP_COUNT_ALLOCATIONS

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 4;
constexpr int32_t kQueryHeads = 4;
constexpr int32_t kHeadDim = 8;
constexpr int64_t kBudget = 96;
constexpr int64_t kSlack = 16;  // an eviction every 17 steps

ModelLayout Layout() {
  ModelLayout l;
  l.name = std::string("alloc");
  l.num_layers = kLayers;
  l.kv_heads = 2;
  l.query_heads = kQueryHeads;
  l.head_dim = kHeadDim;
  l.dtype = DType::kBF16;
  l.page_tokens = 16;
  return l;
}

// The K/V of one token per step, made before any counting.
struct Tokens {
  std::vector<int64_t> positions;
  std::vector<std::vector<std::byte>> keys, values;  // [step * kLayers + l]
  std::vector<LayerKv> layers;                       // likewise

  Tokens(const ModelLayout& l, int64_t first, int64_t steps) {
    for (int64_t p = first; p < first + steps; ++p) positions.push_back(p);
    for (int64_t s = 0; s < steps; ++s) {
      for (int32_t layer = 0; layer < l.num_layers; ++layer) {
        const std::span<const int64_t> one(&positions[s], 1);
        keys.push_back(test_data::TokenBytes(l, layer, one, false));
        values.push_back(test_data::TokenBytes(l, layer, one, true));
      }
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      layers.push_back(LayerKv{keys[i], values[i]});
    }
  }
  AppendRequest Step(int64_t s) const {
    return AppendRequest{std::span(positions).subspan(s, 1),
                         std::span(layers).subspan(s * kLayers, kLayers)};
  }
};

// A worker's view: per layer the version and resident count after the last
// call, and attention buffers sized for the largest step.
struct Worker {
  std::vector<uint64_t> versions;
  std::vector<int64_t> resident;
  std::vector<std::vector<float>> data;
  std::vector<LayerScores> scores;
  std::mt19937 rng{7};

  Worker(ScoreSource source) : versions(kLayers), resident(kLayers) {
    const int64_t per_row =
        source == ScoreSource::kQueries ? kQueryHeads * kHeadDim : kBudget + 1;
    const int64_t heads = source == ScoreSource::kPerHead ? kQueryHeads : 1;
    data.assign(kLayers, std::vector<float>(heads * per_row));
    scores.assign(kLayers, LayerScores{});
    for (int32_t l = 0; l < kLayers; ++l) {
      scores[l].layer = l;
      scores[l].source = source;
    }
  }

  void Follow(const StepResult& r) {
    for (const LayerChange& c : r.layers) {
      versions[c.layer] = c.version;
      resident[c.layer] = c.resident;
    }
  }

  // Attention for a step that appends one token: at the versions before it,
  // over the slots after it. Probabilities are a softmax row's worth of
  // random weights (each head's row sums to 1); queries are random.
  std::span<const LayerScores> Attend() {
    std::uniform_real_distribution<float> w(0.01f, 1);
    for (int32_t l = 0; l < kLayers; ++l) {
      LayerScores& s = scores[l];
      s.version = versions[l];
      const int64_t slots = resident[l] + 1;
      const int64_t n =
          s.source == ScoreSource::kQueries   ? kQueryHeads * kHeadDim
          : s.source == ScoreSource::kPerHead ? kQueryHeads * slots
                                              : slots;
      float* row = data[l].data();
      for (int64_t i = 0; i < n; ++i) row[i] = w(rng);
      if (s.source != ScoreSource::kQueries) {
        const int64_t heads = n / slots;
        for (int64_t h = 0; h < heads; ++h) {
          float* head = row + h * slots;
          float sum = 0;
          for (int64_t i = 0; i < slots; ++i) sum += head[i];
          for (int64_t i = 0; i < slots; ++i) head[i] /= sum;
        }
      }
      s.data = std::span<const float>(row, n);
    }
    return scores;
  }
};

struct Case {
  std::string policy;
  ScoreSource source;
  bool attention = true;  // false: a content-blind policy, appends only
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.policy << (c.attention ? "" : ", appends only");
}

class StepAllocationTest : public ::testing::TestWithParam<Case> {};

TEST_P(StepAllocationTest, SteadyStateStepsAllocateNothing) {
  if (!KVKEEP_COUNT_ALLOCATIONS) {
    GTEST_SKIP() << "ASan replaces operator new: the allocation count runs "
                    "in the build without sanitizers";
  }
  const ModelLayout layout = Layout();
  StoreOptions options;
  options.pools.push_back(PoolSpec{layout, 256});
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  KV_ASSERT_OK(store.status());
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = PolicySpec{
      GetParam().policy,
      {{"sinks", "4"}, {"recent", "16"}, {"slack", std::to_string(kSlack)}}};
  spec.budget.tokens = kBudget;
  absl::StatusOr<SessionId> id = (*store)->CreateSession(spec);
  KV_ASSERT_OK(id.status());

  // Prefill to the budget, then decode: 5 eviction cycles of warm-up, 5
  // counted.
  std::vector<int64_t> prompt(kBudget);
  for (int64_t p = 0; p < kBudget; ++p) prompt[p] = p;
  std::vector<std::vector<std::byte>> pk, pv;
  std::vector<LayerKv> players;
  for (int32_t l = 0; l < kLayers; ++l) {
    pk.push_back(test_data::TokenBytes(layout, l, prompt, false));
    pv.push_back(test_data::TokenBytes(layout, l, prompt, true));
  }
  for (int32_t l = 0; l < kLayers; ++l)
    players.push_back(LayerKv{pk[l], pv[l]});
  absl::StatusOr<StepResult> prefill =
      (*store)->Append(*id, AppendRequest{prompt, players});
  KV_ASSERT_OK(prefill.status());

  constexpr int64_t kCycle = kSlack + 1;
  constexpr int64_t kWarmup = 5 * kCycle;
  constexpr int64_t kCounted = 5 * kCycle;
  const Tokens tokens(layout, kBudget, kWarmup + kCounted);
  Worker worker(GetParam().source);
  worker.Follow(*prefill);
  StepOutcome outcome;
  int64_t evictions = 0;
  for (int64_t s = 0; s < kWarmup + kCounted; ++s) {
    if (s == kWarmup) {
      g_allocations.store(0);
      g_counting.store(true);
    }
    const std::span<const LayerScores> scores =
        GetParam().attention ? worker.Attend() : std::span<const LayerScores>();
    const absl::Status status =
        (*store)->Step(*id, tokens.Step(s), scores, outcome);
    if (!status.ok()) {
      g_counting.store(false);
      FAIL() << "step " << s << ": " << status;
    }
    worker.Follow(outcome.append);
    worker.Follow(outcome.scores);
    if (s >= kWarmup) {
      for (const LayerChange& c : outcome.append.layers) {
        evictions += static_cast<int64_t>(c.evicted_positions.size());
      }
      for (const LayerChange& c : outcome.scores.layers) {
        evictions += static_cast<int64_t>(c.evicted_positions.size());
      }
    }
  }
  g_counting.store(false);
  // The counted steps are steady state: they evicted.
  EXPECT_GT(evictions, 0);
  EXPECT_EQ(g_allocations.load(), 0)
      << "allocations in " << kCounted << " steady-state steps";
}

INSTANTIATE_TEST_SUITE_P(
    PoliciesAndForms, StepAllocationTest,
    ::testing::Values(Case{"h2o", ScoreSource::kReduced},
                      Case{"h2o", ScoreSource::kPerHead},
                      Case{"h2o", ScoreSource::kQueries},
                      Case{"tova", ScoreSource::kReduced},
                      Case{"scissorhands", ScoreSource::kReduced},
                      Case{"h2o_page", ScoreSource::kReduced},
                      Case{"streaming_llm", ScoreSource::kReduced, false}),
    [](const ::testing::TestParamInfo<Case>& info) {
      if (!info.param.attention) return info.param.policy + "_append_only";
      const char* form = info.param.source == ScoreSource::kReduced ? "reduced"
                         : info.param.source == ScoreSource::kPerHead
                             ? "per_head"
                             : "queries";
      return info.param.policy + "_" + form;
    });

}  // namespace
}  // namespace kvkeep
