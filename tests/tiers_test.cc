// Tiers in the store (tiers.h, docs/tiers.md), on a ManualClock: a session
// moved to disk (or host memory) and back is byte-identical and evicts
// exactly as an unmoved twin over a further random stream; a full pool moves
// the least recently used session down instead of answering
// RESOURCE_EXHAUSTED; idle sessions move down when the clock says so; a
// damaged tier file is detected, reported and never served; an unusable
// directory leaves the session where it was; shared sessions stay; leases,
// quotas and closes see a moved session right. Also the tier file's codec.
#include "cache_store/tiers.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "cache_store/clock.h"
#include "cache_store/tier_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectError;
using ::testing::HasSubstr;

constexpr absl::Duration kIdle = absl::Seconds(30);

ModelLayout TierLayout() {
  return ModelLayout{.name = "tiered",
                     .num_layers = 2,
                     .kv_heads = 1,
                     .query_heads = 1,
                     .head_dim = 4,
                     .dtype = DType::kF32,
                     .page_tokens = 4};
}

// A fresh directory under the test's temp dir.
std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("kvkeep-tiers-", ::getpid(), "-", name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

int64_t FilesIn(const std::string& dir) {
  int64_t n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    (void)f;
    ++n;
  }
  return n;
}

class TiersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TierOptions tiers;
    tiers.disk_dir = FreshDir(
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    tiers.idle_after = kIdle;
    Start(tiers, 64);
  }
  void TearDown() override {
    store_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void Start(TierOptions tiers, int64_t capacity_pages,
             int64_t max_bytes_per_tenant = 0) {
    store_.reset();
    dir_ = tiers.disk_dir;
    StoreOptions options;
    options.device = test_support::TestDevice();
    options.pools.push_back(
        PoolSpec{TierLayout(), capacity_pages, std::move(tiers)});
    options.max_bytes_per_tenant = max_bytes_per_tenant;
    options.lease.clock = &clock_;
    absl::StatusOr<std::unique_ptr<CacheStore>> store =
        CacheStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  absl::StatusOr<SessionId> Open(PolicySpec policy = {"h2o", {}},
                                 int64_t budget = 16,
                                 const std::string& tenant = "t") {
    SessionSpec spec;
    spec.layout = "tiered";
    spec.policy = std::move(policy);
    spec.budget.tokens = budget;
    spec.tenant = tenant;
    return store_->CreateSession(spec);
  }

  // Appends positions [first, first + n) with bytes drawn from `seed`: the
  // same seed gives a twin the same tokens.
  absl::StatusOr<StepResult> Append(SessionId id, int64_t first, int64_t n,
                                    uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> value(-1, 1);
    std::vector<int64_t> positions;
    for (int64_t p = first; p < first + n; ++p) positions.push_back(p);
    std::vector<std::vector<float>> data(4, std::vector<float>(n * 4));
    for (auto& d : data) {
      for (float& f : d) f = value(rng);
    }
    std::vector<LayerKv> layers;
    for (int l = 0; l < 2; ++l) {
      layers.push_back(LayerKv{std::as_bytes(std::span(data[2 * l])),
                               std::as_bytes(std::span(data[2 * l + 1]))});
    }
    return store_->Append(id, AppendRequest{positions, layers});
  }

  // One row of attention (drawn from `seed`) per layer over its slots.
  absl::StatusOr<StepResult> Scores(SessionId id, uint32_t seed) {
    absl::StatusOr<SessionStats> stats = store_->GetStats(id);
    if (!stats.ok()) return stats.status();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> weight(0.01f, 1);
    std::vector<std::vector<float>> rows;
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < 2; ++l) {
      std::vector<float> row(stats->layer_resident[l]);
      float sum = 0;
      for (float& f : row) sum += (f = weight(rng));
      for (float& f : row) f /= sum;
      rows.push_back(std::move(row));
    }
    for (int32_t l = 0; l < 2; ++l) {
      scores.push_back(LayerScores{l, stats->layer_version[l],
                                   ScoreSource::kReduced, 1, rows[l]});
    }
    return store_->UpdateScores(id, scores);
  }

  // Every layer's keys, values, positions and version, equal.
  void ExpectSameLayers(SessionId a, SessionId b, const std::string& where) {
    for (int32_t l = 0; l < 2; ++l) {
      absl::StatusOr<LayerKvCopy> x = store_->ReadLayer(a, l);
      absl::StatusOr<LayerKvCopy> y = store_->ReadLayer(b, l);
      ASSERT_TRUE(x.ok()) << x.status();
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_EQ(x->version, y->version) << where << " layer " << l;
      EXPECT_EQ(x->positions, y->positions) << where << " layer " << l;
      EXPECT_TRUE(x->keys == y->keys) << where << " layer " << l;
      EXPECT_TRUE(x->values == y->values) << where << " layer " << l;
    }
  }

  int64_t UsedPages() const { return store_->Layouts()[0].pool.used_pages; }
  TierStats Tiers() const { return store_->Layouts()[0].tiers; }
  int64_t TenantBytes(const std::string& tenant = "t") const {
    for (const TenantStats& t : store_->Tenants()) {
      if (t.tenant == tenant) return t.bytes;
    }
    return 0;
  }
  Tier Where(SessionId id) {
    absl::StatusOr<Tier> tier = store_->TierOf(id);
    EXPECT_TRUE(tier.ok()) << tier.status();
    return tier.ok() ? *tier : Tier::kPool;
  }

  ManualClock clock_;
  std::string dir_;
  std::unique_ptr<CacheStore> store_;
};

