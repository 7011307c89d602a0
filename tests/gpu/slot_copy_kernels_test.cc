// The GPU scatter and gather kernels (kernels/cuda/slot_copy.h) against their
// CPU twins WriteSlotBytes / ReadSlotBytes (kernels/slot_copy.h), exactly:
// page sizes 1, 3, 7, 16, 17, head dims 64, 80, 128, every float dtype and
// kivi_int4 (keys as whole key blocks, and values only), shuffled block
// tables, runs starting mid-page and crossing pages, n = 0, and buffers off
// 16-byte alignment (every copy width); and kivi_int4's key blocks by page.
// Skipped without a CUDA device, except the argument checks.
// cudaMalloc<T>, which DeviceArray<T> calls, is declared here.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/slot_copy.h"
#include "kernels/slot_copy.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::DeviceArray;

struct Case {
  PageLayout layout;
  int64_t first = 0;
  int64_t n = 0;
  size_t offset = 0;  // bytes the device buffers sit past an aligned start
  bool keys = true;   // kivi_int4: false copies values only (null keys)
};

// Bytes of a case's dense keys (kivi_int4: whole key blocks, or none).
int64_t KeyBytes(const Case& c) {
  return c.keys ? c.layout.key_run_bytes(c.first, c.n) : 0;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  std::mt19937 rng(41);
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (DType dtype :
           {DType::kF32, DType::kF16, DType::kBF16, DType::kKiviInt4}) {
        const PageLayout layout{page_tokens, 2, head_dim, dtype,
                                IsKivi(dtype) ? 16 : 0};
        cases.push_back({layout, 0, 0});
        cases.push_back({layout, 0, 1});
        cases.push_back({layout, page_tokens - 1, 2});
        cases.push_back(
            {layout, static_cast<int64_t>(rng() % 40),
             1 + static_cast<int64_t>(rng() % (5 * page_tokens + 60))});
      }
    }
  }
  // Every copy width: rows of 12, 6 and 2 bytes, and misaligned buffers.
  for (size_t offset : {1, 2, 4, 8}) {
    cases.push_back({PageLayout{7, 8, 128, DType::kBF16}, 3, 40, offset});
  }
  cases.push_back({PageLayout{3, 1, 3, DType::kF32}, 2, 20});
  cases.push_back({PageLayout{3, 1, 3, DType::kF16}, 2, 20});
  cases.push_back({PageLayout{2, 1, 1, DType::kBF16}, 1, 20});
  for (size_t offset : {0, 1, 2}) {
    for (bool keys : {true, false}) {
      cases.push_back(
          {PageLayout{16, 3, 64, DType::kKiviInt4, 32}, 5, 40, offset, keys});
    }
  }
  return cases;
}

