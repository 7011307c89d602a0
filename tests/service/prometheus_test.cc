// kvkeepd watched by a real Prometheus server (Debian package `prometheus`),
// both as separate processes on loopback, as in a deployment. Prometheus
// scrapes kvkeepd every 250 ms and evaluates the shipped alert rules
// (deploy/prometheus/alerts.yml); the test drives sessions with evictions
// over gRPC and then asks Prometheus's HTTP API what it scraped:
//  - per-session resident bytes, pages and evicted tokens equal the store's
//    own stats (GetSessionStats);
//  - closed sessions' series are gone after the next scrape, the others stay;
//  - every alert rule evaluates without error against the live data;
//  - every metric name the dashboard and the alerts use (deploy/metrics.txt)
//    is in a live /metrics scrape.
//
// Waits poll with a generous limit (kPatience) only so that a hang fails the
// test; no test measures time.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/client/kvkeep_client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::Child;
using metrics_testing::DecodeWithQueries;
using metrics_testing::HttpGet;
using Json = nlohmann::json;

constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr absl::Duration kPatience = absl::Seconds(120);

// Polls `done` every 100 ms until it returns true or kPatience runs out.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + kPatience;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

class PrometheusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(MakeDir());
    ASSERT_NO_FATAL_FAILURE(StartKvkeepd({}, "http"));
    // Prometheus: the shipped alert rules, a fast scrape of kvkeepd.
    const std::string rules =
        absl::StrCat(KVKEEP_SOURCE_DIR, "/deploy/prometheus/alerts.yml");
    ASSERT_TRUE(std::filesystem::exists(rules)) << rules;
    ASSERT_NO_FATAL_FAILURE(
        StartPrometheus(absl::StrCat("rule_files: ['", rules,
                                     "']\n"
                                     "scrape_configs:\n"
                                     "  - job_name: kvkeepd\n"
                                     "    static_configs:\n"
                                     "      - targets: ['",
                                     metrics_address_, "']\n")));

    client::ClientOptions options;
    options.address = grpc_address_;
    absl::StatusOr<client::KvKeepClient> c =
        client::KvKeepClient::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::make_unique<client::KvKeepClient>(*std::move(c));
  }

  void MakeDir() {
    ASSERT_TRUE(std::filesystem::exists(kPrometheus))
        << kPrometheus
        << " is missing: scripts/test installs Debian's prometheus package";
    dir_ = std::filesystem::path(::testing::TempDir()) /
           absl::StrCat("kvkeep_prometheus_", getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }

  // kvkeepd: 2 layers of f32, 2 kv / 4 query heads, head_dim 8, 4-token
  // pages; both ports picked by the kernel; /metrics over `scheme`.
  void StartKvkeepd(const std::vector<std::string>& flags,
                    const std::string& scheme) {
    const std::string config =
        Write("kvkeepd.json",
              R"({"layouts": [{"name": "m", "num_layers": 2, "kv_heads": 2,
            "query_heads": 4, "head_dim": 8, "dtype": "f32",
            "page_tokens": 4, "pool_pages": 512}]})");
    std::vector<std::string> argv = {
        KVKEEPD_BINARY, "--config=" + config, "--listen=127.0.0.1:0",
        "--metrics_listen=127.0.0.1:0", "--self_check=false"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<Child>> kvkeepd = Child::Spawn(argv);
    ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
    kvkeepd_ = *std::move(kvkeepd);
    grpc_address_ = AddressAfter("kvkeepd: grpc listening on ");
    metrics_address_ = std::string(absl::StripSuffix(
        AddressAfter(absl::StrCat("kvkeepd: metrics on ", scheme, "://")),
        "/metrics"));
    ASSERT_FALSE(grpc_address_.empty() || metrics_address_.empty())
        << kvkeepd_->Output();
  }

  // Prometheus scraping every 250 ms, with `rest` (rule files, scrape
  // configs) after the global section.
  void StartPrometheus(const std::string& rest) {
    const std::string prometheus_config =
        Write("prometheus.yml", absl::StrCat("global:\n"
                                             "  scrape_interval: 250ms\n"
                                             "  evaluation_interval: 250ms\n",
                                             rest));
    prometheus_address_ =
        absl::StrCat("127.0.0.1:", child_process::FreeLoopbackPort());
    absl::StatusOr<std::unique_ptr<Child>> prometheus = Child::Spawn(
        {kPrometheus, "--config.file=" + prometheus_config,
         "--storage.tsdb.path=" + (dir_ / "data").string(),
         "--web.listen-address=" + prometheus_address_, "--log.level=warn"});
    ASSERT_TRUE(prometheus.ok()) << prometheus.status();
    prometheus_ = *std::move(prometheus);
    ASSERT_TRUE(Eventually([&] {
      return HttpGet(prometheus_address_, "/-/ready").ok();
    })) << "Prometheus did not become ready:\n"
        << prometheus_->Output();
  }

  void TearDown() override {
    prometheus_.reset();  // SIGKILL + reap
    kvkeepd_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string Write(const std::string& name, const std::string& text) {
    const std::filesystem::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }

  // The rest of kvkeepd's first stdout line that starts with `prefix`.
  std::string AddressAfter(absl::string_view prefix) {
    std::optional<std::string> line =
        kvkeepd_->out().WaitFor(prefix, kPatience);
    return line.has_value() ? line->substr(prefix.size()) : "";
  }

  // An instant query: the result vector, or an error in its place.
  absl::StatusOr<Json> Query(const std::string& promql) {
    absl::StatusOr<std::string> body =
        HttpGet(prometheus_address_, "/api/v1/query?query=" + promql);
    if (!body.ok()) return body.status();
    const Json j = Json::parse(*body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || j.value("status", "") != "success") {
      return absl::InternalError(absl::StrCat("bad answer: ", *body));
    }
    return j["data"]["result"];
  }

  // session id -> value of `metric` in Prometheus now.
  std::map<std::string, double> BySession(const std::string& metric) {
    std::map<std::string, double> out;
    absl::StatusOr<Json> result = Query(metric);
    if (!result.ok()) return out;
    for (const Json& series : *result) {
      double v = 0;
      if (absl::SimpleAtod(series["value"][1].get<std::string>(), &v)) {
        out[series["metric"].value("session", "")] = v;
      }
    }
    return out;
  }

  client::Session Open(const std::string& policy, int64_t budget) {
    absl::StatusOr<client::Session> s =
        metrics_testing::OpenSession(*client_, "m", policy, budget);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }

  std::filesystem::path dir_;
  std::unique_ptr<Child> kvkeepd_;
  std::unique_ptr<Child> prometheus_;
  std::string grpc_address_;
  std::string metrics_address_;
  std::string prometheus_address_;
  std::unique_ptr<client::KvKeepClient> client_;
};

