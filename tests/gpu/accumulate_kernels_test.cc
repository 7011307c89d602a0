// LaunchAccumulate (kernels/cuda/device_state/accumulate.h) against its CPU
// twin AccumulateScores: every layer of a step in one launch, over GQA 1, 4, 8;
// rows 1 and 3; kv_head_scores present or not; layers of awkward sizes
// (empty, 1, 3, 7, 16, 17, multiples of 4 that take the float4 path, and a
// layer whose arrays are offset by one float so it takes the scalar path).
//
// Exact equality, not a tolerance: kernel and twin perform the same float32
// additions in the same order per slot (the order kernels/accumulate.h
// states), with no multiplication an FMA could fuse, so the results are the
// same floats. Skipped without a CUDA device.
// cuda_runtime.h: gpu_testing.h calls the typed cudaMalloc(T**) overload.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/accumulate.h"
#include "kernels/cuda/device_state/accumulate.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;
using ::kvkeep::testing::Stream;

// One layer: host arrays (for the twin) and the same bytes on the device.
// `offset` floats of padding in front of every array move its base off a
// 16-byte boundary when odd (the kernel's scalar path).
struct Layer {
  int64_t slots = 0;
  int64_t offset = 0;
  std::vector<float> probs, scores, kv;
};

Layer MakeLayer(int32_t query_heads, int32_t kv_heads, int32_t rows,
                int64_t slots, int64_t offset, std::mt19937& rng) {
  std::uniform_real_distribution<float> prob(0.0f, 1.0f);
  std::uniform_real_distribution<float> initial(-1.0f, 30.0f);
  Layer l;
  l.slots = slots;
  l.offset = offset;
  l.probs.resize(offset + int64_t{query_heads} * rows * slots);
  for (float& p : l.probs) p = prob(rng) / static_cast<float>(slots + 1);
  l.scores.resize(offset + slots + 3);  // 3 guards past the end
  for (float& s : l.scores) s = initial(rng);
  l.kv.resize(offset + int64_t{kv_heads} * slots + 3);
  for (float& s : l.kv) s = initial(rng);
  return l;
}

// "" when `got` and `want` hold the same bits, else where they first differ.
std::string BitDifference(const std::vector<float>& got,
                          const std::vector<float>& want) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return ::testing::PrintToString(i) + ": got " +
             ::testing::PrintToString(got[i]) + ", twin " +
             ::testing::PrintToString(want[i]);
    }
  }
  return "";
}

void RunAndCompare(int32_t query_heads, int32_t kv_heads, int32_t rows,
                   bool with_kv, const std::vector<int64_t>& slot_counts,
                   int64_t max_slots_hint, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Layer> layers;
  for (size_t i = 0; i < slot_counts.size(); ++i) {
    // Every third layer is offset by one float: scalar path on the GPU.
    layers.push_back(MakeLayer(query_heads, kv_heads, rows, slot_counts[i],
                               i % 3 == 2 ? 1 : 0, rng));
  }
  // Device copies, described by a device array of AccumulateLayer.
  std::vector<std::unique_ptr<DeviceArray<float>>> d_probs, d_scores, d_kv;
  std::vector<AccumulateLayer> d_views, h_views;
  for (Layer& l : layers) {
    d_probs.push_back(std::make_unique<DeviceArray<float>>(l.probs));
    d_scores.push_back(std::make_unique<DeviceArray<float>>(l.scores));
    d_kv.push_back(std::make_unique<DeviceArray<float>>(l.kv));
    ASSERT_TRUE(d_probs.back()->ok() && d_scores.back()->ok() &&
                d_kv.back()->ok());
    d_views.push_back(
        {d_probs.back()->get() + l.offset, d_scores.back()->get() + l.offset,
         with_kv ? d_kv.back()->get() + l.offset : nullptr, l.slots});
    h_views.push_back({l.probs.data() + l.offset, l.scores.data() + l.offset,
                       with_kv ? l.kv.data() + l.offset : nullptr, l.slots});
  }
  DeviceArray<AccumulateLayer> d_layers(d_views);
  ASSERT_TRUE(d_layers.ok());
  Stream stream;
  ASSERT_NE(stream.get(), nullptr);
  KVKEEP_ASSERT_CUDA(cuda::LaunchAccumulate(
      d_layers.get(), static_cast<int32_t>(d_views.size()), query_heads,
      kv_heads, rows, max_slots_hint, stream.get()));
  KVKEEP_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  AccumulateScores(h_views, query_heads, kv_heads, rows);
  for (size_t i = 0; i < layers.size(); ++i) {
    SCOPED_TRACE(::testing::Message()
                 << "layer " << i << " slots " << layers[i].slots << " offset "
                 << layers[i].offset);
    // The whole arrays, guards and padding included: nothing else written.
    EXPECT_EQ(BitDifference(d_scores[i]->ToHost(), layers[i].scores), "")
        << "scores";
    EXPECT_EQ(BitDifference(d_kv[i]->ToHost(), layers[i].kv), "")
        << "kv_head_scores";
  }
}