std::vector<std::byte> RandomBytes(int64_t n, std::mt19937& rng) {
  std::vector<std::byte> v(n);
  for (std::byte& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

// A shuffled block table covering `slots`, over a pool with spare pages.
struct Pool {
  std::vector<PageId> table;
  std::vector<std::byte> arena;
};

Pool MakePool(const PageLayout& layout, int64_t slots, std::mt19937& rng) {
  Pool p;
  const int64_t needed = (slots + layout.page_tokens - 1) / layout.page_tokens;
  std::vector<PageId> ids(needed + 3);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.table.assign(ids.begin(), ids.begin() + needed);
  p.arena = RandomBytes((needed + 3) * layout.page_bytes(), rng);
  return p;
}

// Host bytes on the device, `offset` bytes into the allocation.
struct OffsetBuffer {
  OffsetBuffer(const std::vector<std::byte>& host, size_t offset)
      : offset(offset), device(Padded(host, offset)) {}
  static std::vector<std::byte> Padded(const std::vector<std::byte>& host,
                                       size_t offset) {
    std::vector<std::byte> v(offset, std::byte{0});
    v.insert(v.end(), host.begin(), host.end());
    return v;
  }
  std::byte* get() const { return device.get() + offset; }
  std::vector<std::byte> ToHost() const {
    const std::vector<std::byte> all = device.ToHost();
    return {all.begin() + offset, all.end()};
  }
  size_t offset;
  DeviceArray<std::byte> device;
};

TEST(SlotCopyKernelTest, WriteSlotsMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  int i = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(::testing::Message()
                 << "page_tokens " << c.layout.page_tokens << " head_dim "
                 << c.layout.head_dim << " " << DTypeName(c.layout.dtype)
                 << " first " << c.first << " n " << c.n << " offset "
                 << c.offset);
    std::mt19937 rng(++i);
    Pool pool = MakePool(c.layout, c.first + c.n, rng);
    const int64_t tb = c.layout.token_bytes();
    const std::vector<std::byte> keys = RandomBytes(KeyBytes(c), rng);
    const std::vector<std::byte> values = RandomBytes(c.n * tb, rng);

    OffsetBuffer arena(pool.arena, c.offset);
    OffsetBuffer dk(keys, c.offset), dv(values, c.offset);
    DeviceArray<PageId> pages(pool.table);
    ASSERT_EQ(
        cuda::LaunchWriteSlots(arena.get(), c.layout, pages.get(), c.first, c.n,
                               c.keys ? dk.get() : nullptr, dv.get(), nullptr),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    WriteSlotBytes(pool.arena.data(), c.layout, pool.table.data(), c.first, c.n,
                   c.keys ? keys.data() : nullptr, values.data());
    ASSERT_EQ(arena.ToHost(), pool.arena);
  }
}

TEST(SlotCopyKernelTest, ReadSlotsMatchesTwin) {
  KVKEEP_REQUIRE_GPU();
  int i = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(::testing::Message()
                 << "page_tokens " << c.layout.page_tokens << " head_dim "
                 << c.layout.head_dim << " " << DTypeName(c.layout.dtype)
                 << " first " << c.first << " n " << c.n << " offset "
                 << c.offset);
    std::mt19937 rng(1000 + ++i);
    const Pool pool = MakePool(c.layout, c.first + c.n, rng);
    const int64_t tb = c.layout.token_bytes();
    // A spare token of garbage after each buffer must survive.
    std::vector<std::byte> keys = RandomBytes(KeyBytes(c) + tb, rng);
    std::vector<std::byte> values = RandomBytes((c.n + 1) * tb, rng);

    OffsetBuffer arena(pool.arena, c.offset);
    OffsetBuffer dk(keys, c.offset), dv(values, c.offset);
    DeviceArray<PageId> pages(pool.table);
    ASSERT_EQ(
        cuda::LaunchReadSlots(arena.get(), c.layout, pages.get(), c.first, c.n,
                              c.keys ? dk.get() : nullptr, dv.get(), nullptr),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    ReadSlotBytes(pool.arena.data(), c.layout, pool.table.data(), c.first, c.n,
                  c.keys ? keys.data() : nullptr, values.data());
    ASSERT_EQ(dk.ToHost(), keys);
    ASSERT_EQ(dv.ToHost(), values);
    ASSERT_EQ(arena.ToHost(), pool.arena);  // reading leaves the pool alone
  }
}

// A whole 32k-token layer out and back: more tokens than one wave of blocks.
TEST(SlotCopyKernelTest, WholeLayerRoundTrip) {
  KVKEEP_REQUIRE_GPU();
  std::mt19937 rng(5);
  const PageLayout layout{16, 8, 128, DType::kBF16};
  const int64_t n = 32768;
  const Pool pool = MakePool(layout, n, rng);
  const std::vector<std::byte> keys =
      RandomBytes(n * layout.token_bytes(), rng);
  const std::vector<std::byte> values =
      RandomBytes(n * layout.token_bytes(), rng);
  DeviceArray<std::byte> arena(pool.arena);
  DeviceArray<PageId> pages(pool.table);
  DeviceArray<std::byte> dk(keys), dv(values);
  DeviceArray<std::byte> rk(keys.size()), rv(values.size());
  ASSERT_EQ(cuda::LaunchWriteSlots(arena.get(), layout, pages.get(), 0, n,
                                   dk.get(), dv.get(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cuda::LaunchReadSlots(arena.get(), layout, pages.get(), 0, n,
                                  rk.get(), rv.get(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(rk.ToHost(), keys);
  EXPECT_EQ(rv.ToHost(), values);
}

TEST(SlotCopyKernelTest, KiviKeyBlocksMatchTwins) {
  KVKEEP_REQUIRE_GPU();
  for (size_t offset : {0, 1, 2, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << "offset " << offset);
    std::mt19937 rng(static_cast<uint32_t>(77 + offset));
    const PageLayout layout{16, 3, 64, DType::kKiviInt4, 32};
    Pool pool = MakePool(layout, 16 * 9, rng);
    // Six of the layer's pages, in an order of their own.
    std::vector<PageId> order = pool.table;
    std::shuffle(order.begin(), order.end(), rng);
    order.resize(6);
    const int64_t count = static_cast<int64_t>(order.size());
    const std::vector<std::byte> blocks =
        RandomBytes(count * layout.key_block_bytes(), rng);
    OffsetBuffer arena(pool.arena, offset);
    OffsetBuffer dense(blocks, offset);
    DeviceArray<PageId> pages(order);
    KVKEEP_ASSERT_CUDA(cuda::LaunchWriteKeyBlocks(
        arena.get(), layout, pages.get(), count, dense.get(), nullptr));
    KVKEEP_ASSERT_CUDA(cudaDeviceSynchronize());
    WriteKeyBlockBytes(pool.arena.data(), layout, order.data(), count,
                       blocks.data());
    ASSERT_EQ(arena.ToHost(), pool.arena);

    OffsetBuffer back(RandomBytes(count * layout.key_block_bytes(), rng),
                      offset);
    KVKEEP_ASSERT_CUDA(cuda::LaunchReadKeyBlocks(
        arena.get(), layout, pages.get(), count, back.get(), nullptr));
    KVKEEP_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(back.ToHost(), blocks);
  }
}

TEST(SlotCopyKernelTest, RejectsBadArguments) {
  const PageLayout layout{16, 8, 128, DType::kBF16};
  std::byte fake[16] = {};
  const auto* pages = reinterpret_cast<const PageId*>(fake);
  // n == 0: success, nothing enqueued (no CUDA call at all).
  EXPECT_EQ(
      cuda::LaunchWriteSlots(fake, layout, pages, 5, 0, fake, fake, nullptr),
      cudaSuccess);
  EXPECT_EQ(
      cuda::LaunchReadSlots(fake, layout, pages, 5, 0, fake, fake, nullptr),
      cudaSuccess);
  EXPECT_EQ(
      cuda::LaunchWriteSlots(fake, layout, pages, -1, 3, fake, fake, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchReadSlots(fake, layout, pages, 0, -3, fake, fake, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchWriteSlots(fake, PageLayout{16, 0, 128}, pages, 0, 3,
                                   fake, fake, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchReadSlots(fake, layout, nullptr, 0, 3, fake, fake, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchWriteSlots(fake, layout, pages, 0, 3, nullptr, fake, nullptr),
      cudaErrorInvalidValue);
  // Key blocks: kivi_int4 only, a count that is not negative, no nulls.
  const PageLayout kivi{16, 2, 64, DType::kKiviInt4, 32};
  EXPECT_EQ(cuda::LaunchReadKeyBlocks(fake, kivi, pages, 0, fake, nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::LaunchReadKeyBlocks(fake, layout, pages, 1, fake, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchWriteKeyBlocks(fake, kivi, pages, -1, fake, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchWriteKeyBlocks(fake, kivi, nullptr, 1, fake, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvkeep
