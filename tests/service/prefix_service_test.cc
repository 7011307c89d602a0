// Named prefixes through a real server on loopback and the C++ client
// (docs/prefixes.md): publish, sessions started from a prefix reading its
// bytes, unpublish with holders, tenant isolation (another tenant's private
// prefix reads as a missing one), public prefixes, bad names and an
// incompatible layout, and the pool back to empty.
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using client::KvKeepClient;
using client::KvTokens;
using client::Session;

constexpr char kLayout[] = "small";
constexpr char kOther[] = "other";

std::unique_ptr<testing::TestServer> StartServer(bool allow_public) {
  ServerConfig config =
      testing::TestServerConfig({PoolSpec{testing::SmallLayout(kLayout), 256},
                                 PoolSpec{testing::SmallLayout(kOther), 64}});
  config.tenants = {TenantToken{"alice", "token-a"},
                    TenantToken{"bob", "token-b"}};
  config.allow_public_prefixes = allow_public;
  absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
      testing::TestServer::Start(config);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

KvKeepClient Connect(const testing::TestServer& server,
                     const std::string& token) {
  client::ClientOptions options;
  options.address = server.address();
  options.token = token;
  absl::StatusOr<KvKeepClient> c = KvKeepClient::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// n tokens of random bytes at positions first.. (2 layers, 2 kv heads of 8
// f32 each).
KvTokens RandomTokens(int64_t first, int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  KvTokens tokens;
  tokens.layers.resize(2);
  for (int64_t i = 0; i < n; ++i) {
    tokens.positions.push_back(first + i);
    for (auto& layer : tokens.layers) {
      for (std::string* s : {&layer.keys, &layer.values}) {
        for (int b = 0; b < 64; ++b) s->push_back(static_cast<char>(byte(rng)));
      }
    }
  }
  return tokens;
}

v1::CreateSessionRequest Create(const std::string& policy, int64_t budget,
                                const std::string& prefix = "") {
  v1::CreateSessionRequest req;
  if (prefix.empty()) req.set_layout(kLayout);
  req.set_prefix(prefix);
  req.set_policy(policy);
  req.mutable_budget()->set_tokens(budget);
  return req;
}

// A full-policy session of the client's tenant holding 10 tokens.
Session Source(const KvKeepClient& as, std::mt19937& rng) {
  absl::StatusOr<Session> s = as.CreateSession(Create("full", 1024));
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->Append(RandomTokens(0, 10, rng)).ok());
  return *s;
}

// Each layer's tokens (position, key, value), sorted by position.
using Kv = std::vector<std::tuple<int64_t, std::string, std::string>>;
std::vector<Kv> ReadAll(const Session& s, int64_t before_position) {
  absl::StatusOr<std::vector<client::LayerKvData>> kv = s.ReadKv();
  EXPECT_TRUE(kv.ok()) << kv.status();
  std::vector<Kv> out;
  if (!kv.ok()) return out;
  for (const client::LayerKvData& l : *kv) {
    Kv layer;
    const size_t n = l.positions.size();
    const size_t bytes = n == 0 ? 0 : l.keys.size() / n;
    for (size_t i = 0; i < n; ++i) {
      if (l.positions[i] >= before_position) continue;
      layer.emplace_back(l.positions[i], l.keys.substr(i * bytes, bytes),
                         l.values.substr(i * bytes, bytes));
    }
    std::sort(layer.begin(), layer.end());
    out.push_back(std::move(layer));
  }
  return out;
}

int64_t UsedPages(const KvKeepClient& as) {
  absl::StatusOr<v1::ServerInfo> info = as.GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->pools(0).used_pages() : -1;
}

TEST(PrefixServiceTest, SessionsStartFromAPublishedPrefix) {
  std::unique_ptr<testing::TestServer> server = StartServer(false);
  ASSERT_NE(server, nullptr);
  const KvKeepClient alice = Connect(*server, "token-a");
  std::mt19937 rng(1);
  Session source = Source(alice, rng);
  KV_ASSIGN_OR_FAIL(const v1::PrefixInfo info, source.Publish("agents/sys"));
  EXPECT_EQ(info.tokens(), 10);
  EXPECT_EQ(info.layout(), kLayout);
  EXPECT_EQ(info.tenant(), "alice");
  EXPECT_EQ(info.source_session_id(), source.id());
  const std::vector<Kv> prefix = ReadAll(source, 10);
  std::vector<Session> children;
  for (int i = 0; i < 2; ++i) {
    KV_ASSIGN_OR_FAIL(Session child,
                      alice.CreateSession(Create("h2o", 16, "agents/sys")));
    EXPECT_EQ(child.layout().name(), kLayout);
    EXPECT_EQ(ReadAll(child, 10), prefix);
    // The child decodes past its budget; the prefix stays.
    client::DecodeStream scoring = child.Decode();
    for (int64_t p = 10; p < 30; ++p) {
      KV_ASSIGN_OR_FAIL(const v1::StepResult r,
                        child.Append(RandomTokens(p, 1, rng)));
      std::vector<v1::LayerScores> scores;
      for (const v1::LayerChange& c : r.layers()) {
        std::vector<float> row(c.resident(), 1.0f / c.resident());
        scores.push_back(client::ReducedScores(c.layer(), c.version(), row));
      }
      KV_ASSERT_OK(scoring.Step(scores).status());
    }
    KV_ASSERT_OK(scoring.Finish());
    KV_ASSIGN_OR_FAIL(const v1::SessionStats stats, child.Stats());
    EXPECT_GT(stats.evicted_tokens(), 0);
    // 10 tokens: 2 full pages per layer stay shared; the partly filled
    // third was copied by the first append.
    EXPECT_EQ(stats.shared_pages(), 4);
    EXPECT_EQ(ReadAll(child, 10), prefix);
    children.push_back(child);
  }
  KV_ASSIGN_OR_FAIL(const std::vector<v1::PrefixInfo> listed,
                    alice.ListPrefixes());
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].holders(), 2);
  EXPECT_EQ(listed[0].pages(), 6);
  EXPECT_TRUE(listed[0].published());
  KV_ASSERT_OK(source.Close().status());
  KV_ASSIGN_OR_FAIL(const int64_t holders, alice.UnpublishPrefix("agents/sys"));
  EXPECT_EQ(holders, 2);
  testing::ExpectError(alice.CreateSession(Create("h2o", 16, "agents/sys")),
                       absl::StatusCode::kNotFound, {"'agents/sys'"});
  for (Session& child : children) {
    EXPECT_GT(UsedPages(alice), 0);
    KV_ASSERT_OK(child.Close().status());
  }
  EXPECT_EQ(UsedPages(alice), 0);
  KV_ASSIGN_OR_FAIL(const std::vector<v1::PrefixInfo> after,
                    alice.ListPrefixes());
  EXPECT_TRUE(after.empty());
}

