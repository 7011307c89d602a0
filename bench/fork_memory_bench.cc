// Memory of forks: a 4,100-token session forked into 100 children, each of
// which then decodes 32 tokens of its own. Pages are shared copy-on-write,
// so the pool should hold about one copy of the prefix plus what the
// children wrote; the counters print that against the unshared sum (what
// 101 independent sessions would hold):
//   physical_pages   pages in use in the pool (each shared page once)
//   unshared_pages   the pages the 101 sessions hold, summed
//   saved_ratio      unshared_pages / physical_pages
//   prefix_pages     the parent's pages at fork time
//   own_pages_per_child  (physical_pages - prefix_pages) / 100: what each
//                    child added, its copies (COW) and new pages
// Three workloads: "full" (no eviction: a child copies only its partly
// filled last page per layer, and adds pages for its new tokens); "h2o" at
// a budget just below the prefix, so every child's first settle evicts 36
// tokens per layer scattered over the prefix and compaction copies each
// page that gets a hole; and "h2o_page" at the same budget, which evicts
// whole pages (48 tokens: 3 pages per layer), so only those pages are
// written. The time per iteration is the 100 forks and their 3,200 decode
// steps.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/store_bench_support.h"
#include "benchmark/benchmark.h"
#include "cache_store/cache_store.h"

namespace kvkeep {
namespace {

using bench::Check;
using bench::Rows;
using bench::Tokens;

constexpr int64_t kPrefix = 4100;
constexpr int kChildren = 100;
constexpr int kSteps = 32;

// 4 layers, 2 KV heads of 32, bf16, 16-token pages: 4 KiB pages, so even
// the evicting run (which copies most of what its evictions touch) stays
// near 100 MiB of host memory.
ModelLayout BenchLayout() { return bench::Bf16Layout(2, 32); }

// A child's 32 steps: appends for "full"; for "h2o" a score update first
// (the child starts over its budget) and then appends with scores.
void Decode(CacheStore& store, SessionId id, bool scored, std::mt19937& rng) {
  if (scored) {
    const Rows settle(Check(store.GetStats(id)), 0, rng);
    Check(store.UpdateScores(id, settle.scores).status());
  }
  for (int step = 0; step < kSteps; ++step) {
    const Tokens token(BenchLayout(), kPrefix + step, 1, rng);
    if (!scored) {
      Check(store.Append(id, token.request()).status());
      continue;
    }
    const Rows rows(Check(store.GetStats(id)), 1, rng);
    Check(store.Step(id, token.request(), rows.scores).status());
  }
}

void BM_ForkChildren(benchmark::State& state) {
  const bool scored = state.range(0) != 0;
  const char* const policy = state.range(0) == 2 ? "h2o_page" : "h2o";
  const ModelLayout layout = BenchLayout();
  StoreOptions options;
  options.pools.push_back(PoolSpec{layout, 32768});
  std::unique_ptr<CacheStore> store = Check(CacheStore::Create(options));
  std::mt19937 rng(18);
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = scored ? PolicySpec{policy, {{"recent", "32"}, {"slack", "32"}}}
                       : PolicySpec{"full", {}};
  spec.budget.tokens = scored ? 4096 : kPrefix + kSteps;
  const SessionId parent = Check(store->CreateSession(spec));
  for (int64_t at = 0; at < kPrefix; at += 1025) {
    const Tokens chunk(layout, at, std::min<int64_t>(1025, kPrefix - at), rng);
    Check(store->Append(parent, chunk.request()).status());
  }
  const int64_t prefix_pages = Check(store->GetStats(parent)).pages;
  PoolStats pool;
  int64_t unshared = 0;
  for (auto _ : state) {
    std::vector<SessionId> children;
    for (int c = 0; c < kChildren; ++c) {
      children.push_back(Check(store->ForkSession(parent, {})));
      Decode(*store, children.back(), scored, rng);
    }
    state.PauseTiming();
    pool = store->Layouts()[0].pool;
    unshared = pool.page_references;
    for (SessionId c : children) Check(store->CloseSession(c));
    state.ResumeTiming();
  }
  state.counters["prefix_pages"] = static_cast<double>(prefix_pages);
  state.counters["physical_pages"] = static_cast<double>(pool.used_pages);
  state.counters["unshared_pages"] = static_cast<double>(unshared);
  state.counters["saved_ratio"] =
      static_cast<double>(unshared) / static_cast<double>(pool.used_pages);
  // What the children added beyond the one shared prefix, per child.
  state.counters["own_pages_per_child"] =
      static_cast<double>(pool.used_pages - prefix_pages) / kChildren;
  state.SetLabel(scored ? absl::StrCat(policy, ", budget 4096 (evicting)")
                        : std::string("full (no eviction)"));
}
BENCHMARK(BM_ForkChildren)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvkeep

BENCHMARK_MAIN();