struct Gqa {
  int32_t query_heads;
  int32_t kv_heads;
};

TEST(AccumulateKernelTest, MatchesTwinExactly) {
  KVKEEP_REQUIRE_GPU();
  const std::vector<int64_t> slots = {1,  3,   7,   0,    16,    17,
                                      64, 100, 257, 4096, 10001, 12};
  int cases = 0;
  // GQA ratios 1, 4 and 8, and query heads that are not a multiple of the
  // kernel's load batch (8).
  for (const Gqa gqa : {Gqa{1, 1}, Gqa{8, 8}, Gqa{4, 1}, Gqa{8, 2}, Gqa{32, 8},
                        Gqa{32, 4}, Gqa{8, 1}, Gqa{12, 3}}) {
    for (int32_t rows : {1, 3}) {
      for (bool with_kv : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "query_heads " << gqa.query_heads << " kv_heads "
                     << gqa.kv_heads << " rows " << rows << " kv " << with_kv);
        RunAndCompare(gqa.query_heads, gqa.kv_heads, rows, with_kv, slots,
                      10001, gqa.query_heads * 10 + rows + with_kv);
        if (HasFatalFailure()) return;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 8 * 2 * 2);
}

// max_slots only sizes the grid: an underestimate still covers every slot
// (grid-stride), and a decode step of a 32-layer model fits one launch.
TEST(AccumulateKernelTest, ManyLayersAndSmallGridHint) {
  KVKEEP_REQUIRE_GPU();
  std::vector<int64_t> slots;
  for (int i = 0; i < 32; ++i) slots.push_back(2000 + 37 * i);
  RunAndCompare(32, 8, 1, true, slots, /*max_slots_hint=*/1, 5);
  if (HasFatalFailure()) return;
  // Slots not a multiple of 4 (scalar path), on a grid sized for the vector
  // path: each thread loops over four slots.
  RunAndCompare(8, 2, 3, true, {200001}, 200001, 6);
}

TEST(AccumulateKernelTest, RowsZeroChangesNothing) {
  KVKEEP_REQUIRE_GPU();
  RunAndCompare(8, 2, 0, true, {17, 64}, 64, 7);
}

// Argument checks happen before any CUDA call, so these run anywhere.
TEST(AccumulateKernelTest, RejectsBadShapes) {
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 1, 6, 4, 1, 10, nullptr),
            cudaErrorInvalidValue);  // 6 % 4 != 0
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 1, 0, 1, 1, 10, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 1, 4, 0, 1, 10, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 70000, 4, 1, 1, 10, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 1, 4, 1, -1, 10, nullptr),
            cudaErrorInvalidValue);
  // Nothing to do: success without a launch.
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 0, 4, 1, 1, 10, nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::LaunchAccumulate(nullptr, 3, 4, 1, 0, 10, nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace kvkeep
