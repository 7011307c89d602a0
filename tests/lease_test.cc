// Session leases in the store (lease.h), on a ManualClock: no test sleeps.
// Expiry and what it frees (pages, quota, the idempotency key), renewal by
// every kind of call, looks that do not renew, holds (streams) and
// transfers that pin a lease, the default and per-tenant limits and bad
// lengths, and the bounded memory of expired ids.
#include "cache_store/lease.h"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "cache_store/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectError;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr absl::Duration kLease = absl::Seconds(10);

// 2 layers of f32, 1 kv head of head_dim 4, 4-token pages (128-byte pages).
ModelLayout SmallLayout() {
  return ModelLayout{.name = "small",
                     .num_layers = 2,
                     .kv_heads = 1,
                     .query_heads = 1,
                     .head_dim = 4,
                     .dtype = DType::kF32,
                     .page_tokens = 4};
}

class LeaseTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(LeaseOptions{}); }

  // A fresh store with `lease` (its clock is the test's).
  void Start(LeaseOptions lease) {
    store_.reset();
    StoreOptions options;
    options.device = test_support::TestDevice();
    options.pools.push_back(PoolSpec{SmallLayout(), 256});
    options.max_bytes_per_tenant = 1 << 20;
    lease.clock = &clock_;
    if (lease.default_idle_timeout == absl::Hours(1)) {
      lease.default_idle_timeout = kLease;
    }
    options.lease = std::move(lease);
    absl::StatusOr<std::unique_ptr<CacheStore>> store =
        CacheStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  absl::StatusOr<SessionId> Open(const std::string& tenant = "t",
                                 absl::Duration idle_timeout = {},
                                 const std::string& policy = "h2o",
                                 const std::string& key = "") {
    SessionSpec spec;
    spec.layout = "small";
    spec.policy = PolicySpec{policy, {}};
    spec.budget.tokens = 64;
    spec.tenant = tenant;
    spec.idle_timeout = idle_timeout;
    spec.idempotency_key = key;
    return store_->CreateSession(spec);
  }

  // Appends positions [first, first + n) to every layer.
  absl::Status Append(SessionId id, int64_t first, int64_t n) {
    std::vector<int64_t> positions;
    for (int64_t p = first; p < first + n; ++p) positions.push_back(p);
    std::vector<std::vector<std::byte>> keys, values;
    std::vector<LayerKv> layers;
    for (int32_t l = 0; l < 2; ++l) {
      keys.push_back(test_data::TokenBytes(SmallLayout(), l, positions, false));
      values.push_back(
          test_data::TokenBytes(SmallLayout(), l, positions, true));
    }
    for (int32_t l = 0; l < 2; ++l) layers.push_back({keys[l], values[l]});
    return store_->Append(id, AppendRequest{positions, layers}).status();
  }

  int64_t UsedPages() const { return store_->Layouts()[0].pool.used_pages; }
  TenantStats Tenant(const std::string& name) const {
    for (const TenantStats& t : store_->Tenants()) {
      if (t.tenant == name) return t;
    }
    return TenantStats{};
  }
  // Alive, by a look that does not renew.
  bool Alive(SessionId id) {
    return store_->GetStats(id, /*renew_lease=*/false).ok();
  }

  ManualClock clock_;
  std::unique_ptr<CacheStore> store_;
};

