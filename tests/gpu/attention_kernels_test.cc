// LaunchQueryAttention (kernels/cuda/attention.h) against its CPU twin
// QueryAttention (kernels/attention.h) over awkward sizes: page sizes 1, 3, 7,
// 16, 17; head dims 64, 80, 128 (and 96, 256); GQA ratios 1, 4, 8; f32, f16
// and bf16 keys, and int8, fp8_e4m3 and int4 keys dequantised in the kernel;
// shuffled, non-contiguous block tables; arrival orders with gaps in shuffled
// slots; causal masks from all-visible to none-visible; one-row decode steps
// over many slots.
//
// Every arena byte the kernel must not read (values, padding slots, pages
// outside the block table) is 0xff, a NaN in every dtype, and the output and
// workspace start as 0xff too: a stray read or an unwritten element shows as
// NaN.
//
// Tolerances, and why they are not 0: the kernel sums each dot product across
// a warp (a tree) and each softmax denominator across a block, where the twin
// sums left to right, and CUDA's expf is within 2 ulp where glibc's is within
// 1. Both are within ~5e-7 relative of the exact result for logits of
// moderate size (attention_kernels_test measures the twin), so
//   - moderate logits: |gpu - twin| <= 1e-5 * twin + 1e-6 (10x margin);
//   - logits near +-120: the logits themselves are known only to float's
//     precision at 120 (ulp 7.6e-6) and exp turns that absolute error into a
//     relative one, so 1e-4 * twin + 1e-6, as the twin's own test allows;
//   - masked slots: exactly 0 in both; each row sums to query_heads within
//     1e-5 relative (a distribution per head), or is exactly 0.
// cuda_runtime.h: gpu_testing.h calls the typed cudaMalloc(T**) overload.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention.h"
#include "kernels/dtype.h"
#include "kernels/kivi.h"
#include "kernels/page_layout.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;
using ::kvkeep::testing::Stream;

// A layer's keys in a paged arena, laid out as the store lays them out:
// page = [K, V][page_tokens][kv_heads][head_dim]. The block table takes
// shuffled pages out of a larger arena.
struct HostKeys {
  PageLayout layout;
  int64_t slots = 0;
  std::vector<std::byte> arena;
  std::vector<PageId> pages;
  std::vector<int64_t> order;

  PagedKeys view() const {
    return PagedKeys{arena.data(), layout, pages, order, slots};
  }
};

// key(s, g, i) gives each key element as float; it is rounded to the
// layout's dtype when stored.
template <typename KeyFn>
HostKeys MakeKeys(const PageLayout& layout, int64_t slots, std::mt19937& rng,
                  KeyFn key) {
  HostKeys f;
  f.layout = layout;
  f.slots = slots;
  const int64_t needed = (slots + layout.page_tokens - 1) / layout.page_tokens;
  const int64_t total = 2 * needed + 3;
  std::vector<PageId> all(total);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  f.pages.assign(all.begin(), all.begin() + needed);
  f.arena.assign(total * layout.page_bytes(), std::byte{0xff});
  const int64_t elem = DTypeBytes(layout.dtype);
  if (IsKivi(layout.dtype)) {  // each page's key block, as the store
    const int32_t p = layout.page_tokens;
    const int64_t e_count = layout.token_elements();
    for (int64_t first = 0; first < slots; first += p) {
      const int32_t count =
          static_cast<int32_t>(std::min<int64_t>(p, slots - first));
      std::vector<float> keys(count * e_count);
      for (int32_t t = 0; t < count; ++t) {
        for (int64_t c = 0; c < e_count; ++c) {
          keys[t * e_count + c] =
              key(first + t, static_cast<int32_t>(c / layout.head_dim),
                  static_cast<int32_t>(c % layout.head_dim));
        }
      }
      EXPECT_TRUE(
          QuantizeKiviKeys(layout, keys.data(), count,
                           f.arena.data() + int64_t{f.pages[first / p]} *
                                                layout.page_bytes())
              .ok());
    }
  }
  for (int64_t s = 0; s < slots && !IsKivi(layout.dtype); ++s) {
    const int64_t base =
        layout.key_offset(f.pages[s / layout.page_tokens],
                          static_cast<int32_t>(s % layout.page_tokens));
    if (IsQuantized(layout.dtype)) {  // the token's record, as the store
      std::vector<float> token(layout.token_elements());
      for (int32_t g = 0; g < layout.kv_heads; ++g) {
        for (int32_t i = 0; i < layout.head_dim; ++i) {
          token[int64_t{g} * layout.head_dim + i] = key(s, g, i);
        }
      }
      EXPECT_TRUE(QuantizeTokens(layout, DType::kF32, token.data(), 1,
                                 f.arena.data() + base)
                      .ok());
      continue;
    }
    for (int32_t g = 0; g < layout.kv_heads; ++g) {
      for (int32_t i = 0; i < layout.head_dim; ++i) {
        StoreFromFloat(
            layout.dtype,
            f.arena.data() + base + (int64_t{g} * layout.head_dim + i) * elem,
            0, key(s, g, i));
      }
    }
  }
  // Distinct arrival orders with gaps (evicted tokens), in shuffled slots.
  std::vector<int64_t> arrivals(3 * slots);
  std::iota(arrivals.begin(), arrivals.end(), 0);
  std::shuffle(arrivals.begin(), arrivals.end(), rng);
  arrivals.resize(slots);
  f.order = arrivals;
  return f;
}