void ExpectSameChange(const StepResult& got, const StepResult& want,
                      const std::string& where) {
  ASSERT_EQ(got.layers.size(), want.layers.size()) << where;
  for (size_t l = 0; l < got.layers.size(); ++l) {
    EXPECT_EQ(got.layers[l].version, want.layers[l].version) << where;
    EXPECT_EQ(got.layers[l].resident, want.layers[l].resident) << where;
    EXPECT_EQ(got.layers[l].evicted_positions, want.layers[l].evicted_positions)
        << where;
    EXPECT_EQ(got.layers[l].moves, want.layers[l].moves) << where;
  }
}

TEST(TierFileTest, RoundTripsAndRefusesEveryDamagedByte) {
  SessionSnapshot s;
  s.id = 42;
  s.layout = "tiered";
  s.policy = PolicySpec{"h2o", {{"recent", "2"}}, 3};
  s.tenant = "t";
  s.last_position = 5;
  s.work.evicted_score = 1.5;
  s.idle_timeout = absl::Seconds(7);
  LayerSnapshot l;
  l.position = {0, 5};
  l.arrival = {0, 1};
  l.score = {0.5f, 0.25f};
  l.appended = 2;
  l.version = 3;
  l.budget = 8;
  l.keys.assign(8, std::byte{7});
  l.values.assign(8, std::byte{9});
  s.layers = {l};
  const std::vector<std::byte> bytes = EncodeTierFile(s);
  KV_ASSIGN_OR_FAIL(const SessionSnapshot back, DecodeTierFile(bytes));
  EXPECT_EQ(back.id, 42u);
  EXPECT_EQ(back.policy.params.at("recent"), "2");
  EXPECT_EQ(back.policy.protect_first, 3);
  EXPECT_EQ(back.idle_timeout, absl::Seconds(7));
  EXPECT_EQ(back.layers[0].position, l.position);
  EXPECT_EQ(back.layers[0].score, l.score);
  EXPECT_TRUE(back.layers[0].keys == l.keys);
  EXPECT_EQ(EncodeTierFile(back), bytes);
  // Every single flipped bit, and every truncation, is DATA_LOSS.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::vector<std::byte> bad = bytes;
    bad[i] ^= std::byte{0x10};
    EXPECT_EQ(DecodeTierFile(bad).status().code(), absl::StatusCode::kDataLoss)
        << "byte " << i;
    EXPECT_EQ(DecodeTierFile(std::span(bytes).first(i)).status().code(),
              absl::StatusCode::kDataLoss)
        << "length " << i;
  }
}

