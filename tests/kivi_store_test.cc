// A store with a kivi_int4 layout (cache_store/kivi_keys.h): appends leave
// every page's key block equal to the twin's quantisation of exactly the
// tokens the page holds (the open page re-quantised as it fills, through
// Append and decode steps), values the int4 records of their token;
// ReadLayerAs returns those blocks' and records' values; resident bytes
// count the pages and the staging; NaN, infinities and keys too large are
// refused with nothing changed; h2o_page keeps the sets a float layout keeps
// for the same probabilities, its compaction re-quantising the pages the
// moves write; a fork continues as its parent would; the policies and
// operations the layout does not take are refused, naming why.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::test_data::AppendBuffers;
using ::kvkeep::test_data::TokenBytes;
using ::testing::HasSubstr;

ModelLayout Layout(DType dtype, const std::string& name) {
  return test_data::SmallLayout(dtype, name);
}
const ModelLayout kKivi = Layout(DType::kKiviInt4, "kivi");
const ModelLayout kFloat = Layout(DType::kF32, "f32");

std::unique_ptr<CacheStore> MakeStore() {
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools = {{kKivi, 256}, {kFloat, 256}};
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

absl::StatusOr<SessionId> NewSession(CacheStore& store, const ModelLayout& l,
                                     PolicySpec policy, int64_t budget) {
  SessionSpec spec{l.name, std::move(policy)};
  spec.budget.tokens = budget;
  return store.CreateSession(spec);
}

// Appends positions [first, first + n) with TokenBytes data (key element
// `poison_at` of layer 1, token 0, set to `poison` when given).
absl::StatusOr<StepResult> Append(CacheStore& store, SessionId id,
                                  const ModelLayout& l, int64_t first,
                                  int64_t n, bool step = false,
                                  const float* poison = nullptr) {
  AppendBuffers data(l, first, n);
  if (poison != nullptr) {
    StoreFromFloat(l.append_dtype, data.keys[1].data(), 5, *poison);
  }
  if (step) {
    absl::StatusOr<StepOutcome> out = store.Step(id, data.request(), {});
    if (!out.ok()) return out.status();
    return out->append;
  }
  return store.Append(id, data.request());
}

// The twin of a full session's layer: each page's keys quantised per
// channel over the tokens it holds, values as int4 records; both read back
// as f32. Positions are in slot order (a full session never moves them).
void Twin(const ModelLayout& l, int32_t layer,
          const std::vector<int64_t>& positions, std::vector<float>* keys,
          std::vector<float>* values) {
  const PageLayout page = l.page_layout();
  const int64_t e_count = page.token_elements();
  const int64_t n = static_cast<int64_t>(positions.size());
  const std::vector<std::byte> k = TokenBytes(l, layer, positions, false);
  const std::vector<std::byte> v = TokenBytes(l, layer, positions, true);
  std::vector<float> k32(n * e_count);
  for (int64_t i = 0; i < n * e_count; ++i) {
    k32[i] = LoadAsFloat(l.append_dtype, k.data(), i);
  }
  keys->assign(n * e_count, 0.0f);
  std::vector<std::byte> block(page.key_block_bytes());
  for (int64_t first = 0; first < n; first += page.page_tokens) {
    const int32_t count =
        static_cast<int32_t>(std::min<int64_t>(page.page_tokens, n - first));
    ASSERT_TRUE(QuantizeKiviKeys(page, k32.data() + first * e_count, count,
                                 block.data())
                    .ok());
    DequantizeKiviKeys(page, block.data(), 0, count, DType::kF32,
                       keys->data() + first * e_count);
  }
  std::vector<std::byte> records(n * page.token_bytes());
  ASSERT_TRUE(
      QuantizeTokens(page, l.append_dtype, v.data(), n, records.data()).ok());
  values->assign(n * e_count, 0.0f);
  DequantizeTokens(page, records.data(), n, DType::kF32, values->data());
}

std::vector<float> Floats(const std::vector<std::byte>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

void ExpectTwin(CacheStore& store, SessionId id, const ModelLayout& l) {
  for (int32_t layer = 0; layer < l.num_layers; ++layer) {
    absl::StatusOr<LayerKvCopy> kv = store.ReadLayerAs(id, layer, DType::kF32);
    ASSERT_TRUE(kv.ok()) << kv.status();
    std::vector<float> keys, values;
    Twin(l, layer, kv->positions, &keys, &values);
    EXPECT_EQ(Floats(kv->keys), keys) << "layer " << layer;
    EXPECT_EQ(Floats(kv->values), values) << "layer " << layer;
  }
}

TEST(KiviStoreTest, PagesHoldTheTwinsBlocksAsTheyFill) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  KV_ASSIGN_OR_FAIL(SessionId id,
                    NewSession(*store, kKivi, {"full", {}}, 1 << 20));
  int64_t next = 0;
  // Through Append and decode steps, in runs that start and end inside
  // pages and cross them.
  for (const auto& [n, step] :
       std::vector<std::pair<int64_t, bool>>{{3, false},
                                             {1, false},
                                             {2, true},
                                             {1, true},
                                             {7, false},
                                             {1, true}}) {
    KV_ASSERT_OK(Append(*store, id, kKivi, next, n, step).status());
    next += n;
    SCOPED_TRACE(next);
    ExpectTwin(*store, id, kKivi);
  }
  // bf16 reads are the f32 values rounded to nearest even.
  KV_ASSIGN_OR_FAIL(LayerKvCopy f32, store->ReadLayerAs(id, 0, DType::kF32));
  KV_ASSIGN_OR_FAIL(LayerKvCopy bf16, store->ReadLayerAs(id, 0, DType::kBF16));
  const std::vector<float> want = Floats(f32.keys);
  ASSERT_EQ(bf16.keys.size(), want.size() * 2);
  for (size_t i = 0; i < want.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, bf16.keys.data() + 2 * i, 2);
    ASSERT_EQ(h, FloatToBf16(want[i])) << i;
  }
  // Raw reads: the keys are blocks, not records.
  const absl::Status raw = store->ReadLayer(id, 0).status();
  EXPECT_EQ(raw.code(), absl::StatusCode::kInvalidArgument) << raw;
  EXPECT_THAT(std::string(raw.message()), HasSubstr("per-page blocks"));
}

