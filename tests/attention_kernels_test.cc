// Tests of the CPU reference kernels in kernels/attention.h (the twins the
// CUDA kernels will be compared against) against independent double-precision
// references written here, over awkward sizes: page sizes 1, 3, 7, 16, 17;
// head dims 64, 80, 128; GQA ratios 1, 4, 8; f32, f16 and bf16 keys; shuffled,
// non-contiguous block tables; causal masks from arrival order.
//
// Tolerances, stated once:
//   - ReduceHeads / CheckRows sums: 1e-5 relative to the sum of magnitudes.
//   - QueryAttention, logits of moderate size (|logit| < ~10): 1e-5 relative
//     per output element plus 1e-6 absolute (observed: < 5e-7); masked slots
//     exactly 0; every row sums to query_heads within 1e-5 relative.
//   - QueryAttention, logits near +-120 (exp overflows/underflows float): the
//     logits are then only known to float's precision at 120 (ulp 7.6e-6,
//     and a 128-term dot product of ~1400 before scaling), so 1e-4 relative
//     (observed: < 6e-6).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/dtype.h"
#include "kernels/page_layout.h"

namespace kvkeep {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// ReduceHeads and CheckRows.

struct RefCheck {
  double min_value;
  double max_row_sum;
};

// probs: [heads][rows][slots].
RefCheck RefReduce(const std::vector<float>& probs, int heads, int rows,
                   int64_t slots, std::vector<double>* out,
                   std::vector<double>* magnitude) {
  out->assign(rows * slots, 0.0);
  magnitude->assign(rows * slots, 0.0);
  RefCheck c{std::numeric_limits<double>::infinity(),
             -std::numeric_limits<double>::infinity()};
  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t s = 0; s < slots; ++s) {
        const double p = probs[(h * rows + r) * slots + s];
        (*out)[r * slots + s] += p;
        (*magnitude)[r * slots + s] += std::fabs(p);
        sum += p;
        c.min_value = std::min(c.min_value, p);
      }
      c.max_row_sum = std::max(c.max_row_sum, sum);
    }
  }
  return c;
}

std::vector<float> RandomProbs(int heads, int rows, int64_t slots,
                               uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> probs(heads * rows * slots);
  // Each (head, row) a probability vector, as attention rows are.
  for (int hr = 0; hr < heads * rows; ++hr) {
    double sum = 0;
    for (int64_t s = 0; s < slots; ++s) {
      probs[hr * slots + s] = u(rng);
      sum += probs[hr * slots + s];
    }
    for (int64_t s = 0; s < slots; ++s) {
      probs[hr * slots + s] = static_cast<float>(probs[hr * slots + s] / sum);
    }
  }
  return probs;
}

// Row sums of a (head, row) in double, for the tolerance of max_row_sum.
double MaxAbsRowSum(const std::vector<float>& probs, int64_t groups,
                    int64_t slots) {
  double m = 0;
  for (int64_t g = 0; g < groups; ++g) {
    double a = 0;
    for (int64_t s = 0; s < slots; ++s) a += std::fabs(probs[g * slots + s]);
    m = std::max(m, a);
  }
  return m;
}

TEST(ReduceHeadsTest, MatchesReferenceOverSizes) {
  for (int heads : {1, 2, 4, 7, 32}) {
    for (int rows : {1, 3}) {
      for (int64_t slots : {1, 3, 7, 16, 17, 100, 1001}) {
        SCOPED_TRACE(::testing::Message() << "heads " << heads << " rows "
                                          << rows << " slots " << slots);
        const std::vector<float> probs =
            RandomProbs(heads, rows, slots, heads * 1000 + rows * 10 + slots);
        std::vector<float> out(rows * slots, kNaN);  // must be overwritten
        const RowCheck check =
            ReduceHeads(probs.data(), heads, rows, slots, out.data());
        std::vector<double> ref, mag;
        const RefCheck rc = RefReduce(probs, heads, rows, slots, &ref, &mag);
        for (int64_t i = 0; i < rows * slots; ++i) {
          ASSERT_NEAR(out[i], ref[i], 1e-5 * mag[i]) << "element " << i;
        }
        EXPECT_EQ(check.min_value, rc.min_value);  // a min is exact
        EXPECT_NEAR(check.max_row_sum, rc.max_row_sum,
                    1e-5 * MaxAbsRowSum(probs, heads * rows, slots));
      }
    }
  }
}

