// kivi_int4's key block (kernels/kivi.h, kernels/page_layout.h): a
// hand-made block byte for byte, exact pack/unpack round trips of codes that
// sit on the grid, per-channel error bounds on fixed data (each key within
// half its own channel's scale, the scale recomputed here from the input),
// re-quantisation of an open page as it fills equal to quantising its tokens
// at once, refusal of NaN and infinities with nothing written.
#include "kernels/kivi.h"

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

PageLayout Layout(int32_t page_tokens, int32_t kv_heads, int32_t head_dim) {
  return PageLayout{page_tokens, kv_heads, head_dim, DType::kKiviInt4, 32};
}

std::vector<float> Gaussian(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<std::byte> Block(const PageLayout& layout, const float* keys,
                             int32_t n) {
  std::vector<std::byte> block(layout.key_block_bytes(), std::byte{0xaa});
  const KiviResult r = QuantizeKiviKeys(layout, keys, n, block.data());
  EXPECT_TRUE(r.ok()) << "token " << r.token << " channel " << r.channel;
  return block;
}

TEST(KiviLayoutTest, PageBytesAndOffsets) {
  // SmolLM2-135M's shape: 3 kv heads of 64, pages of 16, value groups of 32.
  const PageLayout l = Layout(16, 3, 64);
  EXPECT_EQ(l.token_bytes(), 96 + 3 * 6);             // the int4 value record
  EXPECT_EQ(l.key_block_bytes(), 16 * 96 + 3 * 192);  // codes, scale, zero
  EXPECT_EQ(l.page_bytes(), 2112 + 16 * 114);
  EXPECT_EQ(l.key_offset(2, 5), 2 * l.page_bytes() + 5 * 96);
  EXPECT_EQ(l.value_offset(2, 5), 2 * l.page_bytes() + 2112 + 5 * 114);
  EXPECT_EQ(l.key_scales_offset(), 16 * 96);
  EXPECT_EQ(l.key_zeros_offset(), 16 * 96 + 2 * 192);
  // At groups of page_tokens tokens and of 32 elements, KIVI's keys take
  // the bytes of int4's per-token keys (page_tokens = group_size).
  const PageLayout int4{32, 3, 64, DType::kInt4, 32};
  EXPECT_EQ(Layout(32, 3, 64).page_bytes(), int4.page_bytes());
}

TEST(KiviTest, HandMadeBlock) {
  // One head of 2 channels, 2 tokens: channel 0 holds {0, 15}, channel 1
  // holds {-1, 0.5}.
  const PageLayout l = Layout(2, 1, 2);
  const float keys[] = {0.0f, -1.0f, 15.0f, 0.5f};
  std::vector<std::byte> block(l.key_block_bytes());
  ASSERT_TRUE(QuantizeKiviKeys(l, keys, 2, block.data()).ok());
  // Channel 0: range [0, 15], scale 1, zero 0. Channel 1: range [-1, 0.5],
  // scale = f16_up(1.5 / 15) = f16_up(0.1), zero = rne(1 / scale) = 10.
  const uint16_t s1 = FloatToF16Up(1.5f / 15.0f);
  const float scale1 = F16ToFloat(s1);
  const int32_t z1 = static_cast<int32_t>(rintf(1.0f / scale1));
  ASSERT_EQ(z1, 10);
  const int32_t c10 = static_cast<int32_t>(rintf(-1.0f / scale1)) + z1;
  const int32_t c11 = static_cast<int32_t>(rintf(0.5f / scale1)) + z1;
  const uint8_t want[] = {
      static_cast<uint8_t>(0 | c10 << 4),   // token 0: codes 0, c10
      static_cast<uint8_t>(15 | c11 << 4),  // token 1: codes 15, c11
      0x00,
      0x3c,  // scale 1.0 as binary16
      static_cast<uint8_t>(s1 & 0xff),
      static_cast<uint8_t>(s1 >> 8),
      0,
      static_cast<uint8_t>(z1)};  // zeros
  ASSERT_EQ(sizeof want, block.size());
  EXPECT_EQ(std::memcmp(want, block.data(), sizeof want), 0);
  float out[4];
  DequantizeKiviKeys(l, block.data(), 0, 2, DType::kF32, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[2], 15.0f);
  EXPECT_EQ(out[1], static_cast<float>(c10 - z1) * scale1);
  EXPECT_EQ(out[3], static_cast<float>(c11 - z1) * scale1);
}

// Keys on each channel's grid (code - zero) * scale, with codes 0 and 15
// both present (so the channel's range is exactly 15 steps of a binary16
// scale), come back exactly, and quantising what came back writes the same
// block again.
TEST(KiviTest, GridValuesRoundTripExactly) {
  for (const PageLayout& l : {Layout(16, 3, 64), Layout(7, 2, 80),
                              Layout(1, 1, 128), Layout(17, 1, 64)}) {
    const int64_t e_count = l.token_elements();
    std::mt19937 rng(7);
    std::vector<float> keys(l.page_tokens * e_count);
    for (int64_t c = 0; c < e_count; ++c) {
      const float scale = std::ldexp(1.0f, static_cast<int>(c % 7) - 4);
      // One token: its code 15 over zero 0 (the range holds 0).
      const int32_t zero =
          l.page_tokens == 1 ? 0 : static_cast<int32_t>(c % 16);
      for (int32_t t = 0; t < l.page_tokens; ++t) {
        int32_t code = static_cast<int32_t>(rng() % 16);
        if (t == 0) code = l.page_tokens == 1 ? 15 : 0;
        if (t == 1) code = 15;
        keys[t * e_count + c] = static_cast<float>(code - zero) * scale;
      }
    }
    const std::vector<std::byte> block = Block(l, keys.data(), l.page_tokens);
    std::vector<float> back(keys.size());
    DequantizeKiviKeys(l, block.data(), 0, l.page_tokens, DType::kF32,
                       back.data());
    EXPECT_EQ(back, keys) << "page_tokens " << l.page_tokens;
    EXPECT_EQ(block, Block(l, back.data(), l.page_tokens));
    // Read back as bf16: the same values (every grid value here is exact in
    // bf16: at most 4 significant bits).
    std::vector<uint16_t> bf16(keys.size());
    DequantizeKiviKeys(l, block.data(), 0, l.page_tokens, DType::kBF16,
                       bf16.data());
    for (size_t i = 0; i < keys.size(); ++i) {
      ASSERT_EQ(Bf16ToFloat(bf16[i]), keys[i]) << i;
    }
  }
}

// Fixed Gaussian keys with an outlier channel: each key within half its
// channel's scale, which is f16_up((hi - lo) / 15) of that channel's own
// range (holding 0), recomputed here.
TEST(KiviTest, ErrorWithinHalfItsChannelsStep) {
  const PageLayout l = Layout(16, 3, 64);
  const int64_t e_count = l.token_elements();
  for (int32_t n : {1, 5, 16}) {
    std::vector<float> keys = Gaussian(n * e_count, 11);
    for (int32_t t = 0; t < n; ++t) keys[t * e_count + 3] *= 40.0f;
    const std::vector<std::byte> block = Block(l, keys.data(), n);
    std::vector<float> back(keys.size());
    DequantizeKiviKeys(l, block.data(), 0, n, DType::kF32, back.data());
    for (int64_t c = 0; c < e_count; ++c) {
      float lo = 0.0f, hi = 0.0f;
      for (int32_t t = 0; t < n; ++t) {
        lo = std::min(lo, keys[t * e_count + c]);
        hi = std::max(hi, keys[t * e_count + c]);
      }
      const float scale = F16ToFloat(FloatToF16Up((hi - lo) / 15.0f));
      for (int32_t t = 0; t < n; ++t) {
        const float x = keys[t * e_count + c];
        ASSERT_LE(
            std::fabs(back[t * e_count + c] - x),
            scale * (0.5f + 1.0f / 65536) + (std::fabs(x) + scale) * 1.2e-7f)
            << "n " << n << " token " << t << " channel " << c;
      }
    }
    // Widening one head reads the same values.
    float head[64];
    WidenKiviKeyHead(l, block.data(), n - 1, 2, head);
    for (int i = 0; i < 64; ++i) {
      EXPECT_EQ(head[i], back[(n - 1) * e_count + 128 + i]);
    }
  }
}

// The open page: appending its tokens one, three, ... at a time writes, at
// every step, the block that quantising all tokens present at once writes;
// once full, the staging is dropped.
// The block as kernels/kivi.h defines it, channel by channel, straight from
// the contract (range holding 0, GroupScale, CodeOf per key), with its
// first error in channel order: what the row-major twin must equal.
KiviResult ReferenceBlock(const PageLayout& l, const float* keys, int32_t n,
                          std::vector<std::byte>* out) {
  const QuantSpec spec = SpecOf(DType::kInt4);
  const int64_t e_count = l.token_elements();
  std::vector<uint8_t> block(l.key_block_bytes(), 0);
  for (int64_t c = 0; c < e_count; ++c) {
    float lo = 0.0f, hi = 0.0f;
    for (int32_t t = 0; t < n; ++t) {
      const float x = keys[t * e_count + c];
      if (!std::isfinite(x)) return KiviResult{QuantError::kNonFinite, t, c};
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    uint16_t bits;
    float scale;
    int32_t zero;
    if (const QuantError e = GroupScale(spec, lo, hi, &bits, &scale, &zero);
        e != QuantError::kOk) {
      return KiviResult{e, 0, c};
    }
    for (int32_t t = 0; t < n; ++t) {
      const int32_t q = CodeOf(spec, keys[t * e_count + c], scale, zero);
      block[t * l.code_bytes() + c / 2] |= (c % 2 == 0 ? q : q << 4);
    }
    std::memcpy(block.data() + l.key_scales_offset() + 2 * c, &bits, 2);
    block[l.key_zeros_offset() + c] = static_cast<uint8_t>(zero);
  }
  out->resize(block.size());
  std::memcpy(out->data(), block.data(), block.size());
  return KiviResult{};
}

TEST(KiviTest, BlocksAndErrorsEqualAChannelByChannelReference) {
  for (const PageLayout& l : {Layout(16, 3, 64), Layout(7, 2, 32)}) {
    const int64_t e_count = l.token_elements();
    std::vector<float> keys = Gaussian(l.page_tokens * e_count, 11);
    for (int64_t c = 0; c < e_count; c += 9) {  // outlier channels
      for (int32_t t = 0; t < l.page_tokens; ++t) keys[t * e_count + c] *= 30;
    }
    for (int32_t n = 1; n <= l.page_tokens; ++n) {
      std::vector<std::byte> want;
      ASSERT_TRUE(ReferenceBlock(l, keys.data(), n, &want).ok());
      EXPECT_EQ(Block(l, keys.data(), n), want) << n << " tokens";
    }
    // Two faults: a NaN at channel 9 of token 1, a range too wide at
    // channel 5 of token 2. Channel order reports channel 5's; with channel
    // 5 mended, the NaN.
    std::vector<float> bad = keys;
    bad[1 * e_count + 9] = std::numeric_limits<float>::quiet_NaN();
    bad[2 * e_count + 5] = 65504.0f * 16;
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<std::byte> unused, block(l.key_block_bytes(), std::byte{7});
      const KiviResult want = ReferenceBlock(l, bad.data(), 4, &unused);
      const KiviResult got = QuantizeKiviKeys(l, bad.data(), 4, block.data());
      EXPECT_EQ(got.error, want.error);
      EXPECT_EQ(got.token, want.token);
      EXPECT_EQ(got.channel, want.channel);
      EXPECT_EQ(got.channel, pass == 0 ? 5 : 9);
      EXPECT_EQ(block, std::vector<std::byte>(block.size(), std::byte{7}));
      bad[2 * e_count + 5] = 0.5f;
    }
  }
}

TEST(KiviOpenPageTest, RequantisingAsItFillsEqualsQuantisingAtOnce) {
  const PageLayout l = Layout(16, 3, 64);
  const int64_t e_count = l.token_elements();
  const std::vector<float> keys = Gaussian(16 * e_count, 3);
  KiviOpenPage open(l);
  std::vector<std::byte> block(l.key_block_bytes());
  int32_t have = 0;
  for (int32_t n : {1, 3, 2, 5, 4, 1}) {
    ASSERT_TRUE(
        open.Append(keys.data() + have * e_count, n, block.data()).ok());
    have += n;
    EXPECT_EQ(block, Block(l, keys.data(), have)) << have << " tokens";
    EXPECT_EQ(open.tokens(), have == 16 ? 0 : have);
  }
  EXPECT_EQ(have, 16);
  EXPECT_EQ(open.bytes(), 0);
}

// Appends re-code only the channels whose range they change; the block must
// still be what quantising the page's tokens at once writes, through pages
// of appends of every size, Resets to other tokens part way (as compaction
// does), refusals (which keep the state as it was) and channels that stay
// 0 (scale 0) until a late token.
TEST(KiviOpenPageTest, IncrementalCodingEqualsQuantisingAtOnceThroughResets) {
  const PageLayout l = Layout(8, 2, 64);
  const int64_t e_count = l.token_elements();
  std::mt19937 rng(17);
  std::vector<float> pool = Gaussian(400 * e_count, 19);
  for (int64_t t = 0; t < 400; ++t) {
    for (int64_t c = 0; c < e_count; ++c) {
      float& x = pool[t * e_count + c];
      if (c % 7 == 3 && t % 8 < 5) x = 0.0f;  // zero until the page's 6th
      x *= 1.0f + static_cast<float>(t % 8);  // ranges that keep growing
    }
  }
  KiviOpenPage open(l);
  std::vector<float> held;  // the page's tokens, as the test sees them
  std::vector<std::byte> block(l.key_block_bytes());
  int64_t next = 0;
  for (int step = 0; step < 200 && next < 390; ++step) {
    const int32_t have = static_cast<int32_t>(held.size() / e_count);
    const int kind = static_cast<int>(rng() % 8);
    if (kind == 0 && have > 0) {  // compaction's Reset: other tokens
      const int32_t n = 1 + static_cast<int32_t>(rng() % (l.page_tokens - 1));
      held.assign(pool.begin() + next * e_count,
                  pool.begin() + (next + n) * e_count);
      open.Reset(held.data(), n);
      next += n;
      continue;
    }
    const int32_t n =
        1 + static_cast<int32_t>(rng() %
                                 static_cast<uint32_t>(l.page_tokens - have));
    std::vector<float> keys(pool.begin() + next * e_count,
                            pool.begin() + (next + n) * e_count);
    if (kind == 1) {  // refused: nothing changes
      keys[(n - 1) * e_count + 5] = std::numeric_limits<float>::quiet_NaN();
      const std::vector<std::byte> before = block;
      EXPECT_FALSE(open.Append(keys.data(), n, block.data()).ok());
      EXPECT_EQ(block, before);
      EXPECT_EQ(open.tokens(), have);
      continue;
    }
    ASSERT_TRUE(open.Append(keys.data(), n, block.data()).ok());
    held.insert(held.end(), keys.begin(), keys.end());
    next += n;
    const int32_t now = static_cast<int32_t>(held.size() / e_count);
    ASSERT_EQ(block, Block(l, held.data(), now))
        << "step " << step << ", " << now << " tokens";
    if (now == l.page_tokens) held.clear();
    EXPECT_EQ(open.tokens(), static_cast<int32_t>(held.size() / e_count));
    EXPECT_EQ(open.bytes(), held.empty() ? 0 : KiviOpenPage::OpenBytes(l));
  }
}

TEST(KiviOpenPageTest, NonFiniteKeysAreRefusedAndNothingChanges) {
  const PageLayout l = Layout(4, 1, 64);
  std::vector<float> keys = Gaussian(3 * 64, 5);
  KiviOpenPage open(l);
  std::vector<std::byte> block(l.key_block_bytes());
  ASSERT_TRUE(open.Append(keys.data(), 2, block.data()).ok());
  const std::vector<std::byte> before = block;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    std::vector<float> next(keys.begin() + 128, keys.end());
    next[17] = bad;
    const KiviResult r = open.Append(next.data(), 1, block.data());
    EXPECT_EQ(r.error, QuantError::kNonFinite);
    EXPECT_EQ(r.token, 2);
    EXPECT_EQ(r.channel, 17);
    EXPECT_EQ(open.tokens(), 2);
    EXPECT_EQ(block, before);
  }
  // A range too wide for a binary16 scale.
  std::vector<float> wide(keys.begin() + 128, keys.end());
  wide[0] = 65504.0f * 16;
  EXPECT_EQ(open.Append(wide.data(), 1, block.data()).error,
            QuantError::kOutOfRange);
  EXPECT_EQ(block, before);
  // The same in the last channel, after the others' ranges have grown (an
  // append may have re-coded them before it found it): the page goes on as
  // if the refused appends never came.
  std::vector<float> late(keys.begin() + 128, keys.end());
  for (int c = 0; c < 63; ++c) late[c] *= 8.0f;
  late[63] = 65504.0f * 16;
  EXPECT_EQ(open.Append(late.data(), 1, block.data()).error,
            QuantError::kOutOfRange);
  EXPECT_EQ(block, before);
  ASSERT_TRUE(open.Append(keys.data() + 128, 1, block.data()).ok());
  EXPECT_EQ(block, Block(l, keys.data(), 3));
}

