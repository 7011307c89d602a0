// The GPU compaction kernels (kernels/cuda/compaction.h, and the device plan
// of kernels/cuda/device_state/plan_compaction.h) against their CPU twins
// (kernels/compaction.h), exactly: the byte move over page sizes 1, 3,
// 7, 16, 17, head dims 64, 80, 128, every dtype and every copy width; the
// plan against PlanCompaction, bad victims included; the multi-layer move of
// bytes and per-slot values; and the whole step chained on the device
// (select -> plan -> compact) against the CPU chain the session runs.
// Skipped without a CUDA device, except the argument checks.
// cudaMalloc<T>, which DeviceArray<T> calls, is declared here.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/compaction.h"
#include "kernels/cuda/compaction.h"
#include "kernels/cuda/device_state/plan_compaction.h"
#include "kernels/cuda/device_state/selection.h"
#include "kernels/selection.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;

// A pool arena with random bytes and one block table per layer, drawn from a
// shuffled set of page ids (spare pages stay outside every table).
struct Arena {
  PageLayout layout;
  std::vector<std::byte> bytes;
  std::vector<std::vector<PageId>> tables;
};

Arena MakeArena(const PageLayout& layout, const std::vector<int64_t>& slots,
                std::mt19937& rng) {
  Arena a;
  a.layout = layout;
  int64_t needed = 0;
  for (int64_t n : slots)
    needed += (n + layout.page_tokens - 1) / layout.page_tokens;
  const int64_t total = needed + 3;
  std::vector<PageId> ids(total);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t next = 0;
  for (int64_t n : slots) {
    const int64_t pages = (n + layout.page_tokens - 1) / layout.page_tokens;
    a.tables.emplace_back(ids.begin() + next, ids.begin() + next + pages);
    next += pages;
  }
  a.bytes.resize(total * layout.page_bytes());
  for (std::byte& b : a.bytes) b = static_cast<std::byte>(rng() & 0xff);
  return a;
}

// k distinct victims of n slots, in random order.
std::vector<int32_t> RandomVictims(int64_t n, int64_t k, std::mt19937& rng) {
  std::vector<int32_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  return {all.begin(), all.begin() + k};
}

std::vector<SlotMove> Plan(const std::vector<int32_t>& victims, int64_t n) {
  std::vector<uint8_t> scratch;
  return PlanCompaction(victims, n, scratch);
}