TEST_F(LeaseTest, AnIdleSessionExpiresAndEverythingItHeldComesBack) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 9));  // 3 pages per layer
  ASSERT_EQ(UsedPages(), 6);
  ASSERT_GT(Tenant("t").bytes, 0);

  clock_.Advance(kLease - absl::Nanoseconds(1));
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
  EXPECT_TRUE(Alive(id));
  EXPECT_EQ(store_->TimeToNextExpiry(), absl::Nanoseconds(1));

  clock_.Advance(absl::Nanoseconds(1));
  const std::vector<ExpiredSession> expired = store_->ExpireIdle();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].info.id, id);
  EXPECT_EQ(expired[0].info.tenant, "t");
  EXPECT_EQ(expired[0].idle_timeout, kLease);
  EXPECT_EQ(expired[0].freed_pages, 6);
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(Tenant("t").bytes, 0);
  EXPECT_EQ(Tenant("t").sessions, 0);
  EXPECT_EQ(Tenant("t").expired_sessions, 1);
  EXPECT_THAT(store_->ListSessions(), IsEmpty());
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());  // reported once
  EXPECT_EQ(store_->TimeToNextExpiry(), absl::InfiniteDuration());

  // Every later call: NOT_FOUND, saying it expired.
  ExpectError(Append(id, 9, 1), absl::StatusCode::kNotFound,
              {"not found", "expired", "10s"});
  ExpectError(store_->GetStats(id), absl::StatusCode::kNotFound, {"expired"});
  ExpectError(store_->KeepAlive(id), absl::StatusCode::kNotFound, {"expired"});
  ExpectError(store_->CloseSession(id), absl::StatusCode::kNotFound,
              {"expired"});
  ExpectError(store_->TenantOf(id), absl::StatusCode::kNotFound, {"expired"});
  EXPECT_EQ(store_->ExpiredTenant(id), "t");
  // An id that never existed is plainly not found.
  ExpectError(store_->GetStats(id + 1), absl::StatusCode::kNotFound,
              {"not found"});
  EXPECT_THAT(std::string(store_->GetStats(id + 1).status().message()),
              Not(HasSubstr("expired")));
  EXPECT_EQ(store_->ExpiredTenant(id + 1), std::nullopt);
}

TEST_F(LeaseTest, ACallPastTheDeadlineFindsItExpiredWithoutTheReaper) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 5));
  clock_.Advance(kLease);
  // No ExpireIdle ran: the call itself closes it, and does not revive it.
  ExpectError(Append(id, 5, 1), absl::StatusCode::kNotFound, {"expired"});
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(Tenant("t").expired_sessions, 1);
  // The reaper still reports it, once, with what it freed.
  const std::vector<ExpiredSession> expired = store_->ExpireIdle();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].info.id, id);
  EXPECT_EQ(expired[0].freed_pages, 4);
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
}

// One kind of call on a session, made for the lease's sake (its result may
// be an error: a call is a call).
struct Call {
  std::string name;
  std::function<void(CacheStore&, SessionId)> run;
};

std::vector<Call> EveryKindOfCall() {
  auto append = [](CacheStore& store, SessionId id) {
    std::vector<int64_t> p = {1000};
    const std::vector<std::byte> k =
        test_data::TokenBytes(SmallLayout(), 0, p, false);
    const std::vector<LayerKv> layers = {{k, k}, {k, k}};
    store.Append(id, AppendRequest{p, layers}).IgnoreError();
  };
  return {
      {"Append", append},
      {"Step",
       [](CacheStore& s, SessionId id) {
         s.Step(id, AppendRequest{}, {}).IgnoreError();
       }},
      {"UpdateScores",
       [](CacheStore& s, SessionId id) {
         s.UpdateScores(id, {}).IgnoreError();
       }},
      {"CompressPrompt",
       [](CacheStore& s, SessionId id) {
         s.CompressPrompt(id, {}).IgnoreError();
       }},
      {"GetBlockTable",
       [](CacheStore& s, SessionId id) {
         s.GetBlockTable(id, 0).IgnoreError();
       }},
      {"ReadLayer",
       [](CacheStore& s, SessionId id) { s.ReadLayer(id, 1).IgnoreError(); }},
      {"ReadSlots",
       [](CacheStore& s, SessionId id) {
         s.ReadSlots(id, 0, 0, 0, {}, {}).IgnoreError();
       }},
      {"GetStats",
       [](CacheStore& s, SessionId id) { s.GetStats(id).IgnoreError(); }},
      {"KeepAlive",
       [](CacheStore& s, SessionId id) { s.KeepAlive(id).IgnoreError(); }},
      {"ExportSession",
       [](CacheStore& s, SessionId id) { s.ExportSession(id).IgnoreError(); }},
      {"HoldLease",
       [](CacheStore& s, SessionId id) { s.HoldLease(id).IgnoreError(); }},
      {"a failed call",
       [](CacheStore& s, SessionId id) {
         s.GetBlockTable(id, 99).IgnoreError();  // no layer 99
       }},
  };
}

