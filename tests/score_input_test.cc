// Tests of cache_store/score_input.h: each rule of docs/policies.md "Scores"
// and its boundary, for per-head probabilities, head-reduced probabilities
// and queries, with the messages a client sees (less the session prefix).
#include "cache_store/score_input.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// 4 query heads of dim 2, rows over 3 resident slots.
constexpr ScoreInputShape kShape{/*query_heads=*/4, /*head_dim=*/2,
                                 /*resident=*/3};

// The largest sum a per-head row may have, and the smallest refused.
constexpr float kMaxHeadSum = 1.0f + kRowSumTolerance;
const float kOverHeadSum = std::nextafter(kMaxHeadSum, 2.0f);
// The same for a head-reduced row of kShape.query_heads heads.
constexpr float kMaxReducedSum = 4.0f * kMaxHeadSum;
const float kOverReducedSum = std::nextafter(kMaxReducedSum, 8.0f);

LayerScores Input(ScoreSource source, int32_t rows,
                  const std::vector<float>& data, int32_t layer = 2) {
  LayerScores in;
  in.layer = layer;
  in.source = source;
  in.rows = rows;
  in.data = data;
  return in;
}

// [query_heads][rows][resident], zero but for `value` at (head, row, slot).
std::vector<float> PerHead(int32_t rows, int32_t head, int32_t row,
                           int32_t slot, float value) {
  std::vector<float> p(int64_t{kShape.query_heads} * rows * kShape.resident);
  p[(int64_t{head} * rows + row) * kShape.resident + slot] = value;
  return p;
}

absl::Status Check(const LayerScores& in) {
  std::vector<float> sums(int64_t{in.rows} * kShape.resident, -1.0f);
  return CheckScoreInput(in, kShape, sums);
}

void ExpectInvalid(const absl::Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(text)) << s;
}

TEST(ScoreInputTest, FloatsAndShapeTextPerSource) {
  EXPECT_EQ(ScoreInputFloats(ScoreSource::kPerHead, 2, kShape), 4 * 2 * 3);
  EXPECT_EQ(ScoreInputFloats(ScoreSource::kReduced, 2, kShape), 2 * 3);
  EXPECT_EQ(ScoreInputFloats(ScoreSource::kQueries, 2, kShape), 2 * 4 * 2);
  EXPECT_EQ(ScoreInputShapeText(ScoreSource::kPerHead, 2, kShape),
            "[query_heads 4][rows 2][resident 3]");
  EXPECT_EQ(ScoreInputShapeText(ScoreSource::kReduced, 2, kShape),
            "[rows 2][resident 3]");
  EXPECT_EQ(ScoreInputShapeText(ScoreSource::kQueries, 2, kShape),
            "[rows 2][query_heads 4][head_dim 2]");
}

TEST(ScoreInputTest, RowsMustBeBetweenOneAndResident) {
  const std::vector<float> none;
  ExpectInvalid(CheckScoreShape(Input(ScoreSource::kReduced, 0, none), kShape),
                "layer 2: rows = 0 must be in [1, resident tokens = 3]");
  const std::vector<float> four_rows(4 * 3, 0.0f);
  ExpectInvalid(
      CheckScoreShape(Input(ScoreSource::kReduced, 4, four_rows), kShape),
      "rows = 4 must be in [1, resident tokens = 3]");
  const std::vector<float> three_rows(3 * 3, 0.0f);
  EXPECT_TRUE(
      CheckScoreShape(Input(ScoreSource::kReduced, 3, three_rows), kShape)
          .ok());
}

TEST(ScoreInputTest, WrongSizesNameTheShapeExpected) {
  const std::vector<float> seven(7, 0.0f);
  ExpectInvalid(CheckScoreShape(Input(ScoreSource::kPerHead, 1, seven), kShape),
                "layer 2: per-head probabilities have 7 floats, expected 12 = "
                "[query_heads 4][rows 1][resident 3]");
  ExpectInvalid(
      CheckScoreShape(Input(ScoreSource::kReduced, 2, seven), kShape),
      "layer 2: head-reduced probabilities have 7 floats, expected 6 = "
      "[rows 2][resident 3]");
  ExpectInvalid(CheckScoreShape(Input(ScoreSource::kQueries, 1, seven), kShape),
                "layer 2: queries have 7 floats, expected 8 = "
                "[rows 1][query_heads 4][head_dim 2]");
  // One float short and one over are both refused.
  const std::vector<float> eleven(11, 0.0f), thirteen(13, 0.0f);
  EXPECT_FALSE(
      CheckScoreShape(Input(ScoreSource::kPerHead, 1, eleven), kShape).ok());
  EXPECT_FALSE(
      CheckScoreShape(Input(ScoreSource::kPerHead, 1, thirteen), kShape).ok());
}