// Runs LaunchCompactLayers for one layer, bytes only (as the CUDA page memory
// does), on a copy of the arena placed `offset` bytes into a device buffer
// (offset != 0 forces narrower copy words).
std::vector<std::byte> GpuMoveBytes(const Arena& a,
                                    const std::vector<PageId>& table,
                                    const std::vector<SlotMove>& moves,
                                    size_t offset) {
  std::vector<std::byte> padded(offset, std::byte{0});
  padded.insert(padded.end(), a.bytes.begin(), a.bytes.end());
  DeviceArray<std::byte> arena(padded);
  DeviceArray<PageId> pages(table);
  DeviceArray<SlotMove> device_moves(moves);
  DeviceArray<int32_t> count(
      std::vector<int32_t>{static_cast<int32_t>(moves.size())});
  DeviceArray<cuda::CompactLayer> layer(std::vector<cuda::CompactLayer>{
      {pages.get(), device_moves.get(), count.get(), nullptr, nullptr, nullptr,
       nullptr}});
  EXPECT_TRUE(arena.ok() && pages.ok() && device_moves.ok() && count.ok() &&
              layer.ok());
  EXPECT_EQ(
      cuda::LaunchCompactLayers(arena.get() + offset, a.layout, layer.get(), 1,
                                static_cast<int32_t>(moves.size()), nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::byte> out = arena.ToHost();
  return {out.begin() + offset, out.end()};
}

TEST(CompactionKernelTest, MoveSlotBytesMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        for (int trial = 0; trial < 3; ++trial) {
          SCOPED_TRACE(::testing::Message()
                       << "page_tokens " << page_tokens << " head_dim "
                       << head_dim << " " << DTypeName(dtype) << " trial "
                       << trial);
          std::mt19937 rng(page_tokens * 1000 + head_dim * 10 + trial);
          const PageLayout layout{page_tokens, 2, head_dim, dtype};
          const int64_t n = 1 + rng() % (4 * page_tokens + 40);
          const Arena a = MakeArena(layout, {n}, rng);
          const int64_t k = trial == 0 ? n / 2 : rng() % (n + 1);
          const std::vector<SlotMove> moves = Plan(RandomVictims(n, k, rng), n);
          std::vector<std::byte> want = a.bytes;
          MoveSlotBytes(want.data(), layout, a.tables[0], moves);
          ASSERT_EQ(GpuMoveBytes(a, a.tables[0], moves, 0), want);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 3 * 3 * 3);
}

// Token rows of 12, 6 and 2 bytes, and arenas off 16-byte alignment: every
// copy word (16, 8, 4, 2, 1 bytes) gives the same bytes.
TEST(CompactionKernelTest, MoveSlotBytesEveryCopyWidth) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(3);
  const PageLayout layouts[] = {{3, 1, 3, DType::kF32},
                                {3, 1, 3, DType::kF16},
                                {2, 1, 1, DType::kBF16},
                                {7, 2, 80, DType::kBF16}};
  for (const PageLayout& layout : layouts) {
    for (size_t offset : {0, 1, 2, 4, 8}) {
      SCOPED_TRACE(::testing::Message()
                   << "token_bytes " << layout.token_bytes() << " offset "
                   << offset);
      const int64_t n = 50;
      const Arena a = MakeArena(layout, {n}, rng);
      const std::vector<SlotMove> moves = Plan(RandomVictims(n, 20, rng), n);
      std::vector<std::byte> want = a.bytes;
      MoveSlotBytes(want.data(), layout, a.tables[0], moves);
      ASSERT_EQ(GpuMoveBytes(a, a.tables[0], moves, offset), want);
    }
  }
}

// Any independent moves, not only a plan's: sources and targets disjoint.
TEST(CompactionKernelTest, MoveSlotBytesAnyIndependentMoves) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(4);
  const PageLayout layout{16, 8, 128, DType::kBF16};
  const int64_t n = 300;
  const Arena a = MakeArena(layout, {n}, rng);
  std::vector<int32_t> slots(n);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<SlotMove> moves;
  for (int i = 0; i < 100; ++i) moves.push_back({slots[i], slots[100 + i]});
  std::vector<std::byte> want = a.bytes;
  MoveSlotBytes(want.data(), layout, a.tables[0], moves);
  ASSERT_EQ(GpuMoveBytes(a, a.tables[0], moves, 0), want);
}

struct PlanInput {
  std::vector<int32_t> victims;
  int32_t count = 0;  // usually victims.size(); bad values on purpose
  int64_t slots = 0;
};

struct PlanOutput {
  int32_t count = 0;
  std::vector<SlotMove> moves;
};

