// kvkeepd as a separate process, driven over loopback gRPC as a deployment
// sees it: its start-up lines, its config checks, SIGTERM/SIGINT while a
// Decode stream is open, a restart on the same port, tenant tokens and TLS.
//
// Each test spawns the KVKEEPD_BINARY (fork + exec, --listen=127.0.0.1:0,
// --self_check=false, a small f32 layout) and reads the port from its
// "kvkeepd: grpc listening on HOST:PORT" line. Every child is SIGKILLed and
// reaped in TearDown (and gets SIGKILL if this process dies first), so a
// failing test leaves no kvkeepd behind.
//
// Waits here have a generous limit (kPatience) only so that a hang fails
// the test instead of blocking ctest; no test measures time.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/page_memory.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/metrics_testing.h"

namespace kvkeep {
namespace {

using child_process::Child;
using child_process::DescribeWaitStatus;

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr absl::string_view kListenPrefix = "kvkeepd: grpc listening on ";
constexpr absl::string_view kMetricsPrefix = "kvkeepd: metrics on http://";
// A hang guard, not a time limit on the behaviour under test: a correct run
// needs a small fraction of it, also under ASan on two cores.
constexpr absl::Duration kPatience = absl::Seconds(120);

// The layout every test's kvkeepd serves: 2 layers of f32, 2 kv / 4 query
// heads, head_dim 8, 4-token pages (a token is 64 bytes of K per layer).
constexpr int kLayers = 2;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 8;
constexpr absl::string_view kLayoutJson =
    R"({"name": "proc", "num_layers": 2, "kv_heads": 2, "query_heads": 4,
        "head_dim": 8, "dtype": "f32", "page_tokens": 4, "pool_pages": 64})";

// A config document with the test layout and `extra` top-level members
// (each preceded by a comma).
std::string ConfigJson(absl::string_view extra = "") {
  return absl::StrCat(R"({"layouts": [)", kLayoutJson, "]", extra, "}");
}

// One f32 token of K (or V) for one layer: kv_heads * head_dim floats.
std::string TokenBytes(int layer, int64_t position, float sign) {
  std::vector<float> v(kKvHeads * kHeadDim);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = sign * (layer * 1000.0f + position + i / 16.0f);
  }
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(float));
}

// What a worker tracks per layer to send the next step's attention.
struct LayerState {
  uint64_t version = 0;
  int64_t resident = 0;
};

// A Decode stream of one session, lock-step: each step appends one token to
// every layer and sends uniform head-reduced attention over the slots.
class Decoder {
 public:
  Decoder(v1::KvKeep::Stub& stub, const v1::CreateSessionResponse& session)
      : session_id_(session.session_id()),
        stream_(stub.Decode(&context_)),
        layers_(session.layer_versions_size()) {
    for (int l = 0; l < session.layer_versions_size(); ++l) {
      layers_[l].version = session.layer_versions(l);
    }
  }

  // Cancels a stream the test left open (a failed assertion).
  ~Decoder() {
    if (!finished_) {
      context_.TryCancel();
      stream_->Finish().IgnoreError();
    }
  }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Writes one step and reads its reply; false when the stream broke.
  bool Step() {
    v1::DecodeStep step;
    if (position_ == 0) step.set_session_id(session_id_);
    step.mutable_append()->add_positions(position_);
    for (int l = 0; l < static_cast<int>(layers_.size()); ++l) {
      v1::LayerKv* kv = step.mutable_append()->add_layers();
      kv->set_keys(TokenBytes(l, position_, 1.0f));
      kv->set_values(TokenBytes(l, position_, -1.0f));
      v1::LayerScores* s = step.add_scores();
      s->set_layer(l);
      s->set_version(layers_[l].version);  // before this step's append
      const int64_t slots = layers_[l].resident + 1;
      s->mutable_reduced()->set_rows(1);
      for (int64_t i = 0; i < slots; ++i) {
        s->mutable_reduced()->add_values(1.0f / static_cast<float>(slots));
      }
    }
    v1::DecodeStepResult reply;
    if (!stream_->Write(step) || !stream_->Read(&reply)) return false;
    EXPECT_EQ(reply.append().layers_size(), static_cast<int>(layers_.size()));
    EXPECT_EQ(reply.scores().layers_size(), static_cast<int>(layers_.size()));
    for (const v1::LayerChange& c : reply.scores().layers()) {
      layers_.at(c.layer()) = LayerState{c.version(), c.resident()};
      evicted_ += c.evicted_positions_size();
    }
    ++position_;
    return true;
  }

  // Reads once more: the server ends the stream (no reply is due).
  bool ReadExpectingEnd() {
    v1::DecodeStepResult reply;
    return stream_->Read(&reply);
  }

