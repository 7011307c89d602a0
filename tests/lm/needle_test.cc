// FindNeedle: where the expected answer sits in a prompt, and how much of
// it each layer of a cache still holds (kvkeep-lm answer's
// answer_copies / answer_layers_whole / answer_token_share).
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "services/lm/lm_answer.h"

namespace kvkeep::lm {
namespace {

// A cache that holds given original positions per layer (no bytes).
class PositionsOnly : public KvSource {
 public:
  explicit PositionsOnly(std::vector<std::vector<int64_t>> layers)
      : layers_(std::move(layers)) {}
  ResidentKv Layer(int32_t layer) const override {
    ResidentKv view;
    view.resident = static_cast<int64_t>(layers_[layer].size());
    view.positions = layers_[layer];
    return view;
  }

 private:
  std::vector<std::vector<int64_t>> layers_;
};

// Tokens 0..9 at positions 0..9; the needle {7, 8} at 2-3 and at 7-8.
const std::vector<int32_t> kPrompt = {1, 2, 7, 8, 3, 4, 5, 7, 8, 9};
const std::vector<int32_t> kNeedle = {7, 8};

TEST(FindNeedleTest, EveryLayerHoldingEverythingHoldsEveryCopy) {
  std::vector<int64_t> all(kPrompt.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const NeedleInCache found =
      FindNeedle(PositionsOnly({all, all, all}), 3, kPrompt, kNeedle);
  EXPECT_EQ(found.copies, 2);
  EXPECT_EQ(found.layers_whole, 3);
  EXPECT_DOUBLE_EQ(found.token_share, 1.0);
}

TEST(FindNeedleTest, CountsWholeCopiesPerLayerAndTokensOverAll) {
  // Layer 0: the second copy whole (7, 8) and half the first (2).
  // Layer 1: one token of each copy (3 and 7): no whole copy.
  // Layer 2: nothing of either (positions in any order).
  const NeedleInCache found = FindNeedle(
      PositionsOnly({{0, 2, 7, 8, 9}, {3, 7}, {9, 5, 0}}), 3, kPrompt, kNeedle);
  EXPECT_EQ(found.copies, 2);
  EXPECT_EQ(found.layers_whole, 1);
  // (3 + 2 + 0) held of 3 layers x 2 copies x 2 tokens.
  EXPECT_DOUBLE_EQ(found.token_share, 5.0 / 12.0);
}

TEST(FindNeedleTest, ANeedleNotInThePromptOrEmptyIsNotLookedFor) {
  const PositionsOnly cache({{0, 1, 2}});
  const NeedleInCache absent = FindNeedle(cache, 1, kPrompt, {{6, 6}});
  EXPECT_EQ(absent.copies, 0);
  EXPECT_EQ(absent.layers_whole, 0);
  EXPECT_EQ(absent.token_share, 0);
  EXPECT_EQ(FindNeedle(cache, 1, kPrompt, {}).copies, 0);
}

TEST(FindNeedleTest, OverlappingCopiesCountEach) {
  // {5, 5} occurs at 0, 1 and 2 of {5, 5, 5, 5}; positions past the prompt
  // (the answer's own tokens, decoded later) are ignored.
  const NeedleInCache found =
      FindNeedle(PositionsOnly({{1, 2, 40}}), 1, {{5, 5, 5, 5}}, {{5, 5}});
  EXPECT_EQ(found.copies, 3);
  EXPECT_EQ(found.layers_whole, 1);                // the copy at 1-2
  EXPECT_DOUBLE_EQ(found.token_share, 4.0 / 6.0);  // 0:1, 1:2, 2:1 of 2 each
}

}  // namespace
}  // namespace kvkeep::lm
