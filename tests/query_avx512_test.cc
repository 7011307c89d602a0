// kernels/query_avx512.h: the AVX-512 key widening against the scalar twin
// (WidenHead), every code of every format, bit for bit; and the register
// blocks' dot products against plain double sums. Skipped on a CPU without
// AVX-512 (nothing calls these functions there).
#include "kernels/query_avx512.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

// Binary16 scales that exercise the scale path: zero, the smallest
// subnormal, a subnormal with many bits, one, an odd-mantissa normal, the
// largest finite.
constexpr uint16_t kScales[] = {0x0000, 0x0001, 0x03ff, 0x3c00, 0x2e67, 0x7bff};

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Widens every kv head of every record with WidenTileAvx512 and with
// WidenHead and requires the same bits (padding columns past head_dim: 0).
void ExpectSameAsTwin(const PageLayout& layout,
                      const std::vector<std::vector<std::byte>>& records) {
  const int32_t d = layout.head_dim;
  const int32_t dp = d + 16;  // one padding chunk, which must come back 0
  std::vector<const std::byte*> rows;
  for (const auto& r : records) rows.push_back(r.data());
  rows.push_back(nullptr);  // a row the tile fills with zeros
  const int32_t count = static_cast<int32_t>(rows.size());
  std::vector<float> tile(int64_t{count} * dp, std::nanf(""));
  std::vector<float> want(d);
  for (int32_t head = 0; head < layout.kv_heads; ++head) {
    WidenTileAvx512(layout, nullptr, rows.data(), count, head, dp, tile.data());
    for (int32_t t = 0; t < count; ++t) {
      const float* got = tile.data() + int64_t{t} * dp;
      if (rows[t] == nullptr) {
        std::fill(want.begin(), want.end(), 0.0f);
      } else {
        WidenHead(layout, rows[t], head, want.data());
      }
      for (int32_t i = 0; i < d; ++i) {
        ASSERT_EQ(Bits(got[i]), Bits(want[i]))
            << DTypeName(layout.dtype) << " record " << t << " head " << head
            << " element " << i << ": " << got[i] << " vs " << want[i];
      }
      for (int32_t i = d; i < dp; ++i) ASSERT_EQ(Bits(got[i]), 0u) << i;
    }
  }
}

// Records of `layout` (int8, int4 or fp8_e4m3) whose codes cycle through
// every code at every position (record r, element e: code (e + r * step) mod
// codes), each group with a scale of kScales and a zero point of its own.
std::vector<std::vector<std::byte>> EveryCode(const PageLayout& layout) {
  const int32_t codes = layout.dtype == DType::kInt4 ? 16 : 256;
  const int64_t elements = layout.token_elements();
  const int64_t groups = layout.groups();
  const bool has_zero = layout.dtype != DType::kFp8E4M3;
  std::vector<std::vector<std::byte>> records;
  for (int32_t r = 0; r < codes; ++r) {
    std::vector<std::byte> rec(layout.token_bytes());
    auto* p = reinterpret_cast<uint8_t*>(rec.data());
    for (int64_t e = 0; e < elements; ++e) {
      const uint8_t code = static_cast<uint8_t>((e + r * 7) % codes);
      if (layout.dtype == DType::kInt4) {
        p[e / 2] |= static_cast<uint8_t>(e % 2 ? code << 4 : code);
      } else {
        p[e] = code;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t s = kScales[(g + r) % std::size(kScales)];
      p[layout.scales_offset() + 2 * g] = static_cast<uint8_t>(s & 0xff);
      p[layout.scales_offset() + 2 * g + 1] = static_cast<uint8_t>(s >> 8);
      if (has_zero) {
        p[layout.zeros_offset() + g] =
            static_cast<uint8_t>((g * 5 + r) % codes);
      }
    }
    records.push_back(std::move(rec));
  }
  return records;
}

class QueryAvx512Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CpuHasAvx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  }
};