  grpc::Status Close() {
    stream_->WritesDone();
    return FinishWithoutClosing();
  }
  grpc::Status FinishWithoutClosing() {
    finished_ = true;
    return stream_->Finish();
  }

  int64_t steps() const { return position_; }
  int64_t evicted() const { return evicted_; }

 private:
  const std::string session_id_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::DecodeStep, v1::DecodeStepResult>>
      stream_;
  std::vector<LayerState> layers_;
  int64_t position_ = 0;
  int64_t evicted_ = 0;
  bool finished_ = false;
};

v1::CreateSessionRequest H2OSession(int64_t budget_tokens) {
  v1::CreateSessionRequest req;
  req.set_layout("proc");
  req.set_policy("h2o");
  (*req.mutable_policy_params())["recent"] = "2";
  req.mutable_budget()->set_tokens(budget_tokens);
  return req;
}

std::shared_ptr<grpc::Channel> Channel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        grpc::InsecureChannelCredentials()) {
  grpc::ChannelArguments args;
  // Reconnect promptly once a restarted server listens again (gRPC's
  // default backoff starts at 1 s and grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return grpc::CreateCustomChannel(address, std::move(credentials), args);
}

// A context for a unary call that must not hang the test.
std::unique_ptr<grpc::ClientContext> Context(bool wait_for_ready = false) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + kPatience));
  ctx->set_wait_for_ready(wait_for_ready);
  return ctx;
}

grpc::Status GetServerInfo(v1::KvKeep::Stub& stub,
                           v1::ServerInfo* info = nullptr,
                           bool wait_for_ready = false) {
  v1::ServerInfo ignored;
  return stub.GetServerInfo(Context(wait_for_ready).get(), {},
                            info != nullptr ? info : &ignored);
}

std::string Describe(const grpc::Status& s) {
  return absl::StrCat("code ", s.error_code(), ": ", s.error_message());
}

class KvkeepdProcessTest : public ::testing::Test {
 protected:
  struct Started {
    Child* child;
    std::string address;  // host:port from its listening line
  };

  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "kvkeepd_process_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << strerror(errno);
    dir_ = pattern;
  }

  void TearDown() override {
    children_.clear();  // SIGKILLs and reaps any still running
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  absl::StatusOr<Child*> Spawn(const std::vector<std::string>& argv) {
    absl::StatusOr<std::unique_ptr<Child>> child = Child::Spawn(argv);
    if (!child.ok()) return child.status();
    children_.push_back(*std::move(child));
    return children_.back().get();
  }

  // Starts kvkeepd with the test layout (unless `args` name a --config) and
  // waits for its listening line.
  absl::StatusOr<Started> StartKvkeepd(std::vector<std::string> args) {
    std::vector<std::string> argv = {KVKEEPD_BINARY, "--self_check=false"};
    bool has_listen = false;
    bool has_metrics = false;
    bool has_config = false;
    for (const std::string& a : args) {
      has_listen |= absl::StartsWith(a, "--listen=");
      has_metrics |= absl::StartsWith(a, "--metrics_listen=");
      has_config |= absl::StartsWith(a, "--config=");
    }
    if (!has_listen) argv.push_back("--listen=127.0.0.1:0");
    if (!has_metrics) argv.push_back("--metrics_listen=127.0.0.1:0");
    if (!has_config) {
      argv.push_back("--config=" + WriteFile("layout.json", ConfigJson()));
    }
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<Child*> child = Spawn(argv);
    if (!child.ok()) return child.status();
    std::optional<std::string> line =
        (*child)->out().WaitFor(kListenPrefix, kPatience);
    if (!line.has_value()) {
      return absl::UnavailableError(absl::StrCat(
          "kvkeepd printed no listening line:\n", (*child)->Output()));
    }
    return Started{*child, line->substr(kListenPrefix.size())};
  }

  // kvkeepd with `flag` exits 2 before serving, saying `fragment` on stderr.
  void ExpectStartupRefused(const std::string& flag,
                            const std::string& fragment) {
    absl::StatusOr<Child*> child =
        Spawn({KVKEEPD_BINARY, "--self_check=false", "--listen=127.0.0.1:0",
               "--metrics_listen=127.0.0.1:0", flag});
    ASSERT_TRUE(child.ok()) << child.status();
    absl::StatusOr<int> status = (*child)->Wait(kPatience);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2)
        << DescribeWaitStatus(*status) << (*child)->Output();
    EXPECT_THAT((*child)->err().AllLines(kPatience),
                ::testing::Contains(HasSubstr(fragment)));
  }

  // SIGTERM or SIGINT: the child drains, says so, and exits 0.
  void ExpectCleanExit(Child& child) {
    absl::StatusOr<int> status = child.Wait(kPatience);
    ASSERT_TRUE(status.ok()) << status.status() << child.Output();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
        << DescribeWaitStatus(*status) << child.Output();
    const std::vector<std::string> lines = child.out().AllLines(kPatience);
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(), "kvkeepd: stopped") << child.Output();
  }

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Child>> children_;
};

