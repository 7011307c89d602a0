// kvkeepd: the kvkeep store daemon. Builds the store from its configuration
// (the embedded default: one demo layout on a host-memory pool), reports it,
// proves it works with a short self-check session, then serves until SIGINT
// or SIGTERM. The gRPC endpoint arrives with the service; until then the
// daemon only holds the store.
#include <csignal>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache_store/cache_store.h"

ABSL_FLAG(int64_t, pool_pages, 4096, "pages in the demo layout's pool");
ABSL_FLAG(std::string, dtype, "bf16", "demo layout KV dtype: f32, f16, bf16");
ABSL_FLAG(bool, once, false, "exit after the report and self-check");

namespace kvkeep {
namespace {

// A small Llama-like layout: 8 layers, GQA 32 query / 8 kv heads, dim 128.
ModelLayout DemoLayout(DType dtype) {
  ModelLayout l;
  l.name = "demo";
  l.num_layers = 8;
  l.kv_heads = 8;
  l.query_heads = 32;
  l.head_dim = 128;
  l.dtype = dtype;
  l.page_tokens = 16;
  return l;
}

void Report(const CacheStore& store) {
  for (const LayoutStats& s : store.Layouts()) {
    const ModelLayout& l = s.layout;
    std::printf(
        "kvkeepd: layout '%s': %d layers, %d kv / %d query heads, head_dim "
        "%d, %s, %d tokens per page (%lld bytes); host pool of %lld pages "
        "(%.1f MiB), %lld used\n",
        l.name.c_str(), l.num_layers, l.kv_heads, l.query_heads, l.head_dim,
        std::string(DTypeName(l.dtype)).c_str(), l.page_tokens,
        static_cast<long long>(s.pool.page_bytes),
        static_cast<long long>(s.pool.capacity_pages),
        s.pool.capacity_pages * s.pool.page_bytes / 1048576.0,
        static_cast<long long>(s.pool.used_pages));
  }
}

// Decodes 512 tokens of random KV through an h2o session scored from query
// vectors, and prints what the store kept.
absl::Status SelfCheck(CacheStore& store, const ModelLayout& layout) {
  SessionSpec spec;
  spec.layout = "demo";
  spec.policy = {"h2o", {{"sinks", "4"}, {"recent", "32"}, {"slack", "16"}}};
  spec.budget.tokens = 128;
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  if (!id.ok()) return id.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const int64_t token_elems = int64_t{layout.kv_heads} * layout.head_dim;
  std::vector<std::byte> k(token_elems * DTypeBytes(layout.dtype));
  std::vector<std::byte> v(k.size());
  std::vector<float> q(int64_t{layout.query_heads} * layout.head_dim);
  std::vector<LayerKv> kv(layout.num_layers);
  std::vector<LayerScores> scores(layout.num_layers);
  int64_t evicted = 0, moves = 0;
  for (int64_t pos = 0; pos < 512; ++pos) {
    for (int64_t i = 0; i < token_elems; ++i) {
      StoreFromFloat(layout.dtype, k.data(), i, normal(rng));
      StoreFromFloat(layout.dtype, v.data(), i, normal(rng));
    }
    for (LayerKv& layer : kv) layer = LayerKv{k, v};
    absl::StatusOr<StepResult> appended =
        store.Append(*id, AppendRequest{std::span(&pos, 1), kv});
    if (!appended.ok()) return appended.status();
    for (float& x : q) x = normal(rng);
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      scores[l] = LayerScores{l, appended->layers[l].version,
                              ScoreSource::kQueries, 1, q};
    }
    absl::StatusOr<StepResult> step = store.UpdateScores(*id, scores);
    if (!step.ok()) return step.status();
    for (const LayerChange& c : step->layers) {
      evicted += static_cast<int64_t>(c.evicted_positions.size());
      moves += static_cast<int64_t>(c.moves.size());
    }
  }
  absl::StatusOr<SessionStats> stats = store.GetStats(*id);
  if (!stats.ok()) return stats.status();
  std::printf(
      "kvkeepd: self-check: h2o (sinks 4, recent 32, budget 128, slack 16) "
      "decoded 512 tokens x %d layers: %lld resident, %lld evicted, %lld slot "
      "moves, %lld pages (%lld bytes) held\n",
      layout.num_layers, static_cast<long long>(stats->resident_tokens),
      static_cast<long long>(evicted), static_cast<long long>(moves),
      static_cast<long long>(stats->pages),
      static_cast<long long>(stats->bytes));
  return store.CloseSession(*id);
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvkeepd: the kvkeep KV-cache store daemon.\n"
      "Starts on its embedded default: one demo layout, host-memory pool.");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    std::fprintf(stderr, "kvkeepd: %s\n", dtype.status().ToString().c_str());
    return 2;
  }
  const ModelLayout layout = DemoLayout(*dtype);
  StoreOptions options;
  options.pools.push_back(PoolSpec{layout, absl::GetFlag(FLAGS_pool_pages)});
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  if (!store.ok()) {
    std::fprintf(stderr, "kvkeepd: %s\n", store.status().ToString().c_str());
    return 1;
  }
  Report(**store);
  if (absl::Status s = SelfCheck(**store, layout); !s.ok()) {
    std::fprintf(stderr, "kvkeepd: self-check failed: %s\n",
                 s.ToString().c_str());
    return 1;
  }
  Report(**store);
  if (absl::GetFlag(FLAGS_once)) return 0;
  std::printf(
      "kvkeepd: store ready (host memory). No RPC endpoint yet: the gRPC "
      "service is the next milestone. Ctrl-C or SIGTERM stops.\n");
  std::fflush(stdout);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int sig = 0;
  sigwait(&set, &sig);
  std::printf("kvkeepd: signal %d, shutting down\n", sig);
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) { return kvkeep::Main(argc, argv); }
