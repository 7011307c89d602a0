// A fleet of three kvkeepd processes on loopback, each with a replica name,
// reached through FleetClient (docs/fleet.md): ServerInfo names the replica;
// a new session lands on the replica with the most free pages; every call on
// a session reaches the replica its id names; a session moved with
// TransferSession answers on its old replica with NOT_FOUND and its new
// replica in the trailing metadata, and the client follows it there without
// the caller noticing; a replica killed with SIGKILL takes its sessions
// with it (kvkeep is a cache), its callers hear which replica is gone, and
// the other replicas' sessions are untouched.
//
// Waits have a generous limit only so that a hang fails the test; no test
// measures time.
#include <csignal>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/client/fleet_client.h"
#include "services/client/kvkeep_client.h"
#include "services/common/fleet_names.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::ServingChild;
using metrics_testing::DecodeWithQueries;
using metrics_testing::RandomTokens;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr absl::Duration kPatience = absl::Seconds(120);
// 2 layers of 4-token pages: n tokens take 2 * ceil(n / 4) pages.
constexpr int64_t kPoolPages = 256;
constexpr char kConfig[] =
    R"({"layouts": [{"name": "m", "num_layers": 2, "kv_heads": 2,
        "query_heads": 4, "head_dim": 8, "dtype": "f32", "page_tokens": 4,
        "pool_pages": 256}]})";
const char* const kNames[] = {"fleet-a", "fleet-b", "fleet-c"};

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string config =
        child_process::WriteTempFile("fleet.json", kConfig);
    const std::string token = child_process::WriteTempFile(
        "fleet_peer", "fleet-process-test-peer-token\n");
    client::FleetOptions options;
    for (const char* name : kNames) {
      absl::StatusOr<ServingChild> d = child_process::StartServing(
          {KVKEEPD_BINARY, "--config=" + config, "--listen=127.0.0.1:0",
           "--metrics_listen=127.0.0.1:0", "--self_check=false",
           "--peer_token_file=" + token, absl::StrCat("--replica_name=", name)},
          kPatience);
      ASSERT_TRUE(d.ok()) << d.status();
      options.targets.push_back(d->address);
      daemons_.push_back(*std::move(d));
    }
    options.placement_staleness = absl::ZeroDuration();
    absl::StatusOr<client::FleetClient> fleet =
        client::FleetClient::Connect(options);
    ASSERT_TRUE(fleet.ok()) << fleet.status();
    fleet_ = std::make_unique<client::FleetClient>(*std::move(fleet));
  }

  // A plain client of replica i (no routing, no redirects).
  client::KvKeepClient Direct(int i) {
    client::ClientOptions options;
    options.address = daemons_[i].address;
    options.retries = 0;
    return *client::KvKeepClient::Connect(options);
  }

  static v1::CreateSessionRequest Request() {
    v1::CreateSessionRequest request;
    request.set_layout("m");
    request.set_policy("full");
    request.mutable_budget()->set_tokens(1 << 20);
    return request;
  }

  // Appends n tokens from `first` on.
  absl::Status Fill(const client::Session& s, int64_t first, int64_t n) {
    std::vector<int64_t> positions;
    for (int64_t p = first; p < first + n; ++p) positions.push_back(p);
    return s.AppendPrefill(RandomTokens(s.layout(), positions, rng_)).status();
  }

  std::vector<ServingChild> daemons_;
  std::unique_ptr<client::FleetClient> fleet_;
  std::mt19937 rng_{20};
};

TEST_F(FleetTest, ServerInfoNamesTheReplicaAndItsFreePages) {
  EXPECT_THAT(fleet_->Replicas(),
              ::testing::ElementsAre("fleet-a", "fleet-b", "fleet-c"));
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::ServerInfo> info = Direct(i).GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->replica(), kNames[i]);
    EXPECT_EQ(info->address(), daemons_[i].address);
    EXPECT_EQ(info->pools(0).free_pages(), kPoolPages);
  }
  absl::StatusOr<client::Session> s =
      fleet_->CreateSession(Request(), "fleet-b");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->id(), StartsWith("fleet-b."));
  ASSERT_TRUE(Fill(*s, 0, 40).ok());  // 2 layers x 10 pages
  absl::StatusOr<v1::ServerInfo> info = Direct(1).GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pools(0).free_pages(), kPoolPages - 20);
  EXPECT_EQ(info->pools(0).free_pages(),
            info->pools(0).capacity_pages() - info->pools(0).used_pages());
}

TEST_F(FleetTest, ANewSessionLandsOnTheReplicaWithTheMostFreePages) {
  // a holds 200 pages, b 100: the next session goes to c, then (c filled
  // past b) to b.
  absl::StatusOr<client::Session> on_a =
      fleet_->CreateSession(Request(), "fleet-a");
  absl::StatusOr<client::Session> on_b =
      fleet_->CreateSession(Request(), "fleet-b");
  ASSERT_TRUE(on_a.ok() && on_b.ok());
  ASSERT_TRUE(Fill(*on_a, 0, 400).ok());
  ASSERT_TRUE(Fill(*on_b, 0, 200).ok());
  absl::StatusOr<client::Session> placed = fleet_->CreateSession(Request());
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_THAT(placed->id(), StartsWith("fleet-c."));
  ASSERT_TRUE(Fill(*placed, 0, 480).ok());  // c: 240 pages used
  absl::StatusOr<client::Session> next = fleet_->CreateSession(Request());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_THAT(next->id(), StartsWith("fleet-b."));
}

TEST_F(FleetTest, CallsOnASessionReachTheReplicaItsIdNames) {
  std::vector<std::string> ids;
  for (const char* name : kNames) {
    absl::StatusOr<client::Session> s = fleet_->CreateSession(Request(), name);
    ASSERT_TRUE(s.ok()) << s.status();
    ids.push_back(s->id());
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(*fleet_->Route(ids[i]), kNames[i]);
    absl::StatusOr<client::Session> s = fleet_->OpenSession(ids[i]);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(Fill(*s, 0, 8 * (i + 1)).ok());
    ASSERT_TRUE(DecodeWithQueries(*s, 5, 8 * (i + 1), rng_, false).ok());
    // The owner holds what the fleet client sent; the others do not know it.
    absl::StatusOr<v1::SessionStats> stats = Direct(i).GetSessionStats(ids[i]);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->session_id(), ids[i]);
    EXPECT_EQ(stats->resident_tokens(), 2 * (8 * (i + 1) + 5));
    const int other = (i + 1) % 3;
    absl::StatusOr<v1::SessionStats> elsewhere =
        Direct(other).GetSessionStats(ids[i]);
    EXPECT_EQ(elsewhere.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(std::string(elsewhere.status().message()),
                HasSubstr(absl::StrCat("its id names replica ", kNames[i])));
  }
  EXPECT_EQ(fleet_->Route("0123456789abcdef").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fleet_->Route("fleet-z.0123456789abcdef").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(fleet_->Route("Fleet-a.0123456789abcdef").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(FleetTest, AMovedSessionRedirectsAndTheClientFollowsIt) {
  absl::StatusOr<client::Session> s =
      fleet_->CreateSession(Request(), "fleet-a");
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string old_id = s->id();
  ASSERT_TRUE(Fill(*s, 0, 32).ok());
  absl::StatusOr<client::Session> prefill_handle = fleet_->OpenSession(old_id);
  absl::StatusOr<client::Session> decode_handle = fleet_->OpenSession(old_id);
  ASSERT_TRUE(prefill_handle.ok() && decode_handle.ok());
  v1::TransferSessionRequest move;
  move.set_session_id(old_id);
  move.set_target(daemons_[1].address);
  absl::StatusOr<v1::TransferSessionResponse> moved =
      fleet_->Replica("fleet-a")->TransferSession(move);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->session_id(),
            RenameSessionId(*ParseFleetSessionId(old_id), "fleet-b"));

  // A raw call on the old replica: NOT_FOUND, the new replica in the
  // trailing metadata.
  auto stub = v1::KvKeep::NewStub(grpc::CreateChannel(
      daemons_[0].address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::GetSessionStatsRequest request;
  request.set_session_id(old_id);
  v1::SessionStats stats;
  const grpc::Status raw = stub->GetSessionStats(&context, request, &stats);
  EXPECT_EQ(raw.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(raw.error_message(), HasSubstr("moved to replica fleet-b"));
  const auto& trailers = context.GetServerTrailingMetadata();
  auto to = trailers.find(kMovedToMetadata);
  auto address = trailers.find(kMovedToAddressMetadata);
  ASSERT_NE(to, trailers.end());
  ASSERT_NE(address, trailers.end());
  EXPECT_EQ(std::string(to->second.data(), to->second.size()), "fleet-b");
  EXPECT_EQ(std::string(address->second.data(), address->second.size()),
            daemons_[1].address);

  // Handles made before the move follow it, whatever their first call
  // after it: a unary call, an AppendPrefill stream, a Decode stream. Each
  // handle from OpenSession has its own route.
  ASSERT_TRUE(s->Append(RandomTokens(s->layout(), {100}, rng_)).ok());
  ASSERT_TRUE(Fill(*prefill_handle, 101, 4).ok());
  client::DecodeStream stream = decode_handle->Decode();
  absl::StatusOr<v1::DecodeStepResult> step =
      stream.Step(RandomTokens(s->layout(), {105}, rng_), {});
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(stream.Finish().ok());
  absl::StatusOr<client::Session> reopened = fleet_->OpenSession(old_id);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  absl::StatusOr<v1::SessionStats> after = reopened->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->session_id(), moved->session_id());
  EXPECT_EQ(after->resident_tokens(), 2 * (32 + 1 + 4 + 1));
  absl::StatusOr<v1::SessionStats> on_b =
      Direct(1).GetSessionStats(moved->session_id());
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  EXPECT_EQ(on_b->resident_tokens(), after->resident_tokens());
  // Without a fleet client nothing follows: the plain client hears NOT_FOUND.
  EXPECT_EQ(Direct(0).GetSessionStats(old_id).status().code(),
            absl::StatusCode::kNotFound);
}

// Each handle follows its own session: a parent that moves takes none of
// the handles made from it along. Its fork, and a second session made
// through the same replica's client, stay on the replica where they are.
TEST_F(FleetTest, AHandleFollowsOnlyItsOwnSession) {
  absl::StatusOr<client::KvKeepClient> a = fleet_->Replica("fleet-a");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<client::Session> parent = a->CreateSession(Request());
  absl::StatusOr<client::Session> sibling = a->CreateSession(Request());
  ASSERT_TRUE(parent.ok() && sibling.ok());
  ASSERT_TRUE(Fill(*parent, 0, 8).ok());
  ASSERT_TRUE(Fill(*sibling, 0, 4).ok());
  absl::StatusOr<client::Session> child = parent->Fork({});
  ASSERT_TRUE(child.ok()) << child.status();

  v1::TransferSessionRequest move;
  move.set_session_id(parent->id());
  move.set_target(daemons_[1].address);
  ASSERT_TRUE(a->TransferSession(move).ok());
  absl::StatusOr<v1::SessionStats> moved = parent->Stats();  // follows it
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(ParseFleetSessionId(moved->session_id())->replica, "fleet-b");

  for (client::Session* s : {&*child, &*sibling}) {
    absl::StatusOr<v1::SessionStats> stats = s->Stats();
    ASSERT_TRUE(stats.ok()) << s->id() << ": " << stats.status();
    EXPECT_EQ(stats->session_id(), s->id());
    EXPECT_TRUE(Fill(*s, 8, 1).ok()) << s->id();
  }
}

TEST_F(FleetTest, AKilledReplicaIsNamedAndTheOthersAreUntouched) {
  std::vector<client::Session> sessions;
  for (const char* name : kNames) {
    absl::StatusOr<client::Session> s = fleet_->CreateSession(Request(), name);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(Fill(*s, 0, 16).ok());
    sessions.push_back(*s);
  }
  ASSERT_EQ(kill(daemons_[2].child->pid(), SIGKILL), 0);
  ASSERT_TRUE(daemons_[2].child->Wait(kPatience).ok());
  absl::StatusOr<v1::StepResult> lost =
      sessions[2].Append(RandomTokens(sessions[2].layout(), {16}, rng_));
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(lost.status().message()),
              HasSubstr("replica fleet-c"));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(DecodeWithQueries(sessions[i], 4, 16, rng_, false).ok());
    absl::StatusOr<v1::SessionStats> stats = sessions[i].Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->resident_tokens(), 2 * 20);
  }
  // New sessions go to the replicas that answer.
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<client::Session> s = fleet_->CreateSession(Request());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_THAT(s->id(), ::testing::Not(StartsWith("fleet-c.")));
  }
}

}  // namespace
}  // namespace kvkeep