TEST_F(TiersTest, MovedToDiskAndBackIsExactAndEvictsAsAnUnmovedTwin) {
  for (const PolicySpec& policy :
       {PolicySpec{"h2o", {{"sinks", "1"}, {"recent", "2"}}},
        PolicySpec{"scissorhands", {{"recent", "1"}, {"history", "3"}}},
        PolicySpec{"tova", {}}, PolicySpec{"streaming_llm", {}}}) {
    KV_ASSIGN_OR_FAIL(const SessionId moved, Open(policy));
    KV_ASSIGN_OR_FAIL(const SessionId twin, Open(policy));
    std::mt19937 rng(7);
    int64_t next = 0;
    for (int step = 0; step < 60 && !HasFailure(); ++step) {
      const uint32_t seed = rng();
      if (step % 3 == 0) {
        // The moved session goes to disk before most of its calls.
        KV_ASSERT_OK(store_->Demote(moved));
        ASSERT_EQ(Where(moved), Tier::kDisk);
        ASSERT_EQ(FilesIn(dir_), 1);
      }
      const std::string where = absl::StrCat(policy.name, " step ", step);
      const bool scored = policy.name != "streaming_llm";
      if (seed % 2 == 0 || next == 0 || !scored) {
        const int64_t n = 1 + seed % 5;
        KV_ASSIGN_OR_FAIL(const StepResult got, Append(moved, next, n, seed));
        KV_ASSIGN_OR_FAIL(const StepResult want, Append(twin, next, n, seed));
        ExpectSameChange(got, want, where);
        next += n;
      } else if (next > 0) {
        KV_ASSIGN_OR_FAIL(const StepResult got, Scores(moved, seed));
        KV_ASSIGN_OR_FAIL(const StepResult want, Scores(twin, seed));
        ExpectSameChange(got, want, where);
      }
      EXPECT_EQ(Where(moved), Tier::kPool) << where;
      ExpectSameLayers(moved, twin, where);
    }
    KV_ASSIGN_OR_FAIL(const SessionStats a, store_->GetStats(moved));
    KV_ASSIGN_OR_FAIL(const SessionStats b, store_->GetStats(twin));
    EXPECT_EQ(a.evicted_tokens, b.evicted_tokens);
    EXPECT_GT(a.evicted_tokens, 0) << "the stream must evict";
    EXPECT_EQ(a.evicted_score, b.evicted_score);
    KV_ASSERT_OK(store_->CloseSession(moved));
    KV_ASSERT_OK(store_->CloseSession(twin));
  }
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(FilesIn(dir_), 0);
  EXPECT_GT(Tiers().restores, 0);
  EXPECT_EQ(Tiers().restores, Tiers().moves_down);
}

TEST_F(TiersTest, AMovedSessionHoldsNoPagesNorQuotaAndClosesCleanly) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 9, 1).status());
  ASSERT_EQ(UsedPages(), 6);
  const int64_t bytes = TenantBytes();
  ASSERT_GT(bytes, 0);
  KV_ASSERT_OK(store_->Demote(id));
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(TenantBytes(), 0) << "a moved session is charged nothing";
  const TierStats tiers = Tiers();
  EXPECT_EQ(tiers.sessions[static_cast<int>(Tier::kDisk)], 1);
  EXPECT_EQ(tiers.sessions[static_cast<int>(Tier::kPool)], 0);
  EXPECT_GT(tiers.bytes[static_cast<int>(Tier::kDisk)], 2 * 9 * 32);
  // A look does not bring it back; it still shows its tokens.
  KV_ASSIGN_OR_FAIL(const SessionStats peek,
                    store_->GetStats(id, /*renew_lease=*/false));
  EXPECT_EQ(peek.resident_tokens, 18);
  EXPECT_EQ(peek.pages, 0);
  EXPECT_EQ(Where(id), Tier::kDisk);
  ExpectError(store_->Demote(id), absl::StatusCode::kFailedPrecondition,
              {"already in the disk tier"});
  KV_ASSERT_OK(store_->CloseSession(id));
  EXPECT_EQ(FilesIn(dir_), 0);
  EXPECT_EQ(Tiers().sessions[static_cast<int>(Tier::kDisk)], 0);
  EXPECT_EQ(Tiers().bytes[static_cast<int>(Tier::kDisk)], 0);
}

