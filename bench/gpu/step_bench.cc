// step_bench: the device work of one decode step on a CUDA pool, as a session
// hands it to its memory (PageMemory::RunStep, cache_store/step_batch.h), at
// the design point of DESIGN.md 2a: 32 layers x 32k resident tokens, 8 kv
// heads x head dim 128, bf16 pages of 16 tokens, 32 query heads. Every step
// writes one new token per layer and, as an h2o layer at its budget does,
// moves one survivor into the slot its eviction emptied. It prints one line
// per shape, for a script to grep:
//   step=NAME layers=32 tokens=32768 batches=B us=MEDIAN p90_us=...
//   target_us=400
// us is the wall time the session waits per step, from staging the batch to
// the end of its one wait on the stream: the device time plus the staging
// copies, so an upper bound on the device time itself. The shapes:
//   probs            attention probabilities from the worker: the step's
//                    writes and moves, one batch;
//   queries          query vectors: writes and scoring of every layer (one
//                    batch, whose rows come back), then the moves (a second);
//   queries_per_call the same work one call per layer and kind, as the
//                    memory ran it before batching (96 waits a step): the
//                    cost batching removes.
// Exits 2 with a message when no CUDA device is usable, 1 on an error.
// Takes a few seconds on an H200 (about 4 GiB of device memory).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cache_store/page_memory.h"
#include "cache_store/step_batch.h"

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 32;
constexpr int64_t kSlots = 32768;  // resident tokens per layer
constexpr int32_t kKvHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kQueryHeads = 32;
constexpr int32_t kPageTokens = 16;
constexpr int kWarmup = 5;
constexpr int kIters = 50;
constexpr double kStepTargetUs = 400;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "step_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// One decode step's inputs for every layer. Layer l's slots live in pages
// [l * pages_per_layer, (l + 1) * pages_per_layer), one spare slot past
// kSlots for the new token.
struct StepInputs {
  PageLayout layout{kPageTokens, kKvHeads, kHeadDim, DType::kBF16};
  int64_t pages_per_layer = kSlots / kPageTokens + 1;
  std::vector<std::vector<PageId>> tables;
  std::vector<std::byte> token;  // one token's keys (also its values)
  std::vector<float> queries;    // [1][kQueryHeads][kHeadDim]
  std::vector<int64_t> newest = {kSlots};
  std::vector<std::vector<SlotMove>> moves;  // per layer: the new token in
  std::vector<std::vector<float>> rows;      // per layer: [1][kSlots + 1]

  StepInputs() {
    std::mt19937 rng(1);
    std::uniform_int_distribution<int32_t> hole(64, kSlots - 65);
    for (int32_t l = 0; l < kLayers; ++l) {
      std::vector<PageId> table(pages_per_layer);
      std::iota(table.begin(), table.end(),
                static_cast<PageId>(l * pages_per_layer));
      tables.push_back(std::move(table));
      moves.push_back({SlotMove{static_cast<int32_t>(kSlots), hole(rng)}});
      rows.emplace_back(kSlots + 1);
    }
    token.assign(layout.token_bytes(), std::byte{0x3c});
    queries.assign(kQueryHeads * kHeadDim, 0.01f);
  }
  int64_t pool_bytes() const {
    return kLayers * pages_per_layer * layout.page_bytes();
  }
};

void AddWrites(const StepInputs& in, StepBatch& b, int32_t l) {
  b.AddWrite(in.tables[l], kSlots, 1, in.token.data(), in.token.data());
}
void AddScoring(StepInputs& in, StepBatch& b, int32_t l) {
  b.AddScoring(in.tables[l], {}, kSlots + 1, in.queries.data(), in.newest,
               kQueryHeads, in.rows[l].data());
}
void AddMoves(const StepInputs& in, StepBatch& b, int32_t l) {
  b.AddMoves(in.tables[l], in.moves[l]);
}

// Times `step` (which runs one step's batches) and prints its line.
void Time(const char* name, PageMemory& memory,
          const std::function<void()>& step) {
  for (int i = 0; i < kWarmup; ++i) step();
  std::vector<double> us;
  const int64_t batches_before = memory.batches_run();
  for (int i = 0; i < kIters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step();
    us.push_back(std::chrono::duration<double, std::micro>(
                     std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(us.begin(), us.end());
  std::printf(
      "step=%s layers=%d tokens=%lld batches=%lld us=%.1f p90_us=%.1f "
      "target_us=%.0f\n",
      name, kLayers, static_cast<long long>(kSlots),
      static_cast<long long>((memory.batches_run() - batches_before) / kIters),
      us[us.size() / 2], us[us.size() * 9 / 10], kStepTargetUs);
}

int Main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "step_bench: no CUDA device\n");
    return 2;
  }
  StepInputs in;
  absl::StatusOr<std::unique_ptr<PageMemory>> made =
      NewCudaMemory(0, in.pool_bytes());
  Check(made.status(), "making the pool");
  PageMemory& memory = **made;
  if (cudaMemset(memory.device_arena(), 0,
                 static_cast<size_t>(in.pool_bytes())) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "step_bench: clearing the pool failed\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device=%s pool_bytes=%lld\n", prop.name,
              static_cast<long long>(in.pool_bytes()));

  StepBatch batch(in.layout);
  const auto run = [&](const char* what) {
    Check(memory.RunStep(batch), what);
    batch.Clear();
  };
  Time("probs", memory, [&] {
    for (int32_t l = 0; l < kLayers; ++l) AddWrites(in, batch, l);
    batch.NextStage();
    for (int32_t l = 0; l < kLayers; ++l) AddMoves(in, batch, l);
    run("probs");
  });
  Time("queries", memory, [&] {
    for (int32_t l = 0; l < kLayers; ++l) AddWrites(in, batch, l);
    for (int32_t l = 0; l < kLayers; ++l) AddScoring(in, batch, l);
    run("queries: writes and scoring");
    for (int32_t l = 0; l < kLayers; ++l) AddMoves(in, batch, l);
    run("queries: moves");
  });
  Time("queries_per_call", memory, [&] {
    for (int32_t l = 0; l < kLayers; ++l) {
      AddWrites(in, batch, l);
      run("write");
      AddScoring(in, batch, l);
      run("scoring");
    }
    for (int32_t l = 0; l < kLayers; ++l) {
      AddMoves(in, batch, l);
      run("moves");
    }
  });
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main() { return kvkeep::Main(); }