TEST(ReduceHeadsTest, ZeroHeadsGivesZeroRows) {
  std::vector<float> out(3 * 5, kNaN);
  ReduceHeads(nullptr, 0, 3, 5, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// A NaN anywhere (any head, row, SIMD lane) is reported in both fields.
TEST(ReduceHeadsTest, NaNAnywhereIsReported) {
  constexpr int kHeads = 3, kRows = 2;
  constexpr int64_t kSlots = 37;
  const std::vector<float> clean = RandomProbs(kHeads, kRows, kSlots, 5);
  std::vector<float> out(kRows * kSlots);
  for (size_t pos = 0; pos < clean.size(); ++pos) {
    std::vector<float> probs = clean;
    probs[pos] = kNaN;
    const RowCheck check =
        ReduceHeads(probs.data(), kHeads, kRows, kSlots, out.data());
    ASSERT_TRUE(std::isnan(check.min_value)) << "NaN at " << pos;
    ASSERT_TRUE(std::isnan(check.max_row_sum)) << "NaN at " << pos;
  }
}

TEST(ReduceHeadsTest, NegativeAndInfiniteValuesAreReported) {
  constexpr int kHeads = 2, kRows = 3;
  constexpr int64_t kSlots = 19;
  const std::vector<float> clean = RandomProbs(kHeads, kRows, kSlots, 9);
  std::vector<float> out(kRows * kSlots);
  for (size_t pos : {size_t{0}, size_t{20}, clean.size() - 1}) {
    std::vector<float> probs = clean;
    probs[pos] = -1e-3f;
    RowCheck check =
        ReduceHeads(probs.data(), kHeads, kRows, kSlots, out.data());
    EXPECT_EQ(check.min_value, -1e-3f) << pos;
    EXPECT_TRUE(std::isfinite(check.max_row_sum));

    probs = clean;
    probs[pos] = kInf;
    check = ReduceHeads(probs.data(), kHeads, kRows, kSlots, out.data());
    EXPECT_EQ(check.max_row_sum, kInf) << pos;
    EXPECT_FALSE(std::isnan(check.min_value)) << pos;

    probs = clean;
    probs[pos] = -kInf;
    check = ReduceHeads(probs.data(), kHeads, kRows, kSlots, out.data());
    EXPECT_EQ(check.min_value, -kInf) << pos;
  }
  // +inf and -inf in one row sum to NaN.
  std::vector<float> probs = clean;
  probs[3] = kInf;
  probs[4] = -kInf;
  const RowCheck check =
      ReduceHeads(probs.data(), kHeads, kRows, kSlots, out.data());
  EXPECT_TRUE(std::isnan(check.max_row_sum));
  EXPECT_TRUE(std::isnan(check.min_value));
}

TEST(CheckRowsTest, MatchesReferenceAndLeavesInputAlone) {
  for (int rows : {1, 2, 5}) {
    for (int64_t slots : {1, 7, 17, 64, 1001}) {
      SCOPED_TRACE(::testing::Message()
                   << "rows " << rows << " slots " << slots);
      // Reduced rows sum to the number of heads (here 4).
      std::vector<float> data = RandomProbs(1, rows, slots, rows * 7 + slots);
      for (float& v : data) v *= 4.0f;
      const std::vector<float> copy = data;
      const RowCheck check = CheckRows(data.data(), rows, slots);
      std::vector<double> ref, mag;
      const RefCheck rc = RefReduce(data, 1, rows, slots, &ref, &mag);
      EXPECT_EQ(check.min_value, rc.min_value);
      EXPECT_NEAR(check.max_row_sum, rc.max_row_sum,
                  1e-5 * MaxAbsRowSum(data, rows, slots));
      EXPECT_EQ(data, copy);
    }
  }
}

TEST(CheckRowsTest, NaNNegativeAndInfinityAreReported) {
  constexpr int kRows = 3;
  constexpr int64_t kSlots = 23;
  const std::vector<float> clean = RandomProbs(1, kRows, kSlots, 11);
  for (size_t pos = 0; pos < clean.size(); ++pos) {
    std::vector<float> data = clean;
    data[pos] = kNaN;
    RowCheck check = CheckRows(data.data(), kRows, kSlots);
    ASSERT_TRUE(std::isnan(check.min_value)) << pos;
    ASSERT_TRUE(std::isnan(check.max_row_sum)) << pos;

    data[pos] = -0.25f;
    check = CheckRows(data.data(), kRows, kSlots);
    ASSERT_EQ(check.min_value, -0.25f) << pos;

    data[pos] = kInf;
    check = CheckRows(data.data(), kRows, kSlots);
    ASSERT_EQ(check.max_row_sum, kInf) << pos;
  }
}

// The contract: max_row_sum is the largest sum of one row. It must not be
// clamped at 0 when every row sums to less.
TEST(CheckRowsTest, MaxRowSumOfNegativeRows) {
  const float data[] = {-1.0f, -2.0f, -0.5f, -0.25f};
  const RowCheck check = CheckRows(data, 2, 2);
  EXPECT_EQ(check.min_value, -2.0f);
  EXPECT_EQ(check.max_row_sum, -0.75f);
  std::vector<float> out(2);
  const RowCheck heads = ReduceHeads(data, 2, 1, 2, out.data());
  EXPECT_EQ(heads.max_row_sum, -0.75f);
  EXPECT_EQ(out, (std::vector<float>{-1.5f, -2.25f}));
}

// ---------------------------------------------------------------------------
// QueryAttention.

// binary16 decoded from its definition (independent of kernels/dtype.h).
double DecodeF16(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v = e == 0 ? std::ldexp(double(m), -24)
                    : std::ldexp(double(1024 + m), e - 25);
  if (e == 31) v = m == 0 ? INFINITY : NAN;
  return (h & 0x8000) ? -v : v;
}

double DecodeElement(DType t, const std::byte* p) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return DecodeF16(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return std::bit_cast<float>(uint32_t{h} << 16);
    }
    default:
      return NAN;
  }
  return NAN;
}

