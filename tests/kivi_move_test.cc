// kivi_int4 sessions that move (cache_store/kivi_keys.h, session_snapshot.h):
// exported and imported into another store, demoted to a tier and brought
// back, or moved in page chunks through the two-phase transfer calls, a
// session then answers every call exactly as a twin that never moved: the
// same evictions and slot moves, the same ReadLayerAs bytes (f32 and bf16),
// the same key blocks, value records and staging in its pages, the same
// resident bytes; under full and h2o_page, moved again and again with its
// open page at different fills; sessions started from a kivi prefix
// continue likewise. A snapshot that is damaged (short, with a
// staging of the wrong size or not finite, an open page's block that its
// staging does not quantise to, the wrong format for the layout) is refused
// with INVALID_ARGUMENT and leaves nothing held; the tier file says its
// format (2 for kivi_int4), so a reader of format 1 refuses it.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "cache_store/tier_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::test_data::AppendBuffers;
using ::testing::HasSubstr;

const ModelLayout kKivi = test_data::SmallLayout(DType::kKiviInt4, "kivi");

std::unique_ptr<CacheStore> MakeStore(const std::string& disk_dir = "",
                                      int64_t pages = 256) {
  StoreOptions options;
  options.device = test_support::TestDevice();
  TierOptions tiers;
  tiers.disk_dir = disk_dir;
  options.pools = {PoolSpec{kKivi, pages, tiers}};
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// A session and the store that holds it now.
struct Held {
  CacheStore* store = nullptr;
  SessionId id = 0;
};

absl::StatusOr<SessionId> NewSession(CacheStore& store, PolicySpec policy,
                                     int64_t budget) {
  SessionSpec spec{kKivi.name, std::move(policy)};
  spec.budget.tokens = budget;
  return store.CreateSession(spec);
}

void ExpectSameChange(const StepResult& got, const StepResult& want) {
  ASSERT_EQ(got.layers.size(), want.layers.size());
  for (size_t l = 0; l < got.layers.size(); ++l) {
    EXPECT_EQ(got.layers[l].evicted_positions, want.layers[l].evicted_positions)
        << "layer " << l;
    EXPECT_EQ(got.layers[l].moves, want.layers[l].moves) << "layer " << l;
  }
}

// Position `pos` appended to both; the same changes.
void AppendBoth(const Held& moved, const Held& twin, int64_t pos) {
  AppendBuffers data(kKivi, pos, 1);
  KV_ASSIGN_OR_FAIL(StepResult a,
                    moved.store->Append(moved.id, data.request()));
  KV_ASSIGN_OR_FAIL(StepResult b, twin.store->Append(twin.id, data.request()));
  ExpectSameChange(a, b);
}

// The same attention rows (from `rng`) to both; the same changes.
void ScoreBoth(const Held& moved, const Held& twin, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<LayerScores> a, b;
  std::vector<std::vector<float>> rows(kKivi.num_layers);
  for (int32_t layer = 0; layer < kKivi.num_layers; ++layer) {
    KV_ASSIGN_OR_FAIL(BlockTable ta,
                      moved.store->GetBlockTable(moved.id, layer));
    KV_ASSIGN_OR_FAIL(BlockTable tb, twin.store->GetBlockTable(twin.id, layer));
    ASSERT_EQ(ta.positions, tb.positions);
    ASSERT_EQ(ta.version, tb.version);
    for (size_t i = 0; i < ta.positions.size(); ++i) {
      rows[layer].push_back(uniform(rng) / ta.positions.size());
    }
    a.push_back(
        LayerScores{layer, ta.version, ScoreSource::kReduced, 1, rows[layer]});
    b.push_back(
        LayerScores{layer, tb.version, ScoreSource::kReduced, 1, rows[layer]});
  }
  KV_ASSIGN_OR_FAIL(StepResult ra, moved.store->UpdateScores(moved.id, a));
  KV_ASSIGN_OR_FAIL(StepResult rb, twin.store->UpdateScores(twin.id, b));
  ExpectSameChange(ra, rb);
}

// Bit for bit the same: both ReadLayerAs kinds, the pages' key blocks,
// value records and staging, the slots' state, the resident bytes.
void ExpectSame(const Held& moved, const Held& twin) {
  for (int32_t layer = 0; layer < kKivi.num_layers; ++layer) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      KV_ASSIGN_OR_FAIL(LayerKvCopy got,
                        moved.store->ReadLayerAs(moved.id, layer, dtype));
      KV_ASSIGN_OR_FAIL(LayerKvCopy want,
                        twin.store->ReadLayerAs(twin.id, layer, dtype));
      ASSERT_EQ(got.positions, want.positions) << "layer " << layer;
      ASSERT_EQ(got.version, want.version) << "layer " << layer;
      ASSERT_EQ(got.keys, want.keys) << "layer " << layer;
      ASSERT_EQ(got.values, want.values) << "layer " << layer;
    }
  }
  KV_ASSIGN_OR_FAIL(SessionSnapshot got, moved.store->ExportSession(moved.id));
  KV_ASSIGN_OR_FAIL(SessionSnapshot want, twin.store->ExportSession(twin.id));
  ASSERT_TRUE(got.kivi);
  for (size_t l = 0; l < got.layers.size(); ++l) {
    const LayerSnapshot& g = got.layers[l];
    const LayerSnapshot& w = want.layers[l];
    EXPECT_EQ(g.keys, w.keys) << "layer " << l;
    EXPECT_EQ(g.values, w.values) << "layer " << l;
    EXPECT_EQ(g.kivi_staging, w.kivi_staging) << "layer " << l;
    EXPECT_EQ(g.score, w.score) << "layer " << l;
    EXPECT_EQ(g.arrival, w.arrival) << "layer " << l;
    EXPECT_EQ(g.appended, w.appended) << "layer " << l;
  }
  KV_ASSIGN_OR_FAIL(SessionStats gs, moved.store->GetStats(moved.id));
  KV_ASSIGN_OR_FAIL(SessionStats ws, twin.store->GetStats(twin.id));
  EXPECT_EQ(gs.resident_tokens, ws.resident_tokens);
  EXPECT_EQ(gs.pages, ws.pages);
  EXPECT_EQ(gs.bytes, ws.bytes);
  EXPECT_EQ(gs.evicted_tokens, ws.evicted_tokens);
}