TEST_F(QueryAvx512Test, EveryInt4CodeWidensAsTheTwin) {
  for (int32_t group : {32, 64}) {
    const PageLayout layout{16, 3, 128, DType::kInt4, group};
    ASSERT_TRUE(Avx512Widens(layout));
    ExpectSameAsTwin(layout, EveryCode(layout));
  }
}

TEST_F(QueryAvx512Test, EveryInt8CodeWidensAsTheTwin) {
  const PageLayout layout{16, 2, 64, DType::kInt8, 32};
  ASSERT_TRUE(Avx512Widens(layout));
  ExpectSameAsTwin(layout, EveryCode(layout));
}

// Every E4M3 code, subnormals, both zeros and both NaNs (0x7f, 0xff)
// included, times every kind of scale.
TEST_F(QueryAvx512Test, EveryFp8CodeWidensAsTheTwin) {
  const PageLayout layout{16, 2, 256, DType::kFp8E4M3, 32};
  ASSERT_TRUE(Avx512Widens(layout));
  ExpectSameAsTwin(layout, EveryCode(layout));
}

// kivi_int4: every code at every position of a page's rows, per-channel
// scales of every kind and zero points, in the second page of an arena (the
// widening finds a row's block from its offset).
TEST_F(QueryAvx512Test, EveryKiviCodeWidensAsTheTwin) {
  const PageLayout layout{16, 2, 64, DType::kKiviInt4, 32};
  ASSERT_TRUE(Avx512Widens(layout));
  std::vector<std::byte> arena(2 * layout.page_bytes());
  auto* block = reinterpret_cast<uint8_t*>(arena.data()) + layout.page_bytes();
  const int64_t channels = layout.token_elements();
  for (int32_t t = 0; t < layout.page_tokens; ++t) {
    uint8_t* row = block + t * layout.code_bytes();
    for (int64_t c = 0; c < channels; ++c) {
      const uint8_t code = static_cast<uint8_t>((c + t * 7) % 16);
      row[c / 2] |= static_cast<uint8_t>(c % 2 ? code << 4 : code);
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    const uint16_t s = kScales[c % std::size(kScales)];
    block[layout.key_scales_offset() + 2 * c] = static_cast<uint8_t>(s & 0xff);
    block[layout.key_scales_offset() + 2 * c + 1] =
        static_cast<uint8_t>(s >> 8);
    block[layout.key_zeros_offset() + c] = static_cast<uint8_t>((c * 5) % 16);
  }
  std::vector<const std::byte*> rows;
  for (int32_t t = 0; t < layout.page_tokens; ++t) {
    rows.push_back(arena.data() + layout.page_bytes() +
                   t * layout.code_bytes());
  }
  const int32_t d = layout.head_dim;
  std::vector<float> tile(rows.size() * d), want(d);
  for (int32_t head = 0; head < layout.kv_heads; ++head) {
    WidenTileAvx512(layout, arena.data(), rows.data(),
                    static_cast<int32_t>(rows.size()), head, d, tile.data());
    for (int32_t t = 0; t < layout.page_tokens; ++t) {
      WidenKiviKeyHead(layout, arena.data() + layout.page_bytes(), t, head,
                       want.data());
      for (int32_t i = 0; i < d; ++i) {
        ASSERT_EQ(Bits(tile[t * d + i]), Bits(want[i]))
            << "slot " << t << " head " << head << " element " << i;
      }
    }
  }
}

// Every binary16 bit pattern: the same value as WidenHead, NaN for NaN (the
// hardware conversion quiets a signalling NaN's payload; a NaN key makes its
// head's softmax NaN either way).
TEST_F(QueryAvx512Test, EveryHalfWidensToTheTwinsValue) {
  const PageLayout layout{16, 1, 256, DType::kF16};
  ASSERT_TRUE(Avx512Widens(layout));
  std::vector<std::vector<std::byte>> records(65536 / 256);
  for (size_t r = 0; r < records.size(); ++r) {
    records[r].resize(layout.token_bytes());
    for (int32_t i = 0; i < 256; ++i) {
      const uint16_t h = static_cast<uint16_t>(r * 256 + i);
      std::memcpy(records[r].data() + 2 * i, &h, 2);
    }
  }
  std::vector<const std::byte*> rows;
  for (const auto& r : records) rows.push_back(r.data());
  std::vector<float> tile(rows.size() * 256);
  WidenTileAvx512(layout, nullptr, rows.data(),
                  static_cast<int32_t>(rows.size()), 0, 256, tile.data());
  std::vector<float> want(256);
  for (size_t r = 0; r < rows.size(); ++r) {
    WidenHead(layout, rows[r], 0, want.data());
    for (int32_t i = 0; i < 256; ++i) {
      const float got = tile[r * 256 + i];
      if (std::isnan(want[i])) {
        ASSERT_TRUE(std::isnan(got)) << r * 256 + i;
        ASSERT_EQ(std::signbit(got), std::signbit(want[i])) << r * 256 + i;
      } else {
        ASSERT_EQ(Bits(got), Bits(want[i])) << r * 256 + i;
      }
    }
  }
}

TEST_F(QueryAvx512Test, NotForOtherDtypesOrShapes) {
  EXPECT_FALSE(Avx512Widens(PageLayout{16, 2, 64, DType::kF32}));
  EXPECT_FALSE(Avx512Widens(PageLayout{16, 2, 64, DType::kBF16}));
  EXPECT_FALSE(Avx512Widens(PageLayout{16, 2, 72, DType::kF16}));
  EXPECT_FALSE(Avx512Widens(PageLayout{16, 2, 64, DType::kInt4, 16}));
  EXPECT_FALSE(Avx512Widens(PageLayout{16, 2, 80, DType::kKiviInt4, 32}));
}

// Every register block shape (4, 2 and 1 heads; 4 and 8 keys) and a key
// count that leaves partial blocks, from a tile and from f32 rows: within
// float rounding of the double sums, and the same bits either way.
TEST_F(QueryAvx512Test, DotsMatchPlainSumsForEveryBlockShape) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  constexpr int32_t kDim = 96, kCount = 13, kPadded = 16;
  std::vector<float> keys(kPadded * kDim, 0.0f);
  for (int32_t i = 0; i < kCount * kDim; ++i) keys[i] = normal(rng);
  std::vector<const std::byte*> rows(kPadded);
  for (int32_t t = 0; t < kPadded; ++t) {
    rows[t] = reinterpret_cast<const std::byte*>(keys.data() + t * kDim);
  }
  for (int32_t heads : {1, 2, 3, 4, 7}) {
    std::vector<float> q(heads * kDim);
    for (float& x : q) x = normal(rng);
    constexpr int64_t kN = kCount + 5;  // row stride longer than the keys
    std::vector<float> from_tile(heads * kN, -1.0f);
    std::vector<float> from_rows(heads * kN, -1.0f);
    DotsAvx512(q.data(), heads, kDim,
               KeyRows{DType::kInt8, nullptr, keys.data()}, kCount,
               from_tile.data(), kN);
    DotsAvx512(q.data(), heads, kDim,
               KeyRows{DType::kF32, rows.data(), nullptr}, kCount,
               from_rows.data(), kN);
    for (int32_t j = 0; j < heads; ++j) {
      for (int64_t t = 0; t < kN; ++t) {
        const float got = from_tile[j * kN + t];
        ASSERT_EQ(Bits(got), Bits(from_rows[j * kN + t])) << j << " " << t;
        if (t >= kCount) {  // past the keys: untouched
          ASSERT_EQ(got, -1.0f) << j << " " << t;
          continue;
        }
        double want = 0, mag = 0;
        for (int32_t i = 0; i < kDim; ++i) {
          want += double(q[j * kDim + i]) * keys[t * kDim + i];
          mag += std::fabs(double(q[j * kDim + i]) * keys[t * kDim + i]);
        }
        ASSERT_NEAR(got, want, 1e-6 * mag) << "head " << j << " key " << t;
      }
    }
  }
}