TEST_F(KvkeepdProcessTest, PrintsTheGrpcAddressThenTheMetricsAddress) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  std::optional<std::string> ready =
      kvkeepd->child->out().WaitFor("kvkeepd: ready", kPatience);
  ASSERT_TRUE(ready.has_value()) << kvkeepd->child->Output();

  // The documented start-up: layout lines, then the bound gRPC address on
  // one line and the metrics address on the next, before any other address.
  const std::vector<std::string> lines =
      absl::StrSplit(kvkeepd->child->out().Text(), '\n');
  size_t grpc_line = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    if (absl::StartsWith(lines[i], kListenPrefix)) {
      grpc_line = i;
      break;
    }
    EXPECT_THAT(lines[i], StartsWith("kvkeepd: layout 'proc'"));
  }
  ASSERT_LT(grpc_line + 1, lines.size()) << kvkeepd->child->Output();
  // The metrics URL with the port bound (0 was asked for), and serving.
  ASSERT_THAT(lines[grpc_line + 1],
              StartsWith(absl::StrCat(kMetricsPrefix, "127.0.0.1:")));
  const std::string metrics_address(absl::StripSuffix(
      absl::StripPrefix(lines[grpc_line + 1], kMetricsPrefix), "/metrics"));
  EXPECT_FALSE(absl::EndsWith(metrics_address, ":0")) << metrics_address;
  absl::StatusOr<std::string> scrape =
      metrics_testing::HttpGet(metrics_address, "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_THAT(*scrape, HasSubstr("kvkeep_build_info{version=\""));
  // Then the data socket incoming transfers use: listen's host, a port of
  // its own (docs/transfer.md).
  ASSERT_LT(grpc_line + 2, lines.size()) << kvkeepd->child->Output();
  constexpr absl::string_view kDataPrefix =
      "kvkeepd: transfer data socket on 127.0.0.1:";
  ASSERT_THAT(lines[grpc_line + 2], StartsWith(kDataPrefix));
  int data_port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(lines[grpc_line + 2].substr(kDataPrefix.size()),
                               &data_port));
  EXPECT_GT(data_port, 0);

  // HOST:PORT with the port bound (not the 0 asked for), and serving.
  const size_t colon = kvkeepd->address.rfind(':');
  ASSERT_NE(colon, std::string::npos) << kvkeepd->address;
  EXPECT_EQ(kvkeepd->address.substr(0, colon), "127.0.0.1");
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(kvkeepd->address.substr(colon + 1), &port))
      << kvkeepd->address;
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::ServerInfo info;
  const grpc::Status s = GetServerInfo(*stub, &info);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_EQ(info.layouts_size(), 1);
  EXPECT_EQ(info.layouts(0).name(), "proc");
  EXPECT_EQ(info.layouts(0).dtype(), v1::DTYPE_F32);
  EXPECT_EQ(info.pools(0).capacity_pages(), 64);
}

// Typos in a config file stop kvkeepd before it serves, naming the key.
TEST_F(KvkeepdProcessTest, UnknownConfigKeyExitsNonZeroNamingIt) {
  struct Case {
    std::string unknown_key;
    std::string json;
  };
  const std::vector<Case> cases = {
      {"drain_secs", ConfigJson(R"(, "drain_secs": 3)")},
      {"max_sesions", ConfigJson(R"(, "limits": {"max_sesions": 3})")},
      {"pool_size", R"({"layouts": [{"name": "x", "num_layers": 1,
                       "kv_heads": 1, "query_heads": 1, "head_dim": 8,
                       "dtype": "f32", "page_tokens": 4, "pool_size": 8}]})"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.unknown_key);
    const std::string path = WriteFile(c.unknown_key + ".json", c.json);
    absl::StatusOr<Child*> child =
        Spawn({KVKEEPD_BINARY, "--self_check=false", "--listen=127.0.0.1:0",
               "--metrics_listen=127.0.0.1:0", "--config=" + path});
    ASSERT_TRUE(child.ok()) << child.status();
    absl::StatusOr<int> status = (*child)->Wait(kPatience);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0)
        << DescribeWaitStatus(*status);
    const std::string err =
        absl::StrJoin((*child)->err().AllLines(kPatience), "\n");
    EXPECT_THAT(err,
                HasSubstr(absl::StrCat("unknown key '", c.unknown_key, "'")));
    EXPECT_THAT(err, HasSubstr(path));  // which file
    EXPECT_FALSE((*child)
                     ->out()
                     .WaitFor(kListenPrefix, absl::ZeroDuration())
                     .has_value())
        << "it must not serve with a bad config";
  }
}