// Row orders covering every mask shape: all visible, about half, only the
// oldest slot, and none (a zero row).
std::vector<int64_t> RowOrders(const std::vector<int64_t>& order) {
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  return {sorted.back(), sorted[sorted.size() / 2], sorted.front(),
          sorted.front() - 1};
}

// Runs the kernel and the twin on the same input and compares every element
// (rel: relative tolerance, abs_tol: absolute) and every row sum.
void RunAndCompare(const HostKeys& f, const std::vector<float>& queries,
                   const std::vector<int64_t>& row_order, int32_t query_heads,
                   double rel, double abs_tol) {
  const int32_t rows = static_cast<int32_t>(row_order.size());
  const int64_t n = f.slots;
  std::vector<float> want(rows * n);
  std::vector<float> scratch(int64_t{query_heads} * n + f.layout.head_dim);
  QueryAttention(f.view(), queries.data(), row_order.data(), rows, query_heads,
                 want.data(), scratch.data());

  DeviceArray<std::byte> d_arena(f.arena);
  DeviceArray<PageId> d_pages(f.pages);
  DeviceArray<int64_t> d_order(f.order);
  DeviceArray<float> d_queries(queries);
  DeviceArray<int64_t> d_row_order(row_order);
  DeviceArray<float> d_out(rows * n);
  const size_t workspace_bytes =
      cuda::QueryAttentionWorkspaceBytes(rows, query_heads, n);
  DeviceArray<std::byte> d_workspace(workspace_bytes);
  ASSERT_TRUE(d_arena.ok() && d_pages.ok() && d_order.ok() && d_queries.ok() &&
              d_row_order.ok() && d_out.ok() && d_workspace.ok());
  Stream stream;
  ASSERT_NE(stream.get(), nullptr);
  if (rows * n > 0) {
    KVKEEP_ASSERT_CUDA(cudaMemsetAsync(d_out.get(), 0xff,
                                       rows * n * sizeof(float), stream.get()));
  }
  if (workspace_bytes > 0) {
    KVKEEP_ASSERT_CUDA(cudaMemsetAsync(d_workspace.get(), 0xff, workspace_bytes,
                                       stream.get()));
  }
  const cuda::DevicePagedKeys keys{d_arena.get(), f.layout, d_pages.get(),
                                   d_order.get(), n};
  KVKEEP_ASSERT_CUDA(cuda::LaunchQueryAttention(
      keys, d_queries.get(), d_row_order.get(), rows, query_heads, d_out.get(),
      d_workspace.get(), stream.get()));
  KVKEEP_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
  const std::vector<float> got = d_out.ToHost();

  for (int32_t r = 0; r < rows; ++r) {
    double row_sum = 0;
    int64_t visible = 0;
    for (int64_t s = 0; s < n; ++s) {
      const float g = got[r * n + s];
      const float w = want[r * n + s];
      if (f.order[s] > row_order[r]) {
        ASSERT_EQ(g, 0.0f) << "masked slot " << s << " row " << r;
        ASSERT_EQ(w, 0.0f) << "twin: masked slot " << s << " row " << r;
        continue;
      }
      ++visible;
      ASSERT_TRUE(std::isfinite(g)) << "slot " << s << " row " << r;
      ASSERT_NEAR(g, w, rel * std::fabs(w) + abs_tol)
          << "slot " << s << " row " << r;
      row_sum += g;
    }
    if (visible > 0) {
      EXPECT_NEAR(row_sum, query_heads, 1e-5 * query_heads) << "row " << r;
    } else {
      EXPECT_EQ(row_sum, 0.0) << "row " << r;
    }
  }
}

std::string ShapeName(int32_t page_tokens, int32_t head_dim, int32_t group,
                      DType dtype, int64_t slots) {
  return "P " + std::to_string(page_tokens) + " d " + std::to_string(head_dim) +
         " group " + std::to_string(group) + " " +
         std::string(DTypeName(dtype)) + " slots " + std::to_string(slots);
}

