// kernel_bench: the store's CUDA kernels at the design point of DESIGN.md 2a
// (32 layers x 32k resident tokens, 8 kv heads x head dim 128, bf16 pages of
// 16 tokens, 32 query heads), timed with CUDA events: warm-up, then the
// median of kIters runs. For each kernel it prints one line a script can grep,
//   kernel=NAME us=... bytes=... GBps=... peak_ratio=...
// where bytes counts what the kernel must read and write at least (its
// nominal traffic), GBps = bytes / time and peak_ratio = GBps / the device's
// peak HBM bandwidth, computed from its attributes and printed first.
// "step_k1" / "step_k16" are one decode step's eviction work across all
// layers done wholly on the device (accumulate + select + plan + compact,
// chained), the path for when per-token state lives on the device; the
// accumulate, select and plan kernels are outside the product
// (kernels/cuda/device_state/). What kvkeepd runs on a CUDA pool per step
// is timed by step_bench. The target is under 400 us (2% of a 20 ms step).
//
// Exits 2 with a message when no CUDA device is usable, 1 on a CUDA error.
// Takes a few seconds on an H200 (about 5 GiB of device memory).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/accumulate.h"
#include "kernels/compaction.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/compaction.h"
#include "kernels/cuda/device_state/accumulate.h"
#include "kernels/cuda/device_state/plan_compaction.h"
#include "kernels/cuda/device_state/selection.h"
#include "kernels/cuda/slot_copy.h"
#include "kernels/page_layout.h"

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 32;
constexpr int64_t kSlots = 32768;  // resident tokens per layer
constexpr int32_t kKvHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kQueryHeads = 32;
constexpr int32_t kPageTokens = 16;
constexpr int64_t kSinks = 4;
constexpr int64_t kRecent = 64;
constexpr int64_t kCompactVictims = kSlots / 10;  // the compaction case
constexpr int kWarmup = 3;
constexpr int kIters = 20;
constexpr double kStepTargetUs = 400;

#define KVKEEP_BENCH_CHECK(expr)                                            \
  do {                                                                      \
    const cudaError_t kvkeep_err = (expr);                                  \
    if (kvkeep_err != cudaSuccess) {                                        \
      std::fprintf(stderr, "kernel_bench: %s failed at %s:%d: %s\n", #expr, \
                   __FILE__, __LINE__, cudaGetErrorString(kvkeep_err));     \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

// Every device allocation of the run, freed at the end.
class DeviceMemory {
 public:
  ~DeviceMemory() {
    for (void* p : ptrs_) cudaFree(p);
  }
  template <typename T>
  T* Alloc(size_t n) {
    void* p = nullptr;
    KVKEEP_BENCH_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* p = Alloc<T>(host.size());
    KVKEEP_BENCH_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T),
                                  cudaMemcpyHostToDevice));
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

// p[i] = a hash of (i, seed) mapped to [0, scale).
// grid: any; block: any; grid-stride over n.
__global__ void FillUniformKernel(float* p, int64_t n, uint32_t seed,
                                  float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    p[i] = static_cast<float>(x >> 8) * (scale / 16777216.0f);
  }
}

// p[i] = i. grid: any; block: any; grid-stride over n.
__global__ void FillIotaKernel(int64_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    p[i] = i;
  }
}

void FillUniform(float* p, int64_t n, uint32_t seed, float scale) {
  FillUniformKernel<<<1024, 256>>>(p, n, seed, scale);
  KVKEEP_BENCH_CHECK(cudaGetLastError());
}

void FillIota(int64_t* p, int64_t n) {
  FillIotaKernel<<<1024, 256>>>(p, n);
  KVKEEP_BENCH_CHECK(cudaGetLastError());
}