TEST(PrefixServiceTest, AnotherTenantsPrivatePrefixIsNotFound) {
  std::unique_ptr<testing::TestServer> server = StartServer(false);
  ASSERT_NE(server, nullptr);
  const KvKeepClient alice = Connect(*server, "token-a");
  const KvKeepClient bob = Connect(*server, "token-b");
  std::mt19937 rng(2);
  Session source = Source(alice, rng);
  KV_ASSERT_OK(source.Publish("mine").status());
  const absl::Status theirs =
      bob.CreateSession(Create("full", 64, "mine")).status();
  const absl::Status missing =
      bob.CreateSession(Create("full", 64, "nobody")).status();
  EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(theirs.message(), "prefix 'mine' not found");
  EXPECT_EQ(missing.message(), "prefix 'nobody' not found");
  testing::ExpectError(bob.UnpublishPrefix("mine"), absl::StatusCode::kNotFound,
                       {"'mine'"});
  KV_ASSIGN_OR_FAIL(const std::vector<v1::PrefixInfo> bobs, bob.ListPrefixes());
  EXPECT_TRUE(bobs.empty());
  // Bob's own prefix of the same name is his: no collision.
  Session his = Source(bob, rng);
  KV_ASSERT_OK(his.Publish("mine").status());
  KV_ASSIGN_OR_FAIL(Session child,
                    bob.CreateSession(Create("full", 64, "mine")));
  KV_ASSIGN_OR_FAIL(const v1::SessionStats stats, child.Stats());
  EXPECT_EQ(stats.tenant(), "bob");
  EXPECT_EQ(ReadAll(child, 10), ReadAll(his, 10));
  EXPECT_NE(ReadAll(child, 10), ReadAll(source, 10));
  // Public prefixes are off on this server.
  testing::ExpectError(source.Publish("everyone", true),
                       absl::StatusCode::kFailedPrecondition,
                       {"allow_public_prefixes"});
  KV_ASSIGN_OR_FAIL(const v1::ServerInfo info, alice.GetServerInfo());
  EXPECT_FALSE(info.public_prefixes());
}