TEST(KiviStoreTest, ResidentBytesCountPagesAndStaging) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  const PageLayout page = kKivi.page_layout();
  // 128 elements a token: a key block of 4 * 64 + 3 * 128 bytes, values of
  // 4 records of 64 + 4 * 3.
  ASSERT_EQ(page.page_bytes(), 4 * 64 + 3 * 128 + 4 * 76);
  for (const LayoutStats& s : store->Layouts()) {
    if (s.layout.name == "kivi") {
      EXPECT_EQ(s.pool.page_bytes, 944);
    }
  }
  KV_ASSIGN_OR_FAIL(SessionId id,
                    NewSession(*store, kKivi, {"full", {}}, 1 << 20));
  KV_ASSERT_OK(Append(*store, id, kKivi, 0, 9).status());
  KV_ASSIGN_OR_FAIL(SessionStats open, store->GetStats(id));
  EXPECT_EQ(open.pages, 2 * 3);
  // Each layer's open page (1 token) keeps a page of float32 keys, its key
  // block (4 rows of 64 bytes, 128 scales and zero points) and 12 bytes a
  // channel (its range and scale).
  EXPECT_EQ(open.bytes,
            6 * 944 + 2 * (4 * 128 * 4 + 4 * 64 + 128 * 3 + 128 * 12));
  KV_ASSERT_OK(Append(*store, id, kKivi, 9, 3).status());
  KV_ASSIGN_OR_FAIL(SessionStats full, store->GetStats(id));
  EXPECT_EQ(full.bytes, 6 * 944);  // every page full: no staging
}

TEST(KiviStoreTest, BadKeysAreRefusedAndChangeNothing) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  KV_ASSIGN_OR_FAIL(SessionId id,
                    NewSession(*store, kKivi, {"full", {}}, 1 << 20));
  KV_ASSERT_OK(Append(*store, id, kKivi, 0, 6).status());
  KV_ASSIGN_OR_FAIL(SessionStats before, store->GetStats(id));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), 1e6f}) {
    const absl::Status s =
        Append(*store, id, kKivi, 6, 4, false, &bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("layer 1 keys of token 0 (position 6), element 5"));
  }
  KV_ASSIGN_OR_FAIL(SessionStats after, store->GetStats(id));
  EXPECT_EQ(after.resident_tokens, before.resident_tokens);
  EXPECT_EQ(after.pages, before.pages);
  EXPECT_EQ(after.bytes, before.bytes);
  EXPECT_EQ(after.layer_version, before.layer_version);
  KV_ASSERT_OK(Append(*store, id, kKivi, 6, 4).status());
  ExpectTwin(*store, id, kKivi);
}

