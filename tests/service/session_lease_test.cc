// Session leases through the gRPC API, on an in-process kvkeepd whose store
// reads a ManualClock (ServerHooks::clock), so no test sleeps for a lease:
// every RPC that names a session renews it, listings do not, an open Decode
// stream holds it, an expired session answers NOT_FOUND "expired" to its own
// tenant only, KeepAlive, ServerInfo's lease fields, and bad lease lengths
// at CreateSession. Polls (for a stream's end to reach the server) have a
// generous limit, kPatience, so a hang fails instead of blocking ctest.
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectError;
using ::testing::IsEmpty;

constexpr absl::Duration kPatience = absl::Seconds(60);
constexpr double kDefaultSeconds = 10;
constexpr double kCappedMaxSeconds = 30;

// n tokens from `first` on, every layer of SmallLayout (f32, 2 kv heads x
// head_dim 8).
client::KvTokens Tokens(int64_t first, int64_t n) {
  client::KvTokens t;
  for (int64_t p = first; p < first + n; ++p) t.positions.push_back(p);
  t.layers.resize(2);
  for (client::LayerBytes& l : t.layers) {
    l.keys.assign(n * 2 * 8 * 4, '\1');
    l.values.assign(n * 2 * 8 * 4, '\2');
  }
  return t;
}

// The reaper thread of the server may close an expired session before the
// test looks: either way, it is gone and says it expired.
void ExpectExpired(const client::Session& s) {
  ExpectError(s.KeepAlive(), absl::StatusCode::kNotFound,
              {s.id().c_str(), "expired"});
}

class SessionLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerConfig config = testing::TestServerConfig(
        {PoolSpec{testing::SmallLayout("small"), 256}});
    config.session_idle_timeout_seconds = kDefaultSeconds;
    config.tenants = {{"a", "token-a", 0}, {"capped", "token-c", 30}};
    ServerHooks hooks;
    hooks.clock = &clock_;
    absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
        testing::TestServer::Start(config, std::move(hooks));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    a_ = Connect("token-a");
    capped_ = Connect("token-c");
  }

  std::unique_ptr<client::KvKeepClient> Connect(const std::string& token) {
    client::ClientOptions options;
    options.address = server_->address();
    options.token = token;
    absl::StatusOr<client::KvKeepClient> c =
        client::KvKeepClient::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::make_unique<client::KvKeepClient>(*std::move(c));
  }

  static absl::StatusOr<client::Session> Create(
      const client::KvKeepClient& c, double idle_timeout_seconds = 0) {
    v1::CreateSessionRequest request;
    request.set_layout("small");
    request.set_policy("h2o");
    request.mutable_budget()->set_tokens(64);
    request.set_idle_timeout_seconds(idle_timeout_seconds);
    return c.CreateSession(request);
  }

  // The session as ListSessions shows it (a look that does not renew);
  // nullopt once it is gone.
  std::optional<v1::SessionStats> Listed(const client::KvKeepClient& c,
                                         const std::string& id) {
    absl::StatusOr<std::vector<v1::SessionStats>> all = c.ListSessions();
    EXPECT_TRUE(all.ok()) << all.status();
    if (!all.ok()) return std::nullopt;
    for (const v1::SessionStats& s : *all) {
      if (s.session_id() == id) return s;
    }
    return std::nullopt;
  }

  // Waits until no stream holds the session's lease (a stream's end
  // reaches the server just after the client hears its status).
  void AwaitNotHeld(const std::string& id) {
    std::optional<v1::SessionStats> s = Listed(*a_, id);
    for (const absl::Time until = absl::Now() + kPatience;
         s.has_value() && s->lease_held() && absl::Now() < until;
         s = Listed(*a_, id)) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(s.has_value());
    ASSERT_FALSE(s->lease_held());
  }

  int64_t UsedPages() {
    absl::StatusOr<v1::ServerInfo> info = a_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->pools(0).used_pages() : -1;
  }

  // Runs the store's expiry pass now and expects it not to close `s` (it
  // may report others: sessions earlier calls found expired).
  void ExpectNotReaped(const client::Session& s) {
    for (const ExpiredSession& e : server_->store().ExpireIdle()) {
      EXPECT_NE(SessionName(e.info.id), s.id());
    }
    EXPECT_TRUE(Listed(*a_, s.id()).has_value());
  }

  ManualClock clock_;
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::KvKeepClient> a_;
  std::unique_ptr<client::KvKeepClient> capped_;
};