// A layer's keys in a paged arena, built the way the store lays them out:
// page = [K, V][page_tokens][kv_heads][head_dim]. Offsets are computed here
// from that formula, not through PageLayout. Every byte the kernel must not
// read (values, padding slots, pages outside the block table) is 0xff, a NaN
// in every dtype, so a stray read shows up as NaN in the output.
struct PagedFixture {
  PageLayout layout;
  int64_t slots = 0;
  std::vector<std::byte> arena;
  std::vector<PageId> pages;
  std::vector<int64_t> order;

  int64_t elem() const { return DTypeBytes(layout.dtype); }
  int64_t token_bytes() const {
    return int64_t{layout.kv_heads} * layout.head_dim * elem();
  }
  int64_t KeyByte(int64_t slot, int32_t kv_head, int32_t i) const {
    const int64_t page = pages[slot / layout.page_tokens];
    return page * 2 * layout.page_tokens * token_bytes() +
           (slot % layout.page_tokens) * token_bytes() +
           (int64_t{kv_head} * layout.head_dim + i) * elem();
  }
  double Key(int64_t slot, int32_t kv_head, int32_t i) const {
    return DecodeElement(layout.dtype,
                         arena.data() + KeyByte(slot, kv_head, i));
  }
  PagedKeys keys() const {
    return PagedKeys{arena.data(), layout, pages, order, slots};
  }
};

