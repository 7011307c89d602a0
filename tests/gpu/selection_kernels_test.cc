// The GPU selection kernel (kernels/cuda/device_state/selection.h) against its
// CPU twin SelectLowestUnprotected: the same victims in the same order,
// exactly, for every layer of a multi-layer launch. Sweeps sizes (both sort
// paths: gathered victims in shared memory and in the workspace), many equal
// scores, -0.0 against 0.0, infinities and subnormals, k = 0, 1, a page, k
// above the eligible count, all protected, arrivals near 2^32, and layers the
// kernel must refuse. Skipped without a CUDA device, except the argument
// checks, which return before touching the device. cudaMalloc<T>, which
// DeviceArray<T> calls, is declared here.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_state/selection.h"
#include "kernels/selection.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;

struct HostLayer {
  std::vector<float> scores;
  std::vector<int64_t> arrival;
  int64_t appended = 0;
  int64_t k = 0;
  int64_t slots() const { return static_cast<int64_t>(scores.size()); }
};

struct Selected {
  int32_t count = 0;
  std::vector<int32_t> victims;
};

constexpr int32_t kUnwritten = -7;

// Runs every layer in one launch; checks that nothing beyond the count was
// written to a victims buffer.
std::vector<Selected> RunGpu(const std::vector<HostLayer>& layers,
                             int64_t sinks, int64_t recent, int64_t max_slots) {
  std::vector<std::unique_ptr<DeviceArray<float>>> scores;
  std::vector<std::unique_ptr<DeviceArray<int64_t>>> arrivals;
  std::vector<std::unique_ptr<DeviceArray<int32_t>>> victims, counts;
  std::vector<cuda::SelectLayer> spec;
  for (const HostLayer& l : layers) {
    scores.push_back(std::make_unique<DeviceArray<float>>(l.scores));
    arrivals.push_back(std::make_unique<DeviceArray<int64_t>>(l.arrival));
    const int64_t room = std::max<int64_t>(0, l.k) + 1;
    victims.push_back(std::make_unique<DeviceArray<int32_t>>(
        std::vector<int32_t>(room, kUnwritten)));
    counts.push_back(std::make_unique<DeviceArray<int32_t>>(
        std::vector<int32_t>{kUnwritten}));
    EXPECT_TRUE(scores.back()->ok() && arrivals.back()->ok() &&
                victims.back()->ok() && counts.back()->ok());
    spec.push_back({scores.back()->get(), arrivals.back()->get(), l.slots(),
                    l.appended, l.k, victims.back()->get(),
                    counts.back()->get()});
  }
  DeviceArray<cuda::SelectLayer> spec_on_device(spec);
  const int32_t num_layers = static_cast<int32_t>(layers.size());
  const size_t ws_bytes = cuda::SelectWorkspaceBytes(num_layers, max_slots);
  DeviceArray<std::byte> workspace(ws_bytes);
  EXPECT_TRUE(spec_on_device.ok() && workspace.ok());
  EXPECT_EQ(
      cuda::LaunchSelectLowest(spec_on_device.get(), num_layers, sinks, recent,
                               max_slots, workspace.get(), ws_bytes, nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<Selected> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    Selected s;
    s.count = counts[i]->ToHost()[0];
    const std::vector<int32_t> all = victims[i]->ToHost();
    const int32_t written = std::max(s.count, 0);
    EXPECT_LE(written, static_cast<int32_t>(all.size()) - 1);
    for (size_t j = 0; j < all.size(); ++j) {
      if (static_cast<int32_t>(j) < written) {
        s.victims.push_back(all[j]);
      } else {
        EXPECT_EQ(all[j], kUnwritten) << "layer " << i << " entry " << j;
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<int32_t> Twin(const HostLayer& l, int64_t sinks, int64_t recent) {
  std::vector<RankedItem> scratch;
  std::vector<int32_t> out;
  SelectLowestUnprotected(l.scores.data(), l.arrival.data(), l.slots(),
                          l.appended, sinks, recent, l.k, scratch, &out);
  return out;
}

void ExpectMatchesTwin(const std::vector<HostLayer>& layers, int64_t sinks,
                       int64_t recent, int64_t max_slots) {
  const std::vector<Selected> got = RunGpu(layers, sinks, recent, max_slots);
  ASSERT_EQ(got.size(), layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<int32_t> want = Twin(layers[i], sinks, recent);
    EXPECT_EQ(got[i].count, static_cast<int32_t>(want.size()))
        << "layer " << i << " slots " << layers[i].slots() << " k "
        << layers[i].k;
    EXPECT_EQ(got[i].victims, want)
        << "layer " << i << " slots " << layers[i].slots() << " k "
        << layers[i].k;
  }
}

enum class Scores { kSpread, kAllEqual, kFewLevels, kZeros, kSpecial };

// `slots` resident tokens with distinct arrivals from [base, base + span),
// in shuffled slot order.
HostLayer RandomLayer(int64_t slots, Scores kind, int64_t k, std::mt19937& rng,
                      int64_t base = 0) {
  HostLayer l;
  const int64_t span = slots + static_cast<int64_t>(rng() % (slots + 3));
  std::vector<int64_t> all(span);
  std::iota(all.begin(), all.end(), base);
  std::shuffle(all.begin(), all.end(), rng);
  l.arrival.assign(all.begin(), all.begin() + slots);
  l.appended = base + span;
  l.k = k;
  std::uniform_real_distribution<float> spread(-3.0f, 3.0f);
  const float special[] = {0.0f,
                           -0.0f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::max(),
                           -std::numeric_limits<float>::max(),
                           1.0f};
  for (int64_t s = 0; s < slots; ++s) {
    float v = 0;
    switch (kind) {
      case Scores::kSpread:
        v = spread(rng);
        break;
      case Scores::kAllEqual:
        v = 0.75f;
        break;
      case Scores::kFewLevels:
        v = static_cast<float>(rng() % 4) * 0.5f;
        break;
      case Scores::kZeros:
        v = rng() % 2 ? 0.0f : -0.0f;
        break;
      case Scores::kSpecial:
        v = special[rng() % 9];
        break;
    }
    l.scores.push_back(v);
  }
  return l;
}

TEST(SelectionKernelTest, MatchesTwinOverSweep) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(11);
  const Scores kinds[] = {Scores::kSpread, Scores::kAllEqual,
                          Scores::kFewLevels, Scores::kZeros, Scores::kSpecial};
  for (int64_t sinks : {0, 4}) {
    for (int64_t recent : {0, 1, 64}) {
      for (Scores kind : kinds) {
        SCOPED_TRACE(::testing::Message()
                     << "sinks " << sinks << " recent " << recent << " scores "
                     << static_cast<int>(kind));
        // One launch of many layers, of every size and k.
        std::vector<HostLayer> layers;
        for (int64_t slots : {0, 1, 2, 3, 17, 100, 1000, 2049, 5000}) {
          for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{16},
                            int64_t{17}, slots / 3, slots, slots + 5}) {
            layers.push_back(RandomLayer(slots, kind, k, rng));
          }
        }
        ExpectMatchesTwin(layers, sinks, recent, 5000);
      }
    }
  }
}

// Many victims: more than fit the shared-memory sort, up to a whole 32k layer.
TEST(SelectionKernelTest, LargeLayersAndLargeK) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(12);
  std::vector<HostLayer> layers;
  layers.push_back(RandomLayer(32768, Scores::kSpread, 1, rng));
  layers.push_back(RandomLayer(32768, Scores::kSpread, 16, rng));
  layers.push_back(RandomLayer(32768, Scores::kSpread, 3277, rng));
  layers.push_back(RandomLayer(32768, Scores::kFewLevels, 4096, rng));
  layers.push_back(RandomLayer(32768, Scores::kAllEqual, 20000, rng));
  layers.push_back(RandomLayer(32768, Scores::kZeros, 32768, rng));
  layers.push_back(RandomLayer(30000, Scores::kSpecial, 40000, rng));
  ExpectMatchesTwin(layers, 4, 64, 32768);
}

TEST(SelectionKernelTest, NegativeZeroTiesWithZeroByArrival) {
  KVKEEP_REQUIRE_GPU();
  // The older token goes first whichever zero it holds, for k == 1 (the
  // block-minimum path) and k > 1 (the radix path).
  HostLayer a{{0.0f, -0.0f, 1.0f, -0.0f}, {7, 3, 0, 9}, 10, 1};
  HostLayer b = a;
  b.k = 4;
  HostLayer c{{-0.0f, 0.0f, 1.0f, 0.0f}, {7, 3, 0, 9}, 10, 4};
  const std::vector<Selected> got = RunGpu({a, b, c}, 0, 0, 4);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].victims, (std::vector<int32_t>{1}));
  EXPECT_EQ(got[1].victims, (std::vector<int32_t>{1, 0, 3, 2}));
  EXPECT_EQ(got[2].victims, (std::vector<int32_t>{1, 0, 3, 2}));
  ExpectMatchesTwin({a, b, c}, 0, 0, 4);
}

