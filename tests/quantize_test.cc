// The quantised token record (kernels/quant_format.h) and its CPU twins
// (kernels/quantize.h): hand-made records byte for byte, round to nearest
// even on ties, E4M3 on every code, error bounds derived from the format
// (not tuned: each element's error is checked against its own group's scale),
// refusal of NaN, infinities and values too large for binary16 scales, and
// query scoring on quantised keys equal to scoring their dequantised values.
//
// Bounds, from the format (s: the group's scale as stored, x: an element):
//   int8, int4: |x - x'| <= s * (1/2 + 2^-16) + (|x| + s) * 2^-23
//     (half a step; x / s rounds once, by at most 2^-24 * 256 steps; the
//     dequantising multiply once more)
//   fp8_e4m3:   |x - x'| <= max(|x| * 2^-4, s * 2^-10) + |x| * 2^-22
//     (half an E4M3 ulp: 3 mantissa bits, subnormal step 2^-9 * s)
// and every scale is exactly the binary16 rounded up from the group's range
// over its largest code, recomputed here from the input.
#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/page_layout.h"
#include "kernels/quant_format.h"

namespace kvkeep {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<std::byte> Bytes(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<uint8_t> Quantize(const PageLayout& layout,
                              const std::vector<float>& x, int64_t n) {
  std::vector<std::byte> out(n * layout.token_bytes());
  const QuantizeResult r =
      QuantizeTokens(layout, DType::kF32, x.data(), n, out.data());
  EXPECT_TRUE(r.ok()) << "token " << r.token << " element " << r.element;
  std::vector<uint8_t> bytes(out.size());
  std::memcpy(bytes.data(), out.data(), out.size());
  return bytes;
}

std::vector<float> Dequantize(const PageLayout& layout,
                              const std::vector<uint8_t>& records, int64_t n) {
  std::vector<float> out(n * layout.token_elements());
  DequantizeTokens(layout, reinterpret_cast<const std::byte*>(records.data()),
                   n, DType::kF32, out.data());
  return out;
}

TEST(QuantFormatTest, TokenBytesPerFormat) {
  // kv_heads 2 x head_dim 64 = 128 elements, groups of 32: 4 groups.
  EXPECT_EQ((PageLayout{16, 2, 64, DType::kBF16}.token_bytes()), 256);
  EXPECT_EQ((PageLayout{16, 2, 64, DType::kInt8, 32}.token_bytes()),
            128 + 4 * 3);
  EXPECT_EQ((PageLayout{16, 2, 64, DType::kFp8E4M3, 32}.token_bytes()),
            128 + 4 * 2);
  EXPECT_EQ((PageLayout{16, 2, 64, DType::kInt4, 32}.token_bytes()),
            64 + 4 * 3);
  EXPECT_EQ((PageLayout{16, 2, 64, DType::kInt4, 32}.page_bytes()),
            2 * 16 * 76);
}

TEST(QuantFormatTest, Int8RecordByteForByte) {
  // One head of 4, groups of 2, asymmetric. Group 0 in [0, 255]: scale 1,
  // zero 0. Group 1 in [-10, 245]: scale 1, zero 10.
  const PageLayout layout{1, 1, 4, DType::kInt8, 2};
  const std::vector<uint8_t> r = Quantize(layout, {255, 0, -10, 245}, 1);
  EXPECT_EQ(r, (std::vector<uint8_t>{255, 0, 0, 255,          // codes
                                     0x00, 0x3c, 0x00, 0x3c,  // 1.0 = 0x3c00
                                     0, 10}));                // zeros
  EXPECT_EQ(Dequantize(layout, r, 1), (std::vector<float>{255, 0, -10, 245}));
  // Symmetric (the variant the benchmark compares): max |x| 127 -> scale 1,
  // codes x + 128, no zeros stored.
  // The record is the layout's (10 bytes); the symmetric variant leaves
  // the zeros unwritten.
  std::vector<std::byte> sym(layout.token_bytes());
  const std::vector<float> x = {127, -3, 0, 127};
  ASSERT_TRUE(QuantizeTokensWith(layout, QuantSpec{8, false, false},
                                 DType::kF32, x.data(), 1, sym.data())
                  .ok());
  EXPECT_EQ(std::to_integer<int>(sym[0]), 255);
  EXPECT_EQ(std::to_integer<int>(sym[1]), 125);
  EXPECT_EQ(std::to_integer<int>(sym[2]), 128);
}

TEST(QuantFormatTest, Int4RecordByteForByte) {
  // Asymmetric: group 0 in [0, 15] -> scale 1, zero 0; group 1 in [-5, 10]
  // -> scale 1, zero 5. Element 2i in the low nibble.
  const PageLayout layout{1, 1, 4, DType::kInt4, 2};
  const std::vector<uint8_t> r = Quantize(layout, {15, 2, -5, 10}, 1);
  EXPECT_EQ(r, (std::vector<uint8_t>{0x2f, 0xf0,  // codes (15, 2), (0, 15)
                                     0x00, 0x3c, 0x00, 0x3c,  // scales 1, 1
                                     0, 5}));                 // zeros
  EXPECT_EQ(Dequantize(layout, r, 1), (std::vector<float>{15, 2, -5, 10}));
}

TEST(QuantFormatTest, Fp8RecordByteForByte) {
  // max |x| 448 -> scale 1; 448 = 0x7e, -1 = 0xb8, 0.5 = 0x30, 2^-9 = 0x01.
  const PageLayout layout{1, 1, 4, DType::kFp8E4M3, 4};
  const std::vector<uint8_t> r =
      Quantize(layout, {448, -1, 0.5f, 0.001953125f}, 1);
  EXPECT_EQ(r, (std::vector<uint8_t>{0x7e, 0xb8, 0x30, 0x01, 0x00, 0x3c}));
}

TEST(QuantFormatTest, IntegerTiesRoundToEven) {
  // Range [-10, 245]: scale 1, zero 10; exact halves go to the even code.
  const PageLayout layout{1, 1, 8, DType::kInt8, 8};
  const std::vector<uint8_t> r =
      Quantize(layout, {-10, 245, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f}, 1);
  const std::vector<int> codes(r.begin(), r.begin() + 8);
  EXPECT_EQ(codes, (std::vector<int>{0, 255, 12, 14, 8, 6, 10, 10}));
  // int4, range [0, 15]: scale 1, zero 0.
  const PageLayout four{1, 1, 4, DType::kInt4, 4};
  const std::vector<uint8_t> q = Quantize(four, {15, 2.5f, 3.5f, 0.5f}, 1);
  EXPECT_EQ(q[0], 0x2f);  // 15, 2
  EXPECT_EQ(q[1], 0x04);  // 4, 0
}

// The CPU twin's vectorised path is QuantizeGroup (the kernels' shared code)
// byte for byte: on random groups with outliers, on groups whose values sit
// exactly on ties of their own scale, on all-zero groups and on one-signed
// ones, for both integer widths, both zero-point kinds, and fp8_e4m3.
TEST(QuantFormatTest, TheTwinsVectorisedPathIsQuantizeGroupByteForByte) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 64;
  for (int bits : {8, 4, 0}) {  // 0: fp8_e4m3
    for (bool asymmetric : {true, false}) {
      if (bits == 0 && asymmetric) continue;
      const QuantSpec spec = bits == 0 ? SpecOf(DType::kFp8E4M3)
                                       : QuantSpec{bits, false, asymmetric};
      const PageLayout layout{1, 2, 32,
                              bits == 0   ? DType::kFp8E4M3
                              : bits == 8 ? DType::kInt8
                                          : DType::kInt4,
                              16};
      std::vector<float> x(n * layout.token_elements());
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t e = 0; e < layout.token_elements(); ++e) {
          float& v = x[t * layout.token_elements() + e];
          switch (t % 4) {
            case 0:  // Gaussian with an outlier channel
              v = normal(rng) * (e % 16 == 3 ? 40.0f : 1.0f);
              break;
            case 1:  // halves of an integer grid: ties once scaled
              v = (static_cast<float>(rng() % 31) - 15.0f) * 0.5f;
              break;
            case 2:  // zeros
              v = 0.0f;
              break;
            default:  // one-signed
              v = std::fabs(normal(rng)) * 3.0f + 1.0f;
          }
        }
      }
      std::vector<std::byte> twin(n * layout.token_bytes());
      ASSERT_TRUE(QuantizeTokensWith(layout, spec, DType::kF32, x.data(), n,
                                     twin.data())
                      .ok());
      std::vector<uint8_t> reference(twin.size());
      for (int64_t t = 0; t < n; ++t) {
        uint8_t* record = reference.data() + t * layout.token_bytes();
        for (int64_t g = 0; g < layout.groups(); ++g) {
          const int64_t first = g * layout.group_size;
          const float* v = &x[t * layout.token_elements() + first];
          ASSERT_EQ(
              QuantizeGroup(
                  spec, [&](int32_t i) { return v[i]; }, layout.group_size,
                  record, first, record + layout.scales_offset() + 2 * g,
                  record + layout.zeros_offset() + g),
              QuantError::kOk);
        }
      }
      EXPECT_EQ(0, std::memcmp(twin.data(), reference.data(), twin.size()))
          << bits << " bits, asymmetric " << asymmetric;
    }
  }
}