// Builds the fixture; key(s, g, i) gives each key element as float, which is
// rounded to the layout's dtype when stored.
template <typename KeyFn>
PagedFixture MakeKeys(const PageLayout& layout, int64_t slots,
                      std::mt19937& rng, KeyFn key) {
  PagedFixture f;
  f.layout = layout;
  f.slots = slots;
  const int64_t needed = (slots + layout.page_tokens - 1) / layout.page_tokens;
  const int64_t total = 2 * needed + 3;
  std::vector<PageId> all(total);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  f.pages.assign(all.begin(), all.begin() + needed);
  f.arena.assign(total * 2 * layout.page_tokens * f.token_bytes(),
                 std::byte{0xff});
  for (int64_t s = 0; s < slots; ++s) {
    for (int32_t g = 0; g < layout.kv_heads; ++g) {
      for (int32_t i = 0; i < layout.head_dim; ++i) {
        StoreFromFloat(layout.dtype, f.arena.data() + f.KeyByte(s, g, i), 0,
                       key(s, g, i));
      }
    }
  }
  // Distinct arrival orders with gaps (evicted tokens), in shuffled slots:
  // slot order is not arrival order after compaction.
  std::vector<int64_t> arrivals(3 * slots);
  std::iota(arrivals.begin(), arrivals.end(), 0);
  std::shuffle(arrivals.begin(), arrivals.end(), rng);
  arrivals.resize(slots);
  f.order = arrivals;
  return f;
}

// out[r][s] = sum over query heads of softmax over visible slots, in double
// from the stored (rounded) keys.
std::vector<double> RefQueryAttention(const PagedFixture& f,
                                      const std::vector<float>& queries,
                                      const std::vector<int64_t>& row_order,
                                      int32_t query_heads) {
  const int32_t d = f.layout.head_dim;
  const int32_t group = query_heads / f.layout.kv_heads;
  const int64_t n = f.slots;
  const int rows = static_cast<int>(row_order.size());
  std::vector<double> out(rows * n, 0.0);
  std::vector<double> logit(n);
  for (int r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < query_heads; ++h) {
      const float* q = queries.data() + (int64_t{r} * query_heads + h) * d;
      double mx = -INFINITY;
      for (int64_t s = 0; s < n; ++s) {
        if (f.order[s] > row_order[r]) continue;
        double dot = 0;
        for (int32_t i = 0; i < d; ++i)
          dot += double(q[i]) * f.Key(s, h / group, i);
        logit[s] = dot / std::sqrt(double(d));
        mx = std::max(mx, logit[s]);
      }
      if (mx == -INFINITY) continue;
      double denom = 0;
      for (int64_t s = 0; s < n; ++s) {
        if (f.order[s] <= row_order[r]) denom += std::exp(logit[s] - mx);
      }
      for (int64_t s = 0; s < n; ++s) {
        if (f.order[s] <= row_order[r]) {
          out[r * n + s] += std::exp(logit[s] - mx) / denom;
        }
      }
    }
  }
  return out;
}

// Row orders that cover every mask shape: all visible, about half, exactly
// the oldest slot, and none (a zero row).
std::vector<int64_t> RowOrders(const std::vector<int64_t>& order) {
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  return {sorted.back(), sorted[sorted.size() / 2], sorted.front(),
          sorted.front() - 1};
}

struct Shape {
  int32_t page_tokens;
  int32_t head_dim;
  int32_t group;  // query heads per kv head
  DType dtype;
};

std::string ShapeName(const Shape& s) {
  return ::testing::PrintToString(s.page_tokens) + "x" +
         ::testing::PrintToString(s.head_dim) + " group " +
         ::testing::PrintToString(s.group) + " " +
         std::string(DTypeName(s.dtype));
}

