// Tests of kernels/slot_copy.h, the CPU twins of the scatter and gather
// kernels: every element lands where the layout formula says, computed here
// element by element, and no other byte of the arena changes. Page sizes 1,
// 3, 7, 16, 17, head dims 64, 80, 128, every dtype, shuffled block tables,
// runs that start mid-page and cross pages, and n = 0.
#include "kernels/slot_copy.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/page_layout.h"

namespace kvkeep {
namespace {

// A layer's pages in an arena with spare pages around them, random bytes.
struct Arena {
  PageLayout layout;
  std::vector<std::byte> bytes;
  std::vector<PageId> table;  // shuffled ids, some pages outside it

  int64_t elem_bytes() const { return DTypeBytes(layout.dtype); }
  // Byte offset of element (head, dim) of slot's key (is_value: value),
  // from the layout comment in page_layout.h:
  //   page: [2 (K, V)][page_tokens][kv_heads][head_dim]
  int64_t ElementOffset(int64_t slot, bool is_value, int32_t head,
                        int32_t dim) const {
    const int64_t p = layout.page_tokens;
    const int64_t per_token = int64_t{layout.kv_heads} * layout.head_dim;
    const int64_t page_elems = 2 * p * per_token;
    const int64_t elem =
        int64_t{table[slot / p]} * page_elems + (is_value ? p * per_token : 0) +
        (slot % p) * per_token + int64_t{head} * layout.head_dim + dim;
    return elem * elem_bytes();
  }
};

Arena MakeArena(const PageLayout& layout, int64_t slots, std::mt19937& rng) {
  Arena a;
  a.layout = layout;
  const int64_t needed = (slots + layout.page_tokens - 1) / layout.page_tokens;
  const int64_t total = needed + 3;
  std::vector<PageId> ids(total);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  a.table.assign(ids.begin(), ids.begin() + needed);
  a.bytes.resize(total * layout.page_bytes());
  for (std::byte& b : a.bytes) b = static_cast<std::byte>(rng() & 0xff);
  return a;
}

std::vector<std::byte> RandomBytes(int64_t n, std::mt19937& rng) {
  std::vector<std::byte> v(n);
  for (std::byte& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

struct Case {
  PageLayout layout;
  int64_t first = 0;
  int64_t n = 0;
};

// Every combination, with runs chosen to start mid-page and cross pages.
std::vector<Case> Cases() {
  std::vector<Case> cases;
  std::mt19937 rng(31);
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        const PageLayout layout{page_tokens, 2, head_dim, dtype};
        cases.push_back({layout, 0, 0});                // n = 0
        cases.push_back({layout, 0, 1});                // one token
        cases.push_back({layout, page_tokens - 1, 2});  // across a boundary
        cases.push_back(
            {layout, static_cast<int64_t>(rng() % 20),
             1 + static_cast<int64_t>(rng() % (3 * page_tokens + 5))});
      }
    }
  }
  return cases;
}

std::string Describe(const Case& c) {
  return ::testing::PrintToString(c.layout.page_tokens) + " tokens/page, " +
         ::testing::PrintToString(c.layout.head_dim) + " dim, " +
         std::string(DTypeName(c.layout.dtype)) + ", first " +
         ::testing::PrintToString(c.first) + ", n " +
         ::testing::PrintToString(c.n);
}

TEST(WriteSlotBytesTest, EveryElementWhereTheLayoutSays) {
  int checked = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(Describe(c));
    std::mt19937 rng(checked + 1);
    Arena a = MakeArena(c.layout, c.first + c.n, rng);
    const std::vector<std::byte> before = a.bytes;
    const int64_t tb = c.layout.token_bytes();
    const std::vector<std::byte> keys = RandomBytes(c.n * tb, rng);
    const std::vector<std::byte> values = RandomBytes(c.n * tb, rng);
    WriteSlotBytes(a.bytes.data(), c.layout, a.table.data(), c.first, c.n,
                   keys.data(), values.data());

    const int64_t eb = a.elem_bytes();
    std::vector<uint8_t> touched(a.bytes.size(), 0);
    for (int64_t t = 0; t < c.n; ++t) {
      for (int32_t h = 0; h < c.layout.kv_heads; ++h) {
        for (int32_t d = 0; d < c.layout.head_dim; ++d) {
          const int64_t dense =
              ((t * c.layout.kv_heads + h) * c.layout.head_dim + d) * eb;
          for (bool is_value : {false, true}) {
            const int64_t at = a.ElementOffset(c.first + t, is_value, h, d);
            const std::vector<std::byte>& src = is_value ? values : keys;
            ASSERT_EQ(0,
                      std::memcmp(a.bytes.data() + at, src.data() + dense, eb))
                << "token " << t << " head " << h << " dim " << d
                << (is_value ? " value" : " key");
            std::fill_n(touched.begin() + at, eb, 1);
          }
        }
      }
    }
    for (size_t i = 0; i < a.bytes.size(); ++i) {
      if (!touched[i]) {
        ASSERT_EQ(a.bytes[i], before[i]) << "byte " << i;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 5 * 3 * 3 * 4);
}

TEST(ReadSlotBytesTest, EveryElementFromWhereTheLayoutSays) {
  int checked = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(Describe(c));
    std::mt19937 rng(1000 + checked);
    const Arena a = MakeArena(c.layout, c.first + c.n, rng);
    const int64_t tb = c.layout.token_bytes();
    // One spare token of garbage after each buffer: it must stay as it was.
    std::vector<std::byte> keys = RandomBytes((c.n + 1) * tb, rng);
    std::vector<std::byte> values = RandomBytes((c.n + 1) * tb, rng);
    const std::vector<std::byte> keys_before = keys, values_before = values;
    ReadSlotBytes(a.bytes.data(), c.layout, a.table.data(), c.first, c.n,
                  keys.data(), values.data());

    const int64_t eb = a.elem_bytes();
    for (int64_t t = 0; t < c.n; ++t) {
      for (int32_t h = 0; h < c.layout.kv_heads; ++h) {
        for (int32_t d = 0; d < c.layout.head_dim; ++d) {
          const int64_t dense =
              ((t * c.layout.kv_heads + h) * c.layout.head_dim + d) * eb;
          ASSERT_EQ(
              0, std::memcmp(
                     keys.data() + dense,
                     a.bytes.data() + a.ElementOffset(c.first + t, false, h, d),
                     eb));
          ASSERT_EQ(0, std::memcmp(values.data() + dense,
                                   a.bytes.data() +
                                       a.ElementOffset(c.first + t, true, h, d),
                                   eb));
        }
      }
    }
    ASSERT_EQ(0, std::memcmp(keys.data() + c.n * tb,
                             keys_before.data() + c.n * tb, tb));
    ASSERT_EQ(0, std::memcmp(values.data() + c.n * tb,
                             values_before.data() + c.n * tb, tb));
    ++checked;
  }
  EXPECT_EQ(checked, 5 * 3 * 3 * 4);
}

// Write then read is the identity, also for bf16 values made from floats.
TEST(SlotBytesTest, WriteThenReadRoundTrips) {
  std::mt19937 rng(9);
  const PageLayout layout{7, 4, 80, DType::kBF16};
  const int64_t first = 5, n = 30;
  Arena a = MakeArena(layout, first + n, rng);
  const int64_t elems = n * layout.kv_heads * layout.head_dim;
  std::vector<std::byte> keys(elems * 2), values(elems * 2);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < elems; ++i) {
    StoreFromFloat(DType::kBF16, keys.data(), i, normal(rng));
    StoreFromFloat(DType::kBF16, values.data(), i, normal(rng));
  }
  WriteSlotBytes(a.bytes.data(), layout, a.table.data(), first, n, keys.data(),
                 values.data());
  std::vector<std::byte> k2(keys.size()), v2(values.size());
  ReadSlotBytes(a.bytes.data(), layout, a.table.data(), first, n, k2.data(),
                v2.data());
  EXPECT_EQ(k2, keys);
  EXPECT_EQ(v2, values);
}