TEST_F(TiersTest, AFullPoolMovesTheLeastRecentlyUsedSessionDown) {
  TierOptions tiers;
  tiers.disk_dir = dir_;
  Start(tiers, /*capacity_pages=*/8);
  KV_ASSIGN_OR_FAIL(const SessionId oldest, Open());
  KV_ASSIGN_OR_FAIL(const SessionId newer, Open());
  KV_ASSIGN_OR_FAIL(const SessionId caller, Open());
  KV_ASSERT_OK(Append(oldest, 0, 8, 1).status());  // 4 pages
  clock_.Advance(absl::Seconds(1));
  KV_ASSERT_OK(Append(newer, 0, 4, 2).status());  // 2 pages
  clock_.Advance(absl::Seconds(1));
  ASSERT_EQ(UsedPages(), 6);
  // Needs 4 pages, 2 are free: `oldest` goes to disk, not the caller away.
  KV_ASSERT_OK(Append(caller, 0, 8, 3).status());
  EXPECT_EQ(Where(oldest), Tier::kDisk);
  EXPECT_EQ(Where(newer), Tier::kPool);
  EXPECT_EQ(Where(caller), Tier::kPool);
  // And `oldest`'s next call brings it back, moving the now least recently
  // used one down to make room.
  KV_ASSERT_OK(store_->ReadLayer(oldest, 0).status());
  EXPECT_EQ(Where(oldest), Tier::kPool);
  EXPECT_EQ(Where(newer), Tier::kDisk);
  EXPECT_EQ(Where(caller), Tier::kPool);
  EXPECT_EQ(Tiers().moves_down, 2);
  EXPECT_EQ(Tiers().restores, 1);
}

TEST_F(TiersTest, WithoutTiersAFullPoolStillSaysResourceExhausted) {
  Start(TierOptions{}, /*capacity_pages=*/4);
  KV_ASSIGN_OR_FAIL(const SessionId a, Open());
  KV_ASSIGN_OR_FAIL(const SessionId b, Open());
  KV_ASSERT_OK(Append(a, 0, 8, 1).status());
  ExpectError(Append(b, 0, 8, 2).status(), absl::StatusCode::kResourceExhausted,
              {"page pool exhausted"});
  ExpectError(store_->Demote(a), absl::StatusCode::kFailedPrecondition,
              {"has no tiers"});
}

TEST_F(TiersTest, IdleSessionsMoveDownByTheStoresClock) {
  KV_ASSIGN_OR_FAIL(const SessionId idle, Open());
  KV_ASSIGN_OR_FAIL(const SessionId busy, Open());
  KV_ASSERT_OK(Append(idle, 0, 5, 1).status());
  KV_ASSERT_OK(Append(busy, 0, 5, 2).status());
  clock_.Advance(kIdle - absl::Seconds(1));
  EXPECT_EQ(store_->DemoteIdle(), 0);
  KV_ASSERT_OK(store_->KeepAlive(busy).status());
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->DemoteIdle(), 1);
  EXPECT_EQ(Where(idle), Tier::kDisk);
  EXPECT_EQ(Where(busy), Tier::kPool);
  // A stream's hold keeps a session in the pool however long it waits.
  KV_ASSIGN_OR_FAIL(auto hold, store_->HoldLease(busy));
  clock_.Advance(2 * kIdle);
  EXPECT_EQ(store_->DemoteIdle(), 0);
  EXPECT_EQ(Where(busy), Tier::kPool);
  hold.reset();
  clock_.Advance(kIdle);
  EXPECT_EQ(store_->DemoteIdle(), 1);
  EXPECT_EQ(Where(busy), Tier::kDisk);
}

TEST_F(TiersTest, AMovedSessionKeepsItsLeaseAndExpiresWithItsFile) {
  SessionSpec spec;
  spec.layout = "tiered";
  spec.policy = PolicySpec{"h2o", {}};
  spec.budget.tokens = 16;
  spec.idle_timeout = 2 * kIdle;
  KV_ASSIGN_OR_FAIL(const SessionId id, store_->CreateSession(spec));
  KV_ASSERT_OK(Append(id, 0, 5, 1).status());
  clock_.Advance(kIdle);
  EXPECT_EQ(store_->DemoteIdle(), 1);
  ASSERT_EQ(FilesIn(dir_), 1);
  clock_.Advance(kIdle);
  ASSERT_EQ(store_->ExpireIdle().size(), 1u);
  EXPECT_EQ(FilesIn(dir_), 0);
  ExpectError(store_->GetStats(id).status(), absl::StatusCode::kNotFound,
              {"expired"});
}

TEST_F(TiersTest, ADamagedFileIsDetectedReportedAndNeverServed) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 9, 1).status());
  KV_ASSERT_OK(store_->Demote(id));
  ASSERT_EQ(FilesIn(dir_), 1);
  const std::filesystem::path file =
      std::filesystem::directory_iterator(dir_)->path();
  {
    // One byte of one key, deep in the payload.
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(file)) - 40);
    f.put('\x5a');
  }
  const absl::Status lost = store_->ReadLayer(id, 0).status();
  ExpectError(lost, absl::StatusCode::kDataLoss, {SessionName(id).c_str()});
  EXPECT_THAT(lost.message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(lost.message(), HasSubstr(file.string()));
  // Every later call says the same; nothing is held; close frees the id.
  ExpectError(Append(id, 9, 1, 2).status(), absl::StatusCode::kDataLoss,
              {"lost"});
  EXPECT_EQ(Tiers().corrupt, 1);
  EXPECT_EQ(Tiers().restores, 0);
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(TenantBytes(), 0);
  EXPECT_EQ(FilesIn(dir_), 0);
  KV_ASSERT_OK(store_->CloseSession(id));
  ExpectError(store_->ReadLayer(id, 0).status(), absl::StatusCode::kNotFound,
              {"not found"});
}