// Query scoring on kivi pages (the key of slot s read from its page's block)
// is scoring over the keys the blocks dequantise to, stored as f32: the same
// floats in the same order, so the same bits.
TEST(KiviTest, QueryScoringReadsTheBlocksKeys) {
  const PageLayout kivi = Layout(4, 2, 64);
  const PageLayout f32{4, 2, 64, DType::kF32, 0};
  const int64_t e_count = kivi.token_elements();
  const int64_t slots = 11;  // pages 2, 0, 1: the last one open (3 tokens)
  const std::vector<PageId> pages = {2, 0, 1};
  std::vector<std::byte> kivi_arena(3 * kivi.page_bytes());
  std::vector<std::byte> f32_arena(3 * f32.page_bytes());
  const std::vector<float> keys = Gaussian(slots * e_count, 21);
  for (int64_t first = 0; first < slots; first += 4) {
    const int32_t n = static_cast<int32_t>(std::min<int64_t>(4, slots - first));
    std::byte* block =
        kivi_arena.data() + int64_t{pages[first / 4]} * kivi.page_bytes();
    ASSERT_TRUE(
        QuantizeKiviKeys(kivi, keys.data() + first * e_count, n, block).ok());
    for (int32_t t = 0; t < n; ++t) {
      DequantizeKiviKeys(
          kivi, block, t, 1, DType::kF32,
          f32_arena.data() + f32.key_offset(pages[first / 4], t));
    }
  }
  const int32_t query_heads = 4, rows = 2;
  const std::vector<float> queries = Gaussian(rows * query_heads * 64, 22);
  const int64_t row_order[] = {5, 10};
  std::vector<int64_t> order(slots);
  for (int64_t s = 0; s < slots; ++s) order[s] = s;
  std::vector<float> out_kivi(rows * slots), out_f32(rows * slots);
  std::vector<float> scratch(query_heads * slots + 64);
  QueryAttention(PagedKeys{kivi_arena.data(), kivi, pages, order, slots},
                 queries.data(), row_order, rows, query_heads, out_kivi.data(),
                 scratch.data());
  QueryAttention(PagedKeys{f32_arena.data(), f32, pages, order, slots},
                 queries.data(), row_order, rows, query_heads, out_f32.data(),
                 scratch.data());
  EXPECT_EQ(out_kivi, out_f32);
  EXPECT_GT(out_kivi[slots + 10], 0.0f);  // the causal row sees slot 10
}

}  // namespace
}  // namespace kvkeep