// Runs the kernel and compares every output element with the reference
// (rel: relative tolerance, abs_tol: absolute), and every row sum.
void RunAndCompare(const PagedFixture& f, const std::vector<float>& queries,
                   const std::vector<int64_t>& row_order, int32_t query_heads,
                   double rel, double abs_tol) {
  const int32_t rows = static_cast<int32_t>(row_order.size());
  const int64_t n = f.slots;
  std::vector<float> out(rows * n, kNaN);  // must be overwritten
  std::vector<float> scratch(
      int64_t{query_heads} * n + f.keys().layout.head_dim, kNaN);
  QueryAttention(f.keys(), queries.data(), row_order.data(), rows, query_heads,
                 out.data(), scratch.data());
  const std::vector<double> ref =
      RefQueryAttention(f, queries, row_order, query_heads);
  for (int32_t r = 0; r < rows; ++r) {
    double row_sum = 0;
    int64_t visible = 0;
    for (int64_t s = 0; s < n; ++s) {
      const float got = out[r * n + s];
      const double want = ref[r * n + s];
      if (f.order[s] > row_order[r]) {
        ASSERT_EQ(got, 0.0f) << "masked slot " << s << " row " << r;
        continue;
      }
      ++visible;
      ASSERT_TRUE(std::isfinite(got)) << "slot " << s << " row " << r;
      ASSERT_NEAR(got, want, rel * want + abs_tol)
          << "slot " << s << " row " << r;
      row_sum += got;
    }
    // Each query head contributes a distribution: a row sums to query_heads.
    if (visible > 0) {
      EXPECT_NEAR(row_sum, query_heads, 1e-5 * query_heads) << "row " << r;
    } else {
      EXPECT_EQ(row_sum, 0.0) << "row " << r;
    }
  }
}

// Normal random keys and queries for one shape (queries 1.5 N(0, 1), so the
// logits q.k / sqrt(d) ~ N(0, 2.25): a spread-out softmax), every row order
// of RowOrders, compared with the reference at the moderate-logit tolerance.
void CompareRandomCase(const PageLayout& layout, int64_t slots, int32_t group,
                       std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  PagedFixture f = MakeKeys(layout, slots, rng, [&](int64_t, int32_t, int32_t) {
    return normal(rng);
  });
  const int32_t query_heads = layout.kv_heads * group;
  const std::vector<int64_t> row_order = RowOrders(f.order);
  std::vector<float> queries(row_order.size() * query_heads * layout.head_dim);
  for (float& q : queries) q = 1.5f * normal(rng);
  RunAndCompare(f, queries, row_order, query_heads, 1e-5, 1e-6);
}

