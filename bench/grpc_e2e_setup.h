// grpc_e2e_bench's setup: the layout, the clients' inputs, and the sessions
// created and prefilled through AppendPrefill; with the accounting of
// AppendPrefill's chunks and of a ReadKv stream (allocations, minor faults
// and CPU per chunk). bench/README.md explains the benchmark.
#ifndef KVKEEP_BENCH_GRPC_E2E_SETUP_H_
#define KVKEEP_BENCH_GRPC_E2E_SETUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_store/cache_store.h"
#include "grpcpp/support/status.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"

namespace kvkeep::e2e {

constexpr int32_t kLayers = 32;
constexpr int32_t kKvHeads = 8;
constexpr int32_t kQueryHeads = 32;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kPageTokens = 16;
constexpr int64_t kSlack = 16;
// Tokens per AppendPrefill message: 128 x 32 layers x 4 KiB = 16 MiB.
constexpr int64_t kPrefillChunk = 128;
constexpr int64_t kMaxMessageBytes = 64 << 20;  // kvkeepd's default

enum class Form { kReduced, kPerHead, kQueries };

const char* FormName(Form f);

struct RunConfig {
  int sessions = 0;
  int64_t budget = 0;  // tokens per layer
};

struct Options {
  std::vector<RunConfig> configs = {{1, 4096}, {16, 4096}, {64, 1024}};
  std::vector<Form> forms = {Form::kReduced, Form::kPerHead, Form::kQueries};
  double warmup_s = 0.5;
  double seconds = 3;        // timed window of reduced and per_head phases
  double query_seconds = 5;  // queries steps are slow: more time, more steps
  int rounds = 3;            // store/no-op alternations for reduced
  int prefill_threads = 2;
  bool print_windows = false;  // each window's CLOCK_MONOTONIC span
  bool daemon_malloc = true;   // ConfigureMalloc(), as kvkeepd
};

ModelLayout BenchLayout();

// What the clients send, generated once per budget.
struct Inputs {
  int64_t budget = 0;
  // [kQueryHeads][budget + 1]: each head's row a softmax of noisy logits
  // with shared heavy hitters over budget + 1 slots, so any prefix of a row
  // is a valid probability row (sums to at most 1).
  std::vector<float> per_head;
  std::vector<float> reduced;  // [budget + 1]: per_head summed over heads
  std::vector<float> queries;  // [kLayers][kQueryHeads][kHeadDim]
  std::string token_kv;        // one token of one layer: [8][128] bf16
  std::string chunk_kv;        // kPrefillChunk tokens of one layer
};

Inputs MakeInputs(int64_t budget);

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what);

// A session's decode state as its worker tracks it: the next position, and
// per layer the version and resident count after the last step.
struct StreamState {
  std::string session_id;
  int64_t next_position = 0;
  std::vector<uint64_t> version;
  std::vector<int64_t> resident;
};

// Session i starts (i mod 17) tokens below the budget. In steady state a
// layer's resident count cycles through 17 values (budget - 16 after an
// eviction, up to budget + 1 after the append that triggers the next one);
// starting at different points of that cycle keeps sessions, which get the
// same inputs and fair service, from all evicting on the same step, so that
// any window of steps holds its share of eviction steps.
int64_t PrefillTokens(int64_t budget, int session);

// Creates and prefills every session, a few at a time, and prints what
// that took.
absl::StatusOr<std::vector<StreamState>> PrefillAll(
    const Options& opt, const RunConfig& c, const Inputs& in,
    const std::vector<std::unique_ptr<v1::KvKeep::Stub>>& store_stubs,
    const CacheStore& store);

// Reads all of one session's K/V back through ReadKv twice (the first
// warms the buffers) and prints the second read's allocations, minor faults
// and CPU per chunk.
absl::Status MeasureReadKv(v1::KvKeep::Stub& stub, const StreamState& st);

}  // namespace kvkeep::e2e

#endif  // KVKEEP_BENCH_GRPC_E2E_SETUP_H_
