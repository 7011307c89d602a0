// Tests of cache_store/page_pool.h: capacity, all-or-nothing allocation,
// per-owner accounting, page bytes, and exact accounting under concurrent use.
#include "cache_store/page_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

// 2 * 3 tokens * 2 heads * 5 dims * 2 bytes = 120 bytes: odd sizes on purpose.
PageLayout SmallLayout() { return PageLayout{3, 2, 5, DType::kF16}; }

std::unique_ptr<PagePool> MakePool(int64_t capacity,
                                   PageLayout layout = SmallLayout()) {
  absl::StatusOr<std::unique_ptr<PagePool>> pool =
      PagePool::Create(layout, capacity);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

TEST(PagePoolTest, InvalidCapacityIsInvalidArgument) {
  for (int64_t capacity :
       {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min(),
        int64_t{1} << 31, std::numeric_limits<int64_t>::max()}) {
    absl::StatusOr<std::unique_ptr<PagePool>> pool =
        PagePool::Create(SmallLayout(), capacity);
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument)
        << "capacity " << capacity;
  }
}

TEST(PagePoolTest, EmptyLayoutIsInvalidArgument) {
  for (const PageLayout& layout :
       {PageLayout{0, 2, 5, DType::kF16}, PageLayout{3, 0, 5, DType::kF16},
        PageLayout{3, 2, 0, DType::kF16}}) {
    EXPECT_EQ(PagePool::Create(layout, 4).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(PagePoolTest, FreshPoolStats) {
  std::unique_ptr<PagePool> pool = MakePool(7);
  ASSERT_NE(pool, nullptr);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.capacity_pages, 7);
  EXPECT_EQ(s.used_pages, 0);
  EXPECT_EQ(s.page_bytes, 120);
  EXPECT_EQ(s.owners, 0);
  EXPECT_EQ(s.allocation_failures, 0);
  EXPECT_EQ(pool->layout().page_bytes(), 120);
  EXPECT_EQ(pool->PagesHeldBy(1), 0);
}

TEST(PagePoolTest, AllocateAppendsDistinctPagesAndCharges) {
  std::unique_ptr<PagePool> pool = MakePool(5);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages = {-7};  // existing entries are kept
  ASSERT_TRUE(pool->Allocate(1, 3, &pages).ok());
  ASSERT_EQ(pages.size(), 4u);
  EXPECT_EQ(pages[0], -7);
  std::set<PageId> distinct(pages.begin() + 1, pages.end());
  EXPECT_EQ(distinct.size(), 3u);
  for (PageId p : distinct) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, 5);
  }
  EXPECT_EQ(pool->PagesHeldBy(1), 3);
  EXPECT_EQ(pool->PagesHeldBy(2), 0);
  EXPECT_EQ(pool->stats().used_pages, 3);
  EXPECT_EQ(pool->stats().owners, 1);

  std::vector<PageId> more;
  ASSERT_TRUE(pool->Allocate(2, 2, &more).ok());
  ASSERT_EQ(more.size(), 2u);
  for (PageId p : more) EXPECT_FALSE(distinct.contains(p));
  EXPECT_EQ(pool->PagesHeldBy(2), 2);
  EXPECT_EQ(pool->stats().used_pages, 5);
  EXPECT_EQ(pool->stats().owners, 2);
}

TEST(PagePoolTest, AllocateZeroChangesNothing) {
  std::unique_ptr<PagePool> pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(1, 0, &pages).ok());
  EXPECT_TRUE(pages.empty());
  EXPECT_EQ(pool->stats().used_pages, 0);
  EXPECT_EQ(pool->stats().owners, 0);
  EXPECT_EQ(pool->PagesHeldBy(1), 0);
}