TEST(QuantFormatTest, E4M3TiesRoundToEvenAndSaturate) {
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);  // between 1 and 1.125: to 1
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a);  // between 1.125 and 1.25: 1.25
  EXPECT_EQ(FloatToE4M3(-1.0625f), 0xb8);
  EXPECT_EQ(FloatToE4M3(0.0029296875f), 0x02);    // 1.5 * 2^-9: to 2 * 2^-9
  EXPECT_EQ(FloatToE4M3(0.0048828125f), 0x02);    // 2.5 * 2^-9: to 2 * 2^-9
  EXPECT_EQ(FloatToE4M3(0.015380859375f), 0x08);  // 7.875 * 2^-9: to 2^-6
  EXPECT_EQ(FloatToE4M3(460.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToE4M3(240.0f), 0x77);  // 1.875 * 2^7
}

TEST(QuantFormatTest, EveryE4M3CodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(E4M3ToFloat(static_cast<uint8_t>(c))));
      continue;
    }
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(FloatToE4M3(v), c) << c << " = " << v;
  }
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), 0.001953125f);
  EXPECT_EQ(E4M3ToFloat(0x08), 0.015625f);
}

TEST(QuantFormatTest, F16UpRoundsTowardInfinity) {
  EXPECT_EQ(FloatToF16Up(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16Up(1.0f + 0x1p-23f), 0x3c01);
  EXPECT_EQ(FloatToF16Up(0.0f), 0x0000);
  EXPECT_EQ(FloatToF16Up(0x1p-30f), 0x0001);  // up to the smallest subnormal
  EXPECT_EQ(FloatToF16Up(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16Up(65504.5f), 0x7c00);
}

// Gaussian keys with a few large channels of one sign (the outlier channels
// real keys have), and an all-zero head.
std::vector<float> OutlierData(int64_t n, int32_t kv_heads, int32_t head_dim,
                               uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n * kv_heads * head_dim);
  for (int64_t t = 0; t < n; ++t) {
    for (int32_t h = 0; h < kv_heads; ++h) {
      for (int32_t c = 0; c < head_dim; ++c) {
        float v = normal(rng);
        if (c % 16 == 5) v = 12.0f + 3.0f * v;
        if (c % 29 == 7) v *= 40.0f;
        if (h == 1 && t % 5 == 0) v = 0.0f;
        x[(t * kv_heads + h) * head_dim + c] = v;
      }
    }
  }
  return x;
}

// The scale the format prescribes for one group, from its values.
float ExpectedScale(const QuantSpec& spec, const float* x, int32_t n) {
  float lo = 0, hi = 0;
  for (int32_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float abs_max = std::max(-lo, hi);
  const float span = spec.fp8 ? abs_max / 448.0f
                     : spec.asymmetric
                         ? (hi - lo) / static_cast<float>(spec.max_code())
                         : abs_max / static_cast<float>(spec.fixed_zero() - 1);
  return F16ToFloat(FloatToF16Up(span));
}

TEST(QuantFormatTest, RoundTripWithinTheFormatsBounds) {
  for (DType dtype : {DType::kInt8, DType::kFp8E4M3, DType::kInt4}) {
    for (int32_t head_dim : {64, 80, 128}) {
      for (int32_t group : {16, head_dim}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " head_dim "
                                          << head_dim << " group " << group);
        const PageLayout layout{16, 2, head_dim, dtype, group};
        const QuantSpec spec = SpecOf(dtype);
        const int64_t n = 37;
        const std::vector<float> x = OutlierData(n, 2, head_dim, head_dim);
        const std::vector<uint8_t> records = Quantize(layout, x, n);
        const std::vector<float> y = Dequantize(layout, records, n);
        int64_t checked = 0;
        for (int64_t t = 0; t < n; ++t) {
          const uint8_t* rec = records.data() + t * layout.token_bytes();
          for (int64_t g = 0; g < layout.groups(); ++g) {
            const int64_t at = t * layout.token_elements() + g * group;
            const float s = LoadScale(rec + layout.scales_offset(), g);
            ASSERT_EQ(s, ExpectedScale(spec, x.data() + at, group));
            for (int32_t i = 0; i < group; ++i) {
              const float xi = x[at + i], err = std::fabs(xi - y[at + i]);
              const float bound =
                  spec.fp8
                      ? std::max(std::fabs(xi) * 0x1p-4f, s * 0x1p-10f) +
                            std::fabs(xi) * 0x1p-22f
                      : s * (0.5f + 0x1p-16f) + (std::fabs(xi) + s) * 0x1p-23f;
              ASSERT_LE(err, bound) << "token " << t << " element " << at + i;
              ++checked;
            }
          }
        }
        EXPECT_EQ(checked, n * layout.token_elements());
      }
    }
  }
}

TEST(QuantFormatTest, InputDtypesAreReadExactly) {
  // bf16 and f16 inputs quantise like their float32 values.
  const PageLayout layout{4, 2, 64, DType::kInt4, 32};
  const std::vector<float> x = OutlierData(5, 2, 64, 3);
  for (DType in : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> narrow(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      StoreFromFloat(in, narrow.data(), i, x[i]);
      widened[i] = LoadAsFloat(in, narrow.data(), i);
    }
    std::vector<std::byte> a(5 * layout.token_bytes());
    ASSERT_TRUE(QuantizeTokens(layout, in, narrow.data(), 5, a.data()).ok());
    const std::vector<uint8_t> b = Quantize(layout, widened, 5);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), b.size()), 0) << DTypeName(in);
  }
}