TEST(ScoreInputTest, ShapeIsCheckedBeforeValues) {
  const std::vector<float> nan_and_short(5, kNaN);
  ExpectInvalid(Check(Input(ScoreSource::kReduced, 2, nan_and_short)),
                "have 5 floats, expected 6");
}

TEST(ScoreInputTest, PerHeadRowSumsUpToOnePlusTolerance) {
  // Exactly 1 + 1% in one head's row passes; the next float up does not.
  const std::vector<float> at = PerHead(2, 3, 1, 2, kMaxHeadSum);
  EXPECT_TRUE(Check(Input(ScoreSource::kPerHead, 2, at)).ok());
  const std::vector<float> over = PerHead(2, 3, 1, 2, kOverHeadSum);
  ExpectInvalid(Check(Input(ScoreSource::kPerHead, 2, over)),
                "layer 2: per-head probabilities have a row summing to");
  ExpectInvalid(Check(Input(ScoreSource::kPerHead, 2, over)),
                "(attention over resident tokens sums to at most 1 per head)");
}

TEST(ScoreInputTest, PerHeadBoundIsPerHeadNotPerReducedRow) {
  // Every head's row sums to 1: the reduced row sums to 4, which is fine.
  std::vector<float> p(4 * 1 * 3, 0.0f);
  for (int h = 0; h < 4; ++h) {
    p[h * 3 + 0] = 0.25f;
    p[h * 3 + 1] = 0.75f;
  }
  EXPECT_TRUE(Check(Input(ScoreSource::kPerHead, 1, p)).ok());
  // One head over 1 + 1% is refused although the others are zero.
  const std::vector<float> one_head = PerHead(1, 0, 0, 0, 1.5f);
  ExpectInvalid(Check(Input(ScoreSource::kPerHead, 1, one_head)),
                "have a row summing to 1.5, more than 1.01");
}

TEST(ScoreInputTest, PerHeadInputIsSummedOverHeads) {
  // [heads 4][rows 2][resident 3]: head h, row r, slot s holds
  // 0.1 * (h + 1) at slot s = r, 0 elsewhere.
  std::vector<float> p(4 * 2 * 3, 0.0f);
  for (int h = 0; h < 4; ++h) {
    for (int r = 0; r < 2; ++r) p[(h * 2 + r) * 3 + r] = 0.1f * (h + 1);
  }
  std::vector<float> sums(2 * 3, -1.0f);
  ASSERT_TRUE(
      CheckScoreValues(Input(ScoreSource::kPerHead, 2, p), kShape, sums).ok());
  const float total = 0.1f + 0.2f + 0.3f + 0.4f;
  EXPECT_THAT(sums, ElementsAre(::testing::FloatEq(total), 0.0f, 0.0f, 0.0f,
                                ::testing::FloatEq(total), 0.0f));
}

TEST(ScoreInputTest, PerHeadNeedsRoomForTheHeadSums) {
  const std::vector<float> p(4 * 2 * 3, 0.0f);
  std::vector<float> small(5);
  EXPECT_EQ(CheckScoreValues(Input(ScoreSource::kPerHead, 2, p), kShape, small)
                .code(),
            absl::StatusCode::kInternal);
}

