// The quantise and dequantise kernels (kernels/cuda/quantize.h) against their
// CPU twins (kernels/quantize.h), byte for byte: int8, fp8_e4m3 and int4;
// f32, f16 and bf16 inputs; head dims 64, 80, 128; groups from 2 to
// head_dim; Gaussian data with outlier channels, exact ties, zero groups,
// subnormal-sized values; the first failing group (NaN, infinity, a value
// too large for the scale) reported as the twin reports it. Skipped without
// a CUDA device, except the argument checks.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/quantize.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;

struct Case {
  PageLayout layout;
  DType in = DType::kF32;
  int64_t n = 0;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (DType dtype : {DType::kInt8, DType::kFp8E4M3, DType::kInt4}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (int32_t group : {2, 16, head_dim}) {
        for (DType in : {DType::kF32, DType::kF16, DType::kBF16}) {
          cases.push_back({PageLayout{16, 2, head_dim, dtype, group}, in, 33});
        }
      }
    }
    cases.push_back({PageLayout{16, 8, 128, dtype, 32}, DType::kBF16, 1000});
    cases.push_back({PageLayout{16, 1, 64, dtype, 32}, DType::kF32, 0});
  }
  return cases;
}

// [n][kv_heads][head_dim] of `in`: Gaussian, some channels large, one head
// of every fifth token zero, some values exact halves of small integers
// (ties) and some tiny (subnormal after scaling).
std::vector<std::byte> Input(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t count = c.n * c.layout.token_elements();
  std::vector<std::byte> out(count * DTypeBytes(c.in));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t ch = i % c.layout.head_dim;
    float v = normal(rng);
    if (ch % 16 == 5) v = 12.0f + 3.0f * v;
    if (ch % 29 == 7) v *= 40.0f;
    if (ch % 11 == 3) v = std::round(v * 4.0f) / 2.0f + 0.5f;
    if (ch % 13 == 1) v *= 1e-6f;
    if ((i / c.layout.token_elements()) % 5 == 0 &&
        i % c.layout.token_elements() < c.layout.head_dim) {
      v = 0.0f;
    }
    StoreFromFloat(c.in, out.data(), i, v);
  }
  return out;
}

TEST(QuantizeKernelTest, QuantizeMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  uint32_t seed = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(::testing::Message()
                 << DTypeName(c.layout.dtype) << " head_dim "
                 << c.layout.head_dim << " group " << c.layout.group_size
                 << " from " << DTypeName(c.in) << " n " << c.n);
    const std::vector<std::byte> in = Input(c, ++seed);
    std::vector<std::byte> want(c.n * c.layout.token_bytes());
    ASSERT_TRUE(
        QuantizeTokens(c.layout, c.in, in.data(), c.n, want.data()).ok());
    DeviceArray<std::byte> d_in(in);
    DeviceArray<std::byte> d_out(want.size());
    DeviceArray<unsigned long long> failure(1);
    ASSERT_EQ(cuda::LaunchQuantizeTokens(c.layout, c.in, d_in.get(), c.n,
                                         d_out.get(), failure.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(failure.ToHost()[0], cuda::kNoQuantFailure);
    ASSERT_EQ(d_out.ToHost(), want);
  }
}

TEST(QuantizeKernelTest, DequantizeMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  uint32_t seed = 100;
  for (const Case& c : Cases()) {
    for (DType out : {DType::kF32, DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(c.layout.dtype) << " head_dim "
                   << c.layout.head_dim << " group " << c.layout.group_size
                   << " to " << DTypeName(out) << " n " << c.n);
      const std::vector<std::byte> in = Input(c, ++seed);
      std::vector<std::byte> records(c.n * c.layout.token_bytes());
      ASSERT_TRUE(
          QuantizeTokens(c.layout, c.in, in.data(), c.n, records.data()).ok());
      std::vector<std::byte> want(c.n * c.layout.token_elements() *
                                  DTypeBytes(out));
      DequantizeTokens(c.layout, records.data(), c.n, out, want.data());
      DeviceArray<std::byte> d_in(records);
      DeviceArray<std::byte> d_out(want.size());
      ASSERT_EQ(cuda::LaunchDequantizeTokens(c.layout, d_in.get(), c.n, out,
                                             d_out.get(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(d_out.ToHost(), want);
    }
  }
}

TEST(QuantizeKernelTest, FirstFailureIsTheTwins) {
  KVKEEP_REQUIRE_GPU();
  const PageLayout layout{16, 2, 64, DType::kInt8, 16};
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  for (float bad : {kNaN, kInf, 1e30f}) {
    std::vector<float> x(10 * 128, 0.5f);
    x[7 * 128 + 100] = bad;  // token 7, group 6
    x[9 * 128 + 3] = kNaN;   // a later failure
    std::vector<std::byte> scratch(10 * layout.token_bytes());
    const QuantizeResult twin =
        QuantizeTokens(layout, DType::kF32, x.data(), 10, scratch.data());
    ASSERT_FALSE(twin.ok());
    std::vector<std::byte> bytes(x.size() * sizeof(float));
    std::memcpy(bytes.data(), x.data(), bytes.size());
    DeviceArray<std::byte> d_in(bytes);
    DeviceArray<std::byte> d_out(scratch.size());
    DeviceArray<unsigned long long> failure(1);
    ASSERT_EQ(cuda::LaunchQuantizeTokens(layout, DType::kF32, d_in.get(), 10,
                                         d_out.get(), failure.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const unsigned long long f = failure.ToHost()[0];
    const int64_t index = static_cast<int64_t>(f >> 2);
    EXPECT_EQ(index / layout.groups(), twin.token);
    EXPECT_EQ(index % layout.groups() * layout.group_size, twin.element);
    EXPECT_EQ(static_cast<QuantError>(f & 3), twin.error);
  }
}

TEST(QuantizeKernelTest, BadArgumentsAreRefused) {
  const PageLayout bf16{16, 2, 64, DType::kBF16};
  const PageLayout int8{16, 2, 64, DType::kInt8, 48};
  std::byte b{};
  unsigned long long f = 0;
  EXPECT_EQ(
      cuda::LaunchQuantizeTokens(bf16, DType::kF32, &b, 1, &b, &f, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchQuantizeTokens(int8, DType::kF32, &b, 1, &b, &f, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchDequantizeTokens(bf16, &b, 1, DType::kInt8, &b, nullptr),
      cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvkeep
