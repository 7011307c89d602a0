// SlotCache: the worker's mirror of a session's cache follows appends and
// LayerChanges exactly as the documented order says, and refuses a change
// that does not fit without touching anything.
#include "services/lm/kv_caches.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvkeep::lm {
namespace {

constexpr int64_t kTokenBytes = 8;

// n tokens' bytes where every byte of token i is `tag + i`.
std::string TokenBytesOf(int64_t n, int tag) {
  std::string s;
  for (int64_t i = 0; i < n; ++i) s.append(kTokenBytes, char(tag + i));
  return s;
}

// Each slot's first key byte, and (value byte - 100).
std::vector<int> Keys(const SlotCache& c, int32_t layer) {
  std::vector<int> out;
  for (int64_t s = 0; s < c.resident(layer); ++s) {
    out.push_back(static_cast<int>(*c.key(layer, s)));
    EXPECT_EQ(static_cast<int>(*c.value(layer, s)), out.back() + 50);
  }
  return out;
}

// A change of one layer.
v1::LayerChange Change(int32_t layer, int64_t resident,
                       std::vector<int64_t> evicted,
                       std::vector<std::pair<int, int>> moves) {
  v1::LayerChange c;
  c.set_layer(layer);
  c.set_resident(resident);
  for (int64_t p : evicted) c.add_evicted_positions(p);
  for (auto [from, to] : moves) {
    v1::SlotMove* m = c.add_moves();
    m->set_from_slot(from);
    m->set_to_slot(to);
  }
  return c;
}

// What an append that evicts nothing reports: every layer now holds
// `resident` tokens.
v1::StepResult Kept(int32_t layers, int64_t resident) {
  v1::StepResult r;
  for (int32_t l = 0; l < layers; ++l) {
    *r.add_layers() = Change(l, resident, {}, {});
  }
  return r;
}

TEST(SlotCacheTest, AppendsThenFollowsMovesEvictionsAndNewTokens) {
  SlotCache cache(1, kTokenBytes);
  const std::vector<int64_t> first = {0, 1, 2, 3, 4};
  ASSERT_TRUE(cache
                  .Apply(Kept(1, 5), first, {TokenBytesOf(5, 10)},
                         {TokenBytesOf(5, 60)})
                  .ok());
  EXPECT_EQ(Keys(cache, 0), (std::vector<int>{10, 11, 12, 13, 14}));

  // Positions 1 and 2 evicted; the survivors above the new end (slots 3, 4)
  // move into the holes; of two new tokens (5, 6) the first is evicted too.
  v1::StepResult r;
  *r.add_layers() = Change(0, 4, {1, 2, 5}, {{3, 1}, {4, 2}});
  const std::vector<int64_t> fresh = {5, 6};
  ASSERT_TRUE(
      cache.Apply(r, fresh, {TokenBytesOf(2, 20)}, {TokenBytesOf(2, 70)}).ok());
  EXPECT_EQ(Keys(cache, 0), (std::vector<int>{10, 13, 14, 21}));
  EXPECT_EQ(cache.positions(0), (std::vector<int64_t>{0, 3, 4, 6}));

  const ResidentKv view = cache.Layer(0);
  ASSERT_EQ(view.resident, 4);
  // Slot 3's values, through the paged view's arithmetic.
  const std::byte* v = view.arena + view.pages[0] * view.page_bytes +
                       int64_t{view.page_tokens} * kTokenBytes +
                       3 * kTokenBytes;
  EXPECT_EQ(static_cast<int>(*v), 71);
}

TEST(SlotCacheTest, RefusesAChangeThatDoesNotFitAndKeepsItsBytes) {
  SlotCache cache(2, kTokenBytes);
  const std::vector<int64_t> first = {0, 1};
  ASSERT_TRUE(cache
                  .Apply(Kept(2, 2), first,
                         {TokenBytesOf(2, 10), TokenBytesOf(2, 30)},
                         {TokenBytesOf(2, 60), TokenBytesOf(2, 80)})
                  .ok());
  v1::StepResult r;
  *r.add_layers() = Change(0, 1, {0}, {{1, 0}});
  *r.add_layers() = Change(1, 2, {}, {{5, 0}});  // slot 5 does not exist
  EXPECT_EQ(cache.Apply(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Keys(cache, 0), (std::vector<int>{10, 11}));

  v1::StepResult wrong_layers;
  *wrong_layers.add_layers() = Change(0, 2, {}, {});
  EXPECT_EQ(cache.Apply(wrong_layers).code(),
            absl::StatusCode::kInvalidArgument);
  // New tokens whose bytes do not match their count.
  const std::vector<int64_t> third = {2};
  EXPECT_EQ(
      cache.Apply(Kept(2, 3), third, {"short", "short"}, {"x", "y"}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.resident(1), 2);
}

TEST(SlotCacheTest, GrowsWithoutLosingBytes) {
  SlotCache cache(1, kTokenBytes);
  for (int64_t p = 0; p < 40; ++p) {
    const std::vector<int64_t> one = {p};
    ASSERT_TRUE(cache
                    .Apply(Kept(1, p + 1), one, {TokenBytesOf(1, int(p))},
                           {TokenBytesOf(1, int(p) + 50)})
                    .ok());
  }
  std::vector<int> expected;
  for (int p = 0; p < 40; ++p) expected.push_back(p);
  EXPECT_EQ(Keys(cache, 0), expected);
}

}  // namespace
}  // namespace kvkeep::lm