TEST(PagePoolTest, ExhaustionIsAllOrNothing) {
  std::unique_ptr<PagePool> pool = MakePool(5);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> held;
  ASSERT_TRUE(pool->Allocate(1, 3, &held).ok());

  std::vector<PageId> pages = {42};
  const absl::Status s = pool->Allocate(2, 3, &pages);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  // The message names what was asked for and what was there.
  EXPECT_THAT(s.message(), HasSubstr("need 3"));
  EXPECT_THAT(s.message(), HasSubstr("2 of 5 free"));
  EXPECT_EQ(pages, std::vector<PageId>{42});
  EXPECT_EQ(pool->PagesHeldBy(2), 0);
  PoolStats stats = pool->stats();
  EXPECT_EQ(stats.used_pages, 3);
  EXPECT_EQ(stats.owners, 1);
  EXPECT_EQ(stats.allocation_failures, 1);

  // Exactly what is left succeeds; then even one page fails.
  ASSERT_TRUE(pool->Allocate(2, 2, &pages).ok());
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_EQ(pool->Allocate(1, 1, &held).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(held.size(), 3u);
  stats = pool->stats();
  EXPECT_EQ(stats.used_pages, 5);
  EXPECT_EQ(stats.allocation_failures, 2);
  EXPECT_EQ(pool->PagesHeldBy(1), 3);
  EXPECT_EQ(pool->PagesHeldBy(2), 2);
}

TEST(PagePoolTest, RequestLargerThanCapacityFails) {
  std::unique_ptr<PagePool> pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  const absl::Status s = pool->Allocate(9, 5, &pages);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("need 5"));
  EXPECT_THAT(s.message(), HasSubstr("4 of 4 free"));
  EXPECT_TRUE(pages.empty());
  EXPECT_EQ(pool->stats().used_pages, 0);
  EXPECT_EQ(pool->stats().owners, 0);
  EXPECT_EQ(pool->stats().allocation_failures, 1);
}

TEST(PagePoolTest, FreeReturnsPagesAndDropsEmptyOwners) {
  std::unique_ptr<PagePool> pool = MakePool(6);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> a, b;
  ASSERT_TRUE(pool->Allocate(10, 4, &a).ok());
  ASSERT_TRUE(pool->Allocate(20, 2, &b).ok());
  EXPECT_EQ(pool->stats().used_pages, 6);

  pool->Free(10, std::span<const PageId>(a).first(1));
  EXPECT_EQ(pool->PagesHeldBy(10), 3);
  EXPECT_EQ(pool->stats().used_pages, 5);
  EXPECT_EQ(pool->stats().owners, 2);

  // The freed page is the only free one, so it comes back.
  std::vector<PageId> c;
  ASSERT_TRUE(pool->Allocate(30, 1, &c).ok());
  EXPECT_EQ(c, std::vector<PageId>{a[0]});
  EXPECT_EQ(pool->stats().owners, 3);

  pool->Free(10, std::span<const PageId>(a).subspan(1));
  EXPECT_EQ(pool->PagesHeldBy(10), 0);
  EXPECT_EQ(pool->stats().owners, 2);
  pool->Free(20, b);
  pool->Free(30, c);
  pool->Free(30, {});  // nothing to free: no change
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.used_pages, 0);
  EXPECT_EQ(s.owners, 0);

  // All six are free again and distinct.
  std::vector<PageId> all;
  ASSERT_TRUE(pool->Allocate(40, 6, &all).ok());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<PageId>{0, 1, 2, 3, 4, 5}));
}

TEST(PagePoolTest, EveryPageIsHandedOutOnceAndCoversTheArena) {
  constexpr int64_t kCapacity = 37;
  std::unique_ptr<PagePool> pool = MakePool(kCapacity);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  for (OwnerId owner = 0; owner < kCapacity; ++owner) {
    ASSERT_TRUE(pool->Allocate(owner % 5, 1, &pages).ok());
  }
  std::vector<PageId> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < kCapacity; ++i) EXPECT_EQ(sorted[i], i);
  int64_t total = 0;
  for (OwnerId owner = 0; owner < 5; ++owner) {
    total += pool->PagesHeldBy(owner);
  }
  EXPECT_EQ(total, kCapacity);

  // Write a distinct pattern over every byte of every page (through the
  // arena formula of the header), then read all of it back: pages do not
  // overlap and the arena holds capacity * page_bytes bytes.
  const int64_t page_bytes = pool->layout().page_bytes();
  auto pattern = [](int64_t page, int64_t i) {
    return static_cast<std::byte>((page * 131 + i * 7 + (i >> 8)) & 0xff);
  };
  for (PageId p : pages) {
    std::byte* base = pool->data() + int64_t{p} * page_bytes;
    for (int64_t i = 0; i < page_bytes; ++i) base[i] = pattern(p, i);
  }
  const PagePool& const_pool = *pool;
  for (PageId p : pages) {
    const std::byte* base = const_pool.data() + int64_t{p} * page_bytes;
    for (int64_t i = 0; i < page_bytes; ++i) {
      ASSERT_EQ(base[i], pattern(p, i)) << "page " << p << " byte " << i;
    }
  }
}

