// A store with quantised layouts (int8, fp8_e4m3, int4): appends are
// quantised into exactly the records QuantizeTokens makes of the same input;
// ReadLayer returns them and ReadLayerAs their values; NaN, infinities and
// values too large for the scales are refused with nothing changed; eviction
// and compaction move every record whole with its token (each slot checked
// against the record of the position it claims); pools count the records'
// real bytes.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::test_data::AppendBuffers;
using ::kvkeep::test_data::TokenBytes;
using ::testing::HasSubstr;

ModelLayout Quantised(DType dtype) {
  return test_data::SmallLayout(dtype, std::string(DTypeName(dtype)));
}

SessionSpec FullSpec(const ModelLayout& l) {
  SessionSpec spec{l.name, {"full", {}}};
  spec.budget.tokens = 1 << 20;
  return spec;
}

constexpr DType kFormats[] = {DType::kInt8, DType::kFp8E4M3, DType::kInt4};

std::unique_ptr<CacheStore> MakeStore(int64_t pages = 256) {
  StoreOptions options;
  options.device = test_support::TestDevice();
  for (DType d : kFormats) options.pools.push_back({Quantised(d), pages});
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// The records the store should hold for `positions` of one layer.
std::vector<std::byte> Records(const ModelLayout& l, int32_t layer,
                               const std::vector<int64_t>& positions,
                               bool values) {
  const std::vector<std::byte> in = TokenBytes(l, layer, positions, values);
  std::vector<std::byte> out(positions.size() * l.page_layout().token_bytes());
  const QuantizeResult r =
      QuantizeTokens(l.page_layout(), l.append_dtype, in.data(),
                     static_cast<int64_t>(positions.size()), out.data());
  EXPECT_TRUE(r.ok());
  return out;
}

// Appends positions [first, first + n) with data from TokenBytes, or with
// `poison` at (layer 1, values, token 2) when given; through Append, or as
// the append of a decode step (Step, no scores) when `step`.
absl::StatusOr<StepResult> Append(CacheStore& store, SessionId id,
                                  const ModelLayout& l, int64_t first,
                                  int64_t n, const float* poison = nullptr,
                                  bool step = false) {
  AppendBuffers data(l, first, n);
  if (poison != nullptr) {
    StoreFromFloat(l.append_dtype, data.values[1].data(),
                   2 * l.kv_heads * l.head_dim + 40, *poison);
  }
  if (step) {
    absl::StatusOr<StepOutcome> out = store.Step(id, data.request(), {});
    if (!out.ok()) return out.status();
    return out->append;
  }
  return store.Append(id, data.request());
}

// A "full" session of `l` holding positions [0, tokens).
absl::StatusOr<SessionId> FullSessionOf(CacheStore& store, const ModelLayout& l,
                                        int64_t tokens) {
  absl::StatusOr<SessionId> id = store.CreateSession(FullSpec(l));
  if (!id.ok()) return id;
  absl::StatusOr<StepResult> r = Append(store, *id, l, 0, tokens);
  if (!r.ok()) return r.status();
  return id;
}

// Every slot of every layer holds the record of the position it claims.
void ExpectRecordsFollowTokens(CacheStore& store, SessionId id,
                               const ModelLayout& l) {
  const int64_t tb = l.page_layout().token_bytes();
  for (int32_t layer = 0; layer < l.num_layers; ++layer) {
    absl::StatusOr<LayerKvCopy> kv = store.ReadLayer(id, layer);
    ASSERT_TRUE(kv.ok()) << kv.status();
    EXPECT_EQ(kv->dtype, l.dtype);
    ASSERT_EQ(kv->keys.size(), kv->positions.size() * tb);
    EXPECT_EQ(kv->keys, Records(l, layer, kv->positions, false));
    EXPECT_EQ(kv->values, Records(l, layer, kv->positions, true));
  }
}

TEST(QuantizedStoreTest, AppendStoresTheRecordsOfTheInput) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  for (DType d : kFormats) {
    SCOPED_TRACE(DTypeName(d));
    const ModelLayout l = Quantised(d);
    KV_ASSIGN_OR_FAIL(SessionId id, FullSessionOf(*store, l, 7));
    KV_ASSERT_OK(Append(*store, id, l, 7, 1).status());
    ExpectRecordsFollowTokens(*store, id, l);
    // ReadLayerAs: the records' values in the dtype asked for.
    for (DType as : {DType::kF32, DType::kF16, DType::kBF16}) {
      KV_ASSIGN_OR_FAIL(LayerKvCopy stored, store->ReadLayer(id, 1));
      KV_ASSIGN_OR_FAIL(LayerKvCopy kv, store->ReadLayerAs(id, 1, as));
      EXPECT_EQ(kv.dtype, as);
      EXPECT_EQ(kv.positions, stored.positions);
      std::vector<std::byte> want(8 * l.page_layout().token_elements() *
                                  DTypeBytes(as));
      DequantizeTokens(l.page_layout(), stored.values.data(), 8, as,
                       want.data());
      EXPECT_EQ(kv.values, want) << DTypeName(as);
    }
    KV_ASSIGN_OR_FAIL(LayerKvCopy own, store->ReadLayerAs(id, 0, d));
    KV_ASSIGN_OR_FAIL(LayerKvCopy raw, store->ReadLayer(id, 0));
    EXPECT_EQ(own.keys, raw.keys);
    const DType other = d == DType::kInt8 ? DType::kInt4 : DType::kInt8;
    const absl::Status wrong = store->ReadLayerAs(id, 0, other).status();
    EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument) << wrong;
    EXPECT_THAT(std::string(wrong.message()), HasSubstr("the layout stores"));
  }
}