// h2o_page on kivi_int4 keeps what it keeps on f32 for the same
// probabilities (eviction reads scores only); its compaction moves tokens
// across pages, and every page it writes is re-quantised: keys stay within
// a few steps of their input, values are their tokens' records exactly.
TEST(KiviStoreTest, H2OPageKeepsTheFloatSetsAndRequantisesMovedPages) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  const PolicySpec policy{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}};
  KV_ASSIGN_OR_FAIL(SessionId kivi, NewSession(*store, kKivi, policy, 12));
  KV_ASSIGN_OR_FAIL(SessionId f32, NewSession(*store, kFloat, policy, 12));
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  int64_t evicted = 0, moved = 0;
  float worst = 0.0f;
  double error_sum = 0, once_sum = 0;
  int64_t count = 0;
  for (int64_t pos = 0; pos < 60; ++pos) {
    KV_ASSERT_OK(Append(*store, kivi, kKivi, pos, 1).status());
    KV_ASSERT_OK(Append(*store, f32, kFloat, pos, 1).status());
    std::vector<std::vector<float>> rows(2);
    std::vector<LayerScores> kivi_scores, f32_scores;
    for (int32_t layer = 0; layer < 2; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable a, store->GetBlockTable(kivi, layer));
      KV_ASSIGN_OR_FAIL(BlockTable b, store->GetBlockTable(f32, layer));
      ASSERT_EQ(a.positions, b.positions) << "layer " << layer << " at " << pos;
      for (size_t s = 0; s < a.positions.size(); ++s) {
        rows[layer].push_back(uniform(rng) / a.positions.size());
      }
      kivi_scores.push_back(
          LayerScores{layer, a.version, ScoreSource::kReduced, 1, rows[layer]});
      f32_scores.push_back(
          LayerScores{layer, b.version, ScoreSource::kReduced, 1, rows[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult a, store->UpdateScores(kivi, kivi_scores));
    KV_ASSIGN_OR_FAIL(StepResult b, store->UpdateScores(f32, f32_scores));
    for (size_t layer = 0; layer < a.layers.size(); ++layer) {
      EXPECT_EQ(a.layers[layer].evicted_positions,
                b.layers[layer].evicted_positions);
      evicted += static_cast<int64_t>(a.layers[layer].evicted_positions.size());
      moved += static_cast<int64_t>(a.layers[layer].moves.size());
    }
    for (int32_t layer = 0; layer < 2; ++layer) {
      KV_ASSIGN_OR_FAIL(LayerKvCopy kv,
                        store->ReadLayerAs(kivi, layer, DType::kF32));
      const std::vector<std::byte> in =
          TokenBytes(kKivi, layer, kv.positions, false);
      const std::vector<float> keys = Floats(kv.keys);
      // Values: records moved whole. The twin's keys: the same tokens
      // quantised once, in pages of their slot order (the baseline).
      std::vector<float> twin_keys, twin_values;
      Twin(kKivi, layer, kv.positions, &twin_keys, &twin_values);
      for (size_t i = 0; i < keys.size(); ++i) {
        const float x =
            LoadAsFloat(DType::kBF16, in.data(), static_cast<int64_t>(i));
        worst = std::max(worst, std::fabs(keys[i] - x));
        error_sum += std::fabs(keys[i] - x);
        once_sum += std::fabs(twin_keys[i] - x);
        ++count;
      }
      EXPECT_EQ(Floats(kv.values), twin_values);
    }
  }
  EXPECT_GT(evicted, 80);
  EXPECT_GT(moved, 0);
  // Inputs lie in [-1, 1): a channel's step is at most 2 / 15. A key
  // quantised once is within half a step (0.067); moved and re-quantised
  // (and a page's dequantised keys re-quantised on each append while it is
  // the open page) its error compounds, to a few steps at worst; on average
  // it stays within 1.5x of quantising once.
  EXPECT_LT(worst, 0.4f);
  EXPECT_GT(worst, 0.0f);
  EXPECT_LT(error_sum, 1.5 * once_sum);
  std::printf(
      "h2o_page on kivi_int4: %lld evicted, %lld moves, worst key "
      "error %.4f, mean %.5f (quantised once: %.5f)\n",
      static_cast<long long>(evicted), static_cast<long long>(moved), worst,
      error_sum / count, once_sum / count);
}

TEST(KiviStoreTest, QueryScoringRunsOnKiviKeys) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  const PolicySpec policy{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}};
  KV_ASSIGN_OR_FAIL(SessionId id, NewSession(*store, kKivi, policy, 12));
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t evicted = 0;
  for (int64_t pos = 0; pos < 30; ++pos) {
    KV_ASSERT_OK(Append(*store, id, kKivi, pos, 1).status());
    std::vector<std::vector<float>> queries(2);
    std::vector<LayerScores> scores;
    for (int32_t layer = 0; layer < 2; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable t, store->GetBlockTable(id, layer));
      for (int i = 0; i < 4 * 64; ++i) queries[layer].push_back(normal(rng));
      scores.push_back(LayerScores{layer, t.version, ScoreSource::kQueries, 1,
                                   queries[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult r, store->UpdateScores(id, scores));
    for (const LayerChange& c : r.layers) {
      evicted += static_cast<int64_t>(c.evicted_positions.size());
    }
  }
  EXPECT_GT(evicted, 0);
  KV_ASSIGN_OR_FAIL(SessionStats stats, store->GetStats(id));
  EXPECT_LE(stats.resident_tokens, 2 * 12);
}

int64_t Copies(const StepResult& r) {
  int64_t n = 0;
  for (const LayerChange& c : r.layers) {
    n += static_cast<int64_t>(c.pages_copied.size());
  }
  return n;
}

// Position `pos` appended to each of `ids`, in that order; the pages the
// calls copied before writing added to *copied.
void AppendAll(CacheStore& store, const std::vector<SessionId>& ids,
               int64_t pos, int64_t* copied) {
  for (SessionId id : ids) {
    KV_ASSIGN_OR_FAIL(StepResult r, Append(store, id, kKivi, pos, 1));
    *copied += Copies(r);
  }
}

// The same attention rows (from `rng`) given to each of `ids`, in order.
void ScoreAll(CacheStore& store, const std::vector<SessionId>& ids,
              std::mt19937& rng, int64_t* copied) {
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<std::vector<float>> rows(2);
  for (int32_t layer = 0; layer < 2; ++layer) {
    KV_ASSIGN_OR_FAIL(BlockTable t, store.GetBlockTable(ids[0], layer));
    for (size_t i = 0; i < t.positions.size(); ++i) {
      rows[layer].push_back(uniform(rng) / t.positions.size());
    }
  }
  for (SessionId id : ids) {
    std::vector<LayerScores> in;
    for (int32_t layer = 0; layer < 2; ++layer) {
      KV_ASSIGN_OR_FAIL(BlockTable t, store.GetBlockTable(id, layer));
      in.push_back(
          LayerScores{layer, t.version, ScoreSource::kReduced, 1, rows[layer]});
    }
    KV_ASSIGN_OR_FAIL(StepResult r, store.UpdateScores(id, in));
    *copied += Copies(r);
  }
}

void ExpectSameKv(CacheStore& store, SessionId got_id, SessionId want_id) {
  for (int32_t layer = 0; layer < 2; ++layer) {
    KV_ASSIGN_OR_FAIL(LayerKvCopy want,
                      store.ReadLayerAs(want_id, layer, DType::kF32));
    KV_ASSIGN_OR_FAIL(LayerKvCopy got,
                      store.ReadLayerAs(got_id, layer, DType::kF32));
    ASSERT_EQ(got.positions, want.positions) << "layer " << layer;
    ASSERT_EQ(got.keys, want.keys) << "layer " << layer;
    ASSERT_EQ(got.values, want.values) << "layer " << layer;
  }
}

// A fork carries the open pages' staging with the pages it shares: after
// the fork, the parent and the child go on with different tokens (and
// scores), each holding bit for bit what a session that never forked holds
// after the same calls (h2o_page: with its evictions, compactions and the
// copies of shared pages before writing into them; the child steps first,
// so its write into a page the parent still reads would show in the
// parent).
TEST(KiviStoreTest, AForkContinuesAsTheOriginalWould) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  for (const auto& [policy, budget] : std::vector<std::pair<PolicySpec, int>>{
           {{"full", {}}, 1 << 20},
           {{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}}, 12}}) {
    SCOPED_TRACE(policy.name);
    const bool scores = policy.name != "full";
    std::vector<SessionId> ids;  // the parent's twin, the child's, the parent
    for (int i = 0; i < 3; ++i) {
      KV_ASSIGN_OR_FAIL(SessionId id,
                        NewSession(*store, kKivi, policy, budget));
      ids.push_back(id);
    }
    const SessionId parent_twin = ids[0], child_twin = ids[1], parent = ids[2];
    std::mt19937 rng(23);
    int64_t copied = 0;
    for (int64_t pos = 0; pos < 12; ++pos) {
      AppendAll(*store, ids, pos, &copied);
      if (scores) ScoreAll(*store, ids, rng, &copied);
    }
    // 13 tokens, the open page holding 1; the fork comes before the scores
    // that make h2o_page evict a page (the compaction then writes the new
    // open page, still shared, and so copies it first).
    AppendAll(*store, ids, 12, &copied);
    KV_ASSIGN_OR_FAIL(SessionId child, store->ForkSession(parent, ForkSpec{}));
    std::mt19937 child_rng = rng;
    for (int64_t pos = 13; pos < 40; ++pos) {
      SCOPED_TRACE(pos);
      if (scores) ScoreAll(*store, {child_twin, child}, child_rng, &copied);
      if (scores) ScoreAll(*store, {parent_twin, parent}, rng, &copied);
      ExpectSameKv(*store, parent, parent_twin);
      ExpectSameKv(*store, child, child_twin);
      AppendAll(*store, {child_twin, child}, 1000 + pos, &copied);
      AppendAll(*store, {parent_twin, parent}, pos, &copied);
    }
    EXPECT_GT(copied, 0);
    for (SessionId id : {parent_twin, child_twin, parent, child}) {
      KV_ASSERT_OK(store->CloseSession(id));
    }
  }
}