// Several threads allocate, write, check and free pages of one pool. Each
// page has a claim word: a page handed out twice would find it taken. Each
// thread owns one owner id, so PagesHeldBy(owner) must always equal what the
// thread knows it holds, whatever the other threads do.
TEST(PagePoolTest, ConcurrentAllocateFreeKeepsAccountingExact) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 1500;
  constexpr int64_t kCapacity = 24;
  std::unique_ptr<PagePool> pool = MakePool(kCapacity);
  ASSERT_NE(pool, nullptr);
  const int64_t page_bytes = pool->layout().page_bytes();

  std::vector<std::atomic<int>> claim(kCapacity);
  for (auto& c : claim) c.store(-1);
  std::atomic<int64_t> exhausted{0};
  std::atomic<int64_t> double_handouts{0};
  std::atomic<int64_t> accounting_errors{0};
  std::atomic<int64_t> corrupted{0};

  auto worker = [&](int t) {
    std::mt19937 rng(1000 + t);
    const OwnerId owner = 100 + t;
    std::vector<PageId> held;
    for (int it = 0; it < kIterations; ++it) {
      const bool allocate = held.size() < 2 || (rng() % 3 != 0);
      if (allocate) {
        const int64_t n = 1 + rng() % 4;
        const size_t before = held.size();
        const absl::Status s = pool->Allocate(owner, n, &held);
        if (!s.ok()) {
          if (s.code() != absl::StatusCode::kResourceExhausted ||
              held.size() != before) {
            ++accounting_errors;
          }
          ++exhausted;
        } else {
          for (size_t i = before; i < held.size(); ++i) {
            const PageId p = held[i];
            int expected = -1;
            if (p < 0 || p >= kCapacity ||
                !claim[p].compare_exchange_strong(expected, t)) {
              ++double_handouts;
              continue;
            }
            std::memset(pool->data() + int64_t{p} * page_bytes, t, page_bytes);
          }
        }
      } else {
        // Free one to three random pages, after checking their bytes. The
        // pool fills up over time, so exhaustion is exercised.
        std::shuffle(held.begin(), held.end(), rng);
        const size_t k = 1 + rng() % std::min<size_t>(held.size(), 3);
        std::vector<PageId> to_free(held.end() - k, held.end());
        held.resize(held.size() - k);
        for (PageId p : to_free) {
          const std::byte* base = pool->data() + int64_t{p} * page_bytes;
          for (int64_t i = 0; i < page_bytes; ++i) {
            if (base[i] != static_cast<std::byte>(t)) {
              ++corrupted;
              break;
            }
          }
          claim[p].store(-1);
        }
        pool->Free(owner, to_free);
      }
      if (pool->PagesHeldBy(owner) != static_cast<int64_t>(held.size())) {
        ++accounting_errors;
      }
    }
    for (PageId p : held) claim[p].store(-1);
    pool->Free(owner, held);
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();

  EXPECT_EQ(double_handouts.load(), 0);
  EXPECT_EQ(accounting_errors.load(), 0);
  EXPECT_EQ(corrupted.load(), 0);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.used_pages, 0);
  EXPECT_EQ(s.owners, 0);
  EXPECT_EQ(s.allocation_failures, exhausted.load());
  EXPECT_GT(exhausted.load(), 0) << "the test should exercise exhaustion";
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(pool->PagesHeldBy(100 + t), 0);

  // Afterwards every page is free exactly once.
  std::vector<PageId> all;
  ASSERT_TRUE(pool->Allocate(1, kCapacity, &all).ok());
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < kCapacity; ++i) EXPECT_EQ(all[i], i);
}