std::vector<PlanOutput> GpuPlan(const std::vector<PlanInput>& inputs,
                                int32_t max_victims) {
  std::vector<std::unique_ptr<DeviceArray<int32_t>>> victims, counts, outs;
  std::vector<std::unique_ptr<DeviceArray<SlotMove>>> moves;
  std::vector<cuda::PlanLayer> spec;
  for (const PlanInput& in : inputs) {
    victims.push_back(std::make_unique<DeviceArray<int32_t>>(in.victims));
    counts.push_back(
        std::make_unique<DeviceArray<int32_t>>(std::vector<int32_t>{in.count}));
    moves.push_back(std::make_unique<DeviceArray<SlotMove>>(
        std::vector<SlotMove>(in.victims.size() + 1, SlotMove{-7, -7})));
    outs.push_back(
        std::make_unique<DeviceArray<int32_t>>(std::vector<int32_t>{-7}));
    spec.push_back({victims.back()->get(), counts.back()->get(), in.slots,
                    moves.back()->get(), outs.back()->get()});
  }
  DeviceArray<cuda::PlanLayer> spec_on_device(spec);
  const int32_t num_layers = static_cast<int32_t>(inputs.size());
  const size_t ws_bytes =
      cuda::PlanCompactionWorkspaceBytes(num_layers, max_victims);
  DeviceArray<std::byte> workspace(ws_bytes);
  EXPECT_EQ(
      cuda::LaunchPlanCompaction(spec_on_device.get(), num_layers, max_victims,
                                 workspace.get(), ws_bytes, nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<PlanOutput> result;
  for (size_t i = 0; i < inputs.size(); ++i) {
    PlanOutput out;
    out.count = outs[i]->ToHost()[0];
    const std::vector<SlotMove> all = moves[i]->ToHost();
    for (size_t j = 0; j < all.size(); ++j) {
      if (static_cast<int32_t>(j) < out.count) {
        out.moves.push_back(all[j]);
      } else {
        EXPECT_EQ(all[j], (SlotMove{-7, -7})) << "layer " << i << " " << j;
      }
    }
    result.push_back(std::move(out));
  }
  return result;
}

TEST(CompactionKernelTest, PlanMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(5);
  std::vector<PlanInput> inputs;
  // Sizes and victim counts of every kind, both sort paths (shared memory
  // up to 4096 victims, the workspace beyond).
  for (int64_t n : {1, 2, 17, 100, 1000, 32768}) {
    for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{16}, n / 10, n / 2, n - 1,
                      n, int64_t{5000}}) {
      if (k < 0 || k > n || k > 6000) continue;
      PlanInput in;
      in.victims = RandomVictims(n, k, rng);
      in.count = static_cast<int32_t>(k);
      in.slots = n;
      inputs.push_back(in);
    }
  }
  // Victims that are a tail run or a head run.
  PlanInput tail{{99, 98, 97}, 3, 100};
  PlanInput head{{2, 0, 1}, 3, 100};
  inputs.push_back(tail);
  inputs.push_back(head);
  const std::vector<PlanOutput> got = GpuPlan(inputs, 6000);
  ASSERT_EQ(got.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<SlotMove> want = Plan(inputs[i].victims, inputs[i].slots);
    EXPECT_EQ(got[i].count, static_cast<int32_t>(want.size())) << "layer " << i;
    EXPECT_EQ(got[i].moves, want) << "layer " << i;
  }
}

TEST(CompactionKernelTest, PlanRefusesBadVictims) {
  KVKEEP_REQUIRE_GPU();
  const std::vector<PlanInput> inputs = {
      {{1, 5, 1}, 3, 10},        // repeated victim
      {{1, 10}, 2, 10},          // victim out of range
      {{-1, 3}, 2, 10},          // negative victim
      {{1, 2}, -1, 10},          // kSelectInvalidLayer passed through
      {{1, 2, 3}, 3, 2},         // more victims than slots
      {{1, 2, 3, 4, 5}, 5, 10},  // more than max_victims (4)
      {{4, 0}, 2, 10},           // a good layer in the same launch
  };
  const std::vector<PlanOutput> got = GpuPlan(inputs, 4);
  for (size_t i = 0; i + 1 < inputs.size(); ++i) {
    EXPECT_EQ(got[i].count, cuda::kPlanInvalidLayer) << "layer " << i;
  }
  EXPECT_EQ(got.back().moves, Plan({4, 0}, 10));
}

// Per-slot state of one layer, host side.
struct SlotState {
  std::vector<float> score;
  std::vector<int64_t> arrival;
  std::vector<int64_t> position;
  std::vector<uint64_t> history;
};