// A default policy nobody can create stops start-up (exit 2), even when no
// self-check would have tried it, instead of failing the first session.
TEST_F(KvkeepdProcessTest, ADefaultPolicyTypoStopsStartUp) {
  ExpectStartupRefused("--default_policy=h3o", "unknown policy 'h3o'");
}

// The start-up self-check's session is outside the tenant quotas: a quota
// far smaller than the self-check's session (about 37 KiB here) still lets
// kvkeepd start and serve. A quota that cannot hold one token of a layout
// is a configuration error (exit 2) naming the key.
TEST_F(KvkeepdProcessTest, ASmallTenantQuotaDoesNotStopTheSelfCheck) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd(
      {"--self_check=true", "--pool_pages=1024", "--max_bytes_per_tenant=4096",
       "--max_sessions_per_tenant=1"});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  EXPECT_TRUE(kvkeepd->child->out()
                  .WaitFor("kvkeepd: self-check: ", kPatience)
                  .has_value())
      << kvkeepd->child->Output();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::CreateSessionResponse created;
  grpc::Status s =
      stub->CreateSession(Context().get(), H2OSession(6), &created);
  EXPECT_TRUE(s.ok()) << Describe(s);
  ExpectStartupRefused("--max_bytes_per_tenant=1000",
                       "limits.max_bytes_per_tenant (1000 bytes) cannot hold "
                       "one token of layout 'demo'");
  ExpectStartupRefused("--max_sessions=0", "limits.max_sessions must be >= 1");
}