TEST_F(LeaseTest, EveryKindOfCallRenewsTheLease) {
  for (const Call& call : EveryKindOfCall()) {
    SCOPED_TRACE(call.name);
    KV_ASSIGN_OR_FAIL(const SessionId id, Open());
    KV_ASSERT_OK(Append(id, 0, 3));
    clock_.Advance(kLease - absl::Seconds(1));
    call.run(*store_, id);
    clock_.Advance(kLease - absl::Seconds(1));  // 18 s after the create
    EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
    ASSERT_TRUE(Alive(id));
    clock_.Advance(absl::Seconds(1));  // a whole lease after the call
    const std::vector<ExpiredSession> expired = store_->ExpireIdle();
    ASSERT_EQ(expired.size(), 1u);
    EXPECT_EQ(expired[0].info.id, id);
  }
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(LeaseTest, LooksThatAreNotCallsDoNotRenew) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  clock_.Advance(kLease - absl::Seconds(1));
  KV_ASSERT_OK(store_->GetStats(id, /*renew_lease=*/false));
  KV_ASSERT_OK(store_->TenantOf(id));
  store_->Sessions();
  store_->ListSessions();
  store_->Tenants();
  store_->Layouts();
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->ExpireIdle().size(), 1u);
}

TEST_F(LeaseTest, StatsAndKeepAliveReportTheTimeLeft) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  clock_.Advance(absl::Seconds(4));
  KV_ASSIGN_OR_FAIL(const SessionStats peek,
                    store_->GetStats(id, /*renew_lease=*/false));
  EXPECT_EQ(peek.idle_timeout, kLease);
  EXPECT_EQ(peek.lease_left, absl::Seconds(6));
  EXPECT_FALSE(peek.lease_held);
  KV_ASSIGN_OR_FAIL(const LeaseStatus renewed, store_->KeepAlive(id));
  EXPECT_EQ(renewed.idle_timeout, kLease);
  EXPECT_EQ(renewed.left, kLease);
  EXPECT_FALSE(renewed.held);
}

TEST_F(LeaseTest, AHeldLeaseDoesNotExpireAndRestartsWhenReleased) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 4));
  {
    KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore::LeaseHold> stream,
                      store_->HoldLease(id));
    KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore::LeaseHold> second,
                      store_->HoldLease(id));
    clock_.Advance(kLease * 100);
    EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
    KV_ASSIGN_OR_FAIL(const SessionStats held,
                      store_->GetStats(id, /*renew_lease=*/false));
    EXPECT_TRUE(held.lease_held);
    EXPECT_EQ(held.lease_left, kLease);
    second.reset();
    clock_.Advance(kLease * 100);
    EXPECT_THAT(store_->ExpireIdle(), IsEmpty());  // one hold is enough
    ASSERT_TRUE(Alive(id));
  }
  // The idle time starts at the release, not at the last call.
  clock_.Advance(kLease - absl::Seconds(1));
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->ExpireIdle().size(), 1u);
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(LeaseTest, ATransferPinsTheLeaseAndAnAbortRestartsIt) {
  KV_ASSIGN_OR_FAIL(const SessionId id, Open());
  KV_ASSERT_OK(Append(id, 0, 4));
  KV_ASSERT_OK(store_->FreezeForTransfer(id));
  clock_.Advance(kLease * 10);
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
  KV_ASSIGN_OR_FAIL(const SessionStats frozen,
                    store_->GetStats(id, /*renew_lease=*/false));
  EXPECT_TRUE(frozen.lease_held);
  KV_ASSERT_OK(store_->FinishTransfer(id, /*committed=*/false));
  clock_.Advance(kLease - absl::Seconds(1));
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->ExpireIdle().size(), 1u);
  // A committed transfer closes it as before: nothing expires.
  KV_ASSIGN_OR_FAIL(const SessionId moved, Open());
  KV_ASSERT_OK(store_->FreezeForTransfer(moved));
  KV_ASSERT_OK(store_->FinishTransfer(moved, /*committed=*/true));
  clock_.Advance(kLease * 10);
  EXPECT_THAT(store_->ExpireIdle(), IsEmpty());
  EXPECT_EQ(Tenant("t").expired_sessions, 1);
}