TEST(SelectionKernelTest, ProtectedAndEmptyLayers) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(13);
  std::vector<HostLayer> layers;
  // Everything protected: sinks and recent cover all arrivals.
  HostLayer all = RandomLayer(50, Scores::kSpread, 10, rng);
  all.appended = 50;  // eligible: 20 <= arrival < 50 - 30, none
  for (int64_t s = 0; s < 50; ++s) all.arrival[s] = 49 - s;
  layers.push_back(all);
  // k > eligible: the eligible ones, all of them, in rank order.
  HostLayer few = RandomLayer(300, Scores::kFewLevels, 1000, rng);
  layers.push_back(few);
  // Empty layer, and k <= 0.
  layers.push_back(HostLayer{{}, {}, 0, 3});
  HostLayer none = RandomLayer(40, Scores::kSpread, 0, rng);
  layers.push_back(none);
  none.k = -5;
  layers.push_back(none);
  const std::vector<Selected> got = RunGpu(layers, 20, 30, 300);
  EXPECT_EQ(got[0].count, 0);
  EXPECT_EQ(got[2].count, 0);
  EXPECT_EQ(got[3].count, 0);
  EXPECT_EQ(got[4].count, 0);
  ExpectMatchesTwin(layers, 20, 30, 300);
}

// Arrival - sinks spans just under 2^32: still exact.
TEST(SelectionKernelTest, ArrivalsNearTheKeyLimit) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(14);
  const int64_t base = (int64_t{1} << 32) - 3000;
  std::vector<HostLayer> layers;
  for (int64_t k : {1, 7, 500}) {
    HostLayer l = RandomLayer(1000, Scores::kFewLevels, k, rng, base);
    l.arrival[0] = 0;  // the oldest token, arrival 0, still eligible
    l.appended = int64_t{1} << 32;
    layers.push_back(l);
  }
  ExpectMatchesTwin(layers, 0, 0, 1000);
}

