// Tests of kernels/compaction.h: the plan is the minimal ascending-to-
// ascending fill of the holes, and the byte move is exact (every K and V byte
// of each moved slot, nothing else), over page sizes 1, 3, 7, 16, 17 and
// shuffled block tables.
#include "kernels/compaction.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/page_layout.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<SlotMove> Plan(const std::vector<int32_t>& victims, int64_t n) {
  std::vector<uint8_t> scratch;
  return PlanCompaction(victims, n, scratch);
}

// The model: holes are the victims below the new end, sources the survivors
// at or above it, both ascending, paired in order.
std::vector<SlotMove> ModelPlan(const std::vector<int32_t>& victims,
                                int64_t n) {
  const int64_t new_size = n - static_cast<int64_t>(victims.size());
  const std::set<int32_t> v(victims.begin(), victims.end());
  std::vector<int32_t> holes, sources;
  for (int32_t s = 0; s < n; ++s) {
    if (s < new_size && v.contains(s)) holes.push_back(s);
    if (s >= new_size && !v.contains(s)) sources.push_back(s);
  }
  EXPECT_EQ(holes.size(), sources.size());
  std::vector<SlotMove> moves;
  for (size_t i = 0; i < holes.size(); ++i) {
    moves.push_back({sources[i], holes[i]});
  }
  return moves;
}

TEST(PlanCompactionTest, HandCases) {
  // Nothing evicted.
  EXPECT_THAT(Plan({}, 5), IsEmpty());
  // Victims at the end: nothing to move.
  EXPECT_THAT(Plan({4, 3}, 5), IsEmpty());
  // Everything evicted.
  EXPECT_THAT(Plan({2, 0, 1}, 3), IsEmpty());
  // One hole at the front: the last slot fills it.
  EXPECT_THAT(Plan({0}, 5), ElementsAre(SlotMove{4, 0}));
  // Holes 1 and 3 of 8, new size 6: survivors 6, 7 fill 1, 3.
  EXPECT_THAT(Plan({3, 1}, 8), ElementsAre(SlotMove{6, 1}, SlotMove{7, 3}));
  // Mixed: victims {0, 2, 6} of 8, new size 5: sources 5, 7 into holes 0, 2.
  EXPECT_THAT(Plan({6, 0, 2}, 8), ElementsAre(SlotMove{5, 0}, SlotMove{7, 2}));
  // A run of survivors moves as a run: victims {1, 2, 3} of 9, new size 6;
  // 6, 7, 8 go to 1, 2, 3.
  EXPECT_THAT(Plan({2, 3, 1}, 9),
              ElementsAre(SlotMove{6, 1}, SlotMove{7, 2}, SlotMove{8, 3}));
  // One slot, evicted.
  EXPECT_THAT(Plan({0}, 1), IsEmpty());
}

// Random victim sets against the model, with the scratch reused dirty.
TEST(PlanCompactionTest, RandomVictimsMatchModel) {
  std::mt19937 rng(17);
  std::vector<uint8_t> scratch(500, 1);  // dirty and too big on purpose
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t n = 1 + rng() % 80;
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const int64_t k = rng() % (n + 1);
    const std::vector<int32_t> victims(all.begin(), all.begin() + k);
    const std::vector<SlotMove> moves = PlanCompaction(victims, n, scratch);
    ASSERT_EQ(moves, ModelPlan(victims, n)) << "trial " << trial;

    // Properties, stated independently of the model.
    const int64_t new_size = n - k;
    const std::set<int32_t> v(victims.begin(), victims.end());
    int64_t survivors_above = 0;
    for (int32_t s = new_size; s < n; ++s) survivors_above += !v.contains(s);
    ASSERT_EQ(static_cast<int64_t>(moves.size()), survivors_above);
    for (size_t i = 0; i < moves.size(); ++i) {
      ASSERT_GE(moves[i].from_slot, new_size);
      ASSERT_LT(moves[i].from_slot, n);
      ASSERT_FALSE(v.contains(moves[i].from_slot));
      ASSERT_LT(moves[i].to_slot, new_size);
      ASSERT_TRUE(v.contains(moves[i].to_slot));
      if (i > 0) {
        ASSERT_LT(moves[i - 1].from_slot, moves[i].from_slot);
        ASSERT_LT(moves[i - 1].to_slot, moves[i].to_slot);
      }
    }
    // Applied to slot ids, the survivors end up dense in [0, new_size).
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    MoveSlotValues(ids, moves, new_size);
    ASSERT_EQ(static_cast<int64_t>(ids.size()), new_size);
    std::vector<int32_t> kept = ids, want;
    std::sort(kept.begin(), kept.end());
    for (int32_t s = 0; s < n; ++s) {
      if (!v.contains(s)) want.push_back(s);
    }
    ASSERT_EQ(kept, want) << "trial " << trial;
  }
}

