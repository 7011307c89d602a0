// KiviKv (services/lm/kivi_kv.h): what kvkeep-lm's forward pass reads of a
// kivi_int4 session. Mirrored, it holds exactly what the store's emulation
// (--emulate=kivi_int4/gG/tT/store, emulated_kv.h) hands the model for the
// same tokens, bit for bit, in chunks that end inside, at and across page
// ends; after an eviction it quantises again the pages the moves write,
// from the open page's exact keys and the others' decoded ones; mapped, it
// decodes a pool's pages and follows the same bytes.
#include "services/lm/kivi_kv.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"
#include "services/lm/emulated_kv.h"
#include "tests/lm/kv_testing.h"

namespace kvkeep::lm {
namespace {

using ::kvkeep::lm::testing::Append;
using ::kvkeep::lm::testing::Config;
using ::kvkeep::lm::testing::kHeadDim;
using ::kvkeep::lm::testing::kKvHeads;
using ::kvkeep::lm::testing::kLayers;
using ::kvkeep::lm::testing::kWidth;
using ::kvkeep::lm::testing::RandomTokens;
using ::kvkeep::lm::testing::Read;
using ::kvkeep::lm::testing::Tokens;
constexpr int32_t kPage = 4;

PageLayout Layout() {
  return PageLayout{kPage, kKvHeads, kHeadDim, DType::kKiviInt4, 8};
}

std::string Bf16(const std::vector<float>& x, int64_t first, int64_t n) {
  std::string out(n * kWidth * 2, '\0');
  for (int64_t e = 0; e < n * kWidth; ++e) {
    StoreFromFloat(DType::kBF16, out.data(), e, x[first * kWidth + e]);
  }
  return out;
}

// A result that keeps every new token of every layer (resident after).
v1::StepResult KeepAll(int64_t resident) {
  v1::StepResult r;
  for (int32_t l = 0; l < kLayers; ++l) {
    v1::LayerChange* c = r.add_layers();
    c->set_layer(l);
    c->set_resident(resident);
  }
  return r;
}

// Appends tokens [first, first + n) as the worker sends them (bf16).
absl::Status Append(KiviKv& kv, const Tokens& t, int64_t first, int64_t n,
                    int64_t resident = -1) {
  std::vector<int64_t> positions(n);
  for (int64_t i = 0; i < n; ++i) positions[i] = first + i;
  std::vector<std::string> keys, values;
  for (int32_t l = 0; l < kLayers; ++l) {
    keys.push_back(Bf16(t[l][0], first, n));
    values.push_back(Bf16(t[l][1], first, n));
  }
  return kv.Apply(KeepAll(resident < 0 ? first + n : resident), positions, keys,
                  values);
}

TEST(KiviKvTest, MirroredHoldsWhatTheStoreEmulationHolds) {
  const Tokens t = RandomTokens(19, 7);
  KiviKv kivi(Layout(), kLayers, DType::kBF16, /*mapped=*/false);
  EmulatedKv emulated(Config(), *Emulation::Parse("kivi_int4/g8/t4/store"), 32);
  int64_t at = 0;
  for (int64_t n : {3, 1, 5, 2, 1, 7}) {
    ASSERT_TRUE(Append(kivi, t, at, n).ok());
    ASSERT_TRUE(Append(emulated, t, at, n).ok());
    at += n;
    EXPECT_EQ(Read(kivi), Read(emulated)) << "after " << at << " tokens";
  }
}

// The pages the store would hold for tokens [0, n) of layer l, appended
// one at a time (each page's block quantised from all its tokens).
std::vector<std::byte> Pages(const Tokens& t, int32_t l, int64_t n) {
  const PageLayout layout = Layout();
  std::vector<std::byte> arena(((n + kPage - 1) / kPage) * layout.page_bytes());
  std::vector<float> keys(n * kWidth), values(n * kWidth);
  for (int64_t e = 0; e < n * kWidth; ++e) {
    keys[e] = Bf16ToFloat(FloatToBf16(t[l][0][e]));
    values[e] = Bf16ToFloat(FloatToBf16(t[l][1][e]));
  }
  for (int64_t first = 0; first < n; first += kPage) {
    const auto count =
        static_cast<int32_t>(std::min<int64_t>(kPage, n - first));
    std::byte* page = arena.data() + first / kPage * layout.page_bytes();
    EXPECT_TRUE(
        QuantizeKiviKeys(layout, &keys[first * kWidth], count, page).ok());
    EXPECT_TRUE(QuantizeTokens(layout, DType::kF32, &values[first * kWidth],
                               count, page + layout.key_block_bytes())
                    .ok());
  }
  return arena;
}

TEST(KiviKvTest, MappedDecodesThePoolsPagesAsTheMirrorHoldsThem) {
  const Tokens t = RandomTokens(10, 3);
  const PageLayout layout = Layout();
  KiviKv mapped(layout, kLayers, DType::kBF16, /*mapped=*/true);
  KiviKv mirrored(layout, kLayers, DType::kBF16, /*mapped=*/false);
  int64_t at = 0;
  for (int64_t n : {2, 3, 5}) {
    ASSERT_TRUE(Append(mapped, t, at, n).ok());
    ASSERT_TRUE(Append(mirrored, t, at, n).ok());
    at += n;
    // The pool: layer l's pages in reverse order (page ids are any).
    std::vector<std::vector<std::byte>> arenas;
    std::vector<std::vector<int32_t>> ids(kLayers);
    std::vector<ResidentKv> pool;
    for (int32_t l = 0; l < kLayers; ++l) arenas.push_back(Pages(t, l, at));
    for (int32_t l = 0; l < kLayers; ++l) {
      const int32_t pages = static_cast<int32_t>((at + kPage - 1) / kPage);
      std::vector<std::byte> reversed(arenas[l].size());
      for (int32_t i = 0; i < pages; ++i) {
        ids[l].push_back(pages - 1 - i);
        std::memcpy(reversed.data() + (pages - 1 - i) * layout.page_bytes(),
                    arenas[l].data() + i * layout.page_bytes(),
                    layout.page_bytes());
      }
      arenas[l] = std::move(reversed);
      ResidentKv v;
      v.arena = arenas[l].data();
      v.pages = ids[l];
      v.page_tokens = kPage;
      v.page_bytes = layout.page_bytes();
      v.resident = at;
      pool.push_back(v);
    }
    ASSERT_TRUE(mapped.Decode(pool).ok());
    EXPECT_EQ(Read(mapped), Read(mirrored)) << "after " << at << " tokens";
    pool[0].resident = at + 1;
    EXPECT_EQ(mapped.Decode(pool).code(), absl::StatusCode::kInvalidArgument);
  }
}

// Pages of 4; 10 tokens; slots 1 and 2 evicted: slots 8 and 9 (the open
// page, exact keys in the staging) move into them, page 0's keys are
// quantised again from its tokens' (0, 8, 9, 3) keys as held (token 0 and 3
// decoded, 8 and 9 exact), and the next page fills from the staging of the
// new open page (tokens 4-7, whole: none).
TEST(KiviKvTest, MirroredEvictionQuantisesTheWrittenPagesAgain) {
  const Tokens t = RandomTokens(11, 9);
  const PageLayout layout = Layout();
  KiviKv kivi(layout, kLayers, DType::kBF16, /*mapped=*/false);
  ASSERT_TRUE(Append(kivi, t, 0, 10).ok());
  const Tokens before = Read(kivi);
  v1::StepResult evict;
  for (int32_t l = 0; l < kLayers; ++l) {
    v1::LayerChange* c = evict.add_layers();
    c->set_layer(l);
    c->set_resident(8);
    c->add_evicted_positions(1);
    c->add_evicted_positions(2);
    v1::SlotMove* m = c->add_moves();
    m->set_from_slot(8);
    m->set_to_slot(1);
    m = c->add_moves();
    m->set_from_slot(9);
    m->set_to_slot(2);
  }
  ASSERT_TRUE(kivi.Apply(evict).ok());
  const Tokens after = Read(kivi);
  for (int32_t l = 0; l < kLayers; ++l) {
    std::vector<float> page(4 * kWidth);
    const int64_t from[] = {0, 8, 9, 3};
    for (int i = 0; i < 4; ++i) {
      for (int64_t e = 0; e < kWidth; ++e) {
        page[i * kWidth + e] =
            from[i] >= 8
                ? Bf16ToFloat(FloatToBf16(t[l][0][from[i] * kWidth + e]))
                : before[l][0][from[i] * kWidth + e];
      }
    }
    std::vector<std::byte> block(layout.key_block_bytes());
    ASSERT_TRUE(QuantizeKiviKeys(layout, page.data(), 4, block.data()).ok());
    std::vector<float> want(4 * kWidth);
    DequantizeKiviKeys(layout, block.data(), 0, 4, DType::kF32, want.data());
    EXPECT_EQ(std::vector<float>(after[l][0].begin(),
                                 after[l][0].begin() + 4 * kWidth),
              want);
    // Page 1 untouched; values moved as they were.
    EXPECT_EQ(
        std::vector<float>(after[l][0].begin() + 4 * kWidth, after[l][0].end()),
        std::vector<float>(before[l][0].begin() + 4 * kWidth,
                           before[l][0].begin() + 8 * kWidth));
    EXPECT_EQ(std::vector<float>(after[l][1].begin() + kWidth,
                                 after[l][1].begin() + 2 * kWidth),
              std::vector<float>(before[l][1].begin() + 8 * kWidth,
                                 before[l][1].begin() + 9 * kWidth));
  }
  // The next token opens page 2 (8 tokens held: no staging left).
  ASSERT_TRUE(Append(kivi, t, 10, 1, /*resident=*/9).ok());
  EXPECT_EQ(Read(kivi)[0][0].size(), 9u * kWidth);
}

TEST(KiviKvTest, RefusesAStepThatDoesNotFit) {
  KiviKv kivi(Layout(), kLayers, DType::kBF16, /*mapped=*/false);
  const Tokens t = RandomTokens(2, 1);
  std::vector<int64_t> positions = {0, 1};
  std::vector<std::string> keys = {Bf16(t[0][0], 0, 2)};  // one layer of 2
  std::vector<std::string> values = {Bf16(t[0][1], 0, 2)};
  EXPECT_EQ(kivi.Apply(KeepAll(2), positions, keys, values).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read(kivi)[0][0].size(), 0u);
}

}  // namespace
}  // namespace kvkeep::lm
