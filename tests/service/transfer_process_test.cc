// TransferSession between two kvkeepd processes on loopback, as in
// disaggregated serving: many sessions of mixed policies move while other
// sessions stream decode steps on both stores, and each moved session holds
// the same bytes and evicts exactly what its twin (an identical session
// left on the source) evicts over the next steps. A target killed with
// SIGKILL in the middle of a transfer, and a corrupted chunk, leave the
// session on the source, serving; a retry to a live target succeeds. No
// session stays frozen without a way out: a target frozen with SIGSTOP is
// noticed (the time limit, HTTP/2 keepalive), the caller's cancel aborts a
// transfer that has not committed, a commit in doubt is resolved by the
// source asking the target, and the drain on SIGTERM ends on time and tells
// the caller how the transfer ended.
//
// Waits have a generous limit only so that a hang fails the test; no test
// measures time.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/client/kvkeep_client.h"
#include "services/workers/session_driver.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::Child;
using metrics_testing::DecodeWithQueries;
using metrics_testing::OpenSession;

constexpr absl::Duration kPatience = absl::Seconds(120);
constexpr char kConfig[] =
    R"({"layouts": [{"name": "m", "num_layers": 2, "kv_heads": 2,
        "query_heads": 4, "head_dim": 8, "dtype": "f32", "page_tokens": 4,
        "pool_pages": 16384}]})";

// A kvkeepd process and a client of it.
struct Daemon {
  std::unique_ptr<Child> child;
  std::string address;
  std::string metrics;  // host:port of /metrics
  std::unique_ptr<client::KvKeepClient> client;
};

std::string ConfigFile() {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/transfer_", getpid(), ".json");
  std::ofstream(path) << kConfig;
  return path;
}

// The peer token every daemon here sends and takes (a file, as a mounted
// Secret would hold it).
std::string PeerTokenFile() {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/transfer_peer_", getpid());
  std::ofstream(path) << "transfer-process-test-peer-token\n";
  return path;
}

// With a --test_* flag, the daemon is kvkeepd_testing (kvkeepd has none).
Daemon Start(std::vector<std::string> extra = {}) {
  const bool testing = std::any_of(extra.begin(), extra.end(), [](auto& a) {
    return absl::StartsWith(a, "--test_");
  });
  std::vector<std::string> argv = {
      testing ? KVKEEPD_TESTING_BINARY : KVKEEPD_BINARY,
      "--config=" + ConfigFile(),
      "--listen=127.0.0.1:0",
      "--metrics_listen=127.0.0.1:0",
      "--self_check=false",
      "--peer_token_file=" + PeerTokenFile()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  Daemon d;
  absl::StatusOr<std::unique_ptr<Child>> child = Child::Spawn(argv);
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return d;
  d.child = *std::move(child);
  constexpr absl::string_view kPrefix = "kvkeepd: grpc listening on ";
  std::optional<std::string> line = d.child->out().WaitFor(kPrefix, kPatience);
  EXPECT_TRUE(line.has_value()) << d.child->Output();
  if (!line.has_value()) return d;
  d.address = line->substr(kPrefix.size());
  constexpr absl::string_view kMetrics = "kvkeepd: metrics on http://";
  std::optional<std::string> m = d.child->out().WaitFor(kMetrics, kPatience);
  if (m.has_value()) {
    d.metrics =
        std::string(absl::StripSuffix(m->substr(kMetrics.size()), "/metrics"));
  }
  client::ClientOptions options;
  options.address = d.address;
  options.deadline = absl::Seconds(60);
  d.client = std::make_unique<client::KvKeepClient>(
      *client::KvKeepClient::Connect(options));
  return d;
}

absl::StatusOr<v1::TransferSessionResponse> Move(
    Daemon& from, const std::string& id, const Daemon& to,
    const std::string& transport = "") {
  v1::TransferSessionRequest request;
  request.set_session_id(id);
  request.set_target(to.address);
  request.set_transport(transport);
  return from.client->TransferSession(request);
}

// Waits until `d`'s pool holds no page (a target frees what a transfer
// staged when its stream ends, which may be just after the sender's
// answer); the pages still used.
int64_t AwaitNoPagesUsed(const Daemon& d) {
  int64_t used = -1;
  for (const absl::Time until = absl::Now() + kPatience;
       used != 0 && absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(10))) {
    absl::StatusOr<v1::ServerInfo> info = d.client->GetServerInfo();
    if (!info.ok()) continue;
    used = info->pools(0).used_pages();
  }
  return used;
}

// Every layer's positions and bytes, as ReadKv gives them.
std::vector<client::LayerKvData> Contents(const client::KvKeepClient& kv,
                                          const std::string& id) {
  absl::StatusOr<client::Session> s = kv.OpenSession(id);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return {};
  absl::StatusOr<std::vector<client::LayerKvData>> data = s->ReadKv();
  EXPECT_TRUE(data.ok()) << data.status();
  return data.value_or(std::vector<client::LayerKvData>{});
}

TEST(TransferProcessTest, ManySessionsMoveWhileOthersDecodeOnBothStores) {
  Daemon a = Start();
  Daemon b = Start();
  ASSERT_TRUE(a.client && b.client);

  // 16 sessions keep decoding on each store throughout.
  std::atomic<bool> stop{false};
  std::atomic<int> background_errors{0};
  std::vector<std::thread> background;
  // Stops and joins them however the test ends.
  struct Joiner {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~Joiner() {
      stop = true;
      for (std::thread& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } joiner{stop, background};
  for (Daemon* d : {&a, &b}) {
    for (int i = 0; i < 8; ++i) {
      background.emplace_back([&, d, i] {
        std::mt19937 rng(100 + i);
        absl::StatusOr<client::Session> s =
            OpenSession(*d->client, "m", "h2o", 16);
        if (!s.ok()) {
          ++background_errors;
          return;
        }
        for (int64_t p = 0; !stop; p += 8) {
          if (!DecodeWithQueries(*s, 8, p, rng).ok()) ++background_errors;
        }
      });
    }
  }

  // Twins: the same policy, budget and steps on `a`; one of each pair moves.
  const std::vector<std::string> policies = {
      "h2o",    "tova",          "scissorhands", "h2o_page",
      "window", "streaming_llm", "full",         "snapkv"};
  struct Pair {
    std::string policy;
    client::Session moved, twin;
  };
  std::vector<Pair> pairs;
  const absl::StatusOr<v1::ServerInfo> info = a.client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const auto per_step = [&](const std::string& policy) {
    const absl::StatusOr<workers::PolicyInput> in =
        workers::InputOf(*info, policy);
    return in.ok() && *in == workers::PolicyInput::kPerStep;
  };
  for (int i = 0; i < 100; ++i) {
    const std::string& policy = policies[i % policies.size()];
    const bool scores = per_step(policy);
    std::vector<client::Session> two;
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<client::Session> s = OpenSession(
          *a.client, "m", policy, policy == "snapkv" ? 40 : 12 + i % 5);
      ASSERT_TRUE(s.ok()) << s.status();
      std::mt19937 rng(i);  // the same inputs for both twins
      ASSERT_TRUE(DecodeWithQueries(*s, 20 + i % 7, 0, rng, scores).ok());
      two.push_back(*std::move(s));
    }
    pairs.push_back(Pair{policy, two[0], two[1]});
  }
  // Every other one over each transport: the data socket (what "auto"
  // picks between kvkeepd processes) and chunk messages.
  int64_t bytes = 0;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const Pair& p = pairs[i];
    const std::string transport = i % 2 == 0 ? "" : "host";
    absl::StatusOr<v1::TransferSessionResponse> r =
        Move(a, p.moved.id(), b, transport);
    ASSERT_TRUE(r.ok()) << p.policy << ": " << r.status();
    EXPECT_EQ(r->transport(), i % 2 == 0 ? "tcp" : "host");
    bytes += r->bytes();
  }
  EXPECT_GT(bytes, 0);

  for (int i = 0; i < static_cast<int>(pairs.size()); ++i) {
    Pair& p = pairs[i];
    SCOPED_TRACE(absl::StrCat(p.policy, " #", i));
    EXPECT_EQ(a.client->GetSessionStats(p.moved.id()).status().code(),
              absl::StatusCode::kNotFound);
    const std::vector<client::LayerKvData> x =
        Contents(*b.client, p.moved.id());
    const std::vector<client::LayerKvData> y = Contents(*a.client, p.twin.id());
    ASSERT_EQ(x.size(), y.size());
    for (size_t l = 0; l < x.size(); ++l) {
      EXPECT_EQ(x[l].positions, y[l].positions);
      EXPECT_TRUE(x[l].keys == y[l].keys && x[l].values == y[l].values);
      EXPECT_EQ(x[l].version, y[l].version);
    }
    // The next 100 steps, the same inputs: the same state after each block.
    absl::StatusOr<client::Session> moved = b.client->OpenSession(p.moved.id());
    ASSERT_TRUE(moved.ok());
    const bool scores = per_step(p.policy);
    for (int block = 0; block < 4; ++block) {
      std::mt19937 r1(1000 + i * 10 + block), r2(1000 + i * 10 + block);
      const int64_t at = 100 + block * 25;
      ASSERT_TRUE(DecodeWithQueries(*moved, 25, at, r1, scores).ok());
      ASSERT_TRUE(DecodeWithQueries(p.twin, 25, at, r2, scores).ok());
      const absl::StatusOr<v1::SessionStats> sx = moved->Stats();
      const absl::StatusOr<v1::SessionStats> sy = p.twin.Stats();
      ASSERT_TRUE(sx.ok() && sy.ok());
      EXPECT_EQ(sx->evicted_tokens(), sy->evicted_tokens());
      EXPECT_THAT(sx->layer_version(),
                  ::testing::ElementsAreArray(sy->layer_version()));
    }
    const std::vector<client::LayerKvData> x2 =
        Contents(*b.client, p.moved.id());
    const std::vector<client::LayerKvData> y2 =
        Contents(*a.client, p.twin.id());
    for (size_t l = 0; l < x2.size() && l < y2.size(); ++l) {
      EXPECT_EQ(x2[l].positions, y2[l].positions);
    }
  }
  stop = true;
  for (std::thread& t : background) t.join();
  EXPECT_EQ(background_errors, 0);
}

// Each transport in turn: the data socket, chunk messages.
class KilledTargetTest : public ::testing::TestWithParam<std::string> {};

TEST_P(KilledTargetTest, TheSessionStaysHereAndARetrySucceeds) {
  const std::string transport = GetParam();
  // The source sends slowly (kvkeepd_testing's delay), so SIGKILL lands
  // mid-way.
  Daemon a = Start({"--test_transfer_chunk_delay_ms=300",
                    "--test_corrupt_transfer_chunk=-1"});
  Daemon b = Start();
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(7);
  absl::StatusOr<client::Session> s = OpenSession(*a.client, "m", "h2o", 400);
  ASSERT_TRUE(s.ok());
  // One chunk per layer here: sent at 300 ms and 600 ms, the commit after.
  ASSERT_TRUE(DecodeWithQueries(*s, 300, 0, rng).ok());
  const std::vector<client::LayerKvData> before = Contents(*a.client, s->id());

  absl::StatusOr<v1::TransferSessionResponse> moved;
  std::thread mover([&] { moved = Move(a, s->id(), b, transport); });
  absl::SleepFor(absl::Milliseconds(450));  // the header and a chunk are out
  b.child->Signal(SIGKILL);
  mover.join();
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kUnavailable)
      << moved.status();
  // Still here, unchanged, serving.
  const std::vector<client::LayerKvData> after = Contents(*a.client, s->id());
  ASSERT_EQ(after.size(), before.size());
  for (size_t l = 0; l < after.size(); ++l) {
    EXPECT_EQ(after[l].positions, before[l].positions);
    EXPECT_TRUE(after[l].keys == before[l].keys);
  }
  ASSERT_TRUE(DecodeWithQueries(*s, 5, 1000, rng).ok());

  // A retry to a live target succeeds.
  Daemon c = Start();
  ASSERT_TRUE(c.client);
  moved = Move(a, s->id(), c, transport);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->transport(), transport);
  EXPECT_TRUE(c.client->GetSessionStats(s->id()).ok());
  EXPECT_EQ(a.client->GetSessionStats(s->id()).status().code(),
            absl::StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Transports, KilledTargetTest,
                         ::testing::Values("tcp", "host"),
                         [](const auto& info) { return info.param; });

// Over the target's data socket (tcp, kvkeepd's default) and, with the
// target's data socket off, in chunk messages (host).
class CorruptChunkTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CorruptChunkTest, ACorruptChunkIsRefusedAndNothingLeaks) {
  const std::string transport = GetParam();
  Daemon a = Start({"--test_corrupt_transfer_chunk=0"});
  Daemon b = Start({transport == "host" ? "--transfer_listen=off"
                                        : "--transfer_listen=127.0.0.1:0"});
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(8);
  absl::StatusOr<client::Session> s = OpenSession(*a.client, "m", "tova", 32);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(DecodeWithQueries(*s, 40, 0, rng).ok());
  const absl::StatusOr<v1::TransferSessionResponse> moved = Move(a, s->id(), b);
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kDataLoss)
      << moved.status();
  // The target frees its reservation, perhaps just after the sender has its
  // answer (a data-socket receive is cleaned up off gRPC's threads).
  EXPECT_EQ(AwaitNoPagesUsed(b), 0);
  EXPECT_TRUE(a.client->GetSessionStats(s->id()).ok());
  ASSERT_TRUE(DecodeWithQueries(*s, 3, 1000, rng).ok());

  // Both ends count it, by transport, direction and code.
  for (const auto& [d, direction] :
       {std::pair(&a, "out"), std::pair(&b, "in")}) {
    // The receiving end counts when its stream is done, which may be just
    // after the sender has its answer.
    std::optional<double> count;
    const absl::Time until = absl::Now() + kPatience;
    while (absl::Now() < until) {
      absl::StatusOr<std::string> text =
          metrics_testing::HttpGet(d->metrics, "/metrics");
      ASSERT_TRUE(text.ok()) << text.status();
      count = metrics_testing::Value(metrics_testing::ParseExposition(*text),
                                     "kvkeep_transfers_total",
                                     {{"transport", transport},
                                      {"direction", direction},
                                      {"code", "DATA_LOSS"}});
      if (count.has_value()) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_THAT(count, ::testing::Optional(1.0)) << direction;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, CorruptChunkTest,
                         ::testing::Values("tcp", "host"),
                         [](const auto& info) { return info.param; });

// A TransferSession call on its own thread, with no deadline (unless one is
// given) and a context the test may cancel; what came back, trailing
// metadata included.
class PendingTransfer {
 public:
  PendingTransfer(const Daemon& from, const std::string& id, const Daemon& to,
                  const std::string& transport)
      : stub_(v1::KvKeep::NewStub(grpc::CreateChannel(
            from.address, grpc::InsecureChannelCredentials()))) {
    request_.set_session_id(id);
    request_.set_target(to.address);
    request_.set_transport(transport);
    thread_ = std::thread([this] {
      status_ = stub_->TransferSession(&ctx_, request_, &response_);
      done_.Notify();
    });
  }
  ~PendingTransfer() { thread_.join(); }

  void Cancel() { ctx_.TryCancel(); }
  // Whether the call ended within the test's patience.
  bool Ended() { return done_.WaitForNotificationWithTimeout(kPatience); }
  const grpc::Status& status() const { return status_; }
  // The transfer id, as the trailing metadata names it.
  std::string TransferId() const {
    const auto& trailers = ctx_.GetServerTrailingMetadata();
    auto it = trailers.find("kvkeep-transfer-id");
    return it == trailers.end()
               ? ""
               : std::string(it->second.data(), it->second.size());
  }

 private:
  std::unique_ptr<v1::KvKeep::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::TransferSessionRequest request_;
  v1::TransferSessionResponse response_;
  grpc::Status status_;
  absl::Notification done_;
  std::thread thread_;
};

// Whether process `pid` is stopped (SIGSTOP), as /proc says.
bool IsStopped(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)),
                   std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() &&
         text[paren + 2] == 'T';
}

void AwaitStopped(pid_t pid) {
  const absl::Time until = absl::Now() + kPatience;
  while (!IsStopped(pid) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(IsStopped(pid));
}

// A source whose kvkeepd_testing hook freezes `target` (SIGSTOP) before
// the first chunk goes (over tcp: after the data socket connected), with
// `extra` flags.
Daemon StartFreezing(const Daemon& target, std::vector<std::string> extra) {
  extra.push_back(absl::StrCat("--test_stop_pid=", target.child->pid()));
  extra.push_back("--test_stop_at_chunk=0");
  return Start(std::move(extra));
}

// A session of 300 tokens on `d` (one chunk per layer).
absl::StatusOr<client::Session> FilledSession(const Daemon& d,
                                              std::mt19937& rng) {
  absl::StatusOr<client::Session> s = OpenSession(*d.client, "m", "h2o", 400);
  if (!s.ok()) return s;
  if (absl::Status st = DecodeWithQueries(*s, 300, 0, rng); !st.ok()) return st;
  return s;
}

// Finding 7: the caller gives no deadline and the target freezes while the
// sender waits for its verdict on the data socket (before the commit). The
// transfer's time limit ends it; the session serves here again.
TEST(TransferLivenessTest, ATransferWithoutADeadlineEndsAtItsTimeLimit) {
  Daemon b = Start();
  Daemon a = StartFreezing(
      b, {"--transfer_timeout_seconds=2", "--peer_keepalive_seconds=0"});
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(11);
  absl::StatusOr<client::Session> s = FilledSession(a, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  {
    PendingTransfer moved(a, s->id(), b, "tcp");
    const bool ended = moved.Ended();
    if (!ended) b.child->Signal(SIGKILL);  // lets the call end, failed
    ASSERT_TRUE(ended) << "the transfer never ended";
    EXPECT_EQ(moved.status().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << moved.status().error_message();
    EXPECT_THAT(moved.status().error_message(),
                ::testing::HasSubstr("transfer_timeout_seconds"));
    ASSERT_FALSE(moved.TransferId().empty());
    EXPECT_THAT(moved.status().error_message(),
                ::testing::HasSubstr(moved.TransferId()));
  }
  ASSERT_TRUE(DecodeWithQueries(*s, 3, 1000, rng).ok());
  b.child->Signal(SIGCONT);
  EXPECT_EQ(AwaitNoPagesUsed(b), 0);
  EXPECT_EQ(b.client->GetSessionStats(s->id()).status().code(),
            absl::StatusCode::kNotFound);
}

// Finding 7: the caller cancels a transfer to a frozen target (no deadline,
// no keepalive, a long time limit): the transfer stops, the session serves
// here again, and the target frees what it staged once it runs again.
TEST(TransferLivenessTest, TheCallersCancelAbortsATransferNotCommitted) {
  Daemon b = Start();
  Daemon a = StartFreezing(b, {"--peer_keepalive_seconds=0"});
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(12);
  absl::StatusOr<client::Session> s = FilledSession(a, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  {
    PendingTransfer moved(a, s->id(), b, "tcp");
    AwaitStopped(b.child->pid());
    moved.Cancel();
    ASSERT_TRUE(moved.Ended());
    EXPECT_EQ(moved.status().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The source hears the cancel and thaws the session.
  absl::Status served = absl::UnavailableError("not tried");
  for (const absl::Time until = absl::Now() + kPatience;
       served.code() == absl::StatusCode::kUnavailable && absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(20))) {
    served = DecodeWithQueries(*s, 1, 1000, rng);
  }
  EXPECT_TRUE(served.ok()) << served;
  b.child->Signal(SIGCONT);
  EXPECT_EQ(AwaitNoPagesUsed(b), 0);
  EXPECT_EQ(b.client->GetSessionStats(s->id()).status().code(),
            absl::StatusCode::kNotFound);
}

// Findings 6 and 7: the target freezes with the chunks and the commit in
// its socket (chunk messages), and the caller gives no deadline. HTTP/2
// keepalive notices; the commit is in doubt, the caller is told so with the
// transfer id the store made, and so are calls on the frozen session. Once
// the target runs again, the source asks it and settles the session: closed
// here and served there, or served here and not there.
TEST(TransferLivenessTest, ACommitInDoubtIsResolvedByTheSource) {
  Daemon b = Start();
  Daemon a = StartFreezing(
      b, {"--peer_keepalive_seconds=1", "--transfer_resolve_seconds=0.5"});
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(13);
  absl::StatusOr<client::Session> s = FilledSession(a, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<client::LayerKvData> before = Contents(*a.client, s->id());
  std::string transfer_id;
  {
    PendingTransfer moved(a, s->id(), b, "host");
    const bool ended = moved.Ended();
    if (!ended) b.child->Signal(SIGKILL);
    ASSERT_TRUE(ended) << "the transfer never ended";
    EXPECT_EQ(moved.status().error_code(), grpc::StatusCode::UNAVAILABLE)
        << moved.status().error_message();
    transfer_id = moved.TransferId();
    ASSERT_EQ(transfer_id.size(), 32u);
    EXPECT_THAT(moved.status().error_message(),
                ::testing::AllOf(::testing::HasSubstr(transfer_id),
                                 ::testing::HasSubstr("asks the target")));
  }
  // While the target is frozen, the session says which transfer holds it.
  const absl::Status frozen = DecodeWithQueries(*s, 1, 1000, rng);
  EXPECT_EQ(frozen.code(), absl::StatusCode::kUnavailable) << frozen;
  EXPECT_THAT(frozen.message(), ::testing::HasSubstr(transfer_id));
  const absl::Status close = a.client->CloseSession(s->id()).status();
  EXPECT_EQ(close.code(), absl::StatusCode::kUnavailable) << close;
  EXPECT_THAT(close.message(), ::testing::HasSubstr("in doubt"));

  b.child->Signal(SIGCONT);
  absl::Status probe = absl::UnavailableError("not tried");
  for (const absl::Time until = absl::Now() + kPatience;
       probe.code() == absl::StatusCode::kUnavailable && absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(50))) {
    probe = a.client->GetSessionStats(s->id()).status();
    if (probe.ok()) probe = DecodeWithQueries(*s, 1, 1000, rng);
  }
  if (probe.ok()) {  // not committed: served here, nothing there
    EXPECT_EQ(b.client->GetSessionStats(s->id()).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(AwaitNoPagesUsed(b), 0);
  } else {  // committed: closed here, served there, unchanged
    EXPECT_EQ(probe.code(), absl::StatusCode::kNotFound) << probe;
    const std::vector<client::LayerKvData> after = Contents(*b.client, s->id());
    ASSERT_EQ(after.size(), before.size());
    for (size_t l = 0; l < after.size(); ++l) {
      EXPECT_EQ(after[l].positions, before[l].positions);
      EXPECT_TRUE(after[l].keys == before[l].keys);
    }
  }
}

// Finding 10: SIGTERM while a slow transfer is sending (it would commit
// after the drain's grace). The drain cancels it before its commit, the
// source exits, and what the caller is told is what happened: an error
// only if the target does not hold the session.
TEST(TransferLivenessTest, TheDrainEndsATransferAndTellsItsTrueOutcome) {
  Daemon a =
      Start({"--test_transfer_chunk_delay_ms=1200", "--drain_seconds=2"});
  Daemon b = Start();
  ASSERT_TRUE(a.client && b.client);
  std::mt19937 rng(14);
  absl::StatusOr<client::Session> s = FilledSession(a, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  grpc::Status told;
  {
    PendingTransfer moved(a, s->id(), b, "host");
    absl::SleepFor(absl::Milliseconds(200));  // the transfer has begun
    a.child->Signal(SIGTERM);
    ASSERT_TRUE(moved.Ended());
    told = moved.status();
  }
  const absl::StatusOr<int> exit = a.child->Wait(kPatience);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0) << child_process::DescribeWaitStatus(*exit) << "\n"
                      << a.child->Output();
  // The target holds the session exactly when the caller was told OK.
  absl::StatusOr<v1::SessionStats> there = b.client->GetSessionStats(s->id());
  EXPECT_EQ(there.ok(), told.ok())
      << "told " << told.error_code() << " " << told.error_message()
      << "; the target: " << there.status();
  if (!told.ok()) {
    EXPECT_EQ(AwaitNoPagesUsed(b), 0);
  }
}

}  // namespace
}  // namespace kvkeep