TEST_F(PrometheusTest, ScrapedSeriesEqualTheStoresStatsAndVanishOnClose) {
  std::mt19937 rng(3);
  std::vector<client::Session> sessions;
  for (const auto& [policy, budget] :
       std::vector<std::pair<std::string, int64_t>>{{"h2o", 8},
                                                    {"tova", 12},
                                                    {"streaming_llm", 10},
                                                    {"scissorhands", 16}}) {
    sessions.push_back(Open(policy, budget));
    const absl::Status decoded = DecodeWithQueries(sessions.back(), 48, 0, rng,
                                                   policy != "streaming_llm");
    ASSERT_TRUE(decoded.ok()) << policy << ": " << decoded;
  }
  std::map<std::string, v1::SessionStats> stats;
  for (const client::Session& s : sessions) {
    absl::StatusOr<v1::SessionStats> st = s.Stats();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_GT(st->evicted_tokens(), 0) << st->policy();
    stats[s.id()] = *st;
  }

  // What Prometheus holds converges on the store's stats (the next scrape
  // after the last step), then must equal them exactly.
  std::map<std::string, double> bytes, pages, evicted;
  const bool converged = Eventually([&] {
    bytes = BySession("kvkeep_session_resident_bytes");
    pages = BySession("kvkeep_session_pages");
    evicted = BySession("kvkeep_session_evicted_tokens_total");
    for (const auto& [id, st] : stats) {
      if (bytes[id] != st.resident_bytes() || pages[id] != st.pages() ||
          evicted[id] != st.evicted_tokens()) {
        return false;
      }
    }
    return true;
  });
  for (const auto& [id, st] : stats) {
    SCOPED_TRACE(st.policy());
    EXPECT_EQ(bytes[id], st.resident_bytes());
    EXPECT_EQ(pages[id], st.pages());
    EXPECT_EQ(evicted[id], st.evicted_tokens());
  }
  ASSERT_TRUE(converged);
  EXPECT_EQ(bytes.size(), sessions.size());
  absl::StatusOr<Json> up = Query("up");
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(up->size(), 1u);
  EXPECT_EQ((*up)[0]["value"][1], "1");

  // Close two: their series go stale at the next scrape; the others stay.
  ASSERT_TRUE(sessions[0].Close().ok());
  ASSERT_TRUE(sessions[2].Close().ok());
  const bool gone = Eventually([&] {
    bytes = BySession("kvkeep_session_resident_bytes");
    evicted = BySession("kvkeep_session_evicted_tokens_total");
    return bytes.size() == 2 && evicted.size() == 2;
  });
  EXPECT_TRUE(gone) << bytes.size() << " sessions still have series";
  for (const auto* series : {&bytes, &evicted}) {
    EXPECT_FALSE(series->contains(sessions[0].id()));
    EXPECT_FALSE(series->contains(sessions[2].id()));
    EXPECT_TRUE(series->contains(sessions[1].id()));
    EXPECT_TRUE(series->contains(sessions[3].id()));
  }
  // The totals keep the closed sessions' work.
  absl::StatusOr<Json> total = Query("sum(kvkeep_evicted_tokens_total)");
  ASSERT_TRUE(total.ok()) << total.status();
  double sum = 0;
  for (const auto& [id, st] : stats) sum += st.evicted_tokens();
  ASSERT_EQ(total->size(), 1u);
  EXPECT_EQ((*total)[0]["value"][1], absl::StrCat(sum));
}

