// Tiers (docs/tiers.md): what moving a whole session out of the pool and
// back costs, by session size and tier. Each iteration moves one session
// down (CacheStore::Demote: snapshot, encode, CRC32C, then for the disk tier
// write, fsync, rename and fsync the directory) and times the call that
// brings it back (GetBlockTable on it: read, checksum, decode, restore into
// the pool). Counters:
//   restore_ms   the restoring call (the iteration's manual time too)
//   demote_ms    the move down, per iteration
//   MiB          the session's encoded size
//   restore_GiBps  MiB / restore time
// A ratio against the pool: `pool_read_ms` is a ReadLayer of every layer of
// the same session in the pool (copying out every byte), the cheapest thing
// that touches them all.
// Layout: 4 layers, 8 KV heads of 128, bf16 (16 KiB per token over all
// layers, keys and values). Tiers: 1 host memory, 2 disk (a directory under
// $KVKEEP_TIER_BENCH_DIR, default /tmp).
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "bench/store_bench_support.h"
#include "benchmark/benchmark.h"
#include "cache_store/cache_store.h"

namespace kvkeep {
namespace {

using bench::Check;
using bench::Tokens;

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - start)
      .count();
}

void BM_TierRestore(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const bool disk = state.range(1) == 2;
  const ModelLayout layout = bench::Bf16Layout(8, 128);
  const char* base = std::getenv("KVKEEP_TIER_BENCH_DIR");
  const std::string dir = absl::StrCat(base != nullptr ? base : "/tmp",
                                       "/kvkeep-tier-bench-", ::getpid());
  StoreOptions options;
  PoolSpec pool{layout, layout.num_layers * (tokens / layout.page_tokens) + 64};
  if (disk) {
    pool.tiers.disk_dir = dir;
  } else {
    pool.tiers.host_bytes = int64_t{1} << 40;
  }
  options.pools.push_back(pool);
  std::unique_ptr<CacheStore> store = Check(CacheStore::Create(options));
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = PolicySpec{"full", {}};
  spec.budget.tokens = tokens;
  const SessionId id = Check(store->CreateSession(spec));
  std::mt19937 rng(1);
  for (int64_t first = 0; first < tokens; first += 1024) {
    const Tokens chunk(layout, first, std::min<int64_t>(1024, tokens - first),
                       rng);
    Check(store->Append(id, chunk.request()).status());
  }
  auto start = std::chrono::steady_clock::now();
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    Check(store->ReadLayer(id, l).status());
  }
  const double pool_read_ms = MsSince(start);
  double demote_ms = 0;
  double restore_ms = 0;
  for (auto _ : state) {
    start = std::chrono::steady_clock::now();
    Check(store->Demote(id));
    demote_ms += MsSince(start);
    start = std::chrono::steady_clock::now();
    Check(store->GetBlockTable(id, 0).status());
    const double ms = MsSince(start);
    restore_ms += ms;
    state.SetIterationTime(ms / 1e3);
  }
  const TierStats tiers = store->Layouts()[0].tiers;
  const double n = static_cast<double>(state.iterations());
  const double mib = static_cast<double>(tokens * layout.num_layers * 2 *
                                         layout.page_layout().token_bytes()) /
                     (1 << 20);
  state.counters["restore_ms"] = restore_ms / n;
  state.counters["demote_ms"] = demote_ms / n;
  state.counters["pool_read_ms"] = pool_read_ms;
  state.counters["MiB"] = mib;
  state.counters["restore_GiBps"] = mib / 1024 / (restore_ms / n / 1e3);
  state.counters["restores"] = static_cast<double>(tiers.restores);
  state.SetLabel(disk ? "disk" : "host");
  store.reset();
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_TierRestore)
    ->ArgsProduct({{256, 1024, 4096, 16384}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvkeep

BENCHMARK_MAIN();