// Exported with its bytes, closed and imported into `to`.
void MoveByExport(Held& moved, CacheStore* to) {
  KV_ASSIGN_OR_FAIL(SessionSnapshot s, moved.store->ExportSession(moved.id));
  KV_ASSERT_OK(moved.store->CloseSession(moved.id));
  KV_ASSIGN_OR_FAIL(SessionId id, to->ImportSession(s));
  EXPECT_EQ(id, moved.id);
  moved.store = to;
}

// Frozen, read out in chunks of `chunk_pages` pages where they lie, written
// into `to`'s reservation, committed there and closed here: a transfer's
// calls, without the transport.
void MoveInChunks(Held& moved, CacheStore* to, int64_t chunk_pages) {
  KV_ASSIGN_OR_FAIL(SessionSnapshot state,
                    moved.store->FreezeForTransfer(moved.id));
  EXPECT_TRUE(state.kivi);
  KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore::PendingImport> pending,
                    to->PrepareImport(state));
  const int64_t chunk = chunk_pages * kKivi.page_tokens;
  for (size_t l = 0; l < state.layers.size(); ++l) {
    const auto layer = static_cast<int32_t>(l);
    for (int64_t first = 0; first < state.layers[l].resident();
         first += chunk) {
      const int64_t n = std::min(chunk, state.layers[l].resident() - first);
      KV_ASSIGN_OR_FAIL(SlotSpans spans, moved.store->FrozenSlotSpans(
                                             moved.id, layer, first, n));
      std::vector<std::byte> keys, values;
      for (auto piece : spans.keys)
        keys.insert(keys.end(), piece.begin(), piece.end());
      for (auto piece : spans.values)
        values.insert(values.end(), piece.begin(), piece.end());
      KV_ASSERT_OK(pending->Write(layer, keys, values));
    }
  }
  KV_ASSIGN_OR_FAIL(SessionId id, to->CommitImport(std::move(pending)));
  EXPECT_EQ(id, moved.id);
  KV_ASSERT_OK(moved.store->FinishTransfer(moved.id, /*committed=*/true));
  moved.store = to;
}