TEST_F(PrometheusTest, AlertRulesEvaluateOnLiveData) {
  // Some traffic so that the rules' series exist.
  std::mt19937 rng(5);
  ASSERT_TRUE(DecodeWithQueries(Open("h2o", 8), 20, 0, rng).ok());
  Json groups;
  const bool evaluated = Eventually([&] {
    absl::StatusOr<std::string> body =
        HttpGet(prometheus_address_, "/api/v1/rules");
    if (!body.ok()) return false;
    const Json j = Json::parse(*body, nullptr, false);
    if (j.is_discarded()) return false;
    groups = j["data"]["groups"];
    if (groups.empty()) return false;
    for (const Json& g : groups) {
      for (const Json& r : g["rules"]) {
        if (r.value("health", "") == "unknown") return false;
      }
    }
    return true;
  });
  ASSERT_TRUE(evaluated) << groups.dump(2);
  int rules = 0;
  for (const Json& g : groups) {
    for (const Json& r : g["rules"]) {
      ++rules;
      EXPECT_EQ(r.value("health", ""), "ok")
          << r.value("name", "") << ": " << r.value("lastError", "");
      // Healthy kvkeepd with a mostly empty pool: nothing fires.
      EXPECT_EQ(r.value("state", ""), "inactive") << r.value("name", "");
    }
  }
  EXPECT_GE(rules, 3);
}

TEST_F(PrometheusTest, EveryDeployedMetricNameIsExported) {
  // A session, a step and an RPC, so that labelled families have samples.
  std::mt19937 rng(9);
  ASSERT_TRUE(DecodeWithQueries(Open("h2o", 8), 12, 0, rng).ok());
  absl::StatusOr<std::string> text = HttpGet(metrics_address_, "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  std::set<std::string> exported;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      exported.insert(std::string(line.substr(0, line.find(' '))));
    }
  }
  const std::vector<std::string> deployed =
      metrics_testing::DeployedMetricNames(KVKEEP_SOURCE_DIR);
  ASSERT_GE(deployed.size(), 20u) << "deploy/metrics.txt is missing or short";
  for (const std::string& name : deployed) {
    EXPECT_TRUE(exported.contains(name)) << name << " is not exported";
  }
  // And the other way: every kvkeep_ family is documented there.
  for (const std::string& name : exported) {
    if (!absl::StartsWith(name, "kvkeep_")) continue;
    EXPECT_THAT(deployed, ::testing::Contains(name))
        << name << " is exported but not in deploy/metrics.txt";
  }
}

// /metrics behind basic authentication (metrics_auth_file), scraped by
// Prometheus as a deployment would: the job with the password scrapes, and
// jobs without it or with a wrong one get nothing.
class AuthenticatedMetricsTest : public PrometheusTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(MakeDir());
    const std::string auth = Write("metrics-auth", "prometheus:s3cret-pass\n");
    ASSERT_NO_FATAL_FAILURE(
        StartKvkeepd({"--metrics_auth_file=" + auth}, "http"));
    std::string jobs = "scrape_configs:\n";
    const auto job = [&](const std::string& name, const std::string& password) {
      absl::StrAppend(&jobs, "  - job_name: ", name, "\n");
      if (!password.empty()) {
        absl::StrAppend(&jobs, "    basic_auth: {username: prometheus, ",
                        "password: '", password, "'}\n");
      }
      absl::StrAppend(&jobs, "    static_configs: [{targets: ['",
                      metrics_address_, "']}]\n");
    };
    job("right", "s3cret-pass");
    job("no_password", "");
    job("wrong_password", "s3cret-pasS");
    ASSERT_NO_FATAL_FAILURE(StartPrometheus(jobs));
  }

  // up{job=`job`}, once Prometheus has scraped it.
  std::optional<double> Up(const std::string& job) {
    std::optional<double> up;
    Eventually([&] {
      absl::StatusOr<Json> r = Query(absl::StrCat("up{job=\"", job, "\"}"));
      if (!r.ok() || r->empty()) return false;
      double v = 0;
      if (!absl::SimpleAtod((*r)[0]["value"][1].get<std::string>(), &v)) {
        return false;
      }
      up = v;
      return true;
    });
    return up;
  }
};

TEST_F(AuthenticatedMetricsTest, OnlyTheScrapeWithThePasswordGetsMetrics) {
  EXPECT_EQ(Up("right"), 1.0);
  EXPECT_EQ(Up("no_password"), 0.0);
  EXPECT_EQ(Up("wrong_password"), 0.0);
  // What the right job scraped is kvkeepd's.
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<Json> r = Query("kvkeep_pool_capacity_pages{job=\"right\"}");
    return r.ok() && !r->empty();
  })) << "no kvkeep series scraped";
}

}  // namespace
}  // namespace kvkeep
