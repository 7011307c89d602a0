// LaunchPageScores and LaunchPool1d (kernels/cuda/device_state/pooling.h)
// against their CPU twins PageScores (kernels/page_scores.h) and Pool1d
// (kernels/pooling.h).
//
// Exact equality throughout. Oldest, eligibility and max pooling are
// order-free. The page mean and the average pool are float sums, but kernel
// and twin add the same terms in the same order (one thread per output, left
// to right from 0) and divide once with IEEE division (no fast math), so they
// produce the same floats; a tolerance would hide a changed order.
// Skipped without a CUDA device (the argument checks run anywhere).
// cuda_runtime.h: gpu_testing.h calls the typed cudaMalloc(T**) overload.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_state/pooling.h"
#include "kernels/page_scores.h"
#include "kernels/pooling.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;
using ::kvkeep::testing::Stream;

// "" when `got` and `want` hold the same bits, else where they first differ.
template <typename T>
std::string BitDifference(const std::vector<T>& got,
                          const std::vector<T>& want) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return ::testing::PrintToString(i) + ": got " +
             ::testing::PrintToString(+got[i]) + ", twin " +
             ::testing::PrintToString(+want[i]);
    }
  }
  return "";
}

// ---------------------------------------------------------------------------
// LaunchPageScores.

void ComparePageScores(const std::vector<float>& score,
                       const std::vector<int64_t>& arrival, int32_t page_tokens,
                       ProtectedTokens protect) {
  const int64_t slots = static_cast<int64_t>(score.size());
  const int64_t pages = FullPages(slots, page_tokens);
  std::vector<float> mean(pages);
  std::vector<int64_t> oldest(pages);
  std::vector<uint8_t> eligible(pages);
  PageScores(score.data(), arrival.data(), slots, page_tokens, protect,
             mean.data(), oldest.data(), eligible.data());

  DeviceArray<float> d_score(score);
  DeviceArray<int64_t> d_arrival(arrival);
  // Outputs start as 0xff bytes so an unwritten element shows.
  DeviceArray<float> d_mean(pages);
  DeviceArray<int64_t> d_oldest(pages);
  DeviceArray<uint8_t> d_eligible(pages);
  ASSERT_TRUE(d_score.ok() && d_arrival.ok() && d_mean.ok() && d_oldest.ok() &&
              d_eligible.ok());
  Stream stream;
  ASSERT_NE(stream.get(), nullptr);
  if (pages > 0) {
    KVKEEP_ASSERT_CUDA(cudaMemsetAsync(d_mean.get(), 0xff,
                                       pages * sizeof(float), stream.get()));
    KVKEEP_ASSERT_CUDA(cudaMemsetAsync(d_oldest.get(), 0xff,
                                       pages * sizeof(int64_t), stream.get()));
    KVKEEP_ASSERT_CUDA(
        cudaMemsetAsync(d_eligible.get(), 0xff, pages, stream.get()));
  }
  KVKEEP_ASSERT_CUDA(cuda::LaunchPageScores(
      d_score.get(), d_arrival.get(), slots, page_tokens, protect, d_mean.get(),
      d_oldest.get(), d_eligible.get(), stream.get()));
  KVKEEP_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(BitDifference(d_mean.ToHost(), mean), "") << "mean";
  EXPECT_EQ(BitDifference(d_oldest.ToHost(), oldest), "") << "oldest";
  EXPECT_EQ(BitDifference(d_eligible.ToHost(), eligible), "") << "eligible";
}

TEST(PageScoresKernelTest, MatchesTwinExactly) {
  KVKEEP_REQUIRE_GPU();
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int64_t slots :
         {int64_t{0}, int64_t{page_tokens - 1}, int64_t{page_tokens},
          int64_t{7 * page_tokens + 2}, int64_t{1000 * page_tokens + 1}}) {
      std::mt19937 rng(page_tokens * 100 + static_cast<uint32_t>(slots));
      // Arrival: distinct, with gaps, in shuffled slots.
      const int64_t appended = 2 * slots + 3;
      std::vector<int64_t> all(appended);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int64_t> arrival(all.begin(), all.begin() + slots);
      std::uniform_real_distribution<float> u(-1.0f, 1000.0f);
      std::vector<float> score(slots);
      for (float& s : score) s = u(rng);
      for (const ProtectedTokens protect :
           {ProtectedTokens{0, 0, appended}, ProtectedTokens{4, 0, appended},
            ProtectedTokens{0, 9, appended},
            ProtectedTokens{3, 2 * page_tokens, appended},
            ProtectedTokens{appended, 0, appended}}) {
        SCOPED_TRACE(::testing::Message()
                     << "P " << page_tokens << " slots " << slots << " sinks "
                     << protect.sinks << " recent " << protect.recent);
        ComparePageScores(score, arrival, page_tokens, protect);
        if (HasFatalFailure()) return;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 5 * 5);
}

