// kvkeepd's Prometheus metrics, in-process: a real gRPC server with the
// metrics interceptor, a real /metrics HTTP endpoint, a real client. Every
// scrape is compared with the store's own stats (over gRPC): per-session
// series, pool and tenant gauges, totals by policy, the series cap, RPC
// counts by method and code, and what closing a session removes.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/rpc_metrics.h"
#include "services/metrics/store_metrics.h"
#include "tests/testing/metrics_testing.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using metrics_testing::DecodeWithQueries;
using metrics_testing::HttpGet;
using metrics_testing::ParseExposition;
using metrics_testing::Sample;
using metrics_testing::Select;
using metrics_testing::Value;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::Optional;

// 2 layers of f32, 2 kv / 4 query heads, head_dim 8, 4-token pages: a page
// is 2 * 4 * 2 * 8 * 4 = 512 bytes.
ModelLayout TestLayout() { return testing::SmallLayout("m"); }

// A kvkeepd (KvKeepServer) with its /metrics endpoint.
class MetricsTest : public ::testing::Test {
 protected:
  void Start(int64_t max_session_series = 100, int64_t pool_pages = 256,
             int64_t max_sessions_per_tenant = 0) {
    ServerConfig config =
        testing::TestServerConfig({PoolSpec{TestLayout(), pool_pages}});
    config.metrics_listen = "127.0.0.1:0";
    config.metrics_session_series = max_session_series;
    config.max_sessions_per_tenant = max_sessions_per_tenant;
    absl::StatusOr<std::unique_ptr<KvKeepServer>> server =
        KvKeepServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);

    client::ClientOptions client_options;
    client_options.address = server_->address();
    client_ = std::make_unique<client::KvKeepClient>(
        *client::KvKeepClient::Connect(client_options));
  }

  void TearDown() override { server_.reset(); }

  client::Session Open(const std::string& policy, int64_t budget) {
    absl::StatusOr<client::Session> s =
        metrics_testing::OpenSession(*client_, "m", policy, budget);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }

  std::vector<Sample> Scrape() {
    absl::StatusOr<std::string> text =
        HttpGet(server_->metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return ParseExposition(text.value_or(""));
  }

  // The store, its metrics, the service with the RPC interceptor and
  // /metrics, as kvkeepd builds them.
  std::unique_ptr<KvKeepServer> server_;
  std::unique_ptr<client::KvKeepClient> client_;
  std::mt19937 rng_{7};
};

// Every per-session series equals what GetSessionStats says.
void ExpectSessionSeries(const std::vector<Sample>& scrape,
                         const v1::SessionStats& stats) {
  const std::map<std::string, std::string> labels{
      {"session", stats.session_id()},
      {"tenant", stats.tenant()},
      {"policy", stats.policy()}};
  EXPECT_THAT(Value(scrape, "kvkeep_session_resident_tokens", labels),
              Optional(static_cast<double>(stats.resident_tokens())));
  EXPECT_THAT(Value(scrape, "kvkeep_session_resident_bytes", labels),
              Optional(static_cast<double>(stats.resident_bytes())));
  EXPECT_THAT(Value(scrape, "kvkeep_session_pages", labels),
              Optional(static_cast<double>(stats.pages())));
  EXPECT_THAT(Value(scrape, "kvkeep_session_evicted_tokens_total", labels),
              Optional(static_cast<double>(stats.evicted_tokens())));
  std::optional<double> mass =
      Value(scrape, "kvkeep_session_evicted_attention_mass_total", labels);
  ASSERT_TRUE(mass.has_value());
  EXPECT_NEAR(*mass, stats.evicted_score(), 1e-9 * (1 + stats.evicted_score()));
  EXPECT_THAT(Value(scrape, "kvkeep_session_score_updates_total", labels),
              Optional(static_cast<double>(stats.score_updates())));
}