// kivi_int4 (page_layout.h): a page's keys are one block; keys, when asked
// for, move as the whole blocks of the pages a run touches, the values as
// token records, and nothing else in the arena changes.
TEST(SlotBytesTest, KiviKeysMoveAsWholeBlocksOfThePagesTouched) {
  const PageLayout layout{16, 2, 64, DType::kKiviInt4, 32};
  const int64_t block = layout.key_block_bytes();
  const int64_t tb = layout.token_bytes();
  for (const auto& [first, n] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 16}, {5, 30}, {16, 1}}) {
    SCOPED_TRACE(::testing::PrintToString(first) + " + " +
                 ::testing::PrintToString(n));
    std::mt19937 rng(static_cast<uint32_t>(first * 100 + n));
    Arena a = MakeArena(layout, first + n, rng);
    const int64_t touched = layout.key_run_bytes(first, n) / block;
    ASSERT_EQ(touched, (first % 16 + n + 15) / 16);
    const std::vector<std::byte> keys = RandomBytes(touched * block, rng);
    const std::vector<std::byte> values = RandomBytes(n * tb, rng);
    std::vector<std::byte> want = a.bytes;
    for (int64_t b = 0; b < touched; ++b) {
      std::memcpy(want.data() + a.table[first / 16 + b] * layout.page_bytes(),
                  keys.data() + b * block, block);
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = first + t;
      std::memcpy(
          want.data() + layout.value_offset(a.table[slot / 16], slot % 16),
          values.data() + t * tb, tb);
    }
    WriteSlotBytes(a.bytes.data(), layout, a.table.data(), first, n,
                   keys.data(), values.data());
    EXPECT_TRUE(a.bytes == want);

    std::vector<std::byte> keys_back(keys.size()), values_back(values.size());
    ReadSlotBytes(a.bytes.data(), layout, a.table.data(), first, n,
                  keys_back.data(), values_back.data());
    EXPECT_TRUE(keys_back == keys);
    EXPECT_TRUE(values_back == values);

    // Without keys, only the values move.
    const std::vector<std::byte> other = RandomBytes(n * tb, rng);
    WriteSlotBytes(a.bytes.data(), layout, a.table.data(), first, n, nullptr,
                   other.data());
    ReadSlotBytes(a.bytes.data(), layout, a.table.data(), first, n,
                  keys_back.data(), values_back.data());
    EXPECT_TRUE(keys_back == keys);
    EXPECT_TRUE(values_back == other);
  }
}