enum class Move { kExport, kTier, kChunks };

// `how` moves a session (between two stores, or down a tier of the first
// and back) four times, with its open pages at different fills, as it and
// a twin that stays put take the same appends (and, under h2o_page, the
// same scores): after every step they are the same.
void RunTwins(Move how) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           absl::StrCat("kvkeep-kivi-move-", ::getpid(), "-",
                                        static_cast<int>(how)))
                              .string();
  std::filesystem::remove_all(dir);
  std::unique_ptr<CacheStore> a = MakeStore(dir);
  std::unique_ptr<CacheStore> b = MakeStore();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  for (const auto& [policy, budget] : std::vector<std::pair<PolicySpec, int>>{
           {{"full", {}}, 1 << 20},
           {{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}}, 12}}) {
    SCOPED_TRACE(policy.name);
    const bool scores = policy.name != "full";
    KV_ASSIGN_OR_FAIL(SessionId twin_id, NewSession(*a, policy, budget));
    KV_ASSIGN_OR_FAIL(SessionId moved_id, NewSession(*a, policy, budget));
    const Held twin{a.get(), twin_id};
    Held moved{a.get(), moved_id};
    std::mt19937 rng(41);
    int moves = 0;
    for (int64_t pos = 0; pos < 48; ++pos) {
      SCOPED_TRACE(pos);
      AppendBoth(moved, twin, pos);
      if (scores) ScoreBoth(moved, twin, rng);
      ExpectSame(moved, twin);
      if (pos % 11 != 5) continue;  // 6, 17, 28, 39 tokens appended
      ++moves;
      if (how == Move::kTier) {
        KV_ASSIGN_OR_FAIL(SessionStats in, a->GetStats(moved.id));
        const int64_t before = a->Layouts()[0].pool.used_pages;
        KV_ASSERT_OK(a->Demote(moved.id));
        EXPECT_EQ(a->Layouts()[0].pool.used_pages, before - in.pages);
      } else {
        CacheStore* to = moved.store == a.get() ? b.get() : a.get();
        if (how == Move::kExport) {
          MoveByExport(moved, to);
        } else {
          MoveInChunks(moved, to, 1 + moves % 2);
        }
      }
      ExpectSame(moved, twin);
    }
    EXPECT_EQ(moves, 4);
    KV_ASSIGN_OR_FAIL(SessionStats done, twin.store->GetStats(twin.id));
    EXPECT_EQ(done.evicted_tokens > 40, scores);  // 2 x (48 - 12) under h2o
    KV_ASSERT_OK(moved.store->CloseSession(moved.id));
    KV_ASSERT_OK(a->CloseSession(twin.id));
  }
  // Everything went back: no page or tenant byte is left held.
  for (CacheStore* store : {a.get(), b.get()}) {
    for (const LayoutStats& s : store->Layouts()) {
      EXPECT_EQ(s.pool.used_pages, 0);
    }
    for (const TenantStats& t : store->Tenants()) EXPECT_EQ(t.bytes, 0);
  }
  std::filesystem::remove_all(dir);
}

TEST(KiviMoveTest, AnExportedSessionContinuesAsTheOriginalWould) {
  RunTwins(Move::kExport);
}

TEST(KiviMoveTest, ASessionMovedInPageChunksContinuesAsTheOriginalWould) {
  RunTwins(Move::kChunks);
}