TEST_F(MetricsTest, SeriesEqualTheStoresStatsAndVanishOnClose) {
  Start();
  std::vector<client::Session> sessions{Open("h2o", 8), Open("tova", 8),
                                        Open("h2o", 12)};
  for (const client::Session& s : sessions) {
    ASSERT_TRUE(DecodeWithQueries(s, 30, 0, rng_).ok());
  }
  std::vector<Sample> scrape = Scrape();
  double h2o_evicted = 0;
  double pages = 0;
  for (const client::Session& s : sessions) {
    absl::StatusOr<v1::SessionStats> stats = s.Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_GT(stats->evicted_tokens(), 0);
    ExpectSessionSeries(scrape, *stats);
    if (stats->policy() == "h2o") h2o_evicted += stats->evicted_tokens();
    pages += stats->pages();
  }
  EXPECT_THAT(Value(scrape, "kvkeep_evicted_tokens_total", {{"policy", "h2o"}}),
              Optional(h2o_evicted));
  EXPECT_THAT(Value(scrape, "kvkeep_score_updates_total", {{"policy", "tova"}}),
              Optional(60.0));  // 30 steps x 2 layers
  EXPECT_THAT(Value(scrape, "kvkeep_pool_used_pages", {{"layout", "m"}}),
              Optional(pages));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_used_bytes", {{"layout", "m"}}),
              Optional(pages * 512));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_capacity_bytes", {{"layout", "m"}}),
              Optional(256.0 * 512));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_sessions", {{"layout", "m"}}),
              Optional(3.0));
  EXPECT_THAT(Value(scrape, "kvkeep_tenant_sessions", {{"tenant", ""}}),
              Optional(3.0));
  EXPECT_THAT(Value(scrape, "kvkeep_tenant_bytes", {{"tenant", ""}}),
              Optional(pages * 512));
  EXPECT_THAT(Value(scrape, "kvkeep_sessions"), Optional(3.0));
  // One step operation per decode step, each timed.
  EXPECT_THAT(Value(scrape, "kvkeep_store_operation_duration_seconds_count",
                    {{"operation", "step"}}),
              Optional(90.0));
  std::optional<double> evictions = Value(
      scrape, "kvkeep_eviction_duration_seconds_count", {{"policy", "h2o"}});
  ASSERT_TRUE(evictions.has_value());
  EXPECT_GT(*evictions, 0);

  // Closing removes exactly that session's series; the totals keep its work.
  ASSERT_TRUE(sessions[0].Close().ok());
  scrape = Scrape();
  EXPECT_THAT(Select(scrape, "kvkeep_session_resident_bytes",
                     {{"session", sessions[0].id()}}),
              IsEmpty());
  EXPECT_THAT(Select(scrape, "kvkeep_session_evicted_tokens_total",
                     {{"session", sessions[0].id()}}),
              IsEmpty());
  EXPECT_EQ(Select(scrape, "kvkeep_session_resident_bytes").size(), 2u);
  EXPECT_THAT(Value(scrape, "kvkeep_evicted_tokens_total", {{"policy", "h2o"}}),
              Optional(h2o_evicted));
  EXPECT_THAT(
      Value(scrape, "kvkeep_sessions_closed_total", {{"policy", "h2o"}}),
      Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_sessions"), Optional(2.0));
}