TEST_F(LeaseTest, AnImportedSessionKeepsItsLeaseWithinTheTargetsMaximum) {
  LeaseOptions lease;
  lease.default_idle_timeout = absl::Hours(1);  // becomes kLease in Start
  lease.tenant_max_idle_timeout["capped"] = absl::Seconds(50);
  Start(lease);
  // Exported with `carried`, imported back: the lease it then has.
  auto imported = [&](const std::string& tenant, absl::Duration asked,
                      std::optional<absl::Duration> carried) {
    absl::StatusOr<SessionId> id = Open(tenant, asked);
    EXPECT_TRUE(id.ok()) << id.status();
    EXPECT_TRUE(Append(*id, 0, 4).ok());
    absl::StatusOr<SessionSnapshot> snapshot = store_->ExportSession(*id);
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_EQ(snapshot->idle_timeout, asked);  // what the create asked for
    snapshot->idle_timeout = carried;
    EXPECT_TRUE(store_->CloseSession(*id).ok());
    EXPECT_TRUE(store_->ImportSession(*snapshot).ok());
    return store_->GetStats(*id)->idle_timeout;
  };
  // Its own length, also one the target's default is shorter than.
  EXPECT_EQ(imported("t", absl::Seconds(100), absl::Seconds(100)),
            absl::Seconds(100));
  EXPECT_EQ(imported("t", kLease * 3, kLease * 3), kLease * 3);
  // A source that does not say: the target's default.
  EXPECT_EQ(imported("t", absl::Seconds(100), std::nullopt), kLease);
  // The target's maximum for the tenant wins; "never" becomes it.
  EXPECT_EQ(imported("capped", absl::Seconds(40), absl::Seconds(90)),
            absl::Seconds(50));
  EXPECT_EQ(imported("capped", absl::Seconds(40), absl::ZeroDuration()),
            absl::Seconds(50));
  EXPECT_EQ(imported("t", absl::Seconds(40), absl::ZeroDuration()),
            absl::ZeroDuration());
  EXPECT_EQ(imported("t", absl::Seconds(40), absl::Milliseconds(10)),
            kMinIdleTimeout);
}

TEST_F(LeaseTest, TheCreateChoosesItsLeaseWithinItsTenantsMaximum) {
  LeaseOptions lease;
  lease.default_idle_timeout = absl::Hours(1);  // becomes kLease in Start
  lease.tenant_max_idle_timeout["capped"] = absl::Seconds(5);
  Start(lease);
  // Asked for: its own.
  KV_ASSIGN_OR_FAIL(const SessionId own, Open("t", absl::Seconds(30)));
  // Not asked for, capped tenant: the default clamped to the maximum.
  KV_ASSIGN_OR_FAIL(const SessionId clamped, Open("capped"));
  KV_ASSIGN_OR_FAIL(const SessionStats own_stats, store_->GetStats(own));
  KV_ASSIGN_OR_FAIL(const SessionStats clamped_stats,
                    store_->GetStats(clamped));
  EXPECT_EQ(own_stats.idle_timeout, absl::Seconds(30));
  EXPECT_EQ(clamped_stats.idle_timeout, absl::Seconds(5));
  // Asked for more than the tenant may have: refused, nothing held.
  ExpectError(Open("capped", absl::Seconds(6)),
              absl::StatusCode::kInvalidArgument,
              {"idle timeout 6s", "'capped'", "5s"});
  EXPECT_EQ(Tenant("capped").sessions, 1);
  clock_.Advance(absl::Seconds(5));
  const std::vector<ExpiredSession> expired = store_->ExpireIdle();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].info.id, clamped);
  EXPECT_EQ(store_->TimeToNextExpiry(), absl::Seconds(25));
}

TEST_F(LeaseTest, AbsurdLeaseLengthsAreRefusedAndHoldNothing) {
  for (const absl::Duration bad :
       {-absl::Seconds(1), -absl::InfiniteDuration(), absl::Milliseconds(999),
        absl::Nanoseconds(1), kMaxIdleTimeout + absl::Seconds(1),
        absl::InfiniteDuration()}) {
    SCOPED_TRACE(absl::FormatDuration(bad));
    const absl::StatusOr<SessionId> id = Open("t", bad);
    ExpectError(id, absl::StatusCode::kInvalidArgument, {"idle timeout"});
  }
  EXPECT_THAT(store_->ListSessions(), IsEmpty());
  EXPECT_EQ(Tenant("t").sessions, 0);
  EXPECT_EQ(UsedPages(), 0);
  // The edges are taken.
  KV_ASSERT_OK(Open("t", kMinIdleTimeout));
  KV_ASSERT_OK(Open("t", kMaxIdleTimeout));
}