TEST(KiviMoveTest, ASessionBackFromATierContinuesAsTheOriginalWould) {
  RunTwins(Move::kTier);
}

// A kivi prefix, published with its open pages 3 tokens in, shares its
// pages and staging with the sessions started from it: each, fed its own
// tokens and scores, continues as a session that appended the prefix's
// tokens itself (h2o_page: with its evictions, compactions and the copies
// of shared pages before writing into them).
TEST(KiviMoveTest, SessionsFromAKiviPrefixContinueAsTheOriginalWould) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  const PolicySpec policy{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}};
  std::vector<SessionId> ids;  // the source, then a twin for each child
  for (int i = 0; i < 3; ++i) {
    KV_ASSIGN_OR_FAIL(SessionId id, NewSession(*store, policy, 12));
    ids.push_back(id);
  }
  for (SessionId id : ids) {
    AppendBuffers data(kKivi, 0, 11);
    KV_ASSERT_OK(store->Append(id, data.request()).status());
  }
  KV_ASSERT_OK(
      store->PublishPrefix(ids[0], PrefixSpec{"kivi-prefix", ""}).status());
  KV_ASSERT_OK(store->CloseSession(ids[0]));
  std::vector<Held> children, twins;
  for (int i = 0; i < 2; ++i) {
    SessionSpec spec{"", policy};
    spec.budget.tokens = 12;
    spec.prefix = "kivi-prefix";
    spec.prefix_evictable = true;
    KV_ASSIGN_OR_FAIL(SessionId child, store->CreateSession(spec));
    children.push_back(Held{store.get(), child});
    twins.push_back(Held{store.get(), ids[1 + i]});
  }
  std::mt19937 rng(29);
  for (int64_t pos = 11; pos < 40; ++pos) {
    SCOPED_TRACE(pos);
    for (int i = 0; i < 2; ++i) {
      AppendBoth(children[i], twins[i], pos + 1000 * i);
      ScoreBoth(children[i], twins[i], rng);
      ExpectSame(children[i], twins[i]);
    }
  }
  KV_ASSIGN_OR_FAIL(SessionStats done, store->GetStats(children[1].id));
  EXPECT_GT(done.evicted_tokens, 20);
}

// A session of 2 layers x 7 tokens under full: 2 pages a layer, the open
// one holding 3 tokens.
SessionSnapshot Exported(CacheStore& store) {
  absl::StatusOr<SessionId> id = NewSession(store, {"full", {}}, 1 << 20);
  EXPECT_TRUE(id.ok()) << id.status();
  AppendBuffers data(kKivi, 0, 7);
  EXPECT_TRUE(store.Append(*id, data.request()).ok());
  absl::StatusOr<SessionSnapshot> s = store.ExportSession(*id);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(store.CloseSession(*id).ok());
  return *s;
}