TEST(KiviStoreTest, PoliciesAndOperationsItDoesNotTakeAreRefused) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  for (const char* policy : {"h2o", "streaming_llm", "tova", "snapkv"}) {
    const absl::Status s = NewSession(*store, kKivi, {policy, {}}, 64).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << policy;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("takes the policies full and h2o_page only"));
  }
  KV_ASSIGN_OR_FAIL(SessionId id,
                    NewSession(*store, kKivi, {"full", {}}, 1 << 20));
  KV_ASSERT_OK(Append(*store, id, kKivi, 0, 5).status());
  // A fork takes the parent's policy rules: h2o evicts token by token.
  ForkSpec h2o;
  h2o.policy = PolicySpec{"h2o", {}};
  const absl::Status fork = store->ForkSession(id, h2o).status();
  EXPECT_EQ(fork.code(), absl::StatusCode::kInvalidArgument) << fork;
  EXPECT_THAT(std::string(fork.message()),
              HasSubstr("takes the policies full and h2o_page only"));
  // Moving the session is kivi_move_test's; raw slots are read as whole
  // pages' key blocks, not as per-token key records.
  std::vector<std::byte> keys(kKivi.page_layout().token_bytes());
  std::vector<std::byte> values(keys.size());
  const absl::Status slots = store->ReadSlots(id, 0, 0, 1, keys, values);
  EXPECT_EQ(slots.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(slots.message()),
              HasSubstr("not whole kivi_int4 pages"));
  // Still serving after the refused read.
  KV_ASSERT_OK(Append(*store, id, kKivi, 5, 1).status());
  ExpectTwin(*store, id, kKivi);
}

TEST(KiviStoreTest, BadLayoutsAreRefusedNamingTheLayout) {
  ModelLayout odd = kKivi;
  odd.head_dim = 63;
  odd.group_size = 63;
  absl::Status s = ValidateLayout(odd);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("layout 'kivi': kivi_int4 needs an even head_dim"));
  ModelLayout group = kKivi;
  group.group_size = 24;
  s = ValidateLayout(group);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not divide head_dim"));
  EXPECT_EQ(*ParseDType("kivi_int4"), DType::kKiviInt4);
  EXPECT_THAT(std::string(ParseDType("kivi").status().message()),
              HasSubstr("kivi_int4"));
}

}  // namespace
}  // namespace kvkeep