TEST_F(TiersTest, AnUnwritableDirectoryLeavesTheSessionWhereItWas) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 9, 1).status());
  // The directory is replaced by a file: nothing can be created in it (as
  // root, a read-only mode would not stop the write).
  std::filesystem::remove_all(dir_);
  std::ofstream(dir_) << "not a directory";
  ExpectError(store_->Demote(id), absl::StatusCode::kFailedPrecondition,
              {"stays in the pool"});
  EXPECT_EQ(Where(id), Tier::kPool);
  EXPECT_EQ(UsedPages(), 6);
  EXPECT_EQ(Tiers().failed_moves, 1);
  EXPECT_EQ(Tiers().moves_down, 0);
  KV_ASSERT_OK(store_->ReadLayer(id, 0).status());
  // The idle scan tries and leaves it too.
  clock_.Advance(kIdle);
  EXPECT_EQ(store_->DemoteIdle(), 0);
  EXPECT_EQ(Where(id), Tier::kPool);
  std::filesystem::remove(dir_);
}

// A full disk: the session's file is written through a link to /dev/full
// (every write fails ENOSPC), placed where the tier writes its temporary
// file. RESOURCE_EXHAUSTED naming the disk; the session stays in the pool
// and nothing is left in the directory.
TEST_F(TiersTest, AFullDiskLeavesTheSessionWhereItWas) {
  if (!std::filesystem::exists("/dev/full")) {
    GTEST_SKIP() << "no /dev/full on this machine";
  }
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 9, 1).status());
  const std::string temp = absl::StrCat(dir_, "/", SessionName(id), ".kvt.tmp");
  std::filesystem::create_symlink("/dev/full", temp);
  ExpectError(store_->Demote(id), absl::StatusCode::kResourceExhausted,
              {"disk tier: cannot write", "stays in the pool"});
  EXPECT_EQ(Where(id), Tier::kPool);
  EXPECT_EQ(UsedPages(), 6);
  EXPECT_EQ(Tiers().failed_moves, 1);
  EXPECT_EQ(Tiers().moves_down, 0);
  KV_ASSERT_OK(store_->ReadLayer(id, 0).status());
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
  // With room again, the same session moves down and back.
  KV_ASSERT_OK(store_->Demote(id));
  EXPECT_EQ(Where(id), Tier::kDisk);
  KV_ASSERT_OK(store_->ReadLayer(id, 0).status());
  EXPECT_EQ(Where(id), Tier::kPool);
}

TEST_F(TiersTest, SessionsSharingPagesStayInThePool) {
  KV_ASSIGN_OR_FAIL(const SessionId parent, Open());
  KV_ASSERT_OK(Append(parent, 0, 8, 1).status());
  KV_ASSIGN_OR_FAIL(const SessionId child,
                    store_->ForkSession(parent, ForkSpec{}));
  ExpectError(store_->Demote(parent), absl::StatusCode::kFailedPrecondition,
              {"shares"});
  ExpectError(store_->Demote(child), absl::StatusCode::kFailedPrecondition,
              {"shares"});
  KV_ASSERT_OK(store_->CloseSession(child));
  KV_ASSERT_OK(store_->Demote(parent));  // nothing shared any more
  EXPECT_EQ(Where(parent), Tier::kDisk);
  // Forking or publishing a moved session brings it back first.
  KV_ASSIGN_OR_FAIL(const SessionId again,
                    store_->ForkSession(parent, ForkSpec{}));
  EXPECT_EQ(Where(parent), Tier::kPool);
  KV_ASSERT_OK(store_->CloseSession(again));
  KV_ASSERT_OK(store_->Demote(parent));
  PrefixSpec prefix;
  prefix.name = "p";
  prefix.tenant = "t";
  KV_ASSERT_OK(store_->PublishPrefix(parent, prefix).status());
  EXPECT_EQ(Where(parent), Tier::kPool);
  KV_ASSIGN_OR_FAIL(const PrefixInfo info,
                    store_->UnpublishPrefix("t", "p", false));
  EXPECT_EQ(info.tokens, 8);
}

