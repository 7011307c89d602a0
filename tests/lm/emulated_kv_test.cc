// The emulated quantised cache (services/lm/emulated_kv.h) that measures
// KIVI's per-channel keys on the real model: what it hands the model is
// the formats' CPU twins applied to the bf16 of what was appended — per
// token for values (and keys of the stored formats), per channel over each
// whole group of tokens for KIVI's keys, bf16 until the group is whole — the
// same whether tokens come one at a time or in chunks that straddle the
// groups; its bytes are the format's.
#include "services/lm/emulated_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kivi.h"
#include "kernels/quant_format.h"
#include "services/lm/format_emulation.h"
#include "tests/lm/kv_testing.h"

namespace kvkeep::lm {
namespace {

using ::kvkeep::lm::testing::Append;
using ::kvkeep::lm::testing::Bytes;
using ::kvkeep::lm::testing::Config;
using ::kvkeep::lm::testing::kHeadDim;
using ::kvkeep::lm::testing::kKvHeads;
using ::kvkeep::lm::testing::kLayers;
using ::kvkeep::lm::testing::kWidth;
using ::kvkeep::lm::testing::RandomTokens;
using ::kvkeep::lm::testing::Read;
using ::kvkeep::lm::testing::Tokens;

std::vector<float> Bf16(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = Bf16ToFloat(FloatToBf16(x[i]));
  return y;
}

TEST(EmulationTest, ParsesTheFormatsAndNamesWhatIsWrong) {
  absl::StatusOr<Emulation> kivi = Emulation::Parse("kivi_int4/g8/t4");
  ASSERT_TRUE(kivi.ok()) << kivi.status();
  EXPECT_EQ(kivi->dtype, DType::kInt4);
  EXPECT_EQ(kivi->group_size, 8);
  EXPECT_EQ(kivi->key_group_tokens, 4);
  EXPECT_EQ(kivi->Name(), "kivi_int4/g8/t4 (emulated)");
  absl::StatusOr<Emulation> int8 = Emulation::Parse("int8/g32");
  ASSERT_TRUE(int8.ok()) << int8.status();
  EXPECT_EQ(int8->dtype, DType::kInt8);
  EXPECT_EQ(int8->key_group_tokens, 0);
  absl::StatusOr<Emulation> int2 = Emulation::Parse("kivi_int2/g16/t32");
  ASSERT_TRUE(int2.ok()) << int2.status();
  EXPECT_EQ(int2->code_bits, 2);
  EXPECT_EQ(int2->key_bits(), 2);
  EXPECT_EQ(int2->Name(), "kivi_int2/g16/t32 (emulated)");
  for (const char* bad :
       {"int3/g32", "int4", "int4/32", "int4/g0", "int4/g7", "kivi_int4/g32",
        "kivi_int4/g32/32", "int8/g32/t4", "kivi_int8/g32/t32",
        "kivi_int4/g32/t16/stored", "kivi_int2/g32/t16/store"}) {
    absl::StatusOr<Emulation> e = Emulation::Parse(bad);
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(e.status().message().find(bad), std::string::npos) << e.status();
  }
}

// KIVI with groups of 4 tokens, fed 11 tokens as 3 + 1 + 5 + 2 (chunks that
// end inside, at and across group ends): keys of tokens 0-7 per channel,
// 8-10 in bf16; values per token; one token at a time gives the same.
TEST(EmulatedKvTest, KiviKeysArePerChannelOverWholeGroupsAndBf16After) {
  const Emulation kivi = *Emulation::Parse("kivi_int4/g8/t4");
  const Tokens t = RandomTokens(11, 5);
  EmulatedKv chunks(Config(), kivi, 16), singles(Config(), kivi, 16);
  int64_t at = 0;
  for (int64_t n : {3, 1, 5, 2}) {
    ASSERT_TRUE(Append(chunks, t, at, n).ok());
    at += n;
  }
  for (int64_t i = 0; i < 11; ++i) ASSERT_TRUE(Append(singles, t, i, 1).ok());
  const Tokens got = Read(chunks);
  EXPECT_EQ(got, Read(singles));

  const TokenBlock group{4, kKvHeads, kHeadDim}, block{11, kKvHeads, kHeadDim};
  double bits = 0;
  for (int32_t l = 0; l < kLayers; ++l) {
    const std::vector<float> keys = Bf16(t[l][0]);
    std::vector<float> want(keys.begin() + 8 * kWidth, keys.end());
    for (int64_t g = 1; g >= 0; --g) {
      const std::vector<float> x(keys.begin() + g * 4 * kWidth,
                                 keys.begin() + (g + 1) * 4 * kWidth);
      const std::vector<float> y = ThroughPerChannel(group, 4, 4, x, &bits);
      want.insert(want.begin(), y.begin(), y.end());
    }
    EXPECT_EQ(got[l][0], want) << "keys of layer " << l;
    EXPECT_EQ(got[l][1],
              ThroughPerToken(block, DType::kInt4, 8, Bf16(t[l][1]), &bits))
        << "values of layer " << l;
  }
}

// As kvkeepd's kivi_int4 holds them ("/store"): after every append, each
// group of 4 tokens' keys are the store's twin (kernels/kivi.h) over the
// bf16 of the tokens it holds so far, the open group included, the same
// whether tokens come one at a time or in chunks.
TEST(EmulatedKvTest, StorePagesQuantiseTheOpenGroupAsItFills) {
  const Emulation store = *Emulation::Parse("kivi_int4/g8/t4/store");
  EXPECT_EQ(store.Name(), "kivi_int4/g8/t4/store (emulated)");
  const Tokens t = RandomTokens(11, 5);
  EmulatedKv chunks(Config(), store, 16), singles(Config(), store, 16);
  const PageLayout page{4, kKvHeads, kHeadDim, DType::kKiviInt4, 8};
  int64_t at = 0;
  for (int64_t n : {3, 1, 5, 2}) {
    ASSERT_TRUE(Append(chunks, t, at, n).ok());
    for (int64_t i = at; i < at + n; ++i) {
      ASSERT_TRUE(Append(singles, t, i, 1).ok());
    }
    at += n;
    const Tokens got = Read(chunks);
    EXPECT_EQ(got, Read(singles)) << at << " tokens";
    for (int32_t l = 0; l < kLayers; ++l) {
      const std::vector<float> keys = Bf16(t[l][0]);
      std::vector<float> want(at * kWidth);
      std::vector<std::byte> block(page.key_block_bytes());
      for (int64_t g = 0; g < at; g += 4) {
        const auto count = static_cast<int32_t>(std::min<int64_t>(4, at - g));
        ASSERT_TRUE(QuantizeKiviKeys(page, keys.data() + g * kWidth, count,
                                     block.data())
                        .ok());
        DequantizeKiviKeys(page, block.data(), 0, count, DType::kF32,
                           want.data() + g * kWidth);
      }
      EXPECT_EQ(std::vector<float>(got[l][0].begin(),
                                   got[l][0].begin() + at * kWidth),
                want)
          << "keys of layer " << l << " at " << at << " tokens";
    }
  }
}

TEST(EmulatedKvTest, StoredFormatsRoundKeysAndValuesPerToken) {
  const Tokens t = RandomTokens(6, 9);
  const TokenBlock block{6, kKvHeads, kHeadDim};
  for (const char* format : {"int4/g8", "int8/g4", "fp8_e4m3/g8"}) {
    const Emulation e = *Emulation::Parse(format);
    EmulatedKv cache(Config(), e, 8);
    ASSERT_TRUE(Append(cache, t, 0, 2).ok());
    ASSERT_TRUE(Append(cache, t, 2, 4).ok());
    const Tokens got = Read(cache);
    double bits = 0;
    for (int32_t l = 0; l < kLayers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        EXPECT_EQ(got[l][kv], ThroughPerToken(block, e.dtype, e.group_size,
                                              Bf16(t[l][kv]), &bits))
            << format << " layer " << l << " kv " << kv;
      }
    }
    // The stored format's own token records, keys and values, every layer.
    const PageLayout records{1, kKvHeads, kHeadDim, e.dtype, e.group_size};
    EXPECT_EQ(cache.held_bytes(), kLayers * 2 * 6 * records.token_bytes())
        << format;
  }
}

TEST(EmulatedKvTest, KiviHoldsItsBytesAndPerChannelKeysErrLess) {
  const Tokens t = RandomTokens(10, 3);
  EmulatedKv kivi(Config(), *Emulation::Parse("kivi_int4/g8/t4"), 16);
  EmulatedKv int4(Config(), *Emulation::Parse("int4/g8"), 16);
  ASSERT_TRUE(Append(kivi, t, 0, 10).ok());
  ASSERT_TRUE(Append(int4, t, 0, 10).ok());
  // Keys: 8 tokens in int4 codes (kWidth / 2 bytes each) plus 3 bytes per
  // channel per group, 2 tokens in bf16; values as int4/g8's records.
  const PageLayout values{1, kKvHeads, kHeadDim, DType::kInt4, 8};
  EXPECT_EQ(kivi.held_bytes(),
            kLayers * (8 * kWidth / 2 + 2 * kWidth * 3 + 2 * kWidth * 2 +
                       10 * values.token_bytes()));
  // The outlier channel: per-token groups spend their range on it.
  double kivi_err = 0, int4_err = 0;
  const Tokens a = Read(kivi), b = Read(int4);
  for (int32_t l = 0; l < kLayers; ++l) {
    for (int64_t i = 0; i < 8 * kWidth; ++i) {
      kivi_err += std::fabs(a[l][0][i] - t[l][0][i]);
      int4_err += std::fabs(b[l][0][i] - t[l][0][i]);
    }
  }
  EXPECT_LT(kivi_err, 0.5 * int4_err);
}

// The generic integer groups are the store's int4 twin, value for value:
// what makes the emulated int2 (not a stored format) comparable.
TEST(FormatEmulationTest, GenericIntegerGroupsAreTheStoresInt4) {
  const Tokens t = RandomTokens(5, 11);
  const TokenBlock block{5, kKvHeads, kHeadDim};
  double a = 0, b = 0;
  for (int kv = 0; kv < 2; ++kv) {
    EXPECT_EQ(ThroughPerTokenInt(4, 8, t[0][kv], &a),
              ThroughPerToken(block, DType::kInt4, 8, t[0][kv], &b));
    EXPECT_EQ(a, b);
  }
  // int2 keeps four levels a group: coarser than int4, finer than nothing.
  const std::vector<float> y = ThroughPerTokenInt(2, 8, t[0][1], &a);
  EXPECT_EQ(a, 2 + 24.0 / 8);
  double err2 = 0, err4 = 0;
  const std::vector<float> y4 = ThroughPerTokenInt(4, 8, t[0][1], &b);
  for (size_t i = 0; i < y.size(); ++i) {
    err2 += std::fabs(y[i] - t[0][1][i]);
    err4 += std::fabs(y4[i] - t[0][1][i]);
  }
  EXPECT_GT(err2, 2 * err4);
}

TEST(EmulatedKvTest, KiviInt2HoldsItsBytes) {
  const Tokens t = RandomTokens(10, 4);
  EmulatedKv kivi(Config(), *Emulation::Parse("kivi_int2/g8/t4"), 16);
  ASSERT_TRUE(Append(kivi, t, 0, 10).ok());
  // Keys: 8 tokens of 2-bit codes plus 3 bytes per channel per group, 2 in
  // bf16; values: 2-bit codes plus 3 bytes per group of 8.
  EXPECT_EQ(kivi.held_bytes(),
            kLayers * (8 * kWidth / 4 + 2 * kWidth * 3 + 2 * kWidth * 2 +
                       10 * (kWidth / 4 + kWidth / 8 * 3)));
}

TEST(EmulatedKvTest, RefusesANonFiniteValue) {
  Tokens t = RandomTokens(2, 1);
  t[1][1][5] = std::numeric_limits<float>::infinity();
  EmulatedKv cache(Config(), *Emulation::Parse("int4/g8"), 4);
  const absl::Status s = Append(cache, t, 0, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not finite"), std::string::npos) << s;
  EXPECT_EQ(cache.resident(), 0);
}

}  // namespace
}  // namespace kvkeep::lm