// Times what `enqueue` puts on the stream: kWarmup untimed runs, then the
// median of kIters runs, each between two events.
class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    KVKEEP_BENCH_CHECK(cudaEventCreate(&start_));
    KVKEEP_BENCH_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  template <typename Enqueue>
  double MedianUs(Enqueue&& enqueue) {
    for (int i = 0; i < kWarmup; ++i) KVKEEP_BENCH_CHECK(enqueue());
    KVKEEP_BENCH_CHECK(cudaStreamSynchronize(stream_));
    std::vector<float> ms;
    for (int i = 0; i < kIters; ++i) {
      KVKEEP_BENCH_CHECK(cudaEventRecord(start_, stream_));
      KVKEEP_BENCH_CHECK(enqueue());
      KVKEEP_BENCH_CHECK(cudaEventRecord(stop_, stream_));
      KVKEEP_BENCH_CHECK(cudaEventSynchronize(stop_));
      float t = 0;
      KVKEEP_BENCH_CHECK(cudaEventElapsedTime(&t, start_, stop_));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[ms.size() / 2];
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

double g_peak_bytes_per_s = 0;

void Report(const char* name, double us, double bytes, const char* extra = "") {
  const double bytes_per_s = bytes / (us * 1e-6);
  std::printf("kernel=%s us=%.2f bytes=%.0f GBps=%.1f peak_ratio=%.3f%s\n",
              name, us, bytes, bytes_per_s / 1e9,
              bytes_per_s / g_peak_bytes_per_s, extra);
  std::fflush(stdout);
}

// One layer's device state.
struct Layer {
  PageId* pages;      // [kSlots / kPageTokens] block table
  float* scores;      // [kSlots]
  int64_t* arrival;   // [kSlots]
  int64_t* position;  // [kSlots]
  float* probs;       // [kQueryHeads][1][kSlots]: one decode row
  int32_t* victims;   // [kSlots]: the step's victims
  int32_t* victim_count;
  SlotMove* moves;  // [kSlots]: the step's moves
  int32_t* move_count;
  int32_t* victims10;  // [kCompactVictims]: the compaction case
  int32_t* victims10_count;
  SlotMove* moves10;  // [kCompactVictims]
  int32_t* moves10_count;
};

int Run() {
  int devices = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&devices);
  if (count_err != cudaSuccess || devices == 0) {
    std::fprintf(
        stderr,
        "kernel_bench: no CUDA device (%s); run it on a GPU "
        "machine\n",
        count_err != cudaSuccess ? cudaGetErrorString(count_err) : "0 devices");
    return 2;
  }
  int device = 0;
  KVKEEP_BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  KVKEEP_BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
  int mem_clock_khz = 0, bus_bits = 0;
  KVKEEP_BENCH_CHECK(cudaDeviceGetAttribute(
      &mem_clock_khz, cudaDevAttrMemoryClockRate, device));
  KVKEEP_BENCH_CHECK(cudaDeviceGetAttribute(
      &bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  // Double data rate: two transfers per memory clock.
  g_peak_bytes_per_s = 2.0 * mem_clock_khz * 1e3 * bus_bits / 8.0;
  std::printf("device=\"%s\" sms=%d mem_clock_khz=%d bus_bits=%d\n", prop.name,
              prop.multiProcessorCount, mem_clock_khz, bus_bits);
  std::printf("peak_hbm_GBps=%.1f (2 x memoryClockRate x memoryBusWidth / 8)\n",
              g_peak_bytes_per_s / 1e9);
  std::printf(
      "config layers=%d slots=%lld kv_heads=%d head_dim=%d dtype=bf16 "
      "page_tokens=%d query_heads=%d sinks=%lld recent=%lld warmup=%d "
      "iters=%d (median)\n",
      kLayers, static_cast<long long>(kSlots), kKvHeads, kHeadDim, kPageTokens,
      kQueryHeads, static_cast<long long>(kSinks),
      static_cast<long long>(kRecent), kWarmup, kIters);
  std::fflush(stdout);
  if (g_peak_bytes_per_s <= 0) {
    std::fprintf(stderr, "kernel_bench: the device reports no memory clock\n");
    return 1;
  }

  DeviceMemory mem;
  cudaStream_t stream;
  KVKEEP_BENCH_CHECK(cudaStreamCreate(&stream));
  const PageLayout layout{kPageTokens, kKvHeads, kHeadDim, DType::kBF16};
  const int64_t token_bytes = layout.token_bytes();
  const int64_t pages_per_layer = kSlots / kPageTokens;
  const int64_t total_pages = kLayers * pages_per_layer;

  // The arena: every layer's pages, shuffled over the pool. 0x3c bytes are
  // small finite bf16 keys.
  std::byte* arena = mem.Alloc<std::byte>(total_pages * layout.page_bytes());
  KVKEEP_BENCH_CHECK(
      cudaMemset(arena, 0x3c, total_pages * layout.page_bytes()));
  std::vector<PageId> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(ids.begin(), ids.end(), rng);

  std::vector<Layer> layers(kLayers);
  for (int32_t l = 0; l < kLayers; ++l) {
    Layer& L = layers[l];
    L.pages = mem.Upload(
        std::vector<PageId>(ids.begin() + l * pages_per_layer,
                            ids.begin() + (l + 1) * pages_per_layer));
    L.scores = mem.Alloc<float>(kSlots);
    L.arrival = mem.Alloc<int64_t>(kSlots);
    L.position = mem.Alloc<int64_t>(kSlots);
    L.probs = mem.Alloc<float>(int64_t{kQueryHeads} * kSlots);
    FillUniform(L.scores, kSlots, 100 + l, 10.0f);
    FillIota(L.arrival, kSlots);
    FillIota(L.position, kSlots);
    FillUniform(L.probs, int64_t{kQueryHeads} * kSlots, 200 + l, 2.0f / kSlots);
    L.victims = mem.Alloc<int32_t>(kSlots);
    L.victim_count = mem.Alloc<int32_t>(1);
    L.moves = mem.Alloc<SlotMove>(kSlots);
    L.move_count = mem.Alloc<int32_t>(1);
    // The compaction case: 10% of the slots, distinct, random.
    std::vector<int32_t> all(kSlots);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    L.victims10 = mem.Upload(
        std::vector<int32_t>(all.begin(), all.begin() + kCompactVictims));
    L.victims10_count =
        mem.Upload(std::vector<int32_t>{static_cast<int32_t>(kCompactVictims)});
    L.moves10 = mem.Alloc<SlotMove>(kCompactVictims);
    L.moves10_count = mem.Alloc<int32_t>(1);
  }
  KVKEEP_BENCH_CHECK(cudaDeviceSynchronize());
  Timer timer(stream);

  // Accumulate: one decode row of attention, every layer.
  std::vector<AccumulateLayer> acc;
  for (const Layer& L : layers) {
    acc.push_back(AccumulateLayer{L.probs, L.scores, nullptr, kSlots});
  }
  const AccumulateLayer* acc_dev = mem.Upload(acc);
  auto accumulate = [&] {
    return cuda::LaunchAccumulate(acc_dev, kLayers, kQueryHeads, kKvHeads, 1,
                                  kSlots, stream);
  };
  const double acc_bytes =
      double{kLayers} * kSlots * (kQueryHeads * 4.0 + 2 * 4.0);
  Report("accumulate", timer.MedianUs(accumulate), acc_bytes);

  // Selection, every layer, k = 1 (a decode step) and k = a page.
  const size_t select_ws_bytes = cuda::SelectWorkspaceBytes(kLayers, kSlots);
  void* select_ws = mem.Alloc<std::byte>(select_ws_bytes);
  auto select_spec = [&](int64_t k) {
    std::vector<cuda::SelectLayer> spec;
    for (const Layer& L : layers) {
      spec.push_back(
          {L.scores, L.arrival, kSlots, kSlots, k, L.victims, L.victim_count});
    }
    return mem.Upload(spec);
  };
  const cuda::SelectLayer* select_k1 = select_spec(1);
  const cuda::SelectLayer* select_k16 = select_spec(kPageTokens);
  auto select = [&](const cuda::SelectLayer* spec) {
    return [&, spec] {
      return cuda::LaunchSelectLowest(spec, kLayers, kSinks, kRecent, kSlots,
                                      select_ws, select_ws_bytes, stream);
    };
  };
  const double select_bytes = double{kLayers} * kSlots * (4.0 + 8.0);
  Report("select_k1", timer.MedianUs(select(select_k1)), select_bytes);
  Report("select_k16", timer.MedianUs(select(select_k16)), select_bytes,
         " note=bytes_nominal_one_pass");

  // Query scoring: one decode row, 32 query heads, every layer (one launch
  // per layer); bytes = the keys read.
  if (cuda::QueryAttentionSupportsHeadDim(kHeadDim)) {
    std::vector<cuda::DevicePagedKeys> keys;
    for (const Layer& L : layers) {
      keys.push_back({arena, layout, L.pages, L.arrival, kSlots});
    }
    float* queries = mem.Alloc<float>(int64_t{kQueryHeads} * kHeadDim);
    FillUniform(queries, int64_t{kQueryHeads} * kHeadDim, 300, 1.0f);
    const int64_t* row_order = mem.Upload(std::vector<int64_t>{kSlots});
    float* out = mem.Alloc<float>(kSlots);
    void* qa_ws = mem.Alloc<std::byte>(
        cuda::QueryAttentionWorkspaceBytes(1, kQueryHeads, kSlots));
    auto query = [&] {
      for (const cuda::DevicePagedKeys& k : keys) {
        const cudaError_t err = cuda::LaunchQueryAttention(
            k, queries, row_order, 1, kQueryHeads, out, qa_ws, stream);
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    };
    Report("query_scoring", timer.MedianUs(query),
           double{kLayers} * kSlots * token_bytes);
  } else {
    std::printf("kernel=query_scoring skipped: head_dim %d unsupported\n",
                kHeadDim);
  }

  // Gather and scatter of one whole layer (keys and values, 32k tokens).
  std::byte* dense_k = mem.Alloc<std::byte>(kSlots * token_bytes);
  std::byte* dense_v = mem.Alloc<std::byte>(kSlots * token_bytes);
  const double layer_copy_bytes = 2.0 * 2.0 * kSlots * token_bytes;
  Report("gather_layer", timer.MedianUs([&] {
    return cuda::LaunchReadSlots(arena, layout, layers[0].pages, 0, kSlots,
                                 dense_k, dense_v, stream);
  }),
         layer_copy_bytes);
  Report("scatter_layer", timer.MedianUs([&] {
    return cuda::LaunchWriteSlots(arena, layout, layers[0].pages, 0, kSlots,
                                  dense_k, dense_v, stream);
  }),
         layer_copy_bytes);

  // Compaction after evicting 10% of every layer: the plan, then the move of
  // bytes and per-slot values (repeating it is idempotent: sources are never
  // targets).
  const size_t plan10_ws_bytes = cuda::PlanCompactionWorkspaceBytes(
      kLayers, static_cast<int32_t>(kCompactVictims));
  void* plan10_ws = mem.Alloc<std::byte>(plan10_ws_bytes);
  std::vector<cuda::PlanLayer> plan10;
  std::vector<cuda::CompactLayer> compact10;
  for (const Layer& L : layers) {
    plan10.push_back(
        {L.victims10, L.victims10_count, kSlots, L.moves10, L.moves10_count});
    compact10.push_back({L.pages, L.moves10, L.moves10_count, L.scores,
                         L.arrival, L.position, nullptr});
  }
  const cuda::PlanLayer* plan10_dev = mem.Upload(plan10);
  const cuda::CompactLayer* compact10_dev = mem.Upload(compact10);
  Report("plan_10pct", timer.MedianUs([&] {
    return cuda::LaunchPlanCompaction(plan10_dev, kLayers,
                                      static_cast<int32_t>(kCompactVictims),
                                      plan10_ws, plan10_ws_bytes, stream);
  }),
         double{kLayers} * kCompactVictims * (4.0 + 8.0));
  int64_t total_moves = 0;
  for (const Layer& L : layers) {
    int32_t n = 0;
    KVKEEP_BENCH_CHECK(
        cudaMemcpy(&n, L.moves10_count, sizeof n, cudaMemcpyDeviceToHost));
    if (n < 0) {
      std::fprintf(stderr, "kernel_bench: the plan refused a layer\n");
      return 1;
    }
    total_moves += n;
  }
  // Per move: K and V rows read and written, and score, arrival, position.
  const double compact_bytes =
      double(total_moves) * (2.0 * 2.0 * token_bytes + 2.0 * (4 + 8 + 8));
  char moves_note[64];
  std::snprintf(moves_note, sizeof moves_note, " moves=%lld",
                static_cast<long long>(total_moves));
  Report("compact_10pct", timer.MedianUs([&] {
    return cuda::LaunchCompactLayers(arena, layout, compact10_dev, kLayers,
                                     static_cast<int32_t>(kCompactVictims),
                                     stream);
  }),
         compact_bytes, moves_note);

  // The store's whole work for one decode step, every layer: accumulate,
  // select, plan, compact, chained on the device. The layers keep their size
  // between runs (the host would shrink them), so each run repeats the same
  // amount of work.
  for (const Layer& L : layers) FillIota(L.arrival, kSlots);
  const size_t plan_ws_bytes =
      cuda::PlanCompactionWorkspaceBytes(kLayers, kPageTokens);
  void* plan_ws = mem.Alloc<std::byte>(plan_ws_bytes);
  std::vector<cuda::PlanLayer> plan;
  std::vector<cuda::CompactLayer> compact;
  for (const Layer& L : layers) {
    plan.push_back({L.victims, L.victim_count, kSlots, L.moves, L.move_count});
    compact.push_back({L.pages, L.moves, L.move_count, L.scores, L.arrival,
                       L.position, nullptr});
  }
  const cuda::PlanLayer* plan_dev = mem.Upload(plan);
  const cuda::CompactLayer* compact_dev = mem.Upload(compact);
  KVKEEP_BENCH_CHECK(cudaDeviceSynchronize());
  auto step = [&](const cuda::SelectLayer* spec, int32_t k) {
    return [&, spec, k] {
      cudaError_t err = accumulate();
      if (err == cudaSuccess) err = select(spec)();
      if (err == cudaSuccess) {
        err = cuda::LaunchPlanCompaction(plan_dev, kLayers, kPageTokens,
                                         plan_ws, plan_ws_bytes, stream);
      }
      if (err == cudaSuccess) {
        err = cuda::LaunchCompactLayers(arena, layout, compact_dev, kLayers, k,
                                        stream);
      }
      return err;
    };
  };
  char target_note[96];
  for (int32_t k : {1, kPageTokens}) {
    const double us = timer.MedianUs(step(k == 1 ? select_k1 : select_k16, k));
    std::snprintf(target_note, sizeof target_note,
                  " target_us=%.0f within_target=%s", kStepTargetUs,
                  us < kStepTargetUs ? "yes" : "no");
    Report(k == 1 ? "step_k1" : "step_k16", us, acc_bytes + select_bytes,
           target_note);
  }
  KVKEEP_BENCH_CHECK(cudaStreamSynchronize(stream));
  KVKEEP_BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main() { return kvkeep::Run(); }