TEST_F(KvkeepdProcessTest, TenantTokensAreRequiredWhenConfigured) {
  const std::string config = WriteFile(
      "tenants.json",
      ConfigJson(R"(, "tenants": [{"name": "alice", "token": "tok-alice"},
                                  {"name": "bob", "token": "tok-bob"}])"));
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--config=" + config});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  auto as = [](const std::string& token) {
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    return ctx;
  };

  v1::ServerInfo info;
  grpc::Status s = stub->GetServerInfo(as("").get(), {}, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  v1::CreateSessionResponse created;
  s = stub->CreateSession(as("").get(), H2OSession(8), &created);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  s = stub->CreateSession(as("tok-mallory").get(), H2OSession(8), &created);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  s = stub->CreateSession(as("tok-alice").get(), H2OSession(8), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::GetSessionStatsRequest stats_req;
  stats_req.set_session_id(created.session_id());
  v1::SessionStats stats;
  s = stub->GetSessionStats(as("tok-alice").get(), stats_req, &stats);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(stats.tenant(), "alice");
  s = stub->GetSessionStats(as("tok-bob").get(), stats_req, &stats);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  s = stub->GetSessionStats(as("").get(), stats_req, &stats);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
}

// Tokens from --tenants_file (a mounted Secret in Kubernetes) replace the
// config's; a bad file stops start-up with its name in the message.
TEST_F(KvkeepdProcessTest, TenantsFileReplacesTheConfigsTenants) {
  const std::string config = WriteFile(
      "with_tenants.json",
      ConfigJson(R"(, "tenants": [{"name": "old", "token": "tok-old"}])"));
  const std::string tenants =
      WriteFile("secret.json", R"([{"name": "carol", "token": "tok-carol"}])");
  absl::StatusOr<Started> kvkeepd =
      StartKvkeepd({"--config=" + config, "--tenants_file=" + tenants});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  for (const auto& [token, code] :
       std::vector<std::pair<std::string, grpc::StatusCode>>{
           {"tok-carol", grpc::StatusCode::OK},
           {"tok-old", grpc::StatusCode::UNAUTHENTICATED},
           {"", grpc::StatusCode::UNAUTHENTICATED}}) {
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    v1::ServerInfo info;
    const grpc::Status s = stub->GetServerInfo(ctx.get(), {}, &info);
    EXPECT_EQ(s.error_code(), code) << token << ": " << Describe(s);
  }

  const std::string bad = WriteFile("bad_secret.json", R"([{"name": "x"}])");
  ExpectStartupRefused("--tenants_file=" + bad, "bad_secret.json");
}

// --log_events: one structured line per session create and close and per
// failed call, on stderr; without it (the default) those lines stay away.
TEST_F(KvkeepdProcessTest, LogEventsWritesOneLinePerCreateCloseAndError) {
  absl::StatusOr<Started> quiet = StartKvkeepd({});
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  absl::StatusOr<Started> loud = StartKvkeepd({"--log_events"});
  ASSERT_TRUE(loud.ok()) << loud.status();
  std::string loud_session;
  for (Started* kvkeepd : {&*quiet, &*loud}) {
    // The stub (and its connection) goes before the signal: an open idle
    // connection holds kvkeepd's exit for seconds (see the drain tests).
    std::unique_ptr<v1::KvKeep::Stub> stub =
        v1::KvKeep::NewStub(Channel(kvkeepd->address));
    v1::CreateSessionResponse created;
    grpc::Status s =
        stub->CreateSession(Context().get(), H2OSession(8), &created);
    ASSERT_TRUE(s.ok()) << Describe(s);
    loud_session = created.session_id();
    v1::CloseSessionRequest close;
    close.set_session_id(created.session_id());
    v1::CloseSessionResponse closed;
    s = stub->CloseSession(Context().get(), close, &closed);
    ASSERT_TRUE(s.ok()) << Describe(s);
    s = stub->CloseSession(Context().get(), close, &closed);  // now unknown
    ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
    stub.reset();
    kvkeepd->child->Signal(SIGTERM);
    ExpectCleanExit(*kvkeepd->child);
  }
  auto events = [](const Child& child) {
    std::vector<std::string> lines;
    for (const std::string& line : child.err().AllLines(kPatience)) {
      if (line.find(" event=") != std::string::npos) lines.push_back(line);
    }
    return lines;
  };
  EXPECT_THAT(events(*quiet->child), ::testing::IsEmpty());
  const std::vector<std::string> lines = events(*loud->child);
  ASSERT_EQ(lines.size(), 3u) << loud->child->Output();
  EXPECT_THAT(lines[0], ::testing::StartsWith("ts="));
  EXPECT_THAT(lines[0], ::testing::HasSubstr("event=session_create session=" +
                                             loud_session));
  EXPECT_THAT(lines[0], ::testing::HasSubstr("policy=h2o"));
  EXPECT_THAT(lines[1], ::testing::HasSubstr("event=session_close session=" +
                                             loud_session));
  EXPECT_THAT(lines[2], ::testing::HasSubstr(
                            "event=error method=CloseSession code=NOT_FOUND"));
  EXPECT_THAT(lines[2], ::testing::HasSubstr(loud_session));
}

// SIGTERM and SIGINT: the server stops taking calls but lets the open
// Decode stream go on to its end, then exits 0 at once (well before its
// drain deadline, which is set longer than kPatience so that waiting for the
// deadline would fail the test).
class KvkeepdSignalTest : public KvkeepdProcessTest,
                          public ::testing::WithParamInterface<int> {};

TEST_P(KvkeepdSignalTest, DrainsAnOpenDecodeStreamThenExitsZero) {
  const int sig = GetParam();
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--drain_seconds=600"});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::CreateSessionResponse created;
  grpc::Status s =
      stub->CreateSession(Context().get(), H2OSession(6), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);

  Decoder decoder(*stub, created);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(decoder.Step());
  kvkeepd->child->Signal(sig);
  ASSERT_TRUE(kvkeepd->child->out()
                  .WaitFor(absl::StrCat("kvkeepd: signal ", sig, ": draining"),
                           kPatience)
                  .has_value())
      << kvkeepd->child->Output();

  // Draining: new connections are refused (UNAVAILABLE) once Shutdown has
  // closed the listener. Before that, for a moment, a new call may still be
  // served (kvkeepd prints the line above just before it calls Shutdown), or
  // be CANCELLED by gRPC (a connection accepted as Shutdown began; observed:
  // a few calls within ~2 ms).
  grpc::Status refused;
  const absl::Time give_up = absl::Now() + kPatience;
  do {
    auto fresh = v1::KvKeep::NewStub(Channel(kvkeepd->address));
    refused = GetServerInfo(*fresh);
    ASSERT_THAT(refused.error_code(),
                AnyOf(grpc::StatusCode::OK, grpc::StatusCode::CANCELLED,
                      grpc::StatusCode::UNAVAILABLE))
        << "a new call while draining: " << Describe(refused);
  } while (refused.error_code() != grpc::StatusCode::UNAVAILABLE &&
           absl::Now() < give_up);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
      << Describe(refused);
  // ... while the open stream goes on stepping (and evicting).
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(decoder.Step()) << "step " << i;
  EXPECT_EQ(decoder.evicted(), kLayers * (decoder.steps() - 6));

  // The client ends its stream: OK, and the server has nothing left.
  s = decoder.Close();
  EXPECT_TRUE(s.ok()) << Describe(s);
  ExpectCleanExit(*kvkeepd->child);
}

INSTANTIATE_TEST_SUITE_P(SigtermAndSigint, KvkeepdSignalTest,
                         ::testing::Values(SIGTERM, SIGINT),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGTERM ? "Sigterm"
                                                                    : "Sigint");
                         });