// DotsAvx512 of q [heads][d] against `count` keys read through `fused`
// (in place) and through `tile` (the same keys widened first): the same
// bits, and nothing written past the keys (rows n = count + 3 long).
void ExpectFusedAsTile(const std::vector<float>& q, int32_t heads, int32_t d,
                       const float* tile, const KeyRows& fused, int32_t count,
                       const std::string& what) {
  const int64_t n = count + 3;
  std::vector<float> from_tile(heads * n, -1.0f);
  std::vector<float> in_place(heads * n, -1.0f);
  DotsAvx512(q.data(), heads, d, KeyRows{fused.kind, nullptr, tile}, count,
             from_tile.data(), n);
  DotsAvx512(q.data(), heads, d, fused, count, in_place.data(), n);
  for (int64_t i = 0; i < heads * n; ++i) {
    ASSERT_EQ(Bits(in_place[i]), Bits(from_tile[i]))
        << what << " heads " << heads << " at " << i;
    if (i % n >= count) {
      ASSERT_EQ(in_place[i], -1.0f) << what << " " << i;
    }
  }
}

// Keys widened in registers from the records (f16 rows, int8 / int4 / fp8
// records) give the same dot products, bit for bit, as the same keys
// widened into a tile first: every code of every format, groups of one and
// of several 32-element chunks, a record that reads as zeros, every block
// shape and partial blocks.
TEST_F(QueryAvx512Test, FusedWideningDotsAsTheTile) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const PageLayout layouts[] = {
      {16, 3, 128, DType::kInt4, 32},   {16, 2, 128, DType::kInt8, 64},
      {16, 1, 192, DType::kInt4, 96},   {16, 2, 64, DType::kInt8, 32},
      {16, 2, 96, DType::kFp8E4M3, 32}, {16, 2, 80, DType::kF16}};
  for (const PageLayout& layout : layouts) {
    ASSERT_TRUE(FusedWidens(layout)) << DTypeName(layout.dtype);
    std::vector<std::vector<std::byte>> records;
    if (layout.dtype == DType::kF16) {
      for (int32_t r = 0; r < 21; ++r) {  // finite halves of every exponent
        std::vector<std::byte> rec(layout.token_bytes());
        for (int64_t e = 0; e < layout.token_elements(); ++e) {
          const uint16_t h = static_cast<uint16_t>(
              (e * 131 + r * 977) % 0x7c00 | (e % 3 == 0 ? 0x8000 : 0));
          std::memcpy(rec.data() + 2 * e, &h, 2);
        }
        records.push_back(std::move(rec));
      }
    } else {
      records = EveryCode(layout);
    }
    const std::vector<std::byte> zeros(layout.token_bytes());
    const int32_t d = layout.head_dim;
    const bool whole = IsQuantized(layout.dtype);  // rows: whole records
    for (int32_t heads : {1, 2, 4, 7}) {
      std::vector<float> q(heads * d);
      for (float& x : q) x = normal(rng) * 1e-3f;
      for (int32_t head = 0; head < layout.kv_heads; ++head) {
        // Keys: the records, a zero one in the middle, then zero padding up
        // to the next multiple of 8.
        std::vector<const std::byte*> rows;
        std::vector<const std::byte*> recs;
        for (size_t r = 0; r < records.size(); ++r) {
          recs.push_back(r == 5 ? nullptr : records[r].data());
        }
        const int32_t count = static_cast<int32_t>(recs.size());
        const int32_t padded = (count + 7) / 8 * 8;
        std::vector<float> tile(int64_t{padded} * d, 0.0f);
        WidenTileAvx512(layout, nullptr, recs.data(), count, head, d,
                        tile.data());
        const int64_t offset = whole ? 0 : int64_t{head} * d * 2;
        for (int32_t t = 0; t < padded; ++t) {
          rows.push_back(t < count && recs[t] != nullptr ? recs[t] + offset
                                                         : zeros.data());
        }
        ExpectFusedAsTile(
            q, heads, d, tile.data(),
            KeyRows{layout.dtype, rows.data(), nullptr, &layout, head}, count,
            absl::StrCat(std::string(DTypeName(layout.dtype)), " head ", head));
      }
    }
  }
  EXPECT_FALSE(FusedWidens(PageLayout{16, 2, 64, DType::kBF16}));
  EXPECT_FALSE(FusedWidens(PageLayout{16, 2, 256, DType::kKiviInt4, 32}));
}