TEST(PagePoolTest, FreeOfPagesNotHeldIsRejectedAndCounted) {
  std::unique_ptr<PagePool> pool = MakePool(4);
  std::vector<PageId> a, b;
  ASSERT_TRUE(pool->Allocate(1, 2, &a).ok());
  ASSERT_TRUE(pool->Allocate(2, 1, &b).ok());
  pool->Free(1, a);
  pool->Free(1, a);                           // double free
  pool->Free(1, b);                           // another owner's page
  pool->Free(1, std::vector<PageId>{-1, 4});  // not pages of this pool
  const PoolStats stats = pool->stats();
  EXPECT_EQ(stats.rejected_frees, 5);
  EXPECT_EQ(stats.used_pages, 1);
  EXPECT_EQ(pool->PagesHeldBy(2), 1);
  // The double free did not put a page on the free list twice: exactly
  // three distinct pages can be taken now.
  std::vector<PageId> c;
  ASSERT_TRUE(pool->Allocate(3, 3, &c).ok());
  EXPECT_EQ(std::set<PageId>(c.begin(), c.end()).size(), 3u);
  EXPECT_EQ(pool->Allocate(3, 1, &c).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(PagePoolTest, NegativeCountIsInvalidArgument) {
  std::unique_ptr<PagePool> pool = MakePool(4);
  std::vector<PageId> pages;
  EXPECT_EQ(pool->Allocate(1, -1, &pages).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pages.empty());
}

// Forks share pages: each page counts its holders, comes back to the free
// list with its last one, and is counted once in used_pages.
TEST(PagePoolTest, SharedPagesReturnWithTheirLastHolder) {
  std::unique_ptr<PagePool> pool = MakePool(8);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> a;
  ASSERT_TRUE(pool->Allocate(1, 3, &a).ok());
  ASSERT_TRUE(pool->Share(1, 2, a).ok());
  PoolStats s = pool->stats();
  EXPECT_EQ(s.used_pages, 3);
  EXPECT_EQ(s.page_references, 6);
  EXPECT_EQ(s.shared_pages, 3);
  EXPECT_EQ(s.owners, 2);
  EXPECT_EQ(pool->Holders(a[0]), 2);
  EXPECT_EQ(pool->CountShared(a), 3);
  EXPECT_EQ(pool->PagesHeldBy(2), 3);

  // Refused, all or nothing: itself, already held, not held, named twice.
  EXPECT_EQ(pool->Share(1, 1, a).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Share(1, 2, a).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Share(3, 4, a).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Share(1, 3, std::vector<PageId>{a[1], a[0], a[1]}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Share(1, 3, std::vector<PageId>{a[0], 99}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->stats().page_references, 6);
  EXPECT_EQ(pool->PagesHeldBy(3), 0);

  // The first holder lets go: nothing comes back yet.
  EXPECT_EQ(pool->Free(1, a), 0);
  s = pool->stats();
  EXPECT_EQ(s.used_pages, 3);
  EXPECT_EQ(s.page_references, 3);
  EXPECT_EQ(s.shared_pages, 0);
  EXPECT_EQ(pool->Holders(a[2]), 1);
  EXPECT_EQ(pool->Free(1, a), 0);  // no longer its: refused
  EXPECT_EQ(pool->stats().rejected_frees, 3);
  EXPECT_EQ(pool->Free(2, a), 3);
  s = pool->stats();
  EXPECT_EQ(s.used_pages, 0);
  EXPECT_EQ(s.page_references, 0);
  EXPECT_EQ(s.owners, 0);
  EXPECT_EQ(pool->Holders(a[0]), 0);
}

}  // namespace
}  // namespace kvkeep