TEST(QueryAttentionTest, MatchesReferenceOverAwkwardSizes) {
  constexpr int32_t kKvHeads = 2;
  int cases = 0;
  for (int32_t page_tokens : {1, 3, 7, 16, 17}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (int32_t group : {1, 4, 8}) {
        for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
          const Shape shape{page_tokens, head_dim, group, dtype};
          SCOPED_TRACE(ShapeName(shape));
          std::mt19937 rng(page_tokens * 7919 + head_dim * 31 + group * 3 +
                           static_cast<int>(dtype));
          // A last page only partly used (padding slots), except for P = 1.
          const int64_t slots = std::max<int64_t>(29, 2 * page_tokens + 5);
          CompareRandomCase(PageLayout{page_tokens, kKvHeads, head_dim, dtype},
                            slots, group, rng);
          if (HasFatalFailure()) return;
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 3 * 3 * 3);
}

// The query head h reads kv head h / group: give each kv head a key that only
// one query head matches, and check that head's mass goes to that slot.
TEST(QueryAttentionTest, GqaHeadMapping) {
  constexpr int32_t kKvHeads = 4, kGroup = 4, kDim = 64, kSlots = 4;
  const PageLayout layout{3, kKvHeads, kDim, DType::kF32};
  std::mt19937 rng(1);
  // Slot s, kv head g: a one-hot key on coordinate (g == s ? 0 : 1).
  PagedFixture f =
      MakeKeys(layout, kSlots, rng, [](int64_t s, int32_t g, int32_t i) {
        return i == (g == s ? 0 : 1) ? 1.0f : 0.0f;
      });
  const std::vector<int64_t> row_order = {1000};
  // Only query head 2 * kGroup + 1 (kv head 2) is non-zero: it attends to
  // slot 2 with logit 100 / sqrt(64) = 12.5 more than the others.
  constexpr int32_t kQueryHeads = kKvHeads * kGroup;
  std::vector<float> queries(kQueryHeads * kDim, 0.0f);
  queries[(2 * kGroup + 1) * kDim + 0] = 100.0f;
  std::vector<float> out(kSlots), scratch(kQueryHeads * kSlots + kDim);
  QueryAttention(f.keys(), queries.data(), row_order.data(), 1, kQueryHeads,
                 out.data(), scratch.data());
  // 15 uniform heads give 15/4 each; head 9 gives ~1 to slot 2.
  const double e = std::exp(-12.5);
  const double peak = 1 / (1 + 3 * e);
  EXPECT_NEAR(out[2], 15.0 / 4 + peak, 1e-5);
  for (int s : {0, 1, 3}) EXPECT_NEAR(out[s], 15.0 / 4 + e * peak, 1e-5);
  RunAndCompare(f, queries, row_order, kQueryHeads, 1e-5, 1e-6);
}

// Logits near +120 overflow exp() in float and near -120 underflow it: the
// softmax must subtract the row maximum. Keys are u + small noise with u all
// ones and q = +-c * u, so the logits sit near +-120 and differ by O(1).
TEST(QueryAttentionTest, LargeLogitsDoNotOverflow) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int32_t head_dim : {64, 128}) {
      for (float sign : {1.0f, -1.0f}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " d "
                                          << head_dim << " sign " << sign);
        std::mt19937 rng(head_dim + static_cast<int>(dtype));
        std::normal_distribution<float> noise(0.0f, 0.02f);
        const PageLayout layout{7, 2, head_dim, dtype};
        PagedFixture f = MakeKeys(
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

// The blocked kernel's tails: head dims that leave a partial 16-lane chunk
// (1, 15, 17, 72) or take the smallest tile (1024: 8 keys), slot counts
// around its register blocks (8 keys) and tiles (64 keys at head dims up to
// 16, 32 at 128), and GQA groups that leave head tails (3 = 2 + 1,
// 5 = 4 + 1, 7 = 4 + 2 + 1).
TEST(QueryAttentionTest, BlockedKernelTails) {
  constexpr int32_t kKvHeads = 2;
  int cases = 0;
  for (int32_t head_dim : {1, 15, 17, 72, 1024}) {
    for (int64_t slots : {1, 7, 9, 31, 33, 65, 130}) {
      for (int32_t group : {1, 2, 3, 5, 7}) {
        const Shape shape{5, head_dim, group, DType::kF32};
        SCOPED_TRACE(ShapeName(shape) + " slots " + std::to_string(slots));
        std::mt19937 rng(head_dim * 131 + static_cast<int>(slots) * 7 + group);
        CompareRandomCase(PageLayout{5, kKvHeads, head_dim, DType::kF32}, slots,
                          group, rng);
        if (HasFatalFailure()) return;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 7 * 5);
}

// The kernel widens f16 keys with its own branch-free decode: every finite
// binary16 value as a key scores exactly as f32 keys holding dtype.h's
// F16ToFloat of it.
TEST(QueryAttentionTest, EveryFiniteHalfKeyDecodesExactly) {
  constexpr int32_t kDim = 128;
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7c00u) != 0x7c00u) values.push_back(F16ToFloat(uint16_t(h)));
  }
  ASSERT_EQ(values.size(), 63488u);
  const int64_t slots = static_cast<int64_t>(values.size()) / kDim;
  auto key = [&](int64_t s, int32_t, int32_t i) {
    return values[s * kDim + i];
  };
  // The same seed: the same shuffled pages and arrival orders.
  std::mt19937 rng(16), rng_wide(16);
  const PagedFixture half =
      MakeKeys(PageLayout{16, 1, kDim, DType::kF16}, slots, rng, key);
  const PagedFixture wide =
      MakeKeys(PageLayout{16, 1, kDim, DType::kF32}, slots, rng_wide, key);
  ASSERT_EQ(half.pages, wide.pages);
  // Small queries keep the logits (keys up to 65504) finite and spread.
  std::normal_distribution<float> normal(0.0f, 1e-5f);
  std::vector<float> queries(2 * 2 * kDim);
  for (float& q : queries) q = normal(rng);
  const std::vector<int64_t> row_order = RowOrders(half.order);
  const std::vector<int64_t> rows = {row_order[0], row_order[1]};
  std::vector<float> out_half(2 * slots), out_wide(2 * slots);
  std::vector<float> scratch(2 * slots + kDim);
  QueryAttention(half.keys(), queries.data(), rows.data(), 2, 2,
                 out_half.data(), scratch.data());
  QueryAttention(wide.keys(), queries.data(), rows.data(), 2, 2,
                 out_wide.data(), scratch.data());
  EXPECT_EQ(out_half, out_wide);
  double total = 0;
  for (float p : out_half) total += p;
  EXPECT_NEAR(total, 2 * 2, 1e-4);  // two rows of two heads' distributions
}

// All query rows of one call share keys but not masks; a row with no visible
// slot is all zeros even when other rows see everything.
TEST(QueryAttentionTest, RowWithNoVisibleSlotIsZero) {
  const PageLayout layout{16, 1, 80, DType::kBF16};
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  PagedFixture f = MakeKeys(
      layout, 33, rng, [&](int64_t, int32_t, int32_t) { return normal(rng); });
  const int64_t oldest = *std::min_element(f.order.begin(), f.order.end());
  const std::vector<int64_t> row_order = {oldest - 1, 1 << 20, oldest - 5};
  std::vector<float> queries(3 * 4 * 80);
  for (float& q : queries) q = normal(rng);
  std::vector<float> out(3 * 33, kNaN), scratch(4 * 33 + 80);
  QueryAttention(f.keys(), queries.data(), row_order.data(), 3, 4, out.data(),
                 scratch.data());
  for (int64_t s = 0; s < 33; ++s) {
    EXPECT_EQ(out[s], 0.0f);
    EXPECT_EQ(out[2 * 33 + s], 0.0f);
    EXPECT_GT(out[33 + s], 0.0f);
  }
}

// One visible slot takes all of every head's mass, whatever the logits.
TEST(QueryAttentionTest, SingleVisibleSlotGetsEveryHead) {
  const PageLayout layout{3, 2, 64, DType::kF16};
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  PagedFixture f = MakeKeys(
      layout, 10, rng, [&](int64_t, int32_t, int32_t) { return normal(rng); });
  const auto oldest = std::min_element(f.order.begin(), f.order.end());
  const int64_t slot = oldest - f.order.begin();
  const std::vector<int64_t> row_order = {*oldest};
  std::vector<float> queries(8 * 64);
  for (float& q : queries) q = normal(rng);
  std::vector<float> out(10, kNaN), scratch(8 * 10 + 64);
  QueryAttention(f.keys(), queries.data(), row_order.data(), 1, 8, out.data(),
                 scratch.data());
  for (int64_t s = 0; s < 10; ++s) {
    EXPECT_EQ(out[s], s == slot ? 8.0f : 0.0f) << s;
  }
}

}  // namespace
}  // namespace kvkeep