SlotState RandomState(int64_t n, std::mt19937& rng) {
  SlotState s;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    s.score.push_back(u(rng));
    s.arrival.push_back(i * 3 + 1);
    s.position.push_back(1000 + i * 7);
    s.history.push_back((uint64_t{rng()} << 32) | rng());
  }
  return s;
}

// Applies moves to a per-slot array without truncating it (the GPU keeps the
// length; the caller truncates).
template <typename T>
std::vector<T> Moved(std::vector<T> v, const std::vector<SlotMove>& moves) {
  for (const SlotMove& m : moves) v[m.to_slot] = v[m.from_slot];
  return v;
}

TEST(CompactionKernelTest, CompactLayersMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(6);
  const PageLayout layout{16, 8, 128, DType::kBF16};
  const std::vector<int64_t> slots = {100, 1, 333, 2000, 50, 64};
  Arena a = MakeArena(layout, slots, rng);
  std::vector<std::byte> want = a.bytes;
  DeviceArray<std::byte> arena(a.bytes);

  std::vector<std::unique_ptr<DeviceArray<PageId>>> pages;
  std::vector<std::unique_ptr<DeviceArray<SlotMove>>> moves;
  std::vector<std::unique_ptr<DeviceArray<int32_t>>> counts;
  std::vector<std::unique_ptr<DeviceArray<float>>> scores;
  std::vector<std::unique_ptr<DeviceArray<int64_t>>> arrivals, positions;
  std::vector<std::unique_ptr<DeviceArray<uint64_t>>> histories;
  std::vector<SlotState> states, want_states;
  std::vector<cuda::CompactLayer> spec;
  for (size_t l = 0; l < slots.size(); ++l) {
    const int64_t n = slots[l];
    const int64_t k = l == 3 ? 1500 : static_cast<int64_t>(rng() % (n + 1));
    const std::vector<SlotMove> plan = Plan(RandomVictims(n, k, rng), n);
    // Layer 4's plan was refused: count -1, nothing may move.
    const int32_t count = l == 4 ? -1 : static_cast<int32_t>(plan.size());
    if (l != 4) MoveSlotBytes(want.data(), layout, a.tables[l], plan);
    SlotState s = RandomState(n, rng);
    states.push_back(s);
    if (l != 4) {
      s.score = Moved(s.score, plan);
      s.arrival = Moved(s.arrival, plan);
      s.position = Moved(s.position, plan);
      s.history = Moved(s.history, plan);
    }
    want_states.push_back(s);

    pages.push_back(std::make_unique<DeviceArray<PageId>>(a.tables[l]));
    moves.push_back(std::make_unique<DeviceArray<SlotMove>>(plan));
    counts.push_back(
        std::make_unique<DeviceArray<int32_t>>(std::vector<int32_t>{count}));
    scores.push_back(std::make_unique<DeviceArray<float>>(states[l].score));
    arrivals.push_back(
        std::make_unique<DeviceArray<int64_t>>(states[l].arrival));
    positions.push_back(
        std::make_unique<DeviceArray<int64_t>>(states[l].position));
    histories.push_back(
        std::make_unique<DeviceArray<uint64_t>>(states[l].history));
    // Layer 5 keeps no history: a null array is skipped.
    spec.push_back({pages[l]->get(), moves[l]->get(), counts[l]->get(),
                    scores[l]->get(), arrivals[l]->get(), positions[l]->get(),
                    l == 5 ? nullptr : histories[l]->get()});
  }
  want_states[5].history = states[5].history;
  DeviceArray<cuda::CompactLayer> spec_on_device(spec);
  // max_moves 64 < layer 3's moves: its blocks stride over the rest.
  ASSERT_EQ(
      cuda::LaunchCompactLayers(arena.get(), layout, spec_on_device.get(),
                                static_cast<int32_t>(spec.size()), 64, nullptr),
      cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(arena.ToHost(), want);
  for (size_t l = 0; l < slots.size(); ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    EXPECT_EQ(scores[l]->ToHost(), want_states[l].score);
    EXPECT_EQ(arrivals[l]->ToHost(), want_states[l].arrival);
    EXPECT_EQ(positions[l]->ToHost(), want_states[l].position);
    EXPECT_EQ(histories[l]->ToHost(), want_states[l].history);
  }
}

// The store's whole eviction for one step, chained on the device with no
// host round trip: select every layer's victims, plan, move bytes and
// per-slot values. Equal to the session's CPU chain: SelectLowestUnprotected,
// PlanCompaction, MoveSlotBytes, MoveSlotValues.
TEST(CompactionKernelTest, WholeStepPipelineMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(7);
  const PageLayout layout{16, 8, 128, DType::kBF16};
  const int64_t sinks = 4, recent = 32;
  const std::vector<int64_t> slots = {4096, 4000, 17, 1000, 2048, 3001};
  const std::vector<int64_t> ks = {1, 16, 5, 300, 0, 3001};
  const int64_t max_slots = 4096;
  const int32_t max_victims = 3001;
  Arena a = MakeArena(layout, slots, rng);
  std::vector<std::byte> want = a.bytes;
  DeviceArray<std::byte> arena(a.bytes);

  struct Layer {
    std::unique_ptr<DeviceArray<PageId>> pages;
    std::unique_ptr<DeviceArray<float>> score;
    std::unique_ptr<DeviceArray<int64_t>> arrival, position;
    std::unique_ptr<DeviceArray<int32_t>> victims, victim_count, move_count;
    std::unique_ptr<DeviceArray<SlotMove>> moves;
    SlotState want;
    int64_t new_size = 0;
  };
  std::vector<Layer> layers(slots.size());
  std::vector<cuda::SelectLayer> select;
  std::vector<cuda::PlanLayer> plan;
  std::vector<cuda::CompactLayer> compact;
  for (size_t l = 0; l < slots.size(); ++l) {
    const int64_t n = slots[l];
    SlotState s = RandomState(n, rng);
    // Arrivals: distinct, shuffled over the slots, appended = n + 50.
    std::vector<int64_t> arrival(n + 50);
    std::iota(arrival.begin(), arrival.end(), 0);
    std::shuffle(arrival.begin(), arrival.end(), rng);
    s.arrival.assign(arrival.begin(), arrival.begin() + n);
    for (int64_t i = 0; i < n; i += 7) s.score[i] = 0.5f;  // ties
    const int64_t appended = n + 50;
    Layer& L = layers[l];
    L.pages = std::make_unique<DeviceArray<PageId>>(a.tables[l]);
    L.score = std::make_unique<DeviceArray<float>>(s.score);
    L.arrival = std::make_unique<DeviceArray<int64_t>>(s.arrival);
    L.position = std::make_unique<DeviceArray<int64_t>>(s.position);
    L.victims = std::make_unique<DeviceArray<int32_t>>(
        static_cast<size_t>(std::max<int64_t>(ks[l], 1)));
    L.victim_count = std::make_unique<DeviceArray<int32_t>>(1);
    L.move_count = std::make_unique<DeviceArray<int32_t>>(1);
    L.moves = std::make_unique<DeviceArray<SlotMove>>(
        static_cast<size_t>(std::max<int64_t>(ks[l], 1)));
    select.push_back({L.score->get(), L.arrival->get(), n, appended, ks[l],
                      L.victims->get(), L.victim_count->get()});
    plan.push_back({L.victims->get(), L.victim_count->get(), n, L.moves->get(),
                    L.move_count->get()});
    compact.push_back({L.pages->get(), L.moves->get(), L.move_count->get(),
                       L.score->get(), L.arrival->get(), L.position->get(),
                       nullptr});

    // The CPU chain.
    std::vector<RankedItem> scratch;
    std::vector<int32_t> victims;
    SelectLowestUnprotected(s.score.data(), s.arrival.data(), n, appended,
                            sinks, recent, ks[l], scratch, &victims);
    const std::vector<SlotMove> moves = Plan(victims, n);
    MoveSlotBytes(want.data(), layout, a.tables[l], moves);
    L.new_size = n - static_cast<int64_t>(victims.size());
    MoveSlotValues(s.score, moves, L.new_size);
    MoveSlotValues(s.arrival, moves, L.new_size);
    MoveSlotValues(s.position, moves, L.new_size);
    L.want = s;
  }
  DeviceArray<cuda::SelectLayer> select_on_device(select);
  DeviceArray<cuda::PlanLayer> plan_on_device(plan);
  DeviceArray<cuda::CompactLayer> compact_on_device(compact);
  const int32_t num_layers = static_cast<int32_t>(slots.size());
  const size_t select_ws = cuda::SelectWorkspaceBytes(num_layers, max_slots);
  const size_t plan_ws =
      cuda::PlanCompactionWorkspaceBytes(num_layers, max_victims);
  DeviceArray<std::byte> select_workspace(select_ws), plan_workspace(plan_ws);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  EXPECT_EQ(cuda::LaunchSelectLowest(select_on_device.get(), num_layers, sinks,
                                     recent, max_slots, select_workspace.get(),
                                     select_ws, stream),
            cudaSuccess);
  EXPECT_EQ(
      cuda::LaunchPlanCompaction(plan_on_device.get(), num_layers, max_victims,
                                 plan_workspace.get(), plan_ws, stream),
      cudaSuccess);
  EXPECT_EQ(
      cuda::LaunchCompactLayers(arena.get(), layout, compact_on_device.get(),
                                num_layers, max_victims, stream),
      cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  EXPECT_EQ(arena.ToHost(), want);
  for (size_t l = 0; l < slots.size(); ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    const Layer& L = layers[l];
    EXPECT_EQ(L.victim_count->ToHost()[0], slots[l] - L.new_size);
    std::vector<float> score = L.score->ToHost();
    std::vector<int64_t> arrival = L.arrival->ToHost();
    std::vector<int64_t> position = L.position->ToHost();
    score.resize(L.new_size);
    arrival.resize(L.new_size);
    position.resize(L.new_size);
    EXPECT_EQ(score, L.want.score);
    EXPECT_EQ(arrival, L.want.arrival);
    EXPECT_EQ(position, L.want.position);
  }
}

TEST(CompactionKernelTest, RejectsBadArguments) {
  const PageLayout layout{16, 8, 128, DType::kBF16};
  std::byte fake[16] = {};
  auto* arena = fake;
  const auto* compact = reinterpret_cast<const cuda::CompactLayer*>(fake);
  // Nothing to move: success without a launch.
  EXPECT_EQ(cuda::LaunchCompactLayers(arena, layout, compact, 0, 10, nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::LaunchCompactLayers(arena, layout, compact, 2, -1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchCompactLayers(arena, PageLayout{0, 8, 128}, compact, 2,
                                      10, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchCompactLayers(nullptr, layout, compact, 2, 10, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::PlanCompactionWorkspaceBytes(3, 0), 0u);
  const size_t need = cuda::PlanCompactionWorkspaceBytes(3, 100);
  EXPECT_GE(need, 3 * 100 * (sizeof(int32_t) + 1));
  const auto* plan = reinterpret_cast<const cuda::PlanLayer*>(fake);
  EXPECT_EQ(cuda::LaunchPlanCompaction(plan, 0, 100, nullptr, 0, nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::LaunchPlanCompaction(plan, 3, 100, fake, need - 1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchPlanCompaction(plan, 3, -1, fake, need, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchCompactLayers(arena, layout, compact, 70000, 10, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchCompactLayers(arena, layout, nullptr, 2, 10, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvkeep
