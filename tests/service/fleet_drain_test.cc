// Drain by migration (docs/fleet.md) with real kvkeepd processes: a fleet
// of three replicas on loopback, each told its peers (--fleet_peers), and
// 64 sessions decoding through a FleetClient, each with an undisturbed twin
// on a kvkeepd outside the fleet that gets the same prompt and steps. On
// SIGTERM a replica moves its sessions to its peers while they decode: no
// session is lost, every step's evictions and every session's final keys
// and values equal its twin's (byte-exact continuation), and the drained
// process exits 0. A rolling restart SIGTERMs every replica in turn and
// starts it again, empty, under the same name and port: still none lost.
// What a drain cannot move (no peer has room) is counted in
// kvkeep_drain_sessions_total{outcome="unmoved"} and logged, and its
// caller hears the replica's name once it is gone.
//
// Waits have a generous limit only so that a hang fails the test; no test
// measures time (the drain's time is printed, for docs/fleet.md).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/fleet_client.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::ServingChild;
using metrics_testing::RandomTokens;
using ::testing::HasSubstr;

constexpr absl::Duration kPatience = absl::Seconds(120);
constexpr int kSessions = 64;
constexpr int kThreads = 8;
constexpr int kPromptTokens = 12;
constexpr int kBudgetTokens = 16;
// 2 layers of 4-token pages; a session holds at most 2 x 5 pages. The
// linger is what a moved session's handle has to make its next call and
// follow the move: 6 s, twice what an ASan build on a loaded machine needs
// for a round of 8 sessions per thread.
constexpr char kConfig[] =
    R"({"layouts": [{"name": "m", "num_layers": 2, "kv_heads": 2,
        "query_heads": 4, "head_dim": 8, "dtype": "f32", "page_tokens": 4,
        "pool_pages": 512}],
        "drain_seconds": 5,
        "fleet": {"move_seconds": 60, "move_parallelism": 4,
                  "linger_seconds": 6}})";
const char* const kNames[] = {"fleet-a", "fleet-b", "fleet-c"};

// Per layer: what one step did, without page ids (only they may differ
// between a moved session and its twin).
std::string Changes(const v1::StepResult& result) {
  std::string out;
  for (const v1::LayerChange& l : result.layers()) {
    absl::StrAppend(&out, "layer ", l.layer(), " v", l.version(), " resident ",
                    l.resident(), " evicted [",
                    absl::StrJoin(l.evicted_positions(), ","), "] moves ",
                    l.moves_size(), "; ");
  }
  return out;
}

// One session decoding in the fleet and its twin decoding alone, stepped
// together with the same token and queries.
struct Pair {
  client::Session session;
  client::Session twin;
  std::optional<client::DecodeStream> stream;
  std::optional<client::DecodeStream> twin_stream;
  std::vector<uint64_t> versions;  // per layer, before the next append
  int64_t next_position = kPromptTokens;
  std::mt19937 rng;
};

class FleetDrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = child_process::WriteTempFile("drain.json", kConfig);
    token_ = child_process::WriteTempFile("drain_peer",
                                          "fleet-drain-test-peer-token\n");
    std::vector<std::string> peers;
    for (int i = 0; i < 3; ++i) {
      ports_.push_back(child_process::FreeLoopbackPort());
      peers.push_back(absl::StrCat("127.0.0.1:", ports_.back()));
    }
    peers_ = absl::StrJoin(peers, ",");
    for (int i = 0; i < 3; ++i) {
      daemons_.emplace_back();
      ASSERT_NO_FATAL_FAILURE(Start(i));
    }
    absl::StatusOr<ServingChild> twin = child_process::StartServing(
        {KVKEEPD_BINARY, "--config=" + config_, "--listen=127.0.0.1:0",
         "--metrics_listen=127.0.0.1:0", "--self_check=false",
         "--pool_pages=4096", "--replica_name=twins"},
        kPatience);
    ASSERT_TRUE(twin.ok()) << twin.status();
    twins_ = *std::move(twin);
    client::FleetOptions options;
    options.targets = peers;
    options.placement_staleness = absl::ZeroDuration();
    absl::StatusOr<client::FleetClient> fleet =
        client::FleetClient::Connect(options);
    ASSERT_TRUE(fleet.ok()) << fleet.status();
    fleet_ = std::make_unique<client::FleetClient>(*std::move(fleet));
    client::ClientOptions twin_options;
    twin_options.address = twins_.address;
    twin_client_ = std::make_unique<client::KvKeepClient>(
        *client::KvKeepClient::Connect(twin_options));
  }

  // Starts replica i on its port, telling it every replica's address.
  void Start(int i, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {
        KVKEEPD_BINARY,
        "--config=" + config_,
        absl::StrCat("--listen=127.0.0.1:", ports_[i]),
        "--metrics_listen=127.0.0.1:0",
        "--self_check=false",
        "--peer_token_file=" + token_,
        absl::StrCat("--replica_name=", kNames[i]),
        "--fleet_peers=" + peers_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    absl::StatusOr<ServingChild> d =
        child_process::StartServing(argv, kPatience);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons_[i] = *std::move(d);
  }

  // SIGTERMs replica i and waits for it: it must exit 0.
  void Drain(int i) {
    const absl::Time start = absl::Now();
    daemons_[i].child->Signal(SIGTERM);
    absl::StatusOr<int> status = daemons_[i].child->Wait(kPatience);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
        << child_process::DescribeWaitStatus(*status) << "\n"
        << daemons_[i].child->Output();
    std::printf("drain of %s: %s, exit after %s\n", kNames[i],
                LastDrainLine(i).c_str(),
                absl::FormatDuration(absl::Now() - start).c_str());
  }

  std::string LastDrainLine(int i) const {
    std::string line;
    for (absl::string_view l :
         absl::StrSplit(daemons_[i].child->err().Text(), '\n')) {
      if (absl::StartsWith(l, "kvkeepd: drain: ") &&
          absl::StrContains(l, " sessions: ")) {
        line = std::string(l);
      }
    }
    return line;
  }

  static v1::CreateSessionRequest Request() {
    v1::CreateSessionRequest request;
    request.set_layout("m");
    request.set_policy("h2o");
    request.mutable_budget()->set_tokens(kBudgetTokens);
    return request;
  }

  // A session placed by the fleet and its twin, with the same prompt.
  void AddPair(int seed) {
    absl::StatusOr<client::Session> s = fleet_->CreateSession(Request());
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<client::Session> t = twin_client_->CreateSession(Request());
    ASSERT_TRUE(t.ok()) << t.status();
    std::vector<int64_t> positions;
    for (int64_t p = 0; p < kPromptTokens; ++p) positions.push_back(p);
    std::mt19937 rng(seed);
    const client::KvTokens prompt = RandomTokens(s->layout(), positions, rng);
    ASSERT_TRUE(s->AppendPrefill(prompt).ok());
    ASSERT_TRUE(t->AppendPrefill(prompt).ok());
    absl::StatusOr<client::BlockTableMirror> mirror = t->Mirror();
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    auto pair = std::make_unique<Pair>(
        Pair{*s, *t, {}, {}, {}, kPromptTokens, std::mt19937(seed + 1)});
    for (int32_t l = 0; l < s->layout().num_layers(); ++l) {
      pair->versions.push_back(mirror->version(l));
    }
    pair->stream.emplace(pair->session.Decode());
    pair->twin_stream.emplace(pair->twin.Decode());
    pairs_.push_back(std::move(pair));
  }

  // One decode step on a session and on its twin; they must agree.
  absl::Status Step(Pair& p) {
    const v1::Layout& layout = p.session.layout();
    const client::KvTokens token =
        RandomTokens(layout, {p.next_position}, p.rng);
    std::normal_distribution<float> normal;
    std::vector<float> q(layout.query_heads() * layout.head_dim());
    std::vector<v1::LayerScores> scores;
    for (int32_t l = 0; l < layout.num_layers(); ++l) {
      for (float& x : q) x = normal(p.rng);
      scores.push_back(client::QueryScores(l, p.versions[l], q));
    }
    absl::StatusOr<v1::DecodeStepResult> got = p.stream->Step(token, scores);
    if (!got.ok()) {
      return absl::Status(
          got.status().code(),
          absl::StrCat("session ", p.session.id(), " step at ", p.next_position,
                       ": ", got.status().message()));
    }
    absl::StatusOr<v1::DecodeStepResult> want =
        p.twin_stream->Step(token, scores);
    if (!want.ok()) return want.status();
    const std::string a = Changes(got->append()) + Changes(got->scores());
    const std::string b = Changes(want->append()) + Changes(want->scores());
    if (a != b) {
      return absl::InternalError(
          absl::StrCat("session ", p.session.id(), " at ", p.next_position,
                       " differs from its twin:\n", a, "\n", b));
    }
    for (const v1::LayerChange& l : got->scores().layers()) {
      p.versions[l.layer()] = l.version();
    }
    ++p.next_position;
    return absl::OkStatus();
  }

  // Steps every session, from kThreads threads, until `stop`; the first
  // failure is kept.
  void Decode(std::atomic<bool>& stop) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([this, t, &stop] {
        while (!stop.load()) {
          for (size_t i = t; i < pairs_.size(); i += kThreads) {
            if (absl::Status s = Step(*pairs_[i]); !s.ok()) {
              absl::MutexLock lock(&mu_);
              if (failure_.ok()) failure_ = s;
              return;
            }
          }
          steps_.fetch_add(1);
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }

  // Waits until every thread has stepped all its sessions `rounds` more
  // times, or a step failed (then the decoding threads have stopped).
  void WaitForRounds(int64_t rounds) {
    const int64_t target = steps_.load() + rounds * kThreads;
    for (const absl::Time end = absl::Now() + kPatience;
         steps_.load() < target && absl::Now() < end;) {
      {
        absl::MutexLock lock(&mu_);
        if (!failure_.ok()) return;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  // Stops the decoding threads; none may have failed.
  void StopDecoding(std::atomic<bool>& stop, std::thread& decoding) {
    stop = true;
    decoding.join();
    std::printf("%lld decode steps per session (%d threads)\n",
                static_cast<long long>(steps_.load() / kThreads), kThreads);
    absl::MutexLock lock(&mu_);
    ASSERT_TRUE(failure_.ok()) << failure_;
  }

  // Every session's final keys and values equal its twin's.
  void ExpectSameAsTwins() {
    for (const std::unique_ptr<Pair>& p : pairs_) {
      ASSERT_TRUE(p->stream->Finish().ok()) << p->session.id();
      ASSERT_TRUE(p->twin_stream->Finish().ok());
      absl::StatusOr<std::vector<client::LayerKvData>> got =
          p->session.ReadKv();
      ASSERT_TRUE(got.ok()) << p->session.id() << ": " << got.status();
      absl::StatusOr<std::vector<client::LayerKvData>> want = p->twin.ReadKv();
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_EQ(got->size(), want->size());
      for (size_t l = 0; l < got->size(); ++l) {
        EXPECT_EQ((*got)[l].positions, (*want)[l].positions) << p->session.id();
        EXPECT_EQ((*got)[l].version, (*want)[l].version) << p->session.id();
        EXPECT_TRUE((*got)[l].keys == (*want)[l].keys) << p->session.id();
        EXPECT_TRUE((*got)[l].values == (*want)[l].values) << p->session.id();
      }
    }
  }

  // Sessions held per replica (by ServerInfo; -1: it does not answer).
  std::vector<int64_t> Held() {
    std::vector<int64_t> held;
    for (int port : ports_) {
      client::ClientOptions options;
      options.address = absl::StrCat("127.0.0.1:", port);
      options.retries = 0;
      absl::StatusOr<v1::ServerInfo> info =
          client::KvKeepClient::Connect(options)->GetServerInfo();
      held.push_back(info.ok() ? info->pools(0).sessions() : -1);
    }
    return held;
  }

  std::string config_;
  std::string token_;
  std::vector<int> ports_;
  std::string peers_;
  std::vector<ServingChild> daemons_;
  ServingChild twins_;
  std::unique_ptr<client::FleetClient> fleet_;
  std::unique_ptr<client::KvKeepClient> twin_client_;
  std::vector<std::unique_ptr<Pair>> pairs_;
  std::atomic<int64_t> steps_{0};
  absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

TEST_F(FleetDrainTest, DrainOfOneReplicaWhileSessionsDecodeLosesNone) {
  for (int i = 0; i < kSessions; ++i) ASSERT_NO_FATAL_FAILURE(AddPair(i));
  const std::vector<int64_t> before = Held();
  ASSERT_GT(before[0], 0);
  std::atomic<bool> stop{false};
  std::thread decoding([&] { Decode(stop); });
  WaitForRounds(2);
  Drain(0);
  WaitForRounds(2);
  ASSERT_NO_FATAL_FAILURE(StopDecoding(stop, decoding));
  EXPECT_THAT(LastDrainLine(0),
              HasSubstr(absl::StrCat(before[0], " sessions: ", before[0],
                                     " moved to 2 peers, 0 not moved")));
  const std::vector<int64_t> after = Held();
  EXPECT_EQ(after[0], -1);  // gone
  EXPECT_EQ(after[1] + after[2], kSessions);
  ExpectSameAsTwins();
}

TEST_F(FleetDrainTest, RollingRestartOfEveryReplicaLosesNone) {
  for (int i = 0; i < kSessions; ++i) ASSERT_NO_FATAL_FAILURE(AddPair(i));
  std::atomic<bool> stop{false};
  std::thread decoding([&] { Decode(stop); });
  // Highest ordinal first, as kubectl rollout does.
  for (int i = 2; i >= 0; --i) {
    WaitForRounds(2);
    Drain(i);
    Start(i);
  }
  WaitForRounds(2);
  ASSERT_NO_FATAL_FAILURE(StopDecoding(stop, decoding));
  const std::vector<int64_t> held = Held();
  EXPECT_EQ(held[0] + held[1] + held[2], kSessions);
  ExpectSameAsTwins();
}

TEST_F(FleetDrainTest, WhatADrainCannotMoveIsCountedAndLogged) {
  // fleet-b and fleet-c restart with room for 10 pages each; fleet-a holds
  // three sessions of 8 pages (16 tokens in 2 layers of 4-token pages):
  // each peer takes one.
  for (int i : {1, 2}) {
    daemons_[i].child->Signal(SIGTERM);
    ASSERT_TRUE(daemons_[i].child->Wait(kPatience).ok());
    ASSERT_NO_FATAL_FAILURE(Start(i, {"--pool_pages=10"}));
  }
  std::vector<client::Session> sessions;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<client::Session> s =
        fleet_->CreateSession(Request(), "fleet-a");
    ASSERT_TRUE(s.ok()) << s.status();
    std::vector<int64_t> positions;
    for (int64_t p = 0; p < kBudgetTokens; ++p) positions.push_back(p);
    std::mt19937 rng(i);
    ASSERT_TRUE(
        s->AppendPrefill(RandomTokens(s->layout(), positions, rng)).ok());
    sessions.push_back(*s);
  }
  const std::string metrics = daemons_[0].metrics;
  daemons_[0].child->Signal(SIGTERM);
  // The count, scraped while the replica lingers after its moves.
  std::optional<double> unmoved;
  for (const absl::Time end = absl::Now() + kPatience;
       !unmoved.has_value() && absl::Now() < end;) {
    absl::StatusOr<std::string> text =
        metrics_testing::HttpGet(metrics, "/metrics");
    if (text.ok()) {
      const auto samples = metrics_testing::ParseExposition(*text);
      if (metrics_testing::Value(samples, "kvkeep_draining") == 1.0) {
        unmoved = metrics_testing::Value(samples, "kvkeep_drain_sessions_total",
                                         {{"outcome", "unmoved"}});
        if (unmoved == 0.0) unmoved.reset();  // the moves are not done
      }
    }
    if (!unmoved.has_value()) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(unmoved, 1.0);
  // Still lingering: the handles of the moved sessions follow them.
  for (const client::Session& s : sessions) {
    absl::StatusOr<v1::SessionStats> stats = s.Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
  }
  absl::StatusOr<int> status = daemons_[0].child->Wait(kPatience);
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  EXPECT_THAT(LastDrainLine(0),
              HasSubstr("3 sessions: 2 moved to 2 peers, 1 not moved"));
  // The one left behind is named in the log, and its caller hears which
  // replica is gone.
  int lost = 0;
  for (const client::Session& s : sessions) {
    absl::StatusOr<v1::SessionStats> stats = s.Stats();
    if (stats.ok()) continue;
    ++lost;
    EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(stats.status().message(), HasSubstr("replica fleet-a"));
    EXPECT_THAT(daemons_[0].child->Output(),
                HasSubstr(absl::StrCat("could not move session ", s.id(),
                                       " (layout m, 8 pages): no peer has "
                                       "room")));
  }
  EXPECT_EQ(lost, 1);
}

TEST_F(FleetDrainTest, ADrainingReplicaRefusesNewSessionsAndPlacementSkipsIt) {
  // fleet-a drains slowly (a long linger) while new sessions are made.
  daemons_[0].child->Signal(SIGTERM);
  client::ClientOptions direct;
  direct.address = absl::StrCat("127.0.0.1:", ports_[0]);
  direct.retries = 0;
  client::KvKeepClient a = *client::KvKeepClient::Connect(direct);
  absl::Status refused;
  for (const absl::Time end = absl::Now() + kPatience; absl::Now() < end;) {
    refused = a.CreateSession(Request()).status();
    if (!refused.ok()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("replica fleet-a is draining"));
  // The fleet places elsewhere (fleet-a has the most free pages, but says
  // it is draining, or refuses).
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<client::Session> s = fleet_->CreateSession(Request());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_THAT(s->id(), ::testing::Not(::testing::StartsWith("fleet-a.")));
  }
}

}  // namespace
}  // namespace kvkeep