TEST(MoveSlotValuesTest, MovesThenTruncates) {
  std::vector<std::string> v = {"a", "b", "c", "d", "e", "f"};
  const std::vector<SlotMove> moves = {{4, 0}, {5, 2}};
  MoveSlotValues(v, moves, 4);
  EXPECT_EQ(v, (std::vector<std::string>{"e", "b", "f", "d"}));

  // Moves apply in order: a chain copies what was already moved.
  std::vector<int> w = {0, 1, 2, 3, 4, 5};
  MoveSlotValues(w, std::vector<SlotMove>{{5, 2}, {2, 0}}, 6);
  EXPECT_EQ(w, (std::vector<int>{5, 1, 5, 3, 4, 5}));

  std::vector<int> x = {7, 8, 9};
  MoveSlotValues(x, std::vector<SlotMove>{}, 1);
  EXPECT_EQ(x, std::vector<int>{7});
}

// A paged arena whose every byte is distinct-ish, for byte-exact checks.
struct Arena {
  PageLayout layout;
  std::vector<std::byte> bytes;
  std::vector<PageId> table;  // the layer's block table, shuffled ids

  int64_t token_bytes() const {
    return int64_t{layout.kv_heads} * layout.head_dim *
           DTypeBytes(layout.dtype);
  }
  int64_t page_bytes() const {
    return 2 * int64_t{layout.page_tokens} * token_bytes();
  }
  // Offsets from the layout formula in page_layout.h, computed here.
  int64_t KeyOffset(int64_t slot) const {
    return int64_t{table[slot / layout.page_tokens]} * page_bytes() +
           (slot % layout.page_tokens) * token_bytes();
  }
  int64_t ValueOffset(int64_t slot) const {
    return KeyOffset(slot) + int64_t{layout.page_tokens} * token_bytes();
  }
};

Arena MakeArena(const PageLayout& layout, int64_t slots, std::mt19937& rng) {
  Arena a;
  a.layout = layout;
  const int64_t needed = (slots + layout.page_tokens - 1) / layout.page_tokens;
  const int64_t total = needed + 4;  // pages outside the table too
  std::vector<PageId> ids(total);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  a.table.assign(ids.begin(), ids.begin() + needed);
  a.bytes.resize(total * a.page_bytes());
  for (std::byte& b : a.bytes) b = static_cast<std::byte>(rng() & 0xff);
  return a;
}

// Applies moves the slow way, in order: memmove of the K and V bytes.
void ModelMove(Arena& a, const std::vector<SlotMove>& moves) {
  const int64_t tb = a.token_bytes();
  for (const SlotMove& m : moves) {
    std::memmove(a.bytes.data() + a.KeyOffset(m.to_slot),
                 a.bytes.data() + a.KeyOffset(m.from_slot), tb);
    std::memmove(a.bytes.data() + a.ValueOffset(m.to_slot),
                 a.bytes.data() + a.ValueOffset(m.from_slot), tb);
  }
}