// A stream whose client stays silent past the drain deadline is cut off:
// the client's read ends (it does not hang) and kvkeepd still exits 0.
TEST_F(KvkeepdProcessTest, SigtermEndsAnIdleStreamAtTheDrainDeadline) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--drain_seconds=1"});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::CreateSessionResponse created;
  grpc::Status s =
      stub->CreateSession(Context().get(), H2OSession(6), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Decoder decoder(*stub, created);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(decoder.Step());

  kvkeepd->child->Signal(SIGTERM);
  EXPECT_FALSE(decoder.ReadExpectingEnd());
  s = decoder.FinishWithoutClosing();
  // At the deadline gRPC cancels the calls still open
  // (grpc_server_cancel_all_calls); the client's stream ends with
  // UNAVAILABLE, "Cancelling all calls" (gRPC 1.51), not CANCELLED, so a
  // worker can treat it like any other lost server.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
  RecordProperty("idle_stream_status", Describe(s));
  ExpectCleanExit(*kvkeepd->child);
}

// A client sees UNAVAILABLE while kvkeepd is gone and works again, on the
// same channel, once a new kvkeepd listens on the same port. Sessions live
// in memory: the old one is gone.
TEST_F(KvkeepdProcessTest, UnavailableWhileGoneThenServedByARestart) {
  // The client's idle connection holds up the server's exit until the
  // client's side of it reads the GOAWAY (an idle gRPC channel polls only
  // every few seconds) or the drain deadline passes: 2 s keeps this short.
  absl::StatusOr<Started> first = StartKvkeepd({"--drain_seconds=2"});
  ASSERT_TRUE(first.ok()) << first.status();
  auto stub = v1::KvKeep::NewStub(Channel(first->address));
  ASSERT_TRUE(GetServerInfo(*stub).ok());
  v1::CreateSessionResponse created;
  grpc::Status s =
      stub->CreateSession(Context().get(), H2OSession(6), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);
  {
    Decoder decoder(*stub, created);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(decoder.Step());
    ASSERT_TRUE(decoder.Close().ok());
  }

  first->child->Signal(SIGTERM);
  ExpectCleanExit(*first->child);
  for (int i = 0; i < 3; ++i) {  // fails fast, every time, while it is gone
    s = GetServerInfo(*stub);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
  }
  v1::CreateSessionResponse ignored;
  s = stub->CreateSession(Context().get(), H2OSession(6), &ignored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);

  absl::StatusOr<Started> second = StartKvkeepd({"--listen=" + first->address});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->address, first->address);
  // wait_for_ready: the channel may still be in reconnect backoff.
  s = GetServerInfo(*stub, nullptr, /*wait_for_ready=*/true);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::GetSessionStatsRequest old;
  old.set_session_id(created.session_id());
  v1::SessionStats stats;
  s = stub->GetSessionStats(Context().get(), old, &stats);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  s = stub->CreateSession(Context().get(), H2OSession(6), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Decoder decoder(*stub, created);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(decoder.Step());
  EXPECT_TRUE(decoder.Close().ok());
}