// One case: random keys ~ N(0, 1) and queries ~ N(0, 1.5^2), so logits
// q.k / sqrt(d) ~ N(0, 2.25): a spread-out softmax.
void RandomCase(int32_t page_tokens, int32_t head_dim, int32_t kv_heads,
                int32_t group, DType dtype, int64_t slots,
                const std::vector<int64_t>* fixed_rows, uint32_t seed) {
  SCOPED_TRACE(ShapeName(page_tokens, head_dim, group, dtype, slots));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Quantised keys in groups of 16 (it divides every head dim here).
  const PageLayout layout{page_tokens, kv_heads, head_dim, dtype,
                          IsQuantized(dtype) ? 16 : 0};
  const HostKeys f =
      MakeKeys(layout, slots, rng,
               [&](int64_t, int32_t, int32_t) { return normal(rng); });
  const int32_t query_heads = kv_heads * group;
  const std::vector<int64_t> row_order =
      fixed_rows != nullptr ? *fixed_rows : RowOrders(f.order);
  std::vector<float> queries(row_order.size() * query_heads * head_dim);
  for (float& q : queries) q = 1.5f * normal(rng);
  RunAndCompare(f, queries, row_order, query_heads, 1e-5, 1e-6);
}

TEST(QueryAttentionKernelTest, MatchesTwinOverAwkwardSizes) {
  KVKEEP_REQUIRE_GPU();
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (int32_t group : {1, 4, 8}) {
        for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
          // A last page only partly used (padding slots) except for P = 1;
          // 29 slots fit one block of the logits kernel, 700 need eleven and
          // more than two blocks of the head-sum kernel.
          for (int64_t slots :
               {std::max<int64_t>(29, 2 * page_tokens + 5), int64_t{700}}) {
            RandomCase(page_tokens, head_dim, /*kv_heads=*/2, group, dtype,
                       slots, nullptr,
                       page_tokens * 7919 + head_dim * 31 + group * 3 +
                           static_cast<int>(dtype) + slots);
            if (HasFatalFailure()) return;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 3 * 3 * 3 * 2);
}

// Quantised keys (int8, fp8_e4m3, int4, and kivi_int4's per-page key
// blocks): the kernel dequantises each key element with the twin's
// functions, so the keys are bit-identical and the tolerances above hold
// unchanged.
TEST(QueryAttentionKernelTest, QuantisedKeysMatchTwin) {
  KVKEEP_REQUIRE_GPU();
  int cases = 0;
  for (int32_t page_tokens : {1, 7, 16}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (int32_t group : {1, 4}) {
        for (DType dtype :
             {DType::kInt8, DType::kFp8E4M3, DType::kInt4, DType::kKiviInt4}) {
          RandomCase(
              page_tokens, head_dim, /*kv_heads=*/2, group, dtype, 300, nullptr,
              page_tokens * 13 + head_dim + group + static_cast<int>(dtype));
          if (HasFatalFailure()) return;
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 3 * 2 * 4);
}

// The other head dims the dispatch supports.
TEST(QueryAttentionKernelTest, OtherSupportedHeadDims) {
  KVKEEP_REQUIRE_GPU();
  for (int32_t head_dim : {96, 256}) {
    for (int32_t group : {1, 8}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        RandomCase(16, head_dim, 2, group, dtype, 301, nullptr,
                   head_dim + group + static_cast<int>(dtype));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A decode step as the store runs it: one query row over a long layer,
// Llama-like heads (8 kv heads, GQA 4, d 128, bf16), and a prefill chunk of
// several rows.
TEST(QueryAttentionKernelTest, DecodeAndPrefillShapes) {
  KVKEEP_REQUIRE_GPU();
  const std::vector<int64_t> decode = {1000000};  // sees every slot
  RandomCase(16, 128, 8, 4, DType::kBF16, 20000, &decode, 1);
  if (HasFatalFailure()) return;
  RandomCase(17, 80, 8, 1, DType::kF16, 9001, &decode, 2);
  if (HasFatalFailure()) return;
  std::vector<int64_t> chunk;
  for (int64_t r = 0; r < 16; ++r) chunk.push_back(3000 + 150 * r);
  RandomCase(16, 128, 4, 8, DType::kBF16, 3000, &chunk, 3);
}

// Logits near +-120 overflow exp() in float (and underflow it): the kernel
// must subtract each head's maximum.
TEST(QueryAttentionKernelTest, LargeLogitsDoNotOverflow) {
  KVKEEP_REQUIRE_GPU();
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int32_t head_dim : {64, 128}) {
      for (float sign : {1.0f, -1.0f}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " d "
                                          << head_dim << " sign " << sign);
        std::mt19937 rng(head_dim + static_cast<int>(dtype));
        std::normal_distribution<float> noise(0.0f, 0.02f);
        const PageLayout layout{7, 2, head_dim, dtype};
        const HostKeys f = MakeKeys(
            layout, 40, rng,
            [&](int64_t, int32_t, int32_t) { return 1.0f + noise(rng); });
        constexpr int32_t kQueryHeads = 8;
        const std::vector<int64_t> row_order = RowOrders(f.order);
        const float c = sign * 120.0f / std::sqrt(float(head_dim));
        std::vector<float> queries(row_order.size() * kQueryHeads * head_dim);
        for (float& q : queries) q = c * (1.0f + noise(rng));
        RunAndCompare(f, queries, row_order, kQueryHeads, 1e-4, 1e-6);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The query head h reads kv head h / group: each kv head's key matches one
// slot, and only one query head is non-zero.
TEST(QueryAttentionKernelTest, GqaHeadMapping) {
  KVKEEP_REQUIRE_GPU();
  constexpr int32_t kKvHeads = 4, kGroup = 4, kDim = 64, kSlots = 4;
  const PageLayout layout{3, kKvHeads, kDim, DType::kF32};
  std::mt19937 rng(1);
  const HostKeys f =
      MakeKeys(layout, kSlots, rng, [](int64_t s, int32_t g, int32_t i) {
        return i == (g == s ? 0 : 1) ? 1.0f : 0.0f;
      });
  constexpr int32_t kQueryHeads = kKvHeads * kGroup;
  std::vector<float> queries(kQueryHeads * kDim, 0.0f);
  queries[(2 * kGroup + 1) * kDim + 0] = 100.0f;  // head 9 -> kv head 2
  RunAndCompare(f, queries, {1000}, kQueryHeads, 1e-5, 1e-6);
}

TEST(QueryAttentionKernelTest, NoSlotsIsANoOp) {
  KVKEEP_REQUIRE_GPU();
  EXPECT_EQ(cuda::QueryAttentionWorkspaceBytes(3, 8, 0), 0u);
  DeviceArray<float> queries(3 * 8 * 64);
  DeviceArray<int64_t> row_order(3);
  ASSERT_TRUE(queries.ok() && row_order.ok());
  const cuda::DevicePagedKeys keys{nullptr, PageLayout{16, 2, 64, DType::kBF16},
                                   nullptr, nullptr, 0};
  Stream stream;
  EXPECT_EQ(cuda::LaunchQueryAttention(keys, queries.get(), row_order.get(), 3,
                                       8, nullptr, nullptr, stream.get()),
            cudaSuccess);
  KVKEEP_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
}

// Argument checks happen before any CUDA call, so these run anywhere.
TEST(QueryAttentionKernelTest, RejectsBadArguments) {
  for (int32_t d : {64, 80, 96, 128, 256}) {
    EXPECT_TRUE(cuda::QueryAttentionSupportsHeadDim(d)) << d;
  }
  for (int32_t d : {0, 1, 32, 72, 100, 512}) {
    EXPECT_FALSE(cuda::QueryAttentionSupportsHeadDim(d)) << d;
  }
  float dummy = 0;
  auto launch = [&](PageLayout layout, int32_t rows, int32_t query_heads,
                    int64_t slots) {
    const cuda::DevicePagedKeys keys{nullptr, layout, nullptr, nullptr, slots};
    return cuda::LaunchQueryAttention(keys, &dummy, nullptr, rows, query_heads,
                                      &dummy, &dummy, nullptr);
  };
  const PageLayout good{16, 2, 128, DType::kBF16};
  EXPECT_EQ(launch(PageLayout{16, 2, 72, DType::kBF16}, 1, 4, 10),
            cudaErrorInvalidValue);  // unsupported head dim
  EXPECT_EQ(launch(good, 1, 3, 10), cudaErrorInvalidValue);  // 3 % 2
  EXPECT_EQ(launch(good, 1, 0, 10), cudaErrorInvalidValue);
  EXPECT_EQ(launch(PageLayout{0, 2, 128, DType::kBF16}, 1, 4, 10),
            cudaErrorInvalidValue);                              // page_tokens
  EXPECT_EQ(launch(good, 70000, 4, 10), cudaErrorInvalidValue);  // grid.y
  EXPECT_EQ(launch(good, 1, 4, -1), cudaErrorInvalidValue);
  const cuda::DevicePagedKeys keys{nullptr, good, nullptr, nullptr, 10};
  EXPECT_EQ(cuda::LaunchQueryAttention(keys, &dummy, nullptr, 1, 4, &dummy,
                                       /*workspace=*/nullptr, nullptr),
            cudaErrorInvalidValue);
  // Workspace: the logits and two floats per (row, head).
  EXPECT_EQ(cuda::QueryAttentionWorkspaceBytes(2, 4, 10),
            sizeof(float) * (2 * 4 * 10 + 2 * 2 * 4));
  EXPECT_EQ(cuda::QueryAttentionWorkspaceBytes(0, 4, 10), 0u);
}

}  // namespace
}  // namespace kvkeep