TEST(PageScoresKernelTest, RejectsBadArguments) {
  EXPECT_EQ(cuda::LaunchPageScores(nullptr, nullptr, 10, 0, {}, nullptr,
                                   nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchPageScores(nullptr, nullptr, -1, 4, {}, nullptr,
                                   nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  // No full page: nothing to launch.
  EXPECT_EQ(cuda::LaunchPageScores(nullptr, nullptr, 3, 4, {}, nullptr, nullptr,
                                   nullptr, nullptr),
            cudaSuccess);
}

// ---------------------------------------------------------------------------
// LaunchPool1d.

void ComparePool(const std::vector<float>& in, int32_t kernel,
                 Pooling pooling) {
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<float> want(n);
  Pool1d(in, kernel, pooling, want);
  DeviceArray<float> d_in(in);
  DeviceArray<float> d_out(n);
  ASSERT_TRUE(d_in.ok() && d_out.ok());
  Stream stream;
  ASSERT_NE(stream.get(), nullptr);
  if (n > 0) {
    KVKEEP_ASSERT_CUDA(
        cudaMemsetAsync(d_out.get(), 0xff, n * sizeof(float), stream.get()));
  }
  KVKEEP_ASSERT_CUDA(cuda::LaunchPool1d(d_in.get(), n, kernel, pooling,
                                        d_out.get(), stream.get()));
  KVKEEP_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(BitDifference(d_out.ToHost(), want), "");
}

TEST(Pool1dKernelTest, MatchesTwinExactly) {
  KVKEEP_REQUIRE_GPU();
  int cases = 0;
  for (int64_t n : {0, 1, 2, 5, 17, 100, 1000, 4097, 70001}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    // Scores as snapkv sees them: non-negative sums of attention, with a few
    // large and a few negative to catch a wrong padding value.
    std::uniform_real_distribution<float> u(-0.5f, 4.0f);
    std::vector<float> in(n);
    for (float& x : in) x = u(rng);
    for (int32_t kernel : {1, 3, 5, 7, 31, 1025}) {
      for (Pooling pooling : {Pooling::kMax, Pooling::kAvg}) {
        SCOPED_TRACE(::testing::Message()
                     << "n " << n << " kernel " << kernel << " "
                     << (pooling == Pooling::kMax ? "max" : "avg"));
        ComparePool(in, kernel, pooling);
        if (HasFatalFailure()) return;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 9 * 6 * 2);
}

// Max pooling skips NaN as the twin's std::max(m, x) does, and keeps -inf and
// +inf (a window of only NaN and -inf padding gives -inf in both).
TEST(Pool1dKernelTest, MaxWithNonFiniteInputs) {
  KVKEEP_REQUIRE_GPU();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> in(50, -kInf);
  in[3] = std::numeric_limits<float>::quiet_NaN();
  in[10] = kInf;
  in[20] = -1.0f;
  in[21] = std::numeric_limits<float>::quiet_NaN();
  in[49] = 2.0f;
  for (int32_t kernel : {1, 3, 9}) {
    SCOPED_TRACE(::testing::Message() << "kernel " << kernel);
    ComparePool(in, kernel, Pooling::kMax);
  }
}

TEST(Pool1dKernelTest, RejectsBadArguments) {
  EXPECT_EQ(cuda::LaunchPool1d(nullptr, 10, 0, Pooling::kMax, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchPool1d(nullptr, -1, 3, Pooling::kAvg, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchPool1d(nullptr, 0, 3, Pooling::kAvg, nullptr, nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace kvkeep