TEST(ScoreInputTest, ReducedRowSumsUpToHeadsTimesOnePlusTolerance) {
  std::vector<float> at = {0.0f, kMaxReducedSum, 0.0f};
  EXPECT_TRUE(Check(Input(ScoreSource::kReduced, 1, at)).ok());
  // More than one head's bound is fine for a reduced row.
  std::vector<float> some = {1.5f, 0.5f, 1.0f};
  EXPECT_TRUE(Check(Input(ScoreSource::kReduced, 1, some)).ok());
  std::vector<float> over = {0.0f, kOverReducedSum, 0.0f};
  ExpectInvalid(Check(Input(ScoreSource::kReduced, 1, over)),
                "layer 2: head-reduced probabilities have a row summing to");
  ExpectInvalid(Check(Input(ScoreSource::kReduced, 1, over)), "more than 4.04");
}

TEST(ScoreInputTest, RowsMaySumToLessThanOne) {
  const std::vector<float> zeros(4 * 2 * 3, 0.0f);
  EXPECT_TRUE(Check(Input(ScoreSource::kPerHead, 2, zeros)).ok());
  const std::vector<float> small = {0.1f, 0.0f, 0.2f};
  EXPECT_TRUE(Check(Input(ScoreSource::kReduced, 1, small)).ok());
}

TEST(ScoreInputTest, NaNAndInfinityAreRefused) {
  for (float bad : {kNaN, kInf, -kInf}) {
    SCOPED_TRACE(bad);
    const std::vector<float> per_head = PerHead(1, 2, 0, 1, bad);
    ExpectInvalid(Check(Input(ScoreSource::kPerHead, 1, per_head)),
                  "layer 2: per-head probabilities contain NaN or infinity");
    const std::vector<float> reduced = {0.0f, bad, 0.0f};
    ExpectInvalid(Check(Input(ScoreSource::kReduced, 1, reduced)),
                  "layer 2: head-reduced probabilities contain NaN or "
                  "infinity");
    std::vector<float> queries(8, 0.5f);
    queries[5] = bad;
    ExpectInvalid(Check(Input(ScoreSource::kQueries, 1, queries)),
                  "layer 2: queries contain a non-finite value");
  }
}

TEST(ScoreInputTest, NegativeProbabilitiesAreRefused) {
  const std::vector<float> per_head = PerHead(1, 1, 0, 0, -0.5f);
  ExpectInvalid(Check(Input(ScoreSource::kPerHead, 1, per_head)),
                "layer 2: per-head probabilities contain a negative value "
                "(-0.5)");
  const std::vector<float> reduced = {0.5f, -0.25f, 0.5f};
  ExpectInvalid(Check(Input(ScoreSource::kReduced, 1, reduced)),
                "layer 2: head-reduced probabilities contain a negative value "
                "(-0.25)");
  // The smallest negative float is still negative; -0 is not.
  const std::vector<float> tiny = {
      0.5f, -std::numeric_limits<float>::denorm_min(), 0.5f};
  EXPECT_FALSE(Check(Input(ScoreSource::kReduced, 1, tiny)).ok());
  const std::vector<float> negative_zero = {0.5f, -0.0f, 0.5f};
  EXPECT_TRUE(Check(Input(ScoreSource::kReduced, 1, negative_zero)).ok());
}

TEST(ScoreInputTest, QueriesNeedOnlyBeFinite) {
  // Queries are vectors, not probabilities: negative and large values pass,
  // and the head sums are not touched (may be empty).
  const std::vector<float> queries = {-3.0f, 1e30f, -1e30f, 0.0f,
                                      2.5f,  -0.5f, 7.0f,   100.0f};
  EXPECT_TRUE(
      CheckScoreInput(Input(ScoreSource::kQueries, 1, queries), kShape, {})
          .ok());
  const std::vector<float> two_rows(2 * 4 * 2, -1.0f);
  EXPECT_TRUE(Check(Input(ScoreSource::kQueries, 2, two_rows)).ok());
}

TEST(ScoreInputTest, ReducedInputLeavesHeadSumsAlone) {
  const std::vector<float> reduced = {0.5f, 0.25f, 0.25f};
  std::vector<float> sums = {-1.0f, -1.0f, -1.0f};
  EXPECT_TRUE(
      CheckScoreValues(Input(ScoreSource::kReduced, 1, reduced), kShape, sums)
          .ok());
  EXPECT_THAT(sums, ElementsAre(-1.0f, -1.0f, -1.0f));
}

}  // namespace
}  // namespace kvkeep