TEST(KiviMoveTest, DamagedSnapshotsAreRefusedAndHoldNothing) {
  std::unique_ptr<CacheStore> source = MakeStore();
  std::unique_ptr<CacheStore> target = MakeStore();
  ASSERT_NE(source, nullptr);
  ASSERT_NE(target, nullptr);
  const SessionSnapshot good = Exported(*source);
  const PageLayout page = kKivi.page_layout();
  ASSERT_EQ(good.layers[1].keys.size(), 2 * page.key_block_bytes());
  ASSERT_EQ(good.layers[1].kivi_staging.size(), 3 * page.token_elements());
  struct Case {
    std::string name;
    std::function<void(SessionSnapshot&)> damage;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"short key blocks",
       [](SessionSnapshot& s) { s.layers[1].keys.pop_back(); },
       "layer 1: keys must hold 2 kivi_int4 key blocks"},
      {"short values",
       [](SessionSnapshot& s) { s.layers[0].values.resize(100); },
       "layer 0: keys must hold 2 kivi_int4 key blocks"},
      {"staging of 2 tokens",
       [&](SessionSnapshot& s) {
         s.layers[1].kivi_staging.resize(2 * page.token_elements());
       },
       "the kivi_int4 staging must hold the open page's 3 tokens"},
      {"NaN staging",
       [](SessionSnapshot& s) {
         s.layers[0].kivi_staging[5] = std::numeric_limits<float>::quiet_NaN();
       },
       "kivi_int4 staging element 5 is nan"},
      {"staging unlike the block",
       [](SessionSnapshot& s) { s.layers[1].kivi_staging[7] += 0.5f; },
       "layer 1: the open page's kivi_int4 key block is not the quantisation"},
      {"block unlike the staging",
       [&](SessionSnapshot& s) {
         s.layers[0].keys[page.key_block_bytes() + 3] ^= std::byte{0x10};
       },
       "layer 0: the open page's kivi_int4 key block is not the quantisation"},
      {"an infinite scale in a full page",
       [&](SessionSnapshot& s) {
         const uint16_t inf = 0x7c00;
         std::memcpy(s.layers[1].keys.data() + page.key_scales_offset() + 2 * 9,
                     &inf, 2);
       },
       "layer 1: a kivi_int4 key block has channel 9 scale inf"},
      {"a zero point past int4",
       [&](SessionSnapshot& s) {
         s.layers[0].keys[page.key_zeros_offset() + 4] = std::byte{16};
       },
       "channel 4 scale"},
      {"token records' format", [](SessionSnapshot& s) { s.kivi = false; },
       "holds token records; layout 'kivi' stores kivi_int4"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SessionSnapshot bad = good;
    c.damage(bad);
    const absl::Status s = target->ImportSession(bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    for (const LayoutStats& l : target->Layouts()) {
      EXPECT_EQ(l.pool.used_pages, 0);
      EXPECT_EQ(l.sessions, 0);
    }
    for (const TenantStats& t : target->Tenants()) EXPECT_EQ(t.bytes, 0);
  }
  // A pending import takes whole pages only, from a page's first slot.
  SessionSnapshot metadata = good;
  for (LayerSnapshot& l : metadata.layers) {
    l.keys.clear();
    l.values.clear();
  }
  KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore::PendingImport> pending,
                    target->PrepareImport(metadata));
  const int64_t tb = page.token_bytes();
  const std::span<const std::byte> keys(good.layers[0].keys);
  const std::span<const std::byte> values(good.layers[0].values);
  const absl::Status split = pending->Write(
      0, keys.first(page.key_block_bytes()), values.first(2 * tb));
  EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument) << split;
  KV_ASSERT_OK(pending->Write(0, keys.first(page.key_block_bytes()),
                              values.first(4 * tb)));
  const absl::Status rest =
      pending->Write(0, keys.subspan(page.key_block_bytes()).first(10),
                     values.subspan(4 * tb));
  EXPECT_EQ(rest.code(), absl::StatusCode::kInvalidArgument) << rest;
  EXPECT_THAT(std::string(rest.message()),
              HasSubstr("not whole kivi_int4 pages"));
  pending.reset();  // an import given up frees its reservation
  for (const LayoutStats& l : target->Layouts()) {
    EXPECT_EQ(l.pool.used_pages, 0);
  }
  // The undamaged snapshot imports, and reads as it did.
  KV_ASSIGN_OR_FAIL(SessionId id, target->ImportSession(good));
  KV_ASSIGN_OR_FAIL(SessionSnapshot back, target->ExportSession(id));
  for (size_t l = 0; l < back.layers.size(); ++l) {
    EXPECT_EQ(back.layers[l].keys, good.layers[l].keys);
    EXPECT_EQ(back.layers[l].values, good.layers[l].values);
    EXPECT_EQ(back.layers[l].kivi_staging, good.layers[l].kivi_staging);
  }
}