// kivi_int4 keys widened in registers (each page's channels in a table)
// give the same dot products, bit for bit, as the same keys widened into a
// tile: pages of 1 token (a run meets more pages than its table holds) and
// of 3, slots in shuffled order, rows that read as zeros among them.
TEST_F(QueryAvx512Test, FusedKiviDotsAsTheTile) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int32_t page_tokens : {1, 3}) {
    const PageLayout layout{page_tokens, 2, 64, DType::kKiviInt4, 32};
    ASSERT_TRUE(FusedWidens(layout));
    constexpr int32_t kSlots = 45;
    const int32_t pages = (kSlots + page_tokens - 1) / page_tokens;
    std::vector<std::byte> arena(pages * layout.page_bytes());
    auto* base = reinterpret_cast<uint8_t*>(arena.data());
    const int64_t channels = layout.token_elements();
    for (int32_t p = 0; p < pages; ++p) {
      uint8_t* block = base + p * layout.page_bytes();
      for (int32_t t = 0; t < page_tokens; ++t) {
        for (int64_t c = 0; c < channels; c += 2) {
          block[t * layout.code_bytes() + c / 2] =
              static_cast<uint8_t>(rng() & 0xff);
        }
      }
      for (int64_t c = 0; c < channels; ++c) {
        const uint16_t sc = kScales[(c + p) % std::size(kScales)];
        block[layout.key_scales_offset() + 2 * c] =
            static_cast<uint8_t>(sc & 0xff);
        block[layout.key_scales_offset() + 2 * c + 1] =
            static_cast<uint8_t>(sc >> 8);
        block[layout.key_zeros_offset() + c] =
            static_cast<uint8_t>((c * 5 + p) % 16);
      }
    }
    std::vector<int32_t> order(kSlots);
    for (int32_t t = 0; t < kSlots; ++t) order[t] = t;
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<std::byte> zeros(layout.token_bytes());
    std::vector<const std::byte*> recs, rows;
    for (int32_t t = 0; t < kSlots; ++t) {
      const int32_t s = order[t];
      recs.push_back(t % 7 == 3
                         ? nullptr
                         : arena.data() + layout.key_offset(s / page_tokens,
                                                            s % page_tokens));
    }
    const int32_t padded = (kSlots + 7) / 8 * 8;
    for (int32_t t = 0; t < padded; ++t) {
      rows.push_back(t < kSlots && recs[t] != nullptr ? recs[t] : zeros.data());
    }
    const int32_t d = layout.head_dim;
    for (int32_t heads : {1, 4, 6}) {
      std::vector<float> q(heads * d);
      for (float& x : q) x = normal(rng);
      for (int32_t head = 0; head < layout.kv_heads; ++head) {
        std::vector<float> tile(int64_t{padded} * d, 0.0f);
        WidenTileAvx512(layout, arena.data(), recs.data(), kSlots, head, d,
                        tile.data());
        ExpectFusedAsTile(
            q, heads, d, tile.data(),
            KeyRows{layout.dtype, rows.data(), nullptr, &layout, head,
                    arena.data(), zeros.data()},
            kSlots, absl::StrCat("pages of ", page_tokens, " head ", head));
      }
    }
  }
}

}  // namespace
}  // namespace kvkeep