TEST(QuantFormatTest, NonFiniteAndHugeValuesAreReportedWithTheirGroup) {
  const PageLayout layout{4, 2, 8, DType::kInt8, 4};
  for (float bad : {kNaN, kInf, -kInf}) {
    std::vector<float> x(3 * 16, 1.0f);
    x[1 * 16 + 9] = bad;  // token 1, head 1, group 2
    std::vector<std::byte> out(3 * layout.token_bytes());
    const QuantizeResult r =
        QuantizeTokens(layout, DType::kF32, x.data(), 3, out.data());
    EXPECT_EQ(r.error, QuantError::kNonFinite);
    EXPECT_EQ(r.token, 1);
    EXPECT_EQ(r.element, 8);
  }
  // int8's scale is (hi - lo) / 255 in binary16: 65504 * 255 is the limit.
  std::vector<float> x(16, 1.0f);
  x[3] = 65504.0f * 255.0f;
  std::vector<std::byte> out(layout.token_bytes());
  EXPECT_TRUE(
      QuantizeTokens(layout, DType::kF32, x.data(), 1, out.data()).ok());
  x[3] = 65520.0f * 255.0f;
  const QuantizeResult r =
      QuantizeTokens(layout, DType::kF32, x.data(), 1, out.data());
  EXPECT_EQ(r.error, QuantError::kOutOfRange);
  EXPECT_EQ(r.element, 0);
}