// TLS from a certificate made here with openssl (SAN 127.0.0.1 and
// localhost): a client trusting it is served; a plaintext client and one
// trusting another certificate are not.
class KvkeepdTlsTest : public KvkeepdProcessTest {
 protected:
  // Writes NAME.pem and NAME.key: a self-signed P-256 certificate.
  absl::Status MakeCertificate(const std::string& name) {
    const std::string cert = (dir_ / (name + ".pem")).string();
    const std::string key = (dir_ / (name + ".key")).string();
    absl::StatusOr<Child*> openssl =
        Spawn({kOpenssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
               "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
               "/CN=localhost", "-addext",
               "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key,
               "-out", cert});
    if (!openssl.ok()) return openssl.status();
    absl::StatusOr<int> status = (*openssl)->Wait(kPatience);
    if (!status.ok()) return status.status();
    if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      return absl::InternalError(absl::StrCat(
          "openssl: ", DescribeWaitStatus(*status), (*openssl)->Output()));
    }
    return absl::OkStatus();
  }

  std::string Read(const std::string& name) {
    std::ifstream in(dir_ / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  void SetUp() override {
    KvkeepdProcessTest::SetUp();
    if (access(kOpenssl, X_OK) != 0) {
      GTEST_SKIP() << kOpenssl << " not found: cannot make a test certificate";
    }
    ASSERT_TRUE(MakeCertificate("server").ok());
  }

  static constexpr char kOpenssl[] = "/usr/bin/openssl";
};

TEST_F(KvkeepdTlsTest, ServesClientsThatTrustItsCertificateOnly) {
  ASSERT_TRUE(MakeCertificate("other").ok());
  absl::StatusOr<Started> kvkeepd =
      StartKvkeepd({"--tls_cert=" + (dir_ / "server.pem").string(),
                    "--tls_key=" + (dir_ / "server.key").string()});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();

  grpc::SslCredentialsOptions trusting;
  trusting.pem_root_certs = Read("server.pem");
  auto stub = v1::KvKeep::NewStub(
      Channel(kvkeepd->address, grpc::SslCredentials(trusting)));
  v1::ServerInfo info;
  grpc::Status s = GetServerInfo(*stub, &info);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(info.layouts(0).name(), "proc");
  v1::CreateSessionResponse created;
  s = stub->CreateSession(Context().get(), H2OSession(6), &created);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Decoder decoder(*stub, created);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(decoder.Step());
  EXPECT_TRUE(decoder.Close().ok());

  auto plaintext = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  s = GetServerInfo(*plaintext);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);

  grpc::SslCredentialsOptions wrong_root;
  wrong_root.pem_root_certs = Read("other.pem");
  auto mistrusting = v1::KvKeep::NewStub(
      Channel(kvkeepd->address, grpc::SslCredentials(wrong_root)));
  s = GetServerInfo(*mistrusting);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
}

// --tls_client_ca: only clients presenting a certificate that CA signed
// get in (the self-signed client certificate is its own CA here).
TEST_F(KvkeepdTlsTest, RequiresAClientCertificateWhenAClientCaIsSet) {
  ASSERT_TRUE(MakeCertificate("client").ok());
  ASSERT_TRUE(MakeCertificate("stranger").ok());
  absl::StatusOr<Started> kvkeepd =
      StartKvkeepd({"--tls_cert=" + (dir_ / "server.pem").string(),
                    "--tls_key=" + (dir_ / "server.key").string(),
                    "--tls_client_ca=" + (dir_ / "client.pem").string()});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();

  auto client_with = [&](const std::string& name) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = Read("server.pem");
    if (!name.empty()) {
      options.pem_private_key = Read(name + ".key");
      options.pem_cert_chain = Read(name + ".pem");
    }
    return v1::KvKeep::NewStub(
        Channel(kvkeepd->address, grpc::SslCredentials(options)));
  };
  grpc::Status s = GetServerInfo(*client_with("client"));
  EXPECT_TRUE(s.ok()) << Describe(s);
  s = GetServerInfo(*client_with(""));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
  s = GetServerInfo(*client_with("stranger"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
}

// --device: where the pools live. A device this machine does not have is a
// start-up error naming it; auto falls back to host memory without a GPU.
TEST_F(KvkeepdProcessTest, ADeviceThisMachineLacksStopsStartUp) {
  ExpectStartupRefused("--device=cuda:7", "cuda:7");
  ExpectStartupRefused("--device=gpu0", "not one of host, auto, cuda, cuda:N");
}

TEST_F(KvkeepdProcessTest, AutoDevicePicksAGpuWhenThereIsOneElseHost) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--device=auto"});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::ServerInfo info;
  ASSERT_TRUE(GetServerInfo(*stub, &info).ok());
  EXPECT_EQ(info.backend(), CudaDeviceCount() > 0 ? "cuda:0" : "host");
}

