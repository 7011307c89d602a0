// PagePool throughput: one Allocate of n pages followed by one Free of them,
// per iteration, for n = 1, 16 and 256, from one thread and from two threads
// sharing the pool (each thread its own owner). items_per_second counts
// pages allocated and freed (one item = one page's round trip).
//
// "owner_holds_page" variants keep one extra page charged to the owner for
// the whole run, so its entry in the pool's owner map survives each Free;
// without it, every Free of the owner's last pages erases the entry and the
// next Allocate inserts it again.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "cache_store/page_pool.h"

namespace kvkeep {
namespace {

// The layout of the policy benchmarks: 64 KiB pages. The arena is reserved
// but never written here, so its size costs nothing.
PageLayout BenchPageLayout() {
  return PageLayout{/*page_tokens=*/16, /*kv_heads=*/8, /*head_dim=*/128,
                    DType::kBF16};
}

// One pool for every benchmark: created once, shared by the threads of a
// multi-threaded run. Enough pages for two threads holding 257 each.
PagePool& SharedPool() {
  static PagePool* pool = [] {
    absl::StatusOr<std::unique_ptr<PagePool>> p =
        PagePool::Create(BenchPageLayout(), 4096);
    if (!p.ok()) std::abort();
    return p->release();
  }();
  return *pool;
}

void BM_AllocateFree(benchmark::State& state) {
  const int64_t n = state.range(0);
  const bool owner_holds_page = state.range(1) != 0;
  PagePool& pool = SharedPool();
  const OwnerId owner = static_cast<OwnerId>(state.thread_index()) + 1;
  std::vector<PageId> held;
  if (owner_holds_page && !pool.Allocate(owner, 1, &held).ok()) {
    state.SkipWithError("cannot allocate the held page");
    return;
  }
  std::vector<PageId> pages;
  pages.reserve(n);
  for (auto _ : state) {
    pages.clear();
    if (!pool.Allocate(owner, n, &pages).ok()) {
      state.SkipWithError("pool exhausted");
      break;
    }
    pool.Free(owner, pages);
  }
  pool.Free(owner, held);
  state.SetItemsProcessed(state.iterations() * n);
}

BENCHMARK(BM_AllocateFree)
    ->ArgNames({"pages", "owner_holds_page"})
    ->ArgsProduct({{1, 16, 256}, {0, 1}})
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

}  // namespace
}  // namespace kvkeep

BENCHMARK_MAIN();