// One RPC on a session, for the lease's sake: its answer may be an error
// (CompressPrompt of an h2o session, MapPool without pool sharing): a call
// that names the session is a call on it.
struct Rpc {
  std::string name;
  std::function<void(const client::Session&)> call;
};

std::vector<Rpc> EveryRpcOnASession() {
  return {
      {"Append",
       [](const client::Session& s) {
         EXPECT_TRUE(s.Append(Tokens(100, 1)).ok());
       }},
      {"AppendPrefill",
       [](const client::Session& s) {
         EXPECT_TRUE(s.AppendPrefill(Tokens(100, 1)).ok());
       }},
      {"Decode",
       [](const client::Session& s) {
         client::DecodeStream stream = s.Decode();
         EXPECT_TRUE(stream.Step(Tokens(100, 1), {}).ok());
         EXPECT_TRUE(stream.Finish().ok());
       }},
      {"CompressPrompt",
       [](const client::Session& s) { s.CompressPrompt({}).IgnoreError(); }},
      {"GetBlockTables",
       [](const client::Session& s) { EXPECT_TRUE(s.GetBlockTables().ok()); }},
      {"ReadKv",
       [](const client::Session& s) { EXPECT_TRUE(s.ReadKv().ok()); }},
      {"GetSessionStats",
       [](const client::Session& s) { EXPECT_TRUE(s.Stats().ok()); }},
      {"KeepAlive",
       [](const client::Session& s) { EXPECT_TRUE(s.KeepAlive().ok()); }},
      {"MapPool", [](const client::Session& s) { s.MapPool().IgnoreError(); }},
  };
}

TEST_F(SessionLeaseTest, EveryRpcOnTheSessionRenewsItsLease) {
  const absl::Duration lease = absl::Seconds(kDefaultSeconds);
  for (const Rpc& rpc : EveryRpcOnASession()) {
    SCOPED_TRACE(rpc.name);
    KV_ASSIGN_OR_FAIL(const client::Session s, Create(*a_));
    KV_ASSERT_OK(s.AppendPrefill(Tokens(0, 3)));
    clock_.Advance(lease - absl::Seconds(1));
    rpc.call(s);
    AwaitNotHeld(s.id());
    clock_.Advance(lease - absl::Seconds(1));
    ExpectNotReaped(s);
    clock_.Advance(absl::Seconds(1));  // a whole lease since the RPC
    ExpectExpired(s);
  }
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(SessionLeaseTest, ListingDoesNotRenew) {
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*a_));
  clock_.Advance(absl::Seconds(kDefaultSeconds - 1));
  std::optional<v1::SessionStats> listed = Listed(*a_, s.id());
  ASSERT_TRUE(listed.has_value());
  EXPECT_EQ(listed->idle_timeout_seconds(), kDefaultSeconds);
  EXPECT_EQ(listed->lease_seconds_left(), 1);
  EXPECT_FALSE(listed->lease_held());
  clock_.Advance(absl::Seconds(1));
  EXPECT_FALSE(Listed(*a_, s.id()).has_value());
  ExpectExpired(s);
}

TEST_F(SessionLeaseTest, KeepAliveAndStatsSayHowLongTheLeaseRuns) {
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*a_, 20));
  clock_.Advance(absl::Seconds(15));
  KV_ASSIGN_OR_FAIL(const v1::KeepAliveResponse kept, s.KeepAlive());
  EXPECT_EQ(kept.idle_timeout_seconds(), 20);
  EXPECT_EQ(kept.lease_seconds_left(), 20);
  EXPECT_FALSE(kept.lease_held());
  clock_.Advance(absl::Seconds(15));
  KV_ASSIGN_OR_FAIL(const v1::SessionStats stats, s.Stats());  // renews too
  EXPECT_EQ(stats.idle_timeout_seconds(), 20);
  EXPECT_EQ(stats.lease_seconds_left(), 20);
}

TEST_F(SessionLeaseTest, AnOpenDecodeStreamHoldsTheLease) {
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*a_));
  client::DecodeStream stream = s.Decode();
  KV_ASSERT_OK(stream.Step(Tokens(0, 1), {}));
  clock_.Advance(absl::Hours(24));
  ExpectNotReaped(s);
  std::optional<v1::SessionStats> listed = Listed(*a_, s.id());
  ASSERT_TRUE(listed.has_value());
  EXPECT_TRUE(listed->lease_held());
  EXPECT_EQ(listed->lease_seconds_left(), kDefaultSeconds);
  KV_ASSERT_OK(stream.Step(Tokens(1, 1), {}));  // the stream still works
  KV_ASSERT_OK(stream.Finish());
  AwaitNotHeld(s.id());
  // The idle time starts when the stream ends.
  clock_.Advance(absl::Seconds(kDefaultSeconds - 1));
  ExpectNotReaped(s);
  clock_.Advance(absl::Seconds(1));
  ExpectExpired(s);
  EXPECT_EQ(UsedPages(), 0);
}