// MapPool: this test process is the co-located worker. It maps the host
// pool's shared memory read-only and finds, at the offsets the block tables
// give, exactly the bytes it sent, after evictions have compacted the slots.
TEST_F(KvkeepdProcessTest, AWorkerMapsTheSharedPoolAndReadsTheStoredBytes) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--share_pools"});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::CreateSessionResponse session;
  ASSERT_TRUE(
      stub->CreateSession(Context().get(), H2OSession(6), &session).ok());
  {
    Decoder decoder(*stub, session);
    for (int i = 0; i < 13; ++i) ASSERT_TRUE(decoder.Step());
    ASSERT_GT(decoder.evicted(), 0);  // slots were compacted
    ASSERT_TRUE(decoder.Close().ok());
  }
  v1::MapPoolRequest req;
  req.set_session_id(session.session_id());
  v1::MapPoolResponse pool;
  grpc::Status status = stub->MapPool(Context().get(), req, &pool);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(pool.device(), "host");
  EXPECT_EQ(pool.server_pid(), kvkeepd->child->pid());
  EXPECT_EQ(pool.layout().name(), "proc");
  EXPECT_EQ(pool.arena_bytes(),
            pool.capacity_pages() * pool.layout().page_bytes());
  ASSERT_EQ(pool.handle_case(), v1::MapPoolResponse::kShmName);
  ASSERT_EQ(pool.tables_size(), kLayers);

  const int fd = shm_open(pool.shm_name().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0) << pool.shm_name() << ": " << strerror(errno);
  void* mapped = mmap(nullptr, static_cast<size_t>(pool.arena_bytes()),
                      PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(mapped, MAP_FAILED) << strerror(errno);
  const char* arena = static_cast<const char*>(mapped);
  const int64_t token_bytes = kKvHeads * kHeadDim * sizeof(float);
  const int64_t page_tokens = pool.layout().page_tokens();
  for (const v1::BlockTable& table : pool.tables()) {
    ASSERT_EQ(table.positions_size(), 6);  // the budget
    for (int s = 0; s < table.positions_size(); ++s) {
      const int64_t page = table.pages(s / page_tokens);
      const int64_t key_at =
          page * pool.layout().page_bytes() + (s % page_tokens) * token_bytes;
      const int64_t value_at = key_at + page_tokens * token_bytes;
      const int64_t position = table.positions(s);
      EXPECT_EQ(std::string(arena + key_at, token_bytes),
                TokenBytes(table.layer(), position, 1.0f))
          << "layer " << table.layer() << " slot " << s;
      EXPECT_EQ(std::string(arena + value_at, token_bytes),
                TokenBytes(table.layer(), position, -1.0f))
          << "layer " << table.layer() << " slot " << s;
    }
  }
  munmap(mapped, static_cast<size_t>(pool.arena_bytes()));

  // Bad requests: no layout nor session, an unknown layout.
  v1::MapPoolResponse ignored;
  EXPECT_EQ(stub->MapPool(Context().get(), {}, &ignored).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::MapPoolRequest unknown;
  unknown.set_layout("nope");
  EXPECT_EQ(stub->MapPool(Context().get(), unknown, &ignored).error_code(),
            grpc::StatusCode::NOT_FOUND);

  // The shared memory goes with the process.
  kvkeepd->child->Signal(SIGTERM);
  ASSERT_TRUE(kvkeepd->child->Wait(kPatience).ok());
  EXPECT_LT(shm_open(pool.shm_name().c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

// A kvkeepd killed with SIGKILL leaves its shared pools in /dev/shm; the
// next kvkeepd with share_pools removes those whose process is gone.
//
// Every kvkeepd with share_pools sweeps all of /dev/shm at start, and ctest
// runs other such kvkeepds (the lm and Python tests) beside this one. One of
// them may remove the stale pool first; then this kvkeepd has nothing to
// remove, and the attempt proves nothing either way. So the test tries
// again, and passes only on an attempt where its own kvkeepd removed the
// pool. It fails when the pool outlives a kvkeepd's start.
TEST_F(KvkeepdProcessTest, SharedPoolsOfKilledProcessesAreRemovedAtStart) {
  constexpr int kAttempts = 5;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    const pid_t dead = fork();
    if (dead == 0) _exit(0);
    int ignored = 0;
    waitpid(dead, &ignored, 0);
    const std::string stale =
        absl::StrCat("/dev/shm/kvkeep-", dead, "-0badf00d-0");
    std::ofstream(stale) << std::string(4096, 'x');
    ASSERT_TRUE(std::filesystem::exists(stale));
    // The sweep runs before the listening line, which StartKvkeepd awaits.
    absl::StatusOr<Started> kvkeepd = StartKvkeepd({"--share_pools"});
    ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
    ASSERT_FALSE(std::filesystem::exists(stale))
        << "attempt " << attempt << ": " << kvkeepd->child->Output();
    if (absl::StrContains(kvkeepd->child->Output(), "kvkeepd: removed ")) {
      return;
    }
    kvkeepd->child->Signal(SIGTERM);
    ASSERT_TRUE(kvkeepd->child->Wait(kPatience).ok());
  }
  ADD_FAILURE() << "in " << kAttempts << " attempts, another kvkeepd always "
                << "removed the stale pool first";
}

TEST_F(KvkeepdProcessTest, MapPoolIsRefusedUnlessPoolSharingIsOn) {
  absl::StatusOr<Started> kvkeepd = StartKvkeepd({});
  ASSERT_TRUE(kvkeepd.ok()) << kvkeepd.status();
  auto stub = v1::KvKeep::NewStub(Channel(kvkeepd->address));
  v1::MapPoolRequest req;
  req.set_layout("proc");
  v1::MapPoolResponse ignored;
  const grpc::Status status = stub->MapPool(Context().get(), req, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--share_pools"));
}

}  // namespace
}  // namespace kvkeep