// A decode step's append (the Decode stream's path) is quantised as Append
// is: it once stored the first token_bytes of each appended token unchanged.
TEST(QuantizedStoreTest, DecodeStepsStoreTheRecordsOfTheInput) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  for (DType d : kFormats) {
    SCOPED_TRACE(DTypeName(d));
    const ModelLayout l = Quantised(d);
    KV_ASSIGN_OR_FAIL(SessionId id, FullSessionOf(*store, l, 3));
    for (int64_t pos = 3; pos < 9; ++pos) {
      KV_ASSERT_OK(Append(*store, id, l, pos, 1, nullptr, /*step=*/true));
    }
    KV_ASSERT_OK(Append(*store, id, l, 9, 4, nullptr, /*step=*/true));
    ExpectRecordsFollowTokens(*store, id, l);
    KV_ASSIGN_OR_FAIL(SessionStats before, store->GetStats(id));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const absl::Status s = Append(*store, id, l, 13, 4, &nan, true).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("layer 1 values of token 2 (position 15)"));
    KV_ASSIGN_OR_FAIL(SessionStats after, store->GetStats(id));
    EXPECT_EQ(after.resident_tokens, before.resident_tokens);
    EXPECT_EQ(after.pages, before.pages);
  }
}

TEST(QuantizedStoreTest, PoolsCountTheRecordsRealBytes) {
  std::unique_ptr<CacheStore> store = MakeStore(64);
  ASSERT_NE(store, nullptr);
  // 128 elements a token; groups of 32: int8 128 + 4 * 3 bytes, fp8
  // 128 + 4 * 2, int4 64 + 4 * 3 (bf16 would be 256).
  const std::map<std::string, int64_t> token_bytes = {
      {"int8", 140}, {"fp8_e4m3", 136}, {"int4", 76}};
  for (const LayoutStats& s : store->Layouts()) {
    EXPECT_EQ(s.pool.page_bytes, 2 * 4 * token_bytes.at(s.layout.name))
        << s.layout.name;
  }
  const ModelLayout l = Quantised(DType::kInt4);
  KV_ASSIGN_OR_FAIL(SessionId id, FullSessionOf(*store, l, 9));
  KV_ASSIGN_OR_FAIL(SessionStats stats, store->GetStats(id));
  EXPECT_EQ(stats.pages, 2 * 3);  // 9 tokens: 3 pages of 4, per layer
  EXPECT_EQ(stats.bytes, 6 * 2 * 4 * 76);
}