TEST_F(LeaseTest, AForkHasItsOwnLeaseOfItsParentsLengthUnlessItAsks) {
  LeaseOptions lease;
  lease.tenant_max_idle_timeout["capped"] = absl::Seconds(20);
  Start(lease);
  KV_ASSIGN_OR_FAIL(const SessionId parent, Open("capped", absl::Seconds(15)));
  KV_ASSERT_OK(Append(parent, 0, 6));
  clock_.Advance(absl::Seconds(10));
  // The parent's length, fresh from the fork; the fork renews the parent.
  KV_ASSIGN_OR_FAIL(const SessionId same, store_->ForkSession(parent, {}));
  ForkSpec asks;
  asks.idle_timeout = absl::Seconds(3);
  KV_ASSIGN_OR_FAIL(const SessionId short_lived,
                    store_->ForkSession(parent, asks));
  KV_ASSIGN_OR_FAIL(const SessionStats same_stats,
                    store_->GetStats(same, /*renew_lease=*/false));
  KV_ASSIGN_OR_FAIL(const SessionStats parent_stats,
                    store_->GetStats(parent, /*renew_lease=*/false));
  EXPECT_EQ(same_stats.idle_timeout, absl::Seconds(15));
  EXPECT_EQ(same_stats.lease_left, absl::Seconds(15));
  EXPECT_EQ(parent_stats.lease_left, absl::Seconds(15));
  // Beyond the tenant's maximum, or under the shortest lease: refused, and
  // no child is made.
  for (const absl::Duration bad : {absl::Seconds(21), absl::Milliseconds(10)}) {
    ForkSpec spec;
    spec.idle_timeout = bad;
    ExpectError(store_->ForkSession(parent, spec),
                absl::StatusCode::kInvalidArgument, {"idle timeout"});
  }
  EXPECT_EQ(Tenant("capped").sessions, 3);
  // Each expires on its own lease; the shared pages stay with the others.
  clock_.Advance(absl::Seconds(3));
  std::vector<ExpiredSession> expired = store_->ExpireIdle();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].info.id, short_lived);
  EXPECT_TRUE(Alive(parent));
  EXPECT_TRUE(Alive(same));
  clock_.Advance(absl::Seconds(12));
  expired = store_->ExpireIdle();
  EXPECT_EQ(expired.size(), 2u);
  EXPECT_EQ(UsedPages(), 0);
  EXPECT_EQ(Tenant("capped").sessions, 0);
}

TEST_F(LeaseTest, BadLeaseOptionsStopTheStore) {
  for (const absl::Duration bad : {-absl::Seconds(1), absl::Milliseconds(500),
                                   kMaxIdleTimeout + absl::Seconds(1)}) {
    LeaseOptions lease;
    lease.default_idle_timeout = bad;
    ExpectError(ValidateLeaseOptions(lease), absl::StatusCode::kInvalidArgument,
                {"default idle timeout"});
    LeaseOptions tenant;
    tenant.tenant_max_idle_timeout["x"] = bad;
    ExpectError(ValidateLeaseOptions(tenant),
                absl::StatusCode::kInvalidArgument, {"'x'", "maximum"});
  }
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools.push_back(PoolSpec{SmallLayout(), 8});
  options.lease.default_idle_timeout = -absl::Seconds(1);
  ExpectError(CacheStore::Create(options), absl::StatusCode::kInvalidArgument,
              {"idle timeout"});
}