// A key a client appends may hold NaN, infinity or a value whose logit
// overflows; the store keeps the bytes as sent. Query scoring over such keys
// gave a NaN evicted score, and with it a server-wide counter that read NaN
// for ever. Now such rows attend nowhere (zeroed): every score and counter
// stays finite, and the step succeeds.
TEST_F(MetricsTest, NonFiniteKeysNeverReachScoresOrCounters) {
  Start();
  for (const float poison : {std::numeric_limits<float>::quiet_NaN(),
                             std::numeric_limits<float>::infinity(), 3e38f}) {
    SCOPED_TRACE(poison);
    client::Session s = Open("h2o", 32);
    std::vector<int64_t> positions(32);
    std::iota(positions.begin(), positions.end(), 0);
    client::KvTokens prompt =
        metrics_testing::RandomTokens(s.layout(), positions, rng_);
    const size_t per_token = s.layout().kv_heads() * s.layout().head_dim();
    for (client::LayerBytes& layer : prompt.layers) {
      float* keys = reinterpret_cast<float*>(layer.keys.data());
      std::fill(keys, keys + 16 * per_token, poison);  // the first 16 tokens
    }
    ASSERT_TRUE(s.Append(prompt).ok());
    ASSERT_TRUE(DecodeWithQueries(s, 4, 32, rng_).ok());
    absl::StatusOr<v1::SessionStats> stats = s.Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_GT(stats->evicted_tokens(), 0);
    EXPECT_TRUE(std::isfinite(stats->evicted_score()))
        << stats->evicted_score();
  }
  std::optional<double> mass = Value(
      Scrape(), "kvkeep_evicted_attention_mass_total", {{"policy", "h2o"}});
  ASSERT_TRUE(mass.has_value());
  EXPECT_TRUE(std::isfinite(*mass)) << *mass;
}

TEST_F(MetricsTest, PerSessionSeriesAreCapped) {
  Start(/*max_session_series=*/2);
  std::vector<client::Session> sessions{Open("window", 8), Open("window", 8),
                                        Open("window", 8)};
  std::vector<Sample> scrape = Scrape();
  EXPECT_EQ(Select(scrape, "kvkeep_session_pages").size(), 2u);
  EXPECT_THAT(Value(scrape, "kvkeep_sessions"), Optional(3.0));
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_untracked"), Optional(1.0));
  // The first two opened are the tracked ones.
  EXPECT_EQ(
      Select(scrape, "kvkeep_session_pages", {{"session", sessions[2].id()}})
          .size(),
      0u);

  // A tracked session closes: its slot goes to the next session opened.
  ASSERT_TRUE(sessions[0].Close().ok());
  const client::Session late = Open("window", 8);
  scrape = Scrape();
  EXPECT_EQ(
      Select(scrape, "kvkeep_session_pages", {{"session", late.id()}}).size(),
      1u);
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_untracked"), Optional(1.0));
  // An untracked session closes: nothing tracked changes.
  ASSERT_TRUE(sessions[2].Close().ok());
  scrape = Scrape();
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_untracked"), Optional(0.0));
  EXPECT_EQ(Select(scrape, "kvkeep_session_pages").size(), 2u);
}

// metrics_session_series 0 (docs/security.md): no session id appears
// anywhere in a scrape; the totals still count every session.
TEST_F(MetricsTest, NoSessionSeriesNamesNoSession) {
  Start(/*max_session_series=*/0);
  std::vector<client::Session> sessions{Open("window", 8), Open("h2o", 8)};
  const absl::StatusOr<std::string> text =
      HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  for (const client::Session& s : sessions) {
    EXPECT_THAT(*text, Not(HasSubstr(s.id())));
  }
  const std::vector<Sample> scrape = ParseExposition(*text);
  EXPECT_THAT(Value(scrape, "kvkeep_sessions"), Optional(2.0));
  EXPECT_THAT(Value(scrape, "kvkeep_sessions_untracked"), Optional(2.0));
}