// A layer the kernel cannot select exactly is refused, and the other layers
// of the launch are unaffected.
TEST(SelectionKernelTest, RefusesLayersItCannotSelect) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(15);
  HostLayer good = RandomLayer(100, Scores::kSpread, 5, rng);
  HostLayer too_wide = RandomLayer(100, Scores::kSpread, 5, rng);
  too_wide.arrival[3] = (int64_t{1} << 32) + 10;
  too_wide.appended = (int64_t{1} << 32) + 20;  // eligible span > 2^32
  HostLayer too_big = RandomLayer(200, Scores::kSpread, 5, rng);  // > max
  HostLayer negative = RandomLayer(10, Scores::kSpread, 5, rng);
  negative.appended = -1;
  const std::vector<Selected> got =
      RunGpu({good, too_wide, too_big, negative}, 0, 0, 100);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].victims, Twin(good, 0, 0));
  EXPECT_EQ(got[1].count, cuda::kSelectInvalidLayer);
  EXPECT_EQ(got[2].count, cuda::kSelectInvalidLayer);
  EXPECT_EQ(got[3].count, cuda::kSelectInvalidLayer);
}

// Host-side argument checks return before any CUDA call, so they run on
// every machine.
TEST(SelectionKernelTest, RejectsBadArguments) {
  EXPECT_EQ(cuda::SelectWorkspaceBytes(0, 100), 0u);
  EXPECT_EQ(cuda::SelectWorkspaceBytes(4, 0), 0u);
  EXPECT_GE(cuda::SelectWorkspaceBytes(2, 1000),
            2 * 1000 * (sizeof(uint64_t) + 12));
  std::byte fake[16] = {};
  const auto* layers = reinterpret_cast<const cuda::SelectLayer*>(fake);
  EXPECT_EQ(cuda::LaunchSelectLowest(layers, 0, 0, 0, 100, nullptr, 0, nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::LaunchSelectLowest(layers, -1, 0, 0, 100, fake, 16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSelectLowest(layers, 1, -1, 0, 100, fake, 16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSelectLowest(layers, 1, 0, -1, 100, fake, 16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSelectLowest(layers, 1, 0, 0, int64_t{1} << 31, fake,
                                     16, nullptr),
            cudaErrorInvalidValue);
  // A workspace one byte short.
  const size_t need = cuda::SelectWorkspaceBytes(3, 100);
  EXPECT_EQ(
      cuda::LaunchSelectLowest(layers, 3, 0, 0, 100, fake, need - 1, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchSelectLowest(nullptr, 3, 0, 0, 100, fake, need, nullptr),
      cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvkeep
