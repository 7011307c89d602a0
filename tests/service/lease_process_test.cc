// Leases across processes, as a deployment sees them: a client process
// holding 50 sessions (some with an open Decode stream) is killed with
// SIGKILL, never closing anything, and kvkeepd takes every page back once
// the leases run out; while the client lived, its renewals kept every
// session, and its open streams showed as holds.
//
// The kvkeepd here has a 2 s default lease. Waits
// poll the server with a generous limit (kPatience) so a hang fails the
// test instead of blocking ctest; nothing measures time.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::Child;
using child_process::ServingChild;
using child_process::StartServing;

constexpr absl::Duration kPatience = absl::Seconds(120);
constexpr int kSessions = 50;
constexpr int kStreams = 5;
constexpr char kToken[] = "lease-process-test-token";
// 2 layers of f32, 4-token pages: a session of 6 or 7 tokens holds 2 pages
// per layer.
constexpr int64_t kPagesPerSession = 4;
constexpr char kConfig[] = R"({
  "layouts": [{"name": "proc", "num_layers": 2, "kv_heads": 2,
               "query_heads": 4, "head_dim": 8, "dtype": "f32",
               "page_tokens": 4, "pool_pages": 512}],
  "session_idle_timeout_seconds": 2,
  "tenants": [{"name": "agents", "token": "lease-process-test-token"}]
})";

struct PoolUse {
  int64_t used_pages = -1;
  int64_t sessions = -1;
};

absl::StatusOr<PoolUse> Use(const client::KvKeepClient& client) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  if (info->pools_size() != 1) return absl::InternalError("one pool expected");
  return PoolUse{info->pools(0).used_pages(), info->pools(0).sessions()};
}

TEST(LeaseProcessTest, AKilledClientsSessionsAreFreedWhenTheirLeasesRunOut) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("lease_process_", getpid());
  std::filesystem::create_directories(dir);
  const std::string config = (dir / "config.json").string();
  std::ofstream(config) << kConfig;
  absl::StatusOr<ServingChild> kvkeepd = StartServing(
      {KVKEEPD_BINARY, "--config=" + config, "--listen=127.0.0.1:0",
       "--metrics_listen=127.0.0.1:0", "--self_check=false"},
      kPatience);
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  client::ClientOptions options;
  options.address = kvkeepd->address;
  options.token = kToken;
  absl::StatusOr<client::KvKeepClient> client =
      client::KvKeepClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();

  absl::StatusOr<std::unique_ptr<Child>> holder =
      Child::Spawn({SESSION_HOLDER_BINARY, kvkeepd->address, kToken, "proc",
                    absl::StrCat(kSessions), absl::StrCat(kStreams)});
  ASSERT_TRUE(holder.ok()) << holder.status();
  ASSERT_TRUE((*holder)->out().WaitFor("holding", kPatience).has_value())
      << (*holder)->Output();
  // Three seconds (one and a half leases) after the last create, every
  // session is still there: KeepAlive renews them, five streams hold five.
  ASSERT_TRUE((*holder)->out().WaitFor("renewed for 3s", kPatience).has_value())
      << (*holder)->Output();
  absl::StatusOr<std::vector<v1::SessionStats>> listed = client->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), static_cast<size_t>(kSessions));
  int held = 0;
  for (const v1::SessionStats& s : *listed) {
    EXPECT_EQ(s.idle_timeout_seconds(), 2);
    EXPECT_EQ(s.pages(), kPagesPerSession);
    held += s.lease_held() ? 1 : 0;
  }
  EXPECT_EQ(held, kStreams);
  absl::StatusOr<PoolUse> before = Use(*client);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->used_pages, kSessions * kPagesPerSession);

  const absl::Time killed = absl::Now();
  (*holder)->Signal(SIGKILL);
  absl::StatusOr<int> status = (*holder)->Wait(kPatience);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFSIGNALED(*status)) << (*holder)->Output();

  absl::StatusOr<PoolUse> after = Use(*client);
  for (const absl::Time until = absl::Now() + kPatience;
       after.ok() && (after->used_pages != 0 || after->sessions != 0) &&
       absl::Now() < until;
       after = Use(*client)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(after.ok()) << after.status();
  // For the reader, not a limit: the lease is 2 s, the reaper wakes on time.
  std::printf("every page back %.2f s after the SIGKILL\n",
              absl::ToDoubleSeconds(absl::Now() - killed));
  EXPECT_EQ(after->used_pages, 0) << kvkeepd->child->Output();
  EXPECT_EQ(after->sessions, 0);

  // Counted, by tenant, and logged with it.
  absl::StatusOr<std::string> scrape =
      metrics_testing::HttpGet(kvkeepd->metrics, "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  const std::vector<metrics_testing::Sample> samples =
      metrics_testing::ParseExposition(*scrape);
  EXPECT_EQ(metrics_testing::Value(samples, "kvkeep_sessions_expired_total"),
            kSessions);
  EXPECT_EQ(
      metrics_testing::Value(samples, "kvkeep_tenant_sessions_expired_total",
                             {{"tenant", "agents"}}),
      kSessions);
  int logged = 0;
  for (const absl::Time until = absl::Now() + kPatience;
       logged < kSessions && absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(50))) {
    logged = 0;
    for (const std::string& line :
         kvkeepd->child->err().AllLines(absl::ZeroDuration())) {
      logged += absl::StrContains(line, "event=session_expired") &&
                absl::StrContains(line, "tenant=\"agents\"");
    }
  }
  EXPECT_EQ(logged, kSessions) << kvkeepd->child->Output();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace kvkeep
