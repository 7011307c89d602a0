// Tiers through gRPC (docs/tiers.md): a session kvkeepd moved to disk is
// brought back transparently by the next call (ReadKv returns the same
// bytes), and /metrics shows where sessions are, what moved and how long it
// took; then the agent-session metrics of issue 18: prefixes as they are
// published, used and unpublished, and forks.
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "tests/testing/metrics_testing.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using metrics_testing::HttpGet;
using metrics_testing::ParseExposition;
using metrics_testing::Sample;
using metrics_testing::Value;
using ::testing::Optional;

class TiersServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::path(::testing::TempDir()) /
            absl::StrCat("kvkeep-tiers-service-", ::getpid()))
               .string();
    std::filesystem::remove_all(dir_);
    PoolSpec pool{testing::SmallLayout("m"), 256};
    pool.tiers.disk_dir = dir_;
    ServerConfig config = testing::TestServerConfig({pool});
    config.metrics_listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<KvKeepServer>> server =
        KvKeepServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client::ClientOptions options;
    options.address = server_->address();
    client_ = std::make_unique<client::KvKeepClient>(
        *client::KvKeepClient::Connect(options));
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  client::Session Open() {
    absl::StatusOr<client::Session> s =
        metrics_testing::OpenSession(*client_, "m", "h2o", 32);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }
  void Append(const client::Session& s, int64_t first, int64_t n) {
    std::vector<int64_t> positions;
    for (int64_t p = first; p < first + n; ++p) positions.push_back(p);
    ASSERT_TRUE(
        s.Append(metrics_testing::RandomTokens(s.layout(), positions, rng_))
            .ok());
  }
  std::vector<Sample> Scrape() {
    absl::StatusOr<std::string> text =
        HttpGet(server_->metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return ParseExposition(text.value_or(""));
  }
  std::optional<double> Tier(const std::vector<Sample>& scrape,
                             const std::string& name, const std::string& tier) {
    return Value(scrape, name, {{"layout", "m"}, {"tier", tier}});
  }
  std::optional<double> Moves(const std::vector<Sample>& scrape,
                              const std::string& from, const std::string& to) {
    return Value(scrape, "kvkeep_tier_move_duration_seconds_count",
                 {{"from", from}, {"to", to}});
  }

  std::string dir_;
  std::unique_ptr<KvKeepServer> server_;
  std::unique_ptr<client::KvKeepClient> client_;
  std::mt19937 rng_{3};
};

TEST_F(TiersServiceTest, ACallOnAMovedSessionRestoresItTransparently) {
  const client::Session s = Open();
  Append(s, 0, 10);
  absl::StatusOr<std::vector<client::LayerKvData>> before = s.ReadKv();
  ASSERT_TRUE(before.ok()) << before.status();
  const std::vector<SessionId> ids = server_->store().ListSessions();
  ASSERT_EQ(ids.size(), 1u);
  // ReadKv's stream lets go of the session a moment after the client has
  // its last message: until then the store refuses to move it, rightly.
  absl::Status demoted = server_->store().Demote(ids[0]);
  for (int i = 0; i < 200 && absl::IsFailedPrecondition(demoted) &&
                  absl::StrContains(demoted.message(), "open stream");
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    demoted = server_->store().Demote(ids[0]);
  }
  ASSERT_TRUE(demoted.ok()) << demoted;

  std::vector<Sample> scrape = Scrape();
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_sessions", "disk"), Optional(1.0));
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_sessions", "pool"), Optional(0.0));
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_bytes", "pool"), Optional(0.0));
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_bytes", "disk"),
              Optional(::testing::Gt(2 * 10 * 2 * 8 * 4 * 2)));
  EXPECT_THAT(Moves(scrape, "pool", "disk"), Optional(1.0));
  EXPECT_THAT(Moves(scrape, "disk", "pool"), Optional(0.0));

  // The call pays the restore and sees exactly what it would have.
  absl::StatusOr<std::vector<client::LayerKvData>> after = s.ReadKv();
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_EQ(after->size(), before->size());
  for (size_t l = 0; l < after->size(); ++l) {
    EXPECT_EQ((*after)[l].version, (*before)[l].version);
    EXPECT_EQ((*after)[l].positions, (*before)[l].positions);
    EXPECT_TRUE((*after)[l].keys == (*before)[l].keys) << "layer " << l;
    EXPECT_TRUE((*after)[l].values == (*before)[l].values) << "layer " << l;
  }
  Append(s, 10, 1);  // and it goes on working
  scrape = Scrape();
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_sessions", "disk"), Optional(0.0));
  EXPECT_THAT(Tier(scrape, "kvkeep_tier_sessions", "pool"), Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_tier_restores_total", {{"layout", "m"}}),
              Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_tier_demotions_total", {{"layout", "m"}}),
              Optional(1.0));
  EXPECT_THAT(Moves(scrape, "disk", "pool"), Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_tier_corrupt_total", {{"layout", "m"}}),
              Optional(0.0));
}

TEST_F(TiersServiceTest, PrefixAndForkMetricsFollowTheirLives) {
  const std::map<std::string, std::string> m{{"layout", "m"}};
  const client::Session source = Open();
  Append(source, 0, 8);
  std::vector<Sample> scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_prefixes", m), Optional(0.0));
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_forked_total", {}), Optional(0.0));

  ASSERT_TRUE(source.Publish("system").ok());
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_prefixes", m), Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_pages", m), Optional(4.0));
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_holders", m), Optional(0.0));

  v1::CreateSessionRequest from_prefix;
  from_prefix.set_prefix("system");
  from_prefix.mutable_budget()->set_tokens(16);
  absl::StatusOr<client::Session> child = client_->CreateSession(from_prefix);
  ASSERT_TRUE(child.ok()) << child.status();
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_holders", m), Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_shared_pages", m), Optional(4.0));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_shared_saved_bytes", m),
              Optional(::testing::Gt(0.0)));

  absl::StatusOr<client::Session> fork = child->Fork();
  ASSERT_TRUE(fork.ok()) << fork.status();
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_forked_total", {}), Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_holders", m), Optional(2.0));

  ASSERT_TRUE(client_->UnpublishPrefix("system").ok());
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_prefixes", m), Optional(1.0))
      << "held by its sessions";
  ASSERT_TRUE(fork->Close().ok());
  ASSERT_TRUE(child->Close().ok());
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_prefixes", m), Optional(0.0));
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_pages", m), Optional(0.0));
  EXPECT_THAT(Value(scrape, "kvkeep_prefix_holders", m), Optional(0.0));
}

}  // namespace
}  // namespace kvkeep