TEST(PrefixServiceTest, PublicPrefixesServeEveryTenant) {
  std::unique_ptr<testing::TestServer> server = StartServer(true);
  ASSERT_NE(server, nullptr);
  const KvKeepClient alice = Connect(*server, "token-a");
  const KvKeepClient bob = Connect(*server, "token-b");
  KV_ASSIGN_OR_FAIL(const v1::ServerInfo info, bob.GetServerInfo());
  EXPECT_TRUE(info.public_prefixes());
  std::mt19937 rng(3);
  Session source = Source(alice, rng);
  KV_ASSIGN_OR_FAIL(const v1::PrefixInfo published,
                    source.Publish("tools-v1", true));
  EXPECT_TRUE(published.is_public());
  KV_ASSIGN_OR_FAIL(Session child,
                    bob.CreateSession(Create("h2o", 16, "tools-v1")));
  EXPECT_EQ(ReadAll(child, 10), ReadAll(source, 10));
  KV_ASSIGN_OR_FAIL(const std::vector<v1::PrefixInfo> seen, bob.ListPrefixes());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].tenant(), "alice");
  EXPECT_EQ(seen[0].holders(), 1);
  testing::ExpectError(bob.UnpublishPrefix("tools-v1", true),
                       absl::StatusCode::kPermissionDenied, {"another tenant"});
  testing::ExpectError(source.Publish("tools-v1", true),
                       absl::StatusCode::kAlreadyExists, {"'tools-v1'"});
  KV_ASSERT_OK(alice.UnpublishPrefix("tools-v1", true).status());
  KV_ASSERT_OK(source.Close().status());
  KV_ASSERT_OK(child.Close().status());
  EXPECT_EQ(UsedPages(alice), 0);
}

TEST(PrefixServiceTest, BadNamesLayoutsAndBudgetsAreRefused) {
  std::unique_ptr<testing::TestServer> server = StartServer(false);
  ASSERT_NE(server, nullptr);
  const KvKeepClient alice = Connect(*server, "token-a");
  std::mt19937 rng(4);
  Session source = Source(alice, rng);
  for (const std::string& bad : {std::string(), std::string("/root"),
                                 std::string("a\nb"), std::string(300, 'x')}) {
    testing::ExpectError(source.Publish(bad),
                         absl::StatusCode::kInvalidArgument, {"prefix name"});
  }
  KV_ASSERT_OK(source.Publish("p").status());
  const int64_t used = UsedPages(alice);
  v1::CreateSessionRequest other = Create("full", 64, "p");
  other.set_layout(kOther);
  testing::ExpectError(alice.CreateSession(other),
                       absl::StatusCode::kFailedPrecondition,
                       {"layout 'small'", "'other'"});
  testing::ExpectError(alice.CreateSession(Create("h2o", 8, "p")),
                       absl::StatusCode::kInvalidArgument,
                       {"10 tokens are protected"});
  v1::CreateSessionRequest evictable = Create("h2o", 8, "p");
  evictable.set_prefix_evictable(true);
  KV_ASSIGN_OR_FAIL(Session loose, alice.CreateSession(evictable));
  EXPECT_EQ(UsedPages(alice), used);  // nothing copied yet
  KV_ASSERT_OK(loose.Close().status());
  KV_ASSIGN_OR_FAIL(const std::vector<v1::SessionStats> sessions,
                    alice.ListSessions());
  EXPECT_EQ(sessions.size(), 1u);  // the refusals made nothing
}

}  // namespace
}  // namespace kvkeep