TEST_F(MetricsTest, RpcsAreCountedByMethodAndCode) {
  Start();
  const client::Session s = Open("h2o", 8);
  ASSERT_TRUE(client_->GetSessionStats(s.id()).ok());
  EXPECT_EQ(client_->GetSessionStats("00000000000000aa").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetSessionStats("not-an-id").status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(DecodeWithQueries(s, 3, 0, rng_).ok());

  const std::vector<Sample> scrape = Scrape();
  const std::string stats = "/kvkeep.v1.KvKeep/GetSessionStats";
  auto count = [&](const std::string& method, const std::string& code) {
    return Value(scrape, "kvkeep_rpc_duration_seconds_count",
                 {{"method", method}, {"code", code}});
  };
  EXPECT_THAT(count(stats, "OK"), Optional(1.0));
  EXPECT_THAT(count(stats, "NOT_FOUND"), Optional(1.0));
  EXPECT_THAT(count(stats, "INVALID_ARGUMENT"), Optional(1.0));
  EXPECT_THAT(count("/kvkeep.v1.KvKeep/CreateSession", "OK"), Optional(1.0));
  // A Decode stream is one call however many steps it carries.
  EXPECT_THAT(count("/kvkeep.v1.KvKeep/Decode", "OK"), Optional(1.0));
}

TEST_F(MetricsTest, AllocationFailuresAndQuotaRejectionsAreCounted) {
  Start(/*max_session_series=*/100, /*pool_pages=*/4,
        /*max_sessions_per_tenant=*/1);
  const client::Session s = Open("full", 0);
  v1::CreateSessionRequest second;
  second.set_layout("m");
  EXPECT_EQ(client_->CreateSession(second).status().code(),
            absl::StatusCode::kResourceExhausted);
  // 4 pages hold 16 tokens per layer... of 2 layers: 8 tokens fill the pool.
  std::mt19937 rng(1);
  std::vector<int64_t> positions;
  for (int64_t p = 0; p < 9; ++p) positions.push_back(p);
  EXPECT_EQ(s.Append(metrics_testing::RandomTokens(s.layout(), positions, rng))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  const std::vector<Sample> scrape = Scrape();
  EXPECT_THAT(
      Value(scrape, "kvkeep_pool_allocation_failures_total", {{"layout", "m"}}),
      Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_pool_used_pages", {{"layout", "m"}}),
              Optional(0.0));
  EXPECT_THAT(
      Value(scrape, "kvkeep_tenant_quota_rejections_total", {{"tenant", ""}}),
      Optional(1.0));
  EXPECT_THAT(Value(scrape, "kvkeep_rpc_duration_seconds_count",
                    {{"method", "/kvkeep.v1.KvKeep/Append"},
                     {"code", "RESOURCE_EXHAUSTED"}}),
              Optional(1.0));
}

TEST(MetricsServerTest, RefusesBadAndBusyAddresses) {
  auto registry = std::make_shared<prometheus::Registry>();
  EXPECT_EQ(MetricsServer::Start("no-port", {registry}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:99999", {registry}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("127.0.0.1:0", {registry});
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start((*first)->address(), {registry});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable)
      << second.status();
}

// Basic authentication: 401 without the user and password or with a wrong
// one; the scrape with them (a real Prometheus in prometheus_test).
TEST(MetricsServerTest, AsksForTheUserAndPasswordWhenGiven) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(MetricsServerOptions{.address = "127.0.0.1:0",
                                                .auth_user = "prometheus",
                                                .auth_password = "s3cret-pass"},
                           {registry});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> anonymous =
      metrics_testing::HttpGet((*server)->address(), "/metrics");
  EXPECT_THAT(std::string(anonymous.status().message()),
              ::testing::HasSubstr("401"));
  // "prometheus:s3cret-pasS" and "prometheus:s3cret-pass" in base64.
  absl::StatusOr<std::string> wrong = metrics_testing::HttpGet(
      (*server)->address(), "/metrics",
      "Authorization: Basic cHJvbWV0aGV1czpzM2NyZXQtcGFzUw==\r\n");
  EXPECT_THAT(std::string(wrong.status().message()),
              ::testing::HasSubstr("401"));
  absl::StatusOr<std::string> right = metrics_testing::HttpGet(
      (*server)->address(), "/metrics",
      "Authorization: Basic cHJvbWV0aGV1czpzM2NyZXQtcGFzcw==\r\n");
  EXPECT_TRUE(right.ok()) << right.status();
}

}  // namespace
}  // namespace kvkeep
