// Named prefixes against independent prefills, and whether content hashing
// of pages (vLLM-style automatic prefix matching) would pay now.
//
// The workload: 100 agents share a 3,000-token preamble (system prompt and
// tool definitions); each then appends its own 200-token tail and decodes
// 32 tokens. It runs three ways on one store layout (4 layers, 1 KV head of
// 64, bf16, 16-token pages: 4 KiB of keys and values per page):
//   independent   each agent prefills the preamble itself (100 copies)
//   named_prefix  the preamble is published once (PublishPrefix) and every
//                 agent starts from it (CreateSession with prefix), policy
//                 full
//   named_h2o     the same with h2o at a budget of 3,100 (each agent evicts
//                 its own tokens; the protected preamble stays shared)
// and prints the pool's physical pages, MiB, and the store time per agent
// (every call on the store; the tokens' bytes are made before the clock
// starts, the preamble's once for all runs).
//
// Content hashing is measured on the independent run's token ids (the
// preamble's are the same for every agent, the tails differ): each full
// 16-token page gets a chain hash of (parent hash, its first position, its
// ids), and a page whose hash the table already holds would be shared.
// Printed: the pages that would be deduplicated, and the cost of hashing a
// page two ways: its token ids (what vLLM hashes; kvkeep's appends do not
// carry ids today) and its keys and values in every layer (all kvkeep
// sees now).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "bench/store_bench_support.h"
#include "cache_store/cache_store.h"

namespace kvkeep {
namespace {

using bench::Check;
using bench::Rows;
using bench::Tokens;

constexpr int kAgents = 100;
constexpr int64_t kPreamble = 3000;
constexpr int64_t kTail = 200;
constexpr int kSteps = 32;
constexpr int32_t kPageTokens = 16;

ModelLayout BenchLayout() { return bench::Bf16Layout(1, 64); }

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

struct Run {
  const char* name;
  int64_t physical_pages = 0;
  int64_t unshared_pages = 0;  // pages the sessions hold, summed
  double seconds = 0;          // store time for all agents
};

// One agent's own tokens, made before the clock starts: its tail, then
// kSteps single tokens.
struct AgentTokens {
  Tokens tail;
  std::vector<Tokens> steps;
  explicit AgentTokens(std::mt19937& rng)
      : tail(BenchLayout(), kPreamble, kTail, rng) {
    for (int step = 0; step < kSteps; ++step) {
      steps.emplace_back(BenchLayout(), kPreamble + kTail + step, 1, rng);
    }
  }
};

std::vector<AgentTokens> MakeAgents() {
  std::mt19937 rng(1);
  std::vector<AgentTokens> agents;
  for (int a = 0; a < kAgents; ++a) agents.emplace_back(rng);
  return agents;
}

// One agent's own work after its start: the tail, then its steps (with one
// row of attention each for a scored policy).
void Agent(CacheStore& store, SessionId id, const AgentTokens& tokens,
           bool scored, std::mt19937& rng) {
  Check(store.Append(id, tokens.tail.request()).status());
  if (scored) {  // the tail's attention: evicts the layer down to budget
    const Rows settle(Check(store.GetStats(id)), 0, rng);
    Check(store.UpdateScores(id, settle.scores).status());
  }
  for (const Tokens& token : tokens.steps) {
    if (!scored) {
      Check(store.Append(id, token.request()).status());
      continue;
    }
    const Rows rows(Check(store.GetStats(id)), 1, rng);
    Check(store.Step(id, token.request(), rows.scores).status());
  }
}

std::unique_ptr<CacheStore> NewStore() {
  StoreOptions options;
  options.pools.push_back(PoolSpec{BenchLayout(), 100000});
  return Check(CacheStore::Create(options));
}

SessionSpec Spec(const std::string& policy, int64_t budget) {
  SessionSpec spec;
  spec.layout = BenchLayout().name;
  spec.policy = PolicySpec{policy, {}};
  spec.budget.tokens = budget;
  return spec;
}

Run Independent(const Tokens& preamble,
                const std::vector<AgentTokens>& agents) {
  std::unique_ptr<CacheStore> store = NewStore();
  std::mt19937 rng(1);
  const auto start = std::chrono::steady_clock::now();
  for (int a = 0; a < kAgents; ++a) {
    const SessionId id = Check(store->CreateSession(Spec("full", 4096)));
    Check(store->Append(id, preamble.request()).status());
    Agent(*store, id, agents[a], false, rng);
  }
  const PoolStats pool = store->Layouts()[0].pool;
  return Run{"independent", pool.used_pages, pool.page_references,
             Seconds(std::chrono::steady_clock::now() - start)};
}

Run Named(const Tokens& preamble, const std::vector<AgentTokens>& agents,
          bool h2o) {
  std::unique_ptr<CacheStore> store = NewStore();
  std::mt19937 rng(1);
  const auto start = std::chrono::steady_clock::now();
  const SessionId source = Check(store->CreateSession(Spec("full", 4096)));
  Check(store->Append(source, preamble.request()).status());
  Check(
      store->PublishPrefix(source, PrefixSpec{"preamble", "", false}).status());
  Check(store->CloseSession(source));
  for (int a = 0; a < kAgents; ++a) {
    SessionSpec spec = h2o ? Spec("h2o", kPreamble + 100) : Spec("full", 4096);
    spec.layout.clear();
    spec.prefix = "preamble";
    Agent(*store, Check(store->CreateSession(spec)), agents[a], h2o, rng);
  }
  const PoolStats pool = store->Layouts()[0].pool;
  return Run{h2o ? "named_h2o" : "named_prefix", pool.used_pages,
             pool.page_references,
             Seconds(std::chrono::steady_clock::now() - start)};
}

// Chain hashes of every full page of every agent's token ids; how many a
// table would already hold.
struct Hashing {
  int64_t full_pages = 0;  // per layer
  int64_t matched = 0;     // per layer
  double ids_ns_per_page = 0;
  double kv_ns_per_page = 0;  // every layer's keys and values
};

Hashing MeasureHashing(const Tokens& preamble) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> id(0, 128255);  // a Llama 3 vocab
  std::vector<int32_t> common(kPreamble);
  for (int32_t& t : common) t = id(rng);
  Hashing h;
  absl::flat_hash_set<size_t> table;
  std::chrono::steady_clock::duration spent{};
  for (int a = 0; a < kAgents; ++a) {
    std::vector<int32_t> ids = common;
    for (int64_t i = 0; i < kTail + kSteps; ++i) ids.push_back(id(rng));
    const auto start = std::chrono::steady_clock::now();
    size_t parent = 0;
    for (size_t p = 0; p + kPageTokens <= ids.size(); p += kPageTokens) {
      parent =
          absl::HashOf(parent, p,
                       std::string_view(reinterpret_cast<const char*>(&ids[p]),
                                        kPageTokens * sizeof(int32_t)));
      ++h.full_pages;
      h.matched += table.insert(parent).second ? 0 : 1;
    }
    spent += std::chrono::steady_clock::now() - start;
  }
  h.ids_ns_per_page = 1e9 * Seconds(spent) / static_cast<double>(h.full_pages);
  // Keys and values: a page's bytes in every layer (what the store holds).
  const int64_t page_bytes = BenchLayout().page_layout().page_bytes() / 2;
  const int64_t pages = kPreamble / kPageTokens;
  size_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int rep = 0; rep < 10; ++rep) {
    for (int64_t p = 0; p < pages; ++p) {
      for (const std::vector<std::byte>& layer : preamble.bytes) {
        const char* at = reinterpret_cast<const char*>(layer.data());
        sink ^= absl::HashOf(
            std::string_view(at + p * page_bytes, page_bytes),
            std::string_view(at + layer.size() / 2 + p * page_bytes,
                             page_bytes));
      }
    }
  }
  h.kv_ns_per_page = 1e9 * Seconds(std::chrono::steady_clock::now() - start) /
                     static_cast<double>(10 * pages);
  if (sink == 1) std::printf(" ");  // keeps the hashes
  return h;
}