TEST(QuantFormatTest, ZeroGroupStoresZeros) {
  for (DType dtype : {DType::kInt8, DType::kFp8E4M3, DType::kInt4}) {
    const PageLayout layout{1, 1, 8, dtype, 8};
    const std::vector<float> y =
        Dequantize(layout, Quantize(layout, std::vector<float>(8, 0.0f), 1), 1);
    EXPECT_EQ(y, std::vector<float>(8, 0.0f)) << DTypeName(dtype);
  }
}

TEST(QuantFormatTest, DequantizeToNarrowDtypesRoundsTheFloats) {
  const PageLayout layout{4, 2, 64, DType::kFp8E4M3, 32};
  const std::vector<uint8_t> r = Quantize(layout, OutlierData(3, 2, 64, 9), 3);
  const std::vector<float> f = Dequantize(layout, r, 3);
  for (DType out : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> narrow(f.size());
    DequantizeTokens(layout, reinterpret_cast<const std::byte*>(r.data()), 3,
                     out, narrow.data());
    for (size_t i = 0; i < f.size(); ++i) {
      ASSERT_EQ(narrow[i],
                out == DType::kF16 ? FloatToF16(f[i]) : FloatToBf16(f[i]));
    }
  }
}

// One query-scoring case: quantised keys against f32 keys holding their
// dequantised values, bit for bit.
void ExpectScoringMatchesValues(DType dtype, int32_t head_dim,
                                int32_t group_size, int64_t slots,
                                int32_t group) {
  SCOPED_TRACE(::testing::Message()
               << DTypeName(dtype) << " head_dim " << head_dim << " groups of "
               << group_size << " slots " << slots << " gqa " << group);
  constexpr int32_t kPageTokens = 3, kKvHeads = 2;
  const PageLayout q{kPageTokens, kKvHeads, head_dim, dtype, group_size};
  const PageLayout f{kPageTokens, kKvHeads, head_dim, DType::kF32};
  const std::vector<float> x = OutlierData(slots, kKvHeads, head_dim, 21);
  const std::vector<uint8_t> records = Quantize(q, x, slots);
  const std::vector<float> values = Dequantize(q, records, slots);
  // The block table takes pages in reverse order; K records then V (zeros).
  const int64_t num_pages = (slots + kPageTokens - 1) / kPageTokens;
  std::vector<PageId> pages(num_pages);
  for (int64_t p = 0; p < num_pages; ++p) {
    pages[p] = static_cast<PageId>(num_pages - 1 - p);
  }
  std::vector<std::byte> qa(num_pages * q.page_bytes());
  std::vector<std::byte> fa(num_pages * f.page_bytes());
  const std::vector<std::byte> fv = Bytes(values);
  for (int64_t s = 0; s < slots; ++s) {
    const PageId p = pages[s / kPageTokens];
    const int32_t in_page = static_cast<int32_t>(s % kPageTokens);
    std::memcpy(qa.data() + q.key_offset(p, in_page),
                records.data() + s * q.token_bytes(), q.token_bytes());
    std::memcpy(fa.data() + f.key_offset(p, in_page),
                fv.data() + s * f.token_bytes(), f.token_bytes());
  }
  const int32_t query_heads = kKvHeads * group;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> queries(2 * query_heads * head_dim);
  for (float& v : queries) v = normal(rng);
  const std::vector<int64_t> row_order = {slots - 1, slots / 2};
  std::vector<int64_t> order(slots);
  for (int64_t s = 0; s < slots; ++s) order[s] = s;
  std::vector<float> out_q(2 * slots), out_f(2 * slots);
  std::vector<float> scratch(query_heads * slots + head_dim);
  QueryAttention(PagedKeys{qa.data(), q, pages, order, slots}, queries.data(),
                 row_order.data(), 2, query_heads, out_q.data(),
                 scratch.data());
  QueryAttention(PagedKeys{fa.data(), f, pages, order, slots}, queries.data(),
                 row_order.data(), 2, query_heads, out_f.data(),
                 scratch.data());
  EXPECT_EQ(out_q, out_f);
  EXPECT_GT(out_q[0], 0.0f);
}

TEST(QuantFormatTest, ScoringQuantisedKeysEqualsScoringTheirValues) {
  // Query scoring dequantises inside the kernel (into its key tile): the
  // same logits as f32 keys holding the dequantised values, bit for bit,
  // over head dims that leave a partial 16-lane chunk, groups of 8 to 32,
  // slot counts around the kernel's tiles (32 keys at head_dim 128) and
  // register blocks (8 keys), and GQA groups that leave head tails.
  int cases = 0;
  for (DType dtype : {DType::kInt8, DType::kFp8E4M3, DType::kInt4}) {
    for (int32_t head_dim : {32, 80, 128}) {
      for (int32_t group_size : {8, 16, 32}) {
        if (head_dim % group_size != 0) continue;
        for (int64_t slots : {1, 11, 33, 70}) {
          for (int32_t group : {1, 3, 4}) {
            ExpectScoringMatchesValues(dtype, head_dim, group_size, slots,
                                       group);
            if (HasFailure()) return;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 8 * 4 * 3);
}

}  // namespace
}  // namespace kvkeep