TEST(KiviMoveTest, APoolWithoutRoomRefusesTheImportAndHoldsNothing) {
  std::unique_ptr<CacheStore> source = MakeStore();
  std::unique_ptr<CacheStore> small = MakeStore("", 3);  // 4 pages needed
  ASSERT_NE(source, nullptr);
  ASSERT_NE(small, nullptr);
  const absl::Status s = small->ImportSession(Exported(*source)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  for (const LayoutStats& l : small->Layouts()) {
    EXPECT_EQ(l.pool.used_pages, 0);
  }
  for (const TenantStats& t : small->Tenants()) EXPECT_EQ(t.bytes, 0);
}

// Slot runs of a kivi session (FrozenSlotSpans, ReadSlots) start on a page
// and hand out its whole key block.
TEST(KiviMoveTest, SlotRunsOfKiviStartOnAPage) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  KV_ASSIGN_OR_FAIL(SessionId id, NewSession(*store, {"full", {}}, 1 << 20));
  AppendBuffers data(kKivi, 0, 7);
  KV_ASSERT_OK(store->Append(id, data.request()).status());
  KV_ASSERT_OK(store->FreezeForTransfer(id).status());
  const absl::Status s = store->FrozenSlotSpans(id, 0, 2, 3).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not start a page"));
  KV_ASSIGN_OR_FAIL(SlotSpans spans, store->FrozenSlotSpans(id, 0, 4, 3));
  ASSERT_EQ(spans.keys.size(), 1u);
  EXPECT_EQ(spans.keys[0].size(), kKivi.page_layout().key_block_bytes());
  KV_ASSERT_OK(store->FinishTransfer(id, /*committed=*/false));
  const PageLayout page = kKivi.page_layout();
  KV_ASSIGN_OR_FAIL(SessionSnapshot all, store->ExportSession(id));
  std::vector<std::byte> keys(page.key_block_bytes());
  std::vector<std::byte> values(3 * page.token_bytes());
  KV_ASSERT_OK(store->ReadSlots(id, 1, 4, 3, keys, values));
  const std::span<const std::byte> want_keys(all.layers[1].keys);
  const std::span<const std::byte> want_values(all.layers[1].values);
  EXPECT_TRUE(
      std::ranges::equal(keys, want_keys.subspan(page.key_block_bytes())));
  EXPECT_TRUE(
      std::ranges::equal(values, want_values.subspan(4 * page.token_bytes())));
  const absl::Status mid = store->ReadSlots(id, 1, 2, 3, keys, values);
  EXPECT_EQ(mid.code(), absl::StatusCode::kInvalidArgument) << mid;
}

TEST(KiviMoveTest, TheTierFileSaysItsFormat) {
  std::unique_ptr<CacheStore> store = MakeStore();
  ASSERT_NE(store, nullptr);
  const SessionSnapshot kivi = Exported(*store);
  std::vector<std::byte> file = EncodeTierFile(kivi);
  uint32_t format = 0;
  std::memcpy(&format, file.data() + 8, 4);
  EXPECT_EQ(format, 2u);
  KV_ASSIGN_OR_FAIL(SessionSnapshot back, DecodeTierFile(file));
  EXPECT_TRUE(back.kivi);
  for (size_t l = 0; l < back.layers.size(); ++l) {
    EXPECT_EQ(back.layers[l].keys, kivi.layers[l].keys);
    EXPECT_EQ(back.layers[l].kivi_staging, kivi.layers[l].kivi_staging);
  }
  SessionSnapshot records = kivi;
  records.kivi = false;
  for (LayerSnapshot& l : records.layers) l.kivi_staging.clear();
  const std::vector<std::byte> old = EncodeTierFile(records);
  std::memcpy(&format, old.data() + 8, 4);
  EXPECT_EQ(format, 1u);  // what every older build reads
  const uint32_t newer = 3;
  std::memcpy(file.data() + 8, &newer, 4);
  const absl::Status s = DecodeTierFile(file).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("tier file format 3"));
}

}  // namespace
}  // namespace kvkeep