void Print(const Run& r, const Run& baseline, int64_t page_bytes) {
  std::printf("%-13s %9lld %9.1f %9lld %8.2fx %10.2f\n", r.name,
              static_cast<long long>(r.physical_pages),
              static_cast<double>(r.physical_pages * page_bytes) / (1 << 20),
              static_cast<long long>(r.unshared_pages),
              static_cast<double>(baseline.physical_pages) /
                  static_cast<double>(r.physical_pages),
              1e3 * r.seconds / kAgents);
}

int Main() {
  std::mt19937 rng(3);
  const Tokens preamble(BenchLayout(), 0, kPreamble, rng);
  const int64_t page_bytes = BenchLayout().page_layout().page_bytes();
  const std::vector<AgentTokens> agents = MakeAgents();
  const Run independent = Independent(preamble, agents);
  const Run named = Named(preamble, agents, false);
  const Run named_h2o = Named(preamble, agents, true);
  std::printf(
      "%d agents: %lld-token preamble + %lld-token tail + %d decode steps; "
      "%d layers, %lld-byte pages\n",
      kAgents, static_cast<long long>(kPreamble), static_cast<long long>(kTail),
      kSteps, BenchLayout().num_layers, static_cast<long long>(page_bytes));
  std::printf("%-13s %9s %9s %9s %9s %10s\n", "run", "pages", "MiB", "unshared",
              "vs indep", "ms/agent");
  for (const Run* r : {&independent, &named, &named_h2o}) {
    Print(*r, independent, page_bytes);
  }
  const Hashing h = MeasureHashing(preamble);
  const int64_t layers = BenchLayout().num_layers;
  std::printf(
      "content hashing over the independent run: %lld full pages per layer, "
      "%lld would match (%lld pages over %lld layers; %.1f%% of its "
      "pages)\n",
      static_cast<long long>(h.full_pages), static_cast<long long>(h.matched),
      static_cast<long long>(h.matched * layers),
      static_cast<long long>(layers),
      100.0 * static_cast<double>(h.matched * layers) /
          static_cast<double>(independent.physical_pages));
  std::printf(
      "hash cost per page: token ids %.1f ns; keys and values of all %lld "
      "layers %.1f ns; store time per page appended (independent run) "
      "%.1f ns\n",
      h.ids_ns_per_page, static_cast<long long>(layers), h.kv_ns_per_page,
      1e9 * independent.seconds /
          static_cast<double>(independent.physical_pages));
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main() { return kvkeep::Main(); }