TEST_F(TiersTest, TheHostTierTakesWhatFitsAndTheDiskTheRest) {
  TierOptions tiers;
  tiers.disk_dir = dir_;
  tiers.host_bytes = 1500;  // one 9-token session's file, not two
  Start(tiers, 64);
  KV_ASSIGN_OR_FAIL(const SessionId a, Open());
  KV_ASSIGN_OR_FAIL(const SessionId b, Open());
  KV_ASSERT_OK(Append(a, 0, 9, 1).status());
  KV_ASSERT_OK(Append(b, 0, 9, 1).status());
  KV_ASSERT_OK(store_->Demote(a));
  KV_ASSERT_OK(store_->Demote(b));
  EXPECT_EQ(Where(a), Tier::kHost);
  EXPECT_EQ(Where(b), Tier::kDisk);
  EXPECT_LE(Tiers().bytes[static_cast<int>(Tier::kHost)], 1500);
  ExpectSameLayers(a, b, "host and disk");
  EXPECT_EQ(Tiers().sessions[static_cast<int>(Tier::kHost)], 0);
}

// The device pool -> host tier path: a session in a GPU's pool moves to
// host memory and comes back byte for byte. Needs a CUDA device (the GPU
// device check runs it, and every test above, with KVKEEP_TEST_DEVICE).
TEST(TiersDeviceTest, ADevicePoolSessionMovesToHostMemoryAndBack) {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device here: the device pool -> host tier path "
                    "runs in the GPU device check";
  }
  StoreOptions options;
  options.device = Device{Device::Kind::kCuda, 0};
  PoolSpec pool{TierLayout(), 64};
  pool.tiers.host_bytes = 1 << 20;
  options.pools.push_back(pool);
  KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore> store,
                    CacheStore::Create(options));
  SessionSpec spec;
  spec.layout = "tiered";
  spec.policy = PolicySpec{"full", {}};
  spec.budget.tokens = 32;
  KV_ASSIGN_OR_FAIL(const SessionId id, store->CreateSession(spec));
  std::vector<int64_t> positions = {0, 1, 2, 3, 4};
  std::vector<float> kv(5 * 4);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = 0.25f * static_cast<float>(i);
  const LayerKv layer{std::as_bytes(std::span(kv)),
                      std::as_bytes(std::span(kv))};
  const std::vector<LayerKv> layers = {layer, layer};
  KV_ASSERT_OK(store->Append(id, AppendRequest{positions, layers}).status());
  KV_ASSIGN_OR_FAIL(const LayerKvCopy before, store->ReadLayer(id, 1));
  KV_ASSERT_OK(store->Demote(id));
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  KV_ASSIGN_OR_FAIL(const Tier tier, store->TierOf(id));
  EXPECT_EQ(tier, Tier::kHost);
  KV_ASSIGN_OR_FAIL(const LayerKvCopy after, store->ReadLayer(id, 1));
  EXPECT_TRUE(after.keys == before.keys);
  EXPECT_TRUE(after.values == before.values);
  EXPECT_EQ(after.positions, before.positions);
  EXPECT_EQ(after.version, before.version);
}

TEST(TierOptionsTest, BadOptionsAreRefusedNamingTheLayout) {
  TierOptions idle_only;
  idle_only.idle_after = absl::Seconds(1);
  ExpectError(PrepareTiers(idle_only, "big"),
              absl::StatusCode::kInvalidArgument, {"layout 'big'"});
  TierOptions negative;
  negative.host_bytes = -1;
  ExpectError(PrepareTiers(negative, "big"), absl::StatusCode::kInvalidArgument,
              {"negative"});
  // Each layout clears its directory at start: two may not share one.
  StoreOptions options;
  PoolSpec a{TierLayout(), 8};
  a.tiers.disk_dir = FreshDir("shared");
  PoolSpec b = a;
  b.layout.name = "other";
  options.pools = {a, b};
  ExpectError(CacheStore::Create(options).status(),
              absl::StatusCode::kInvalidArgument,
              {"layout 'other'", "another layout's"});
  std::filesystem::remove_all(a.tiers.disk_dir);
}

}  // namespace
}  // namespace kvkeep