TEST(MoveSlotBytesTest, LayoutOffsetsMatchTheFormula) {
  const PageLayout layout{7, 3, 80, DType::kBF16};
  EXPECT_EQ(layout.token_bytes(), 3 * 80 * 2);
  EXPECT_EQ(layout.page_bytes(), 2 * 7 * 3 * 80 * 2);
  EXPECT_EQ(layout.key_offset(5, 6), 5 * layout.page_bytes() + 6 * 480);
  EXPECT_EQ(layout.value_offset(5, 6),
            5 * layout.page_bytes() + 7 * 480 + 6 * 480);
  // 64-bit offsets: page id x page bytes beyond int32.
  const PageLayout big{16, 8, 128, DType::kF32};
  EXPECT_EQ(big.key_offset(1 << 20, 0), int64_t{1 << 20} * 131072);
}

TEST(MoveSlotBytesTest, ByteExactOverPageSizes) {
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (int trial = 0; trial < 6; ++trial) {
        SCOPED_TRACE(::testing::Message()
                     << "page_tokens " << page_tokens << " " << DTypeName(dtype)
                     << " trial " << trial);
        std::mt19937 rng(page_tokens * 100 + static_cast<int>(dtype) * 10 +
                         trial);
        const PageLayout layout{page_tokens, 2, 3 + trial % 2, dtype};
        const int64_t n = 1 + rng() % (4 * page_tokens + 20);
        Arena a = MakeArena(layout, n, rng);
        std::vector<int32_t> all(n);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        const int64_t k = trial == 0 ? n / 2 : rng() % (n + 1);
        const std::vector<int32_t> victims(all.begin(), all.begin() + k);
        const std::vector<SlotMove> moves = Plan(victims, n);

        Arena want = a;
        ModelMove(want, moves);
        std::vector<std::byte> before = a.bytes;
        MoveSlotBytes(a.bytes.data(), layout, a.table, moves);
        ASSERT_EQ(a.bytes, want.bytes);

        // And directly: each hole now holds its source's original K and V,
        // and no byte outside the holes' K/V ranges changed.
        std::vector<uint8_t> touched(a.bytes.size(), 0);
        const int64_t tb = a.token_bytes();
        for (const SlotMove& m : moves) {
          ASSERT_EQ(0,
                    std::memcmp(a.bytes.data() + a.KeyOffset(m.to_slot),
                                before.data() + a.KeyOffset(m.from_slot), tb));
          ASSERT_EQ(
              0, std::memcmp(a.bytes.data() + a.ValueOffset(m.to_slot),
                             before.data() + a.ValueOffset(m.from_slot), tb));
          std::fill_n(touched.begin() + a.KeyOffset(m.to_slot), tb, 1);
          std::fill_n(touched.begin() + a.ValueOffset(m.to_slot), tb, 1);
        }
        for (size_t i = 0; i < a.bytes.size(); ++i) {
          if (!touched[i]) {
            ASSERT_EQ(a.bytes[i], before[i]) << "byte " << i;
          }
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 3 * 6);
}

// Moves are applied in order, as the contract says (a chain sees the bytes
// an earlier move wrote), and across pages of a shuffled table.
TEST(MoveSlotBytesTest, AppliesMovesInOrder) {
  std::mt19937 rng(5);
  const PageLayout layout{3, 1, 4, DType::kF32};
  Arena a = MakeArena(layout, 9, rng);
  const std::vector<SlotMove> moves = {{8, 4}, {4, 0}, {1, 7}};
  const Arena before = a;
  Arena want = a;
  ModelMove(want, moves);
  MoveSlotBytes(a.bytes.data(), layout, a.table, moves);
  EXPECT_EQ(a.bytes, want.bytes);
  // Slot 0 now holds what slot 8 held, by way of slot 4.
  const int64_t tb = a.token_bytes();
  EXPECT_EQ(0, std::memcmp(a.bytes.data() + a.KeyOffset(0),
                           before.bytes.data() + before.KeyOffset(8), tb));
  EXPECT_EQ(0, std::memcmp(a.bytes.data() + a.ValueOffset(0),
                           before.bytes.data() + before.ValueOffset(8), tb));
}

}  // namespace
}  // namespace kvkeep