TEST_F(SessionLeaseTest, OnlyItsOwnTenantHearsThatASessionExpired) {
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*a_));
  KV_ASSERT_OK(s.AppendPrefill(Tokens(0, 9)));
  AwaitNotHeld(s.id());  // the idle time starts once the stream has ended
  const std::string not_found = absl::StrCat("session ", s.id(), " not found");
  // Another tenant: the answer an unknown id gets, live or expired.
  absl::Status other = capped_->KeepAlive(s.id()).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other.message(), not_found);
  clock_.Advance(absl::Seconds(kDefaultSeconds));
  ExpectExpired(s);
  ExpectError(s.Append(Tokens(9, 1)), absl::StatusCode::kNotFound, {"expired"});
  other = capped_->KeepAlive(s.id()).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other.message(), not_found);
  other = capped_->GetSessionStats(s.id()).status();
  EXPECT_EQ(other.message(), not_found);
  EXPECT_EQ(UsedPages(), 0);
  int64_t expired = 0;
  for (const TenantStats& t : server_->store().Tenants()) {
    if (t.tenant == "a") expired = t.expired_sessions;
  }
  EXPECT_EQ(expired, 1);
}

TEST_F(SessionLeaseTest, KeepAliveOnAnUnknownOrMalformedIdIsRefused) {
  ExpectError(a_->KeepAlive("00000000000000ab"), absl::StatusCode::kNotFound,
              {"session 00000000000000ab not found"});
  ExpectError(a_->KeepAlive("not-an-id"), absl::StatusCode::kInvalidArgument,
              {"session_id", "16 lowercase hex digits"});
  ExpectError(a_->KeepAlive(""), absl::StatusCode::kInvalidArgument,
              {"session_id"});
}

TEST_F(SessionLeaseTest, ServerInfoGivesTheCallersDefaultAndMaximum) {
  KV_ASSIGN_OR_FAIL(const v1::ServerInfo a, a_->GetServerInfo());
  EXPECT_EQ(a.default_idle_timeout_seconds(), kDefaultSeconds);
  EXPECT_EQ(a.max_idle_timeout_seconds(),
            absl::ToDoubleSeconds(kMaxIdleTimeout));
  KV_ASSIGN_OR_FAIL(const v1::ServerInfo c, capped_->GetServerInfo());
  EXPECT_EQ(c.default_idle_timeout_seconds(), kDefaultSeconds);
  EXPECT_EQ(c.max_idle_timeout_seconds(), kCappedMaxSeconds);
}

TEST_F(SessionLeaseTest, BadLeaseLengthsAreRefusedAndTheServerServesOn) {
  const double inf = std::numeric_limits<double>::infinity();
  for (const double bad : {-1.0, -inf, 0.5, 1e-9, std::nan(""), inf, 1e12,
                           absl::ToDoubleSeconds(kMaxIdleTimeout) + 1}) {
    SCOPED_TRACE(bad);
    ExpectError(Create(*a_, bad), absl::StatusCode::kInvalidArgument, {"idle"});
  }
  ExpectError(Create(*capped_, kCappedMaxSeconds + 1),
              absl::StatusCode::kInvalidArgument,
              {"idle timeout 31s", "'capped'", "30s"});
  absl::StatusOr<std::vector<v1::SessionStats>> none = a_->ListSessions();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_THAT(*none, IsEmpty());
  EXPECT_EQ(UsedPages(), 0);
  // Within the limits: taken, as asked or as defaulted.
  KV_ASSIGN_OR_FAIL(const client::Session most,
                    Create(*capped_, kCappedMaxSeconds));
  KV_ASSIGN_OR_FAIL(const client::Session defaulted, Create(*capped_));
  KV_ASSIGN_OR_FAIL(const v1::SessionStats m, most.Stats());
  KV_ASSIGN_OR_FAIL(const v1::SessionStats d, defaulted.Stats());
  EXPECT_EQ(m.idle_timeout_seconds(), kCappedMaxSeconds);
  EXPECT_EQ(d.idle_timeout_seconds(), kDefaultSeconds);
}

}  // namespace
}  // namespace kvkeep