TEST(QuantizedStoreTest, NonFiniteOrHugeValuesAreRefusedAndChangeNothing) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  for (DType d : kFormats) {
    SCOPED_TRACE(DTypeName(d));
    const ModelLayout l = Quantised(d);
    KV_ASSIGN_OR_FAIL(SessionId id, FullSessionOf(*store, l, 6));
    KV_ASSIGN_OR_FAIL(SessionStats before, store->GetStats(id));
    KV_ASSIGN_OR_FAIL(LayerKvCopy kv_before, store->ReadLayer(id, 1));
    const int64_t used = store->Layouts()[0].pool.used_pages +
                         store->Layouts()[1].pool.used_pages +
                         store->Layouts()[2].pool.used_pages;
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(), 3e38f}) {
      // 6 tokens resident in pages of 4: the append would take a page.
      const absl::Status s = Append(*store, id, l, 6, 4, &bad).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr("layer 1 values of token 2 (position 8)"));
      EXPECT_THAT(std::string(s.message()), HasSubstr(DTypeName(d)));
    }
    KV_ASSIGN_OR_FAIL(SessionStats after, store->GetStats(id));
    EXPECT_EQ(after.resident_tokens, before.resident_tokens);
    EXPECT_EQ(after.pages, before.pages);
    EXPECT_EQ(after.layer_version, before.layer_version);
    KV_ASSIGN_OR_FAIL(LayerKvCopy kv_after, store->ReadLayer(id, 1));
    EXPECT_EQ(kv_after.values, kv_before.values);
    EXPECT_EQ(kv_after.positions, kv_before.positions);
    EXPECT_EQ(store->Layouts()[0].pool.used_pages +
                  store->Layouts()[1].pool.used_pages +
                  store->Layouts()[2].pool.used_pages,
              used);
    // The session goes on: the same positions are still free to append.
    KV_ASSERT_OK(Append(*store, id, l, 6, 4).status());
    ExpectRecordsFollowTokens(*store, id, l);
  }
}

TEST(QuantizedStoreTest, EvictionAndCompactionMoveRecordsWhole) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (DType d : kFormats) {
    SCOPED_TRACE(DTypeName(d));
    const ModelLayout l = Quantised(d);
    SessionSpec spec{l.name, {"h2o", {{"sinks", "1"}, {"recent", "2"}}}};
    spec.budget.tokens = 9;
    KV_ASSIGN_OR_FAIL(SessionId id, store->CreateSession(spec));
    int64_t evicted = 0;
    for (int64_t pos = 0; pos < 40; ++pos) {
      KV_ASSIGN_OR_FAIL(StepResult r, Append(*store, id, l, pos, 1));
      // Random attention: the kept set (and so the moves) is random.
      std::vector<std::vector<float>> rows(l.num_layers);
      std::vector<LayerScores> scores;
      for (int32_t layer = 0; layer < l.num_layers; ++layer) {
        KV_ASSIGN_OR_FAIL(BlockTable t, store->GetBlockTable(id, layer));
        for (size_t s = 0; s < t.positions.size(); ++s) {
          rows[layer].push_back(uniform(rng) / t.positions.size());
        }
        scores.push_back(LayerScores{layer, t.version, ScoreSource::kReduced, 1,
                                     rows[layer]});
      }
      KV_ASSIGN_OR_FAIL(StepResult step, store->UpdateScores(id, scores));
      for (const LayerChange& c : step.layers) {
        evicted += static_cast<int64_t>(c.evicted_positions.size());
      }
      ExpectRecordsFollowTokens(*store, id, l);
    }
    EXPECT_GT(evicted, 40);  // both layers evicted all along
  }
}

}  // namespace
}  // namespace kvkeep