TEST(SlotBytesTest, KiviKeyBlocksByPageRoundTrip) {
  const PageLayout layout{7, 3, 64, DType::kKiviInt4, 32};
  const int64_t block = layout.key_block_bytes();
  std::mt19937 rng(7);
  Arena a = MakeArena(layout, 5 * 7, rng);
  // Pages in an order of their own, one outside the layer's table.
  PageId outside = 0;
  while (std::find(a.table.begin(), a.table.end(), outside) != a.table.end()) {
    ++outside;
  }
  const std::vector<PageId> pages = {a.table[3], a.table[0], outside,
                                     a.table[4]};
  const std::vector<std::byte> blocks =
      RandomBytes(static_cast<int64_t>(pages.size()) * block, rng);
  std::vector<std::byte> want = a.bytes;
  for (size_t b = 0; b < pages.size(); ++b) {
    std::memcpy(want.data() + pages[b] * layout.page_bytes(),
                blocks.data() + b * block, block);
  }
  WriteKeyBlockBytes(a.bytes.data(), layout, pages.data(),
                     static_cast<int64_t>(pages.size()), blocks.data());
  EXPECT_TRUE(a.bytes == want);
  std::vector<std::byte> back(blocks.size());
  ReadKeyBlockBytes(a.bytes.data(), layout, pages.data(),
                    static_cast<int64_t>(pages.size()), back.data());
  EXPECT_TRUE(back == blocks);
}

}  // namespace
}  // namespace kvkeep