TEST_F(LeaseTest, AZeroDefaultMeansNeverUnlessTheTenantHasAMaximum) {
  LeaseOptions lease;
  lease.default_idle_timeout = absl::ZeroDuration();
  lease.tenant_max_idle_timeout["capped"] = absl::Seconds(60);
  Start(lease);
  KV_ASSIGN_OR_FAIL(const SessionId forever, Open("t"));
  KV_ASSIGN_OR_FAIL(const SessionId capped, Open("capped"));
  KV_ASSIGN_OR_FAIL(const SessionStats stats, store_->GetStats(forever));
  EXPECT_EQ(stats.idle_timeout, absl::ZeroDuration());
  EXPECT_EQ(stats.lease_left, absl::ZeroDuration());
  clock_.Advance(absl::Hours(24 * 365));
  const std::vector<ExpiredSession> expired = store_->ExpireIdle();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].info.id, capped);
  EXPECT_TRUE(Alive(forever));
  EXPECT_EQ(store_->TimeToNextExpiry(), absl::InfiniteDuration());
}

TEST_F(LeaseTest, TheIdempotencyKeyOfAnExpiredSessionMakesANewOne) {
  KV_ASSIGN_OR_FAIL(const SessionId first, Open("t", {}, "h2o", "key"));
  clock_.Advance(kLease);
  EXPECT_EQ(store_->ExpireIdle().size(), 1u);
  KV_ASSIGN_OR_FAIL(const SessionId second, Open("t", {}, "h2o", "key"));
  EXPECT_NE(first, second);
  EXPECT_TRUE(Alive(second));
}

TEST_F(LeaseTest, TheMemoryOfExpiredIdsIsBounded) {
  LeaseOptions lease;
  lease.remembered_expiries = 2;
  Start(lease);
  std::vector<SessionId> ids;
  for (int i = 0; i < 3; ++i) {
    KV_ASSIGN_OR_FAIL(const SessionId id, Open());
    ids.push_back(id);
    clock_.Advance(absl::Seconds(1));  // expire in creation order
  }
  clock_.Advance(kLease);
  EXPECT_EQ(store_->ExpireIdle().size(), 3u);
  // Which two are remembered depends on the scan's order; exactly two are.
  int remembered = 0;
  for (SessionId id : ids) {
    const absl::Status s = store_->KeepAlive(id).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    remembered += absl::StrContains(s.message(), "expired") ? 1 : 0;
  }
  EXPECT_EQ(remembered, 2);
}

TEST(ExpiredSessionsTest, AnIdAddedAgainKeepsTheOthers) {
  ExpiredSessions expired(2);
  expired.Add(1, "t", absl::Seconds(5));
  expired.Add(2, "t", absl::Seconds(5));
  expired.Add(2, "u", absl::Seconds(7));  // full: nothing need go for it
  EXPECT_NE(expired.Find(1), nullptr);
  ASSERT_NE(expired.Find(2), nullptr);
  EXPECT_EQ(expired.Find(2)->tenant, "u");
  expired.Add(3, "t", absl::Seconds(5));  // the oldest goes
  EXPECT_EQ(expired.Find(1), nullptr);
  EXPECT_NE(expired.Find(2), nullptr);
  EXPECT_NE(expired.Find(3), nullptr);
}

// Reaping runs while other sessions work (a race for the sanitizers): the
// busy sessions have long leases, so exactly the idle ones go.
TEST_F(LeaseTest, ExpiringWhileOtherSessionsWorkFreesExactlyTheIdleOnes) {
  std::vector<SessionId> busy, idle;
  for (int i = 0; i < 8; ++i) {
    KV_ASSIGN_OR_FAIL(const SessionId b, Open("t", absl::Hours(1)));
    KV_ASSIGN_OR_FAIL(const SessionId d, Open());
    busy.push_back(b);
    idle.push_back(d);
    KV_ASSERT_OK(Append(d, 0, 5));
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (SessionId id : busy) {
    workers.emplace_back([&, id] {
      for (int64_t p = 0; !stop && p < 40; ++p) {
        ASSERT_TRUE(Append(id, p, 1).ok());
      }
    });
  }
  clock_.Advance(kLease);
  const std::vector<ExpiredSession> expired = store_->ExpireIdle();
  stop = true;
  for (std::thread& t : workers) t.join();
  std::vector<SessionId> gone;
  for (const ExpiredSession& e : expired) gone.push_back(e.info.id);
  EXPECT_THAT(gone, ::testing::UnorderedElementsAreArray(idle));
  for (SessionId id : busy) EXPECT_TRUE(Alive(id));
}

}  // namespace
}  // namespace kvkeep
