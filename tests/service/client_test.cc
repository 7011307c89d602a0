// The C++ client library (services/client) against a real KvKeepService on
// a loopback port, and the kvkeep CLI against a kvkeepd process.
//
// Covers every client method; prompt chunking under the server's message
// limit; byte-exact KV round trips for f32, f16 and bf16; the block-table
// mirror against GetBlockTables after every decode step of every policy
// family; errors as absl::Status with the server's codes; which calls are
// retried on UNAVAILABLE (and that a retried idempotent call succeeds once
// the server is up); and `kvkeep info/sessions/stats/close/demo --json`.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/client/kvkeep_client.h"
#include "services/common/convert.h"
#include "services/common/grpc_status.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using client::BlockTableMirror;
using client::ClientOptions;
using client::DecodeStream;
using client::KvKeepClient;
using client::KvTokens;
using client::Session;
using ::testing::Contains;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

// The server's message limit in these tests: small, so a modest prompt
// needs several AppendPrefill messages and ReadKv several chunks per layer.
constexpr int64_t kMaxMessageBytes = 16 << 10;

ModelLayout MakeLayout(std::string name, DType dtype, int32_t layers = 3,
                       int32_t kv_heads = 2, int32_t head_dim = 8) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = layers;
  l.kv_heads = kv_heads;
  l.query_heads = 2 * kv_heads;
  l.head_dim = head_dim;
  l.dtype = dtype;
  l.page_tokens = 4;
  return l;
}

StoreOptions TestStoreOptions() {
  StoreOptions o;
  o.pools = {
      {MakeLayout("f32", DType::kF32), 2048},
      {MakeLayout("f16", DType::kF16), 2048},
      {MakeLayout("bf16", DType::kBF16), 2048},
      // One token (4 layers x 2 x 8 heads x 128 x 4 bytes = 32 KiB) is
      // larger than a message.
      {MakeLayout("wide", DType::kF32, 4, 8, 128), 16},
      {MakeLayout("tiny", DType::kF32, 2), 6},  // exhausted quickly
  };
  return o;
}

// A free loopback port (nothing listens on it when this returns).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

using TestServer = testing::TestServer;

// A kvkeepd (KvKeepServer) on a loopback port, in-process: the test pools,
// small messages, `tenants` (none: no authentication) and, with `stand_in`,
// the service it makes over the store instead of kvkeep's. Null if it
// cannot start (port taken).
std::unique_ptr<TestServer> StartServer(
    std::vector<TenantToken> tenants = {}, int port = 0,
    std::function<grpc::Service*(CacheStore&)> stand_in = nullptr) {
  ServerConfig config = testing::TestServerConfig(TestStoreOptions().pools);
  config.listen = absl::StrCat("127.0.0.1:", port);
  config.max_message_bytes = kMaxMessageBytes;
  config.tenants = std::move(tenants);
  ServerHooks hooks;
  hooks.stand_in = std::move(stand_in);
  absl::StatusOr<std::unique_ptr<TestServer>> server =
      TestServer::Start(config, std::move(hooks));
  if (!server.ok()) return nullptr;
  return *std::move(server);
}

// Records on_retry calls: "Method#attempt".
class RetryLog {
 public:
  void Record(absl::string_view method, int attempt) {
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat(method, "#", attempt));
  }
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

KvKeepClient Connect(const std::string& address, int retries = 2,
                     std::shared_ptr<RetryLog> log = nullptr,
                     std::string token = "") {
  ClientOptions o;
  o.address = address;
  o.token = std::move(token);
  o.retries = retries;
  o.backoff = absl::Milliseconds(2);
  o.max_backoff = absl::Milliseconds(20);
  o.deadline = absl::Seconds(30);
  if (log != nullptr) {
    o.on_retry = [log](absl::string_view method, int attempt,
                       const absl::Status& status) {
      EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
      log->Record(method, attempt);
    };
  }
  absl::StatusOr<KvKeepClient> c = KvKeepClient::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

v1::CreateSessionRequest Request(const std::string& layout,
                                 const std::string& policy,
                                 std::map<std::string, std::string> params = {},
                                 int64_t budget = 16,
                                 std::vector<int64_t> per_layer = {}) {
  v1::CreateSessionRequest r;
  r.set_layout(layout);
  r.set_policy(policy);
  for (const auto& [k, v] : params) (*r.mutable_policy_params())[k] = v;
  r.mutable_budget()->set_tokens(budget);
  r.mutable_budget()->mutable_per_layer()->Add(per_layer.begin(),
                                               per_layer.end());
  return r;
}

int64_t TokenBytes(const v1::Layout& l) {
  return int64_t{l.kv_heads()} * l.head_dim() *
         (l.dtype() == v1::DTYPE_F32 ? 4 : 2);
}

// Tokens at `positions` with random bytes (every bit pattern: the store
// copies them and must give the same bytes back).
KvTokens RandomBytes(const v1::Layout& layout, std::vector<int64_t> positions,
                     std::mt19937& rng) {
  KvTokens t;
  t.positions = std::move(positions);
  const size_t bytes = t.positions.size() * TokenBytes(layout);
  t.layers.resize(layout.num_layers());
  for (client::LayerBytes& l : t.layers) {
    l.keys.resize(bytes);
    l.values.resize(bytes);
    for (char& c : l.keys) c = static_cast<char>(rng());
    for (char& c : l.values) c = static_cast<char>(rng());
  }
  return t;
}

// Tokens of float32 N(0, 1) keys and values (an f32 layout, for scoring).
KvTokens NormalF32(const v1::Layout& layout, std::vector<int64_t> positions,
                   std::mt19937& rng) {
  std::normal_distribution<float> normal;
  KvTokens t;
  t.positions = std::move(positions);
  const size_t floats =
      t.positions.size() * layout.kv_heads() * layout.head_dim();
  t.layers.resize(layout.num_layers());
  for (client::LayerBytes& l : t.layers) {
    for (std::string* s : {&l.keys, &l.values}) {
      s->resize(floats * 4);
      for (size_t i = 0; i < floats; ++i) {
        const float v = normal(rng);
        std::memcpy(s->data() + i * 4, &v, 4);
      }
    }
  }
  return t;
}

std::vector<int64_t> Positions(int64_t first, int64_t n, int64_t stride = 1) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = first + i * stride;
  return p;
}

// One head's attention row over n slots: positive, sums to 1.
std::vector<float> Row(int64_t n, std::mt19937& rng) {
  std::exponential_distribution<float> e(1.0f);
  std::vector<float> row(n);
  double sum = 0;
  for (float& x : row) sum += (x = e(rng) * e(rng));
  for (float& x : row) x = static_cast<float>(x / sum);
  return row;
}

// A layer's scores in `form` over n slots at `version`.
v1::LayerScores Scores(const std::string& form, const v1::Layout& layout,
                       int32_t layer, uint64_t version, int64_t n,
                       std::mt19937& rng, int32_t rows = 1) {
  const int32_t heads = layout.query_heads();
  std::vector<float> values;
  if (form == "queries") {
    std::normal_distribution<float> normal;
    values.resize(int64_t{rows} * heads * layout.head_dim());
    for (float& x : values) x = normal(rng);
    return client::QueryScores(layer, version, values, rows);
  }
  if (form == "per_head") {
    for (int32_t h = 0; h < heads * rows; ++h) {
      const std::vector<float> r = Row(n, rng);
      values.insert(values.end(), r.begin(), r.end());
    }
    return client::PerHeadScores(layer, version, values, rows);
  }
  values.assign(int64_t{rows} * n, 0.0f);
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < heads; ++h) {
      const std::vector<float> row = Row(n, rng);
      for (int64_t i = 0; i < n; ++i) values[r * n + i] += row[i];
    }
  }
  return client::ReducedScores(layer, version, values, rows);
}

// The mirror equals the store's tables, every layer, every field.
::testing::AssertionResult MirrorMatches(const BlockTableMirror& mirror,
                                         const Session& session) {
  absl::StatusOr<v1::GetBlockTablesResponse> tables = session.GetBlockTables();
  if (!tables.ok()) {
    return ::testing::AssertionFailure() << tables.status().ToString();
  }
  if (tables->tables_size() != mirror.num_layers()) {
    return ::testing::AssertionFailure()
           << tables->tables_size() << " tables, mirror has "
           << mirror.num_layers() << " layers";
  }
  for (int32_t l = 0; l < mirror.num_layers(); ++l) {
    const v1::BlockTable& want = tables->tables(l);
    const v1::BlockTable got = mirror.Table(l);
    if (got.version() != want.version() ||
        got.page_tokens() != want.page_tokens()) {
      return ::testing::AssertionFailure()
             << "layer " << l << ": version " << got.version() << " vs "
             << want.version() << " in the store";
    }
    auto same =
        [&](absl::string_view what, const auto& a,
            const auto& b) -> std::optional<::testing::AssertionResult> {
      if (a.size() != b.size()) {
        return ::testing::AssertionFailure()
               << "layer " << l << ": " << a.size() << " " << what
               << ", the store has " << b.size();
      }
      for (int i = 0; i < a.size(); ++i) {
        if (a[i] != b[i]) {
          return ::testing::AssertionFailure()
                 << "layer " << l << ": " << what << "[" << i << "] is " << a[i]
                 << ", the store's is " << b[i];
        }
      }
      return std::nullopt;
    };
    if (auto r = same("pages", got.pages(), want.pages())) return *r;
    if (auto r = same("positions", got.positions(), want.positions())) {
      return *r;
    }
    if (auto r = same("cache_positions", got.cache_positions(),
                      want.cache_positions())) {
      return *r;
    }
  }
  return ::testing::AssertionSuccess();
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer();
    ASSERT_NE(server_, nullptr);
    client_ = std::make_unique<KvKeepClient>(Connect(server_->address()));
  }

  Session Create(v1::CreateSessionRequest request) {
    absl::StatusOr<Session> s = client_->CreateSession(request);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<KvKeepClient> client_;
  std::mt19937 rng_{42};
};

// ---------------------------------------------------------------------------
// Calls

TEST_F(ClientTest, ServerInfoListsLayoutsPoliciesAndLimits) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "host");
  EXPECT_EQ(info->max_message_bytes(), kMaxMessageBytes);
  ASSERT_EQ(info->layouts_size(), 5);
  EXPECT_EQ(info->layouts(0).name(), "f32");
  EXPECT_EQ(info->layouts(0).dtype(), v1::DTYPE_F32);
  EXPECT_EQ(info->layouts(1).dtype(), v1::DTYPE_F16);
  EXPECT_EQ(info->layouts(2).dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(info->layouts(0).page_bytes(), 2 * 4 * 2 * 8 * 4);
  ASSERT_EQ(info->pools_size(), 5);
  EXPECT_EQ(info->pools(0).capacity_pages(), 2048);
  EXPECT_EQ(info->pools(0).used_pages(), 0);
  EXPECT_THAT(info->policies(), Contains("h2o"));
  EXPECT_THAT(info->policies(), Contains("snapkv"));
}

TEST_F(ClientTest, SessionLifecycle) {
  Session s = Create(Request("f32", "h2o", {{"recent", "2"}}, 16, {8, 12, 16}));
  EXPECT_EQ(s.id().size(), 16u);
  EXPECT_EQ(s.layout().name(), "f32");
  EXPECT_EQ(s.layout().num_layers(), 3);
  EXPECT_THAT(s.layer_budgets(), ElementsAreArray({8, 12, 16}));
  EXPECT_EQ(s.max_message_bytes(), kMaxMessageBytes);

  absl::StatusOr<v1::StepResult> appended =
      s.Append(RandomBytes(s.layout(), Positions(0, 6), rng_));
  ASSERT_TRUE(appended.ok()) << appended.status();
  ASSERT_EQ(appended->layers_size(), 3);
  EXPECT_EQ(appended->layers(0).resident(), 6);
  EXPECT_EQ(appended->layers(0).pages_added_size(), 2);  // 4 tokens a page

  absl::StatusOr<v1::SessionStats> stats = s.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->session_id(), s.id());
  EXPECT_EQ(stats->policy(), "h2o");
  EXPECT_EQ(stats->resident_tokens(), 18);
  EXPECT_EQ(stats->pages(), 6);
  EXPECT_THAT(stats->layer_budget(), ElementsAreArray({8, 12, 16}));

  absl::StatusOr<std::vector<v1::SessionStats>> list = client_->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].session_id(), s.id());

  // A second handle on the same session, from its id.
  absl::StatusOr<Session> opened = client_->OpenSession(s.id());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->layout().SerializeAsString(),
            s.layout().SerializeAsString());
  EXPECT_THAT(opened->layer_budgets(), ElementsAreArray({8, 12, 16}));
  absl::StatusOr<v1::SessionStats> via_client =
      client_->GetSessionStats(s.id());
  ASSERT_TRUE(via_client.ok());
  EXPECT_EQ(via_client->resident_tokens(), 18);

  absl::StatusOr<int64_t> freed = opened->Close();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 6);
  EXPECT_EQ(s.Stats().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.Close().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->CloseSession(s.id()).status().code(),
            absl::StatusCode::kNotFound);
  list = client_->ListSessions();
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(list->empty());
  EXPECT_EQ(server_->store().Layouts()[0].pool.used_pages, 0);
}

// This server does not share its pools: MapPool says so, and how to.
// (Mapping a shared pool: kvkeepd_process_test, the Python client.)
TEST_F(ClientTest, MapPoolNamesTheFlagWhenPoolsAreNotShared) {
  Session s = Create(Request("f32", "h2o", {{"recent", "2"}}, 16));
  absl::StatusOr<v1::MapPoolResponse> pool = s.MapPool();
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(pool.status().message(), HasSubstr("--share_pools"));
}

TEST_F(ClientTest, HandlesOutliveTheirClient) {
  std::optional<Session> s;
  {
    KvKeepClient other = Connect(server_->address());
    absl::StatusOr<Session> created =
        other.CreateSession(Request("f16", "full"));
    ASSERT_TRUE(created.ok()) << created.status();
    s = *std::move(created);
  }
  ASSERT_TRUE(s->Append(RandomBytes(s->layout(), {5}, rng_)).ok());
  absl::StatusOr<int64_t> freed = s->Close();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 3);
}

TEST_F(ClientTest, IdempotencyKeyReturnsTheFirstSession) {
  v1::CreateSessionRequest r = Request("f32", "window");
  r.set_idempotency_key("worker-7/seq-1");
  Session a = Create(r);
  Session b = Create(r);
  EXPECT_EQ(a.id(), b.id());
  r.set_idempotency_key("worker-7/seq-2");
  EXPECT_NE(Create(r).id(), a.id());
  EXPECT_EQ(server_->store().Sessions().size(), 2u);
}

// ---------------------------------------------------------------------------
// AppendPrefill chunking and ReadKv

TEST_F(ClientTest, AppendPrefillChunksAPromptLargerThanOneMessage) {
  Session s = Create(Request("f32", "full"));
  const v1::Layout& layout = s.layout();
  const int64_t n = 300;  // 300 x 3 layers x 128 B = 112.5 KiB
  const KvTokens prompt = RandomBytes(layout, Positions(10, n, 3), rng_);
  ASSERT_GT(n * 3 * 2 * TokenBytes(layout), 6 * kMaxMessageBytes);

  absl::StatusOr<BlockTableMirror> seeded = s.Mirror();
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  BlockTableMirror mirror = *std::move(seeded);
  // In one message the prompt is refused by the server's limit...
  EXPECT_EQ(s.Append(prompt).status().code(),
            absl::StatusCode::kResourceExhausted);
  // ...and chunked it goes through: every message under the limit (or the
  // server would have refused it), in as few as fit.
  absl::StatusOr<client::PrefillResult> result = s.AppendPrefill(prompt);
  ASSERT_TRUE(result.ok()) << result.status();
  const int64_t min_chunks =
      (n * 3 * 2 * TokenBytes(layout) + kMaxMessageBytes - 1) /
      kMaxMessageBytes;
  EXPECT_GE(static_cast<int64_t>(result->chunks.size()), min_chunks);
  EXPECT_LE(static_cast<int64_t>(result->chunks.size()), min_chunks + 1);
  ASSERT_EQ(result->chunk_tokens.size(), result->chunks.size());
  int64_t total = 0;
  for (int64_t t : result->chunk_tokens) total += t;
  EXPECT_EQ(total, n);
  EXPECT_EQ(result->chunks.back().layers(2).resident(), n);

  ASSERT_TRUE(mirror.ApplyPrefill(*result, prompt.positions).ok());
  EXPECT_TRUE(MirrorMatches(mirror, s));

  // The bytes come back exactly, in order.
  absl::StatusOr<std::vector<client::LayerKvData>> kv = s.ReadKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ(kv->size(), 3u);
  for (int32_t l = 0; l < 3; ++l) {
    EXPECT_EQ((*kv)[l].layer, l);
    EXPECT_THAT((*kv)[l].positions, ElementsAreArray(prompt.positions));
    EXPECT_TRUE((*kv)[l].keys == prompt.layers[l].keys) << "layer " << l;
    EXPECT_TRUE((*kv)[l].values == prompt.layers[l].values) << "layer " << l;
  }
}

TEST_F(ClientTest, AppendPrefillHonoursMaxChunkTokens) {
  Session s = Create(Request("bf16", "full"));
  const KvTokens prompt = RandomBytes(s.layout(), Positions(0, 30), rng_);
  absl::StatusOr<client::PrefillResult> result = s.AppendPrefill(prompt, 7);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->chunk_tokens, ElementsAreArray({7, 7, 7, 7, 2}));
  ASSERT_EQ(result->chunks.size(), 5u);
  for (int c = 0; c < 5; ++c) {
    EXPECT_EQ(result->chunks[c].layers(0).resident(), std::min(30, 7 * c + 7));
  }
}

TEST_F(ClientTest, AppendPrefillRefusesBadInputBeforeSending) {
  Session s = Create(Request("f32", "full"));
  KvTokens prompt = RandomBytes(s.layout(), Positions(0, 8), rng_);
  prompt.layers[1].values.pop_back();
  absl::Status bad = s.AppendPrefill(prompt).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("layer 1"));
  EXPECT_EQ(s.AppendPrefill(KvTokens{}).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A token larger than a message cannot be sent at all.
  Session wide = Create(Request("wide", "full"));
  absl::Status too_big =
      wide.AppendPrefill(RandomBytes(wide.layout(), {0}, rng_)).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("message limit"));
  absl::StatusOr<v1::SessionStats> stats = wide.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->resident_tokens(), 0);
  absl::StatusOr<v1::SessionStats> f32 = s.Stats();
  ASSERT_TRUE(f32.ok());
  EXPECT_EQ(f32->resident_tokens(), 0);
}

TEST_F(ClientTest, AppendPrefillReportsTheServersStatus) {
  Session s = Create(Request("f32", "full"));
  ASSERT_TRUE(s.Append(RandomBytes(s.layout(), {100}, rng_)).ok());
  // Positions must exceed those appended before.
  absl::Status st =
      s.AppendPrefill(RandomBytes(s.layout(), Positions(0, 80), rng_), 40)
          .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("0 earlier chunks were appended"));
}

class ReadKvTest : public ClientTest,
                   public ::testing::WithParamInterface<std::string> {};

TEST_P(ReadKvTest, RoundTripIsByteExact) {
  Session s = Create(Request(GetParam(), "full"));
  const v1::Layout& layout = s.layout();
  // 147 prompt tokens and 3 decode tokens: several ReadKv chunks per layer.
  KvTokens all = RandomBytes(layout, Positions(0, 150, 2), rng_);
  KvTokens prompt;
  prompt.positions.assign(all.positions.begin(), all.positions.begin() + 147);
  const int64_t tb = TokenBytes(layout);
  for (const client::LayerBytes& l : all.layers) {
    prompt.layers.push_back(
        {l.keys.substr(0, 147 * tb), l.values.substr(0, 147 * tb)});
  }
  ASSERT_TRUE(s.AppendPrefill(prompt).ok());
  for (int64_t i = 147; i < 150; ++i) {
    KvTokens one;
    one.positions = {all.positions[i]};
    for (const client::LayerBytes& l : all.layers) {
      one.layers.push_back(
          {l.keys.substr(i * tb, tb), l.values.substr(i * tb, tb)});
    }
    ASSERT_TRUE(s.Append(one).ok());
  }
  absl::StatusOr<std::vector<client::LayerKvData>> kv = s.ReadKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ(kv->size(), 3u);
  absl::StatusOr<v1::SessionStats> stats = s.Stats();
  ASSERT_TRUE(stats.ok());
  for (int32_t l = 0; l < 3; ++l) {
    const client::LayerKvData& got = (*kv)[l];
    EXPECT_EQ(got.layer, l);
    EXPECT_EQ(got.version, stats->layer_version(l));
    EXPECT_THAT(got.positions, ElementsAreArray(all.positions));
    ASSERT_EQ(got.keys.size(), all.layers[l].keys.size());
    EXPECT_TRUE(got.keys == all.layers[l].keys) << "layer " << l;
    EXPECT_TRUE(got.values == all.layers[l].values) << "layer " << l;
  }
  // Some layers, in the order asked.
  absl::StatusOr<std::vector<client::LayerKvData>> some = s.ReadKv({2, 0});
  ASSERT_TRUE(some.ok()) << some.status();
  ASSERT_EQ(some->size(), 2u);
  EXPECT_EQ((*some)[0].layer, 2);
  EXPECT_TRUE((*some)[0].keys == all.layers[2].keys);
  EXPECT_EQ((*some)[1].layer, 0);
  EXPECT_TRUE((*some)[1].values == all.layers[0].values);
  EXPECT_EQ(s.ReadKv({3}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(ReadKvTest, EmptyLayersReadAsEmpty) {
  Session s = Create(Request(GetParam(), "full"));
  absl::StatusOr<std::vector<client::LayerKvData>> kv = s.ReadKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ(kv->size(), 3u);
  for (const client::LayerKvData& l : *kv) {
    EXPECT_TRUE(l.positions.empty());
    EXPECT_TRUE(l.keys.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, ReadKvTest,
                         ::testing::Values("f32", "f16", "bf16"));

// ---------------------------------------------------------------------------
// Decode streams and the block-table mirror

struct DecodeCase {
  friend void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }
  std::string name;
  std::string policy;
  std::map<std::string, std::string> params;
  std::vector<int64_t> budget;  // per layer
  int64_t prompt = 0;
  std::string scores;  // reduced | per_head | queries | "" (none)
};

class MirrorTest : public ClientTest,
                   public ::testing::WithParamInterface<DecodeCase> {};

// A prompt, then decode steps with scores; after every call the mirror must
// equal GetBlockTables, and at the end every slot's bytes must be the bytes
// appended at its position (the moves moved the data too).
TEST_P(MirrorTest, MirrorEqualsBlockTablesAfterEveryStep) {
  const DecodeCase& c = GetParam();
  Session s = Create(Request("f32", c.policy, c.params, 0, c.budget));
  const v1::Layout& layout = s.layout();
  absl::StatusOr<BlockTableMirror> seeded = s.Mirror();
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  BlockTableMirror mirror = *std::move(seeded);
  ASSERT_TRUE(MirrorMatches(mirror, s));

  // position -> its bytes, per layer
  std::vector<std::map<int64_t, std::string>> appended(3);
  auto remember = [&](const KvTokens& t) {
    const int64_t tb = TokenBytes(layout);
    for (int32_t l = 0; l < 3; ++l) {
      for (size_t i = 0; i < t.positions.size(); ++i) {
        appended[l][t.positions[i]] = t.layers[l].keys.substr(i * tb, tb) +
                                      t.layers[l].values.substr(i * tb, tb);
      }
    }
  };
  int64_t evicted = 0, moves = 0;
  auto count = [&](const v1::StepResult& r) {
    for (const v1::LayerChange& ch : r.layers()) {
      evicted += ch.evicted_positions_size();
      moves += ch.moves_size();
    }
  };

  // Positions with gaps, so nothing may assume position == index.
  const KvTokens prompt = NormalF32(layout, Positions(1, c.prompt, 3), rng_);
  remember(prompt);
  absl::StatusOr<client::PrefillResult> prefill = s.AppendPrefill(prompt, 5);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  for (const v1::StepResult& r : prefill->chunks) count(r);
  ASSERT_TRUE(mirror.ApplyPrefill(*prefill, prompt.positions).ok());
  ASSERT_TRUE(MirrorMatches(mirror, s)) << "after the prompt";

  DecodeStream stream = s.Decode();
  int64_t next = 1 + 3 * c.prompt;
  const int kSteps = 60;
  // Step 0: the prompt's own attention (no new token), which brings a
  // prompt longer than the budget down to it.
  for (int step = c.scores.empty() ? 1 : 0; step <= kSteps; ++step) {
    const bool append = step > 0;
    std::vector<v1::LayerScores> scores;
    if (!c.scores.empty()) {
      for (int32_t l = 0; l < 3; ++l) {
        scores.push_back(Scores(c.scores, layout, l, mirror.version(l),
                                mirror.resident(l) + (append ? 1 : 0), rng_));
      }
    }
    KvTokens token;
    if (append) {
      token = NormalF32(layout, {next}, rng_);
      next += 1 + step % 3;
      remember(token);
    }
    absl::StatusOr<v1::DecodeStepResult> r =
        append ? stream.Step(token, scores) : stream.Step(scores);
    ASSERT_TRUE(r.ok()) << "step " << step << ": " << r.status();
    EXPECT_EQ(r->has_append(), append);
    count(r->append());
    count(r->scores());
    ASSERT_TRUE(mirror.ApplyDecode(*r, token.positions).ok());
    ASSERT_TRUE(MirrorMatches(mirror, s)) << "after step " << step;
    for (int32_t l = 0; l < 3; ++l) {
      ASSERT_LE(mirror.resident(l), c.budget[l] + 1) << "step " << step;
    }
  }
  EXPECT_TRUE(stream.Finish().ok());
  EXPECT_GT(evicted, 0);
  EXPECT_GT(moves, 0);

  absl::StatusOr<std::vector<client::LayerKvData>> kv = s.ReadKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int64_t tb = TokenBytes(layout);
  for (int32_t l = 0; l < 3; ++l) {
    const client::LayerKvData& got = (*kv)[l];
    EXPECT_THAT(got.positions, ElementsAreArray(mirror.positions(l)));
    for (size_t slot = 0; slot < got.positions.size(); ++slot) {
      const std::string bytes =
          got.keys.substr(slot * tb, tb) + got.values.substr(slot * tb, tb);
      ASSERT_TRUE(bytes == appended[l][got.positions[slot]])
          << "layer " << l << " slot " << slot << " position "
          << got.positions[slot];
    }
  }
  absl::StatusOr<v1::SessionStats> stats = s.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->evicted_tokens(), evicted);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, MirrorTest,
    ::testing::Values(
        DecodeCase{"h2o_reduced_prompt_over_budget",
                   "h2o",
                   {{"sinks", "2"}, {"recent", "3"}, {"slack", "2"}},
                   {8, 11, 14},
                   20,
                   "reduced"},
        DecodeCase{"h2o_queries",
                   "h2o",
                   {{"recent", "2"}},
                   {10, 10, 10},
                   6,
                   "queries"},
        DecodeCase{"tova_per_head", "tova", {}, {9, 7, 12}, 5, "per_head"},
        DecodeCase{
            "scissorhands_reduced",
            "scissorhands",
            {{"history", "8"}, {"sinks", "1"}, {"recent", "2"}, {"slack", "1"}},
            {10, 10, 10},
            12,
            "reduced"},
        DecodeCase{"h2o_page_reduced",
                   "h2o_page",
                   {{"recent", "4"}, {"slack", "4"}},
                   {16, 12, 20},
                   8,
                   "reduced"},
        DecodeCase{"window_prompt_over_budget",
                   "window",
                   {{"slack", "3"}},
                   {10, 13, 7},
                   25,
                   ""},
        DecodeCase{"streaming_llm",
                   "streaming_llm",
                   {{"sinks", "2"}},
                   {9, 9, 9},
                   4,
                   ""}),
    [](const ::testing::TestParamInfo<DecodeCase>& info) {
      return info.param.name;
    });

TEST_F(ClientTest, MirrorFromTablesAttachesToAnExistingSession) {
  Session s = Create(Request("f32", "window", {}, 10));
  ASSERT_TRUE(
      s.AppendPrefill(RandomBytes(s.layout(), Positions(0, 23), rng_)).ok());
  absl::StatusOr<v1::GetBlockTablesResponse> tables = s.GetBlockTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  absl::StatusOr<BlockTableMirror> mirror =
      BlockTableMirror::FromTables(*tables);
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  EXPECT_TRUE(MirrorMatches(*mirror, s));
  for (int64_t p = 23; p < 40; ++p) {
    absl::StatusOr<v1::StepResult> r =
        s.Append(RandomBytes(s.layout(), {p}, rng_));
    ASSERT_TRUE(r.ok());
    const int64_t pos[] = {p};
    ASSERT_TRUE(mirror->Apply(*r, pos).ok());
    ASSERT_TRUE(MirrorMatches(*mirror, s)) << "position " << p;
  }
  // GetBlockTables of some layers, and of a layer that does not exist.
  absl::StatusOr<v1::GetBlockTablesResponse> one = s.GetBlockTables({1});
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->tables_size(), 1);
  EXPECT_EQ(one->tables(0).layer(), 1);
  EXPECT_EQ(s.GetBlockTables({7}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A partial set of tables cannot seed a mirror.
  EXPECT_EQ(BlockTableMirror::FromTables(*one).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockTableMirrorTest, RefusesResultsThatDoNotFitAndStaysUnchanged) {
  BlockTableMirror mirror(4, {0, 0});
  v1::StepResult add;
  for (int32_t l = 0; l < 2; ++l) {
    v1::LayerChange* c = add.add_layers();
    c->set_layer(l);
    c->set_version(1);
    c->set_resident(5);
    c->add_pages_added(10 + 2 * l);
    c->add_pages_added(11 + 2 * l);
  }
  const int64_t positions[] = {0, 1, 2, 3, 4};
  ASSERT_TRUE(mirror.Apply(add, positions).ok());
  const std::string before = mirror.Table(1).SerializeAsString();

  v1::StepResult bad = add;  // layer 1 moves a slot that does not exist
  bad.mutable_layers(1)->clear_pages_added();
  bad.mutable_layers(1)->set_resident(5);
  v1::SlotMove* m = bad.mutable_layers(1)->add_moves();
  m->set_from_slot(9);
  m->set_to_slot(0);
  bad.mutable_layers(0)->clear_pages_added();
  EXPECT_EQ(mirror.Apply(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mirror.Table(1).SerializeAsString(), before);
  EXPECT_EQ(mirror.version(0), 1u);  // layer 0 untouched too

  v1::StepResult wrong_pages = bad;  // frees a page that is not the tail
  wrong_pages.mutable_layers(1)->clear_moves();
  wrong_pages.mutable_layers(1)->set_resident(3);
  wrong_pages.mutable_layers(1)->add_pages_freed(12);
  wrong_pages.mutable_layers(1)->add_evicted_positions(0);
  wrong_pages.mutable_layers(1)->add_evicted_positions(1);
  EXPECT_EQ(mirror.Apply(wrong_pages).code(),
            absl::StatusCode::kInvalidArgument);
  v1::StepResult one_layer;
  *one_layer.add_layers() = add.layers(0);
  EXPECT_EQ(mirror.Apply(one_layer).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mirror.Table(1).SerializeAsString(), before);
  EXPECT_THAT(mirror.CachePositions(0), ElementsAreArray({0, 1, 2, 3, 4}));
}

TEST_F(ClientTest, CompressPromptAndMirror) {
  Session s =
      Create(Request("f32", "snapkv", {{"window", "4"}, {"kernel", "3"}}, 10));
  const v1::Layout& layout = s.layout();
  absl::StatusOr<BlockTableMirror> seeded = s.Mirror();
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  BlockTableMirror mirror = *std::move(seeded);
  const KvTokens prompt = NormalF32(layout, Positions(0, 30), rng_);
  absl::StatusOr<client::PrefillResult> prefill = s.AppendPrefill(prompt);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(mirror.ApplyPrefill(*prefill, prompt.positions).ok());

  std::vector<v1::LayerScores> window;
  for (int32_t l = 0; l < 3; ++l) {
    window.push_back(Scores("reduced", layout, l, mirror.version(l), 30, rng_,
                            /*rows=*/4));
  }
  absl::StatusOr<v1::StepResult> r = s.CompressPrompt(window);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int32_t l = 0; l < 3; ++l) {
    EXPECT_EQ(r->layers(l).resident(), 10);
    EXPECT_EQ(r->layers(l).evicted_positions_size(), 20);
  }
  ASSERT_TRUE(mirror.Apply(*r).ok());
  EXPECT_TRUE(MirrorMatches(mirror, s));
  absl::StatusOr<v1::SessionStats> stats = s.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(stats->compressed());
  EXPECT_EQ(s.CompressPrompt(window).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Not a snapkv session.
  Session h2o = Create(Request("f32", "h2o"));
  EXPECT_EQ(h2o.CompressPrompt(window).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, FailingStepEndsTheStreamAndChangesNothing) {
  Session s = Create(Request("f32", "h2o", {}, 8));
  const v1::Layout& layout = s.layout();
  ASSERT_TRUE(s.Append(NormalF32(layout, Positions(0, 5), rng_)).ok());
  absl::StatusOr<v1::SessionStats> before = s.Stats();
  ASSERT_TRUE(before.ok());

  DecodeStream stream = s.Decode();
  std::vector<v1::LayerScores> stale;
  for (int32_t l = 0; l < 3; ++l) {
    stale.push_back(
        Scores("reduced", layout, l, before->layer_version(l) + 1, 6, rng_));
  }
  absl::StatusOr<v1::DecodeStepResult> r =
      stream.Step(NormalF32(layout, {5}, rng_), stale);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("stale version"));
  // The stream has ended: later steps say so; Finish gives the cause.
  absl::StatusOr<v1::DecodeStepResult> again = stream.Step(stale);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("has ended"));
  EXPECT_EQ(stream.Finish().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::SessionStats> after = s.Stats();
  ASSERT_TRUE(after.ok());
  // The lease moves with every call (and the failed stream's hold may not
  // have ended yet): not the session's state.
  for (v1::SessionStats* stats : {&*after, &*before}) {
    stats->clear_lease_seconds_left();
    stats->clear_lease_held();
  }
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString());

  // NaN scores on a new stream: INVALID_ARGUMENT.
  DecodeStream nan_stream = s.Decode();
  std::vector<float> nan(5, 0.1f);
  nan[2] = std::nanf("");
  const v1::LayerScores bad =
      client::ReducedScores(0, before->layer_version(0), nan);
  EXPECT_EQ(nan_stream.Step({&bad, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A healthy stream finishes OK, and is over after Finish.
  DecodeStream ok_stream = s.Decode();
  std::vector<v1::LayerScores> fine;
  for (int32_t l = 0; l < 3; ++l) {
    fine.push_back(
        Scores("reduced", layout, l, before->layer_version(l), 5, rng_));
  }
  ASSERT_TRUE(ok_stream.Step(fine).ok());
  EXPECT_TRUE(ok_stream.Finish().ok());
  EXPECT_TRUE(ok_stream.Finish().ok());
  EXPECT_EQ(ok_stream.Step(fine).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Scores for a policy that takes none.
  Session window = Create(Request("f32", "window"));
  DecodeStream w = window.Decode();
  EXPECT_EQ(w.Step(NormalF32(layout, {0}, rng_), fine).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // A stream abandoned mid-way is cancelled by its destructor.
  { DecodeStream abandoned = s.Decode(); }
  // A moved-to stream keeps working.
  DecodeStream moved = s.Decode();
  DecodeStream target = std::move(moved);
  ASSERT_TRUE(target.Step(fine).ok());
  EXPECT_TRUE(target.Finish().ok());
}

// ---------------------------------------------------------------------------
// Errors

TEST_F(ClientTest, ErrorsCarryTheServersCodes) {
  EXPECT_EQ(client_->CreateSession(Request("nope", "h2o")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->CreateSession(Request("f32", "lru")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->CreateSession(Request("f32", "h2o", {{"colour", "blue"}}))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetSessionStats("xyz").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status missing = client_->GetSessionStats("00000000deadbeef").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("00000000deadbeef"));
  EXPECT_EQ(client_->OpenSession("00000000deadbeef").status().code(),
            absl::StatusCode::kNotFound);

  Session s = Create(Request("f32", "full"));
  KvTokens wrong = RandomBytes(s.layout(), {0}, rng_);
  wrong.layers.pop_back();
  EXPECT_EQ(s.Append(wrong).status().code(),
            absl::StatusCode::kInvalidArgument);

  // The pool runs out: RESOURCE_EXHAUSTED, and nothing changed.
  Session tiny = Create(Request("tiny", "full"));
  ASSERT_TRUE(tiny.Append(RandomBytes(tiny.layout(), Positions(0, 8), rng_))
                  .ok());  // 2 layers x 2 pages
  absl::Status full =
      tiny.Append(RandomBytes(tiny.layout(), Positions(8, 8), rng_)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<v1::SessionStats> stats = tiny.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->resident_tokens(), 16);

  // A closed session's handle.
  ASSERT_TRUE(s.Close().ok());
  EXPECT_EQ(s.ReadKv().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.GetBlockTables().status().code(), absl::StatusCode::kNotFound);
  DecodeStream stream = s.Decode();
  EXPECT_EQ(stream.Step(std::vector<v1::LayerScores>{}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ClientAuthTest, TokensAndTenants) {
  std::unique_ptr<TestServer> server =
      StartServer({{"alice", "tok-a"}, {"bob", "tok-b"}});
  ASSERT_NE(server, nullptr);
  KvKeepClient anonymous = Connect(server->address());
  KvKeepClient wrong = Connect(server->address(), 2, nullptr, "tok-x");
  KvKeepClient alice = Connect(server->address(), 2, nullptr, "tok-a");
  KvKeepClient bob = Connect(server->address(), 2, nullptr, "tok-b");

  EXPECT_EQ(anonymous.GetServerInfo().status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.ListSessions().status().code(),
            absl::StatusCode::kUnauthenticated);
  absl::StatusOr<Session> s = alice.CreateSession(Request("f32", "h2o", {}, 8));
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<v1::SessionStats> mine = s->Stats();
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(mine->tenant(), "alice");

  // Another tenant's session is NOT_FOUND, as a missing one.
  EXPECT_EQ(bob.GetSessionStats(s->id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(bob.OpenSession(s->id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(bob.CloseSession(s->id()).status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<v1::SessionStats>> bobs = bob.ListSessions();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  absl::StatusOr<std::vector<v1::SessionStats>> alices = alice.ListSessions();
  ASSERT_TRUE(alices.ok());
  EXPECT_EQ(alices->size(), 1u);
  EXPECT_TRUE(s->Close().ok());
}

// ---------------------------------------------------------------------------
// Retries

TEST(ClientRetryTest, NoServerGivesUnavailableAfterTheRetries) {
  const int port = FreePort();
  ASSERT_NE(port, 0);
  auto log = std::make_shared<RetryLog>();
  KvKeepClient c = Connect(absl::StrCat("127.0.0.1:", port), 3, log);

  absl::Status s = c.GetServerInfo().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("after 4 attempts"));
  EXPECT_THAT(log->Take(),
              ElementsAreArray(
                  {"GetServerInfo#1", "GetServerInfo#2", "GetServerInfo#3"}));
  EXPECT_EQ(c.ListSessions().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(log->Take().size(), 3u);
  EXPECT_EQ(c.GetSessionStats("0123456789abcdef").status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(log->Take().size(), 3u);
  EXPECT_EQ(c.CloseSession("0123456789abcdef").status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(log->Take().size(), 3u);
  // CreateSession fetches the layout first (retried), then stops there.
  EXPECT_EQ(c.CreateSession(Request("f32", "h2o")).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_THAT(log->Take(), Contains("GetServerInfo#3"));

  KvKeepClient no_retries = Connect(absl::StrCat("127.0.0.1:", port), 0, log);
  EXPECT_EQ(no_retries.GetServerInfo().status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(log->Take().empty());
}

// Calls that change a session are sent once; reads are retried.
TEST(ClientRetryTest, OnlyIdempotentCallsAreRetried) {
  std::unique_ptr<TestServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  auto log = std::make_shared<RetryLog>();
  KvKeepClient c = Connect(server->address(), 2, log);
  absl::StatusOr<Session> s = c.CreateSession(Request("f32", "h2o", {}, 8));
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937 rng(3);
  const KvTokens token = NormalF32(s->layout(), {0}, rng);
  server->Stop();  // the server is gone; the client does not know yet
  EXPECT_TRUE(log->Take().empty());

  EXPECT_EQ(s->Append(token).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s->AppendPrefill(token).status().code(),
            absl::StatusCode::kUnavailable);
  const v1::LayerScores scores = client::ReducedScores(0, 0, {1.0f});
  EXPECT_EQ(s->CompressPrompt({&scores, 1}).status().code(),
            absl::StatusCode::kUnavailable);
  DecodeStream stream = s->Decode();
  EXPECT_EQ(stream.Step(token, {}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(c.CreateSession(Request("f32", "h2o")).status().code(),
            absl::StatusCode::kUnavailable);  // the layout is cached
  EXPECT_TRUE(log->Take().empty());

  v1::CreateSessionRequest keyed = Request("f32", "h2o");
  keyed.set_idempotency_key("k");
  EXPECT_EQ(c.CreateSession(keyed).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_THAT(log->Take(),
              ElementsAreArray({"CreateSession#1", "CreateSession#2"}));
  EXPECT_EQ(s->Stats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s->GetBlockTables().status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(s->ReadKv().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s->Close().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(
      log->Take(),
      ElementsAreArray({"GetSessionStats#1", "GetSessionStats#2",
                        "GetBlockTables#1", "GetBlockTables#2", "ReadKv#1",
                        "ReadKv#2", "CloseSession#1", "CloseSession#2"}));
}

TEST(ClientRetryTest, IdempotentCallSucceedsOnceTheServerIsUp) {
  const int port = FreePort();
  ASSERT_NE(port, 0);
  absl::Notification retrying;
  std::atomic<int> retries{0};
  ClientOptions o;
  o.address = absl::StrCat("127.0.0.1:", port);
  o.retries = 2000;  // bounded: at most 2000 x 20 ms
  o.backoff = absl::Milliseconds(5);
  o.max_backoff = absl::Milliseconds(20);
  o.on_retry = [&](absl::string_view, int, const absl::Status&) {
    if (retries.fetch_add(1) == 0) retrying.Notify();
  };
  absl::StatusOr<KvKeepClient> c = KvKeepClient::Connect(o);
  ASSERT_TRUE(c.ok());

  absl::StatusOr<v1::ServerInfo> info = absl::UnknownError("not run");
  std::thread caller([&] { info = c->GetServerInfo(); });
  retrying.WaitForNotification();  // the client has failed at least once
  std::unique_ptr<TestServer> server = StartServer({}, port);
  caller.join();
  ASSERT_NE(server, nullptr) << "port " << port << " was taken meanwhile";
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layouts_size(), 5);
  EXPECT_GE(retries.load(), 1);
}

// A server that loses the reply of the first CreateSession and the first
// CloseSession after doing the work: what a retry then sees.
class LostReplyService final : public v1::KvKeep::CallbackService {
 public:
  explicit LostReplyService(CacheStore* store) : store_(store) {}

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest*,
                                          v1::ServerInfo* resp) override {
    for (const LayoutStats& s : store_->Layouts()) {
      LayoutToProto(s.layout, resp->add_layouts());
    }
    return Done(ctx, grpc::Status::OK);
  }
  grpc::ServerUnaryReactor* CreateSession(
      grpc::CallbackServerContext* ctx, const v1::CreateSessionRequest* req,
      v1::CreateSessionResponse* resp) override {
    absl::StatusOr<SessionId> id = store_->CreateSession(SpecFromProto(*req));
    if (id.ok()) resp->set_session_id(SessionName(*id));
    return Done(ctx, creates_++ == 0 ? Lost() : ToGrpcStatus(id.status()));
  }
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse*) override {
    std::optional<SessionId> id = ParseSessionName(req->session_id());
    const absl::Status s = store_->CloseSession(id.value_or(0));
    return Done(ctx, closes_++ == 0 ? Lost() : ToGrpcStatus(s));
  }

  int creates() const { return creates_; }
  int closes() const { return closes_; }

 private:
  static grpc::Status Lost() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "reply lost");
  }
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx,
                                        const grpc::Status& status) {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(status);
    return r;
  }
  CacheStore* const store_;
  std::atomic<int> creates_{0};
  std::atomic<int> closes_{0};
};

TEST(ClientRetryTest, RetriesAfterALostReply) {
  std::unique_ptr<LostReplyService> service;
  std::unique_ptr<TestServer> server =
      StartServer({}, 0, [&service](CacheStore& store) {
        service = std::make_unique<LostReplyService>(&store);
        return service.get();
      });
  ASSERT_NE(server, nullptr);
  CacheStore& store = server->store();
  auto log = std::make_shared<RetryLog>();
  KvKeepClient c = Connect(server->address(), 3, log);

  // The first attempt created the session; the retry gets the same one.
  v1::CreateSessionRequest r = Request("f32", "full");
  r.set_idempotency_key("seq-1");
  absl::StatusOr<Session> s = c.CreateSession(r);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(service->creates(), 2);
  ASSERT_EQ(store.Sessions().size(), 1u);
  EXPECT_EQ(SessionName(store.Sessions()[0].id), s->id());

  // The first attempt closed it; the retry finds it gone: closed, freed
  // pages unknown.
  absl::StatusOr<int64_t> freed = s->Close();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, Session::kUnknownFreedPages);
  EXPECT_EQ(service->closes(), 2);
  EXPECT_TRUE(store.Sessions().empty());
  EXPECT_THAT(log->Take(),
              ElementsAreArray({"CreateSession#1", "CloseSession#1"}));
  server->Stop();
}

TEST(ClientOptionsTest, ConnectRefusesBadOptions) {
  ClientOptions o;
  o.address = "";
  EXPECT_EQ(KvKeepClient::Connect(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.address = "127.0.0.1:1";
  o.retries = -1;
  EXPECT_EQ(KvKeepClient::Connect(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.retries = 1;
  o.max_backoff = absl::Milliseconds(1);
  o.backoff = absl::Milliseconds(5);
  EXPECT_EQ(KvKeepClient::Connect(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.max_backoff = absl::Milliseconds(10);
  o.deadline = absl::ZeroDuration();
  EXPECT_EQ(KvKeepClient::Connect(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// The kvkeep CLI against a kvkeepd process

std::string KvkeepBinary() {
  std::string dir = KVKEEPD_BINARY;
  dir = dir.substr(0, dir.rfind('/'));
  return dir + "/kvkeep";
}

// kvkeepd as a child process, its stdout on a pipe; killed if still running
// when destroyed.
class Daemon {
 public:
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  // Starts kvkeepd and reads its stdout up to the "grpc listening on" line.
  ::testing::AssertionResult Start(std::vector<std::string> args) {
    int fds[2];
    if (pipe(fds) != 0) return ::testing::AssertionFailure() << "pipe";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    args.insert(args.begin(), KVKEEPD_BINARY);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, KVKEEPD_BINARY, &actions, nullptr,
                               argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fds[0];
    if (rc != 0) {
      pid_ = 0;
      return ::testing::AssertionFailure() << "spawn: " << std::strerror(rc);
    }
    constexpr absl::string_view kListening = "kvkeepd: grpc listening on ";
    std::string line;
    char ch;
    while (read(out_, &ch, 1) == 1) {
      if (ch != '\n') {
        line += ch;
        continue;
      }
      if (absl::StartsWith(line, kListening)) {
        address_ = line.substr(kListening.size());
        return ::testing::AssertionSuccess();
      }
      line.clear();
    }
    return ::testing::AssertionFailure() << "kvkeepd exited before listening";
  }

  // SIGTERM; the exit status.
  int Stop() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = 0;
  int out_ = -1;
  std::string address_;
};

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
  nlohmann::json json;  // stdout parsed, when it is JSON
};

// Runs `kvkeep args` (with `env`, e.g. "NAME=value ", before it).
CliRun RunCli(const std::string& args, const std::string& env = "") {
  static std::atomic<int> n{0};
  const std::string err_file = absl::StrCat(
      ::testing::TempDir(), "/kvkeep_cli_err_", getpid(), "_", n.fetch_add(1));
  const std::string command =
      absl::StrCat(env, "'", KvkeepBinary(), "' ", args, " 2>'", err_file, "'");
  CliRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t got;
  while ((got = fread(buffer, 1, sizeof(buffer), pipe)) > 0) {
    run.out.append(buffer, got);
  }
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_file);
  std::stringstream text;
  text << err.rdbuf();
  run.err = text.str();
  std::remove(err_file.c_str());
  run.json =
      nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  return run;
}

TEST(CliTest, CommandsAgainstKvkeepd) {
  ASSERT_EQ(access(KvkeepBinary().c_str(), X_OK), 0)
      << KvkeepBinary() << " is missing: build the kvkeep_cli target";
  Daemon daemon;
  ASSERT_TRUE(
      daemon.Start({"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                    "--self_check=false", "--pool_pages=256"}));
  const std::string server = absl::StrCat("--server=", daemon.address());

  CliRun info = RunCli(server + " --json info");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  ASSERT_TRUE(info.json.is_object()) << info.out;
  EXPECT_EQ(info.json["layouts"][0]["name"], "demo");
  EXPECT_EQ(info.json["layouts"][0]["num_layers"], 8);
  EXPECT_EQ(info.json["layouts"][0]["dtype"], "bf16");
  EXPECT_EQ(info.json["pools"][0]["capacity_pages"], 256);
  EXPECT_EQ(info.json["max_message_bytes"], 64 << 20);
  EXPECT_THAT(info.json["policies"].get<std::vector<std::string>>(),
              Contains("h2o"));
  // Each policy as the server describes it (ServerInfo.policy_info).
  ASSERT_EQ(info.json["policy_info"].size(), info.json["policies"].size());
  for (const auto& p : info.json["policy_info"]) {
    if (p["name"] == "h2o") {
      EXPECT_EQ(p["input"], "per-step");
      EXPECT_EQ(p["accepts_queries"], true);
      EXPECT_EQ(p["params"][0]["name"], "sinks");
      EXPECT_EQ(p["params"][0]["default"], "0");
    }
    if (p["name"] == "snapkv") {
      EXPECT_EQ(p["input"], "compress");
      EXPECT_EQ(p["params"][1]["rule"], "odd");
      EXPECT_EQ(p["params"][2]["choices"][1], "maxpool");
    }
    if (p["name"] == "window") {
      EXPECT_EQ(p["input"], "none");
    }
  }
  CliRun table = RunCli(server + " info");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("LAYOUT"));
  EXPECT_THAT(table.out, HasSubstr("demo"));
  EXPECT_THAT(table.out, HasSubstr("input: compress; budget: budget >= "
                                   "max(1, window)"));
  EXPECT_THAT(table.out, HasSubstr("kernel = 5: int in [1, 1025], odd"));

  // --help lists the flags, once prefixed, and finds them (absl's default
  // looks for kvkeep.cc and says "No flags matched").
  CliRun help = RunCli("--help");
  EXPECT_THAT(help.out + help.err, HasSubstr("--server (kvkeepd address)"));
  EXPECT_THAT(help.out + help.err, Not(HasSubstr("No flags matched")));
  EXPECT_THAT(help.out + help.err, Not(HasSubstr("kvkeep: kvkeep:")));

  // A session made with the client library, seen through the CLI. (The
  // client goes away again: an idle open connection holds up kvkeepd's exit
  // on SIGTERM for seconds.)
  std::string id;
  {
    KvKeepClient c = Connect(daemon.address());
    absl::StatusOr<Session> s = c.CreateSession(Request("demo", "h2o", {}, 64));
    ASSERT_TRUE(s.ok()) << s.status();
    std::mt19937 rng(5);
    ASSERT_TRUE(
        s->AppendPrefill(RandomBytes(s->layout(), Positions(0, 5), rng)).ok());
    id = s->id();
  }

  CliRun sessions = RunCli(server + " --json sessions");
  ASSERT_EQ(sessions.exit_code, 0) << sessions.err;
  ASSERT_EQ(sessions.json["sessions"].size(), 1u) << sessions.out;
  EXPECT_EQ(sessions.json["sessions"][0]["session_id"], id);
  EXPECT_EQ(sessions.json["sessions"][0]["resident_tokens"], 40);
  EXPECT_THAT(RunCli(server + " sessions").out, HasSubstr(id));

  CliRun stats = RunCli(absl::StrCat(server, " --json stats ", id));
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_EQ(stats.json["policy"], "h2o");
  EXPECT_EQ(stats.json["pages"], 8);
  EXPECT_EQ(stats.json["layer_resident"],
            nlohmann::json(std::vector<int>(8, 5)));
  EXPECT_THAT(RunCli(absl::StrCat(server, " stats ", id)).out,
              HasSubstr("RESIDENT"));

  CliRun closed = RunCli(absl::StrCat(server, " --json close ", id));
  ASSERT_EQ(closed.exit_code, 0) << closed.err;
  EXPECT_EQ(closed.json["closed"], true);
  EXPECT_EQ(closed.json["freed_pages"], 8);

  // Failures: the status code on stderr and in the JSON, exit status 1.
  CliRun gone = RunCli(absl::StrCat(server, " --json stats ", id));
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_EQ(gone.json["error"]["code"], "NOT_FOUND");
  EXPECT_THAT(gone.err, HasSubstr("NOT_FOUND"));
  CliRun malformed = RunCli(server + " close not-a-session");
  EXPECT_EQ(malformed.exit_code, 1);
  EXPECT_THAT(malformed.err, HasSubstr("INVALID_ARGUMENT"));

  // The demo: a session, decode steps with scores, evictions, closed.
  CliRun demo = RunCli(server +
                       " --json demo --steps=40 --budget=24 --prompt=8 "
                       "--scores=reduced");
  ASSERT_EQ(demo.exit_code, 0) << demo.err << demo.out;
  EXPECT_EQ(demo.json["policy"], "h2o");
  EXPECT_EQ(demo.json["steps"].size(), 41u);  // the prompt's step and 40
  EXPECT_GT(demo.json["evicted_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(demo.json["block_tables_match"], true);
  EXPECT_EQ(demo.json["closed"], true);
  EXPECT_EQ(demo.json["stats"]["layer_resident"][0], 24);
  CliRun queries = RunCli(server +
                          " --json demo --steps=20 --budget=16 "
                          "--scores=queries --policy=tova --params=");
  ASSERT_EQ(queries.exit_code, 0) << queries.err;
  EXPECT_EQ(queries.json["block_tables_match"], true);
  CliRun window = RunCli(server +
                         " --json demo --policy=window --params=slack=2 "
                         "--budget=12 --steps=20");
  ASSERT_EQ(window.exit_code, 0) << window.err;
  EXPECT_EQ(window.json["scores"], "none");
  EXPECT_EQ(window.json["block_tables_match"], true);
  EXPECT_GT(window.json["evicted_tokens"].get<int64_t>(), 0);
  CliRun human = RunCli(server + " demo --steps=4");
  ASSERT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("matches the store's"));
  CliRun after = RunCli(server + " --json sessions");
  EXPECT_TRUE(after.json["sessions"].empty()) << after.out;

  // Usage errors: exit status 2.
  EXPECT_EQ(RunCli(server).exit_code, 2);
  EXPECT_EQ(RunCli(server + " stats").exit_code, 2);
  EXPECT_EQ(RunCli(server + " frobnicate").exit_code, 2);

  EXPECT_EQ(daemon.Stop(), 0);
  // Nothing listens any more.
  CliRun down = RunCli(server + " --retries=1 --json info");
  EXPECT_EQ(down.exit_code, 1);
  EXPECT_EQ(down.json["error"]["code"], "UNAVAILABLE");
  EXPECT_THAT(down.err, HasSubstr("UNAVAILABLE"));
}

TEST(CliTest, TokensReachTheServer) {
  const std::string config =
      absl::StrCat(::testing::TempDir(), "/kvkeep_cli_tenants.json");
  {
    std::ofstream f(config);
    f << R"({"tenants": [{"name": "alice", "token": "secret-a"}]})";
  }
  Daemon daemon;
  ASSERT_TRUE(daemon.Start(
      {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
       "--self_check=false", "--pool_pages=64", "--config=" + config}));
  const std::string server = absl::StrCat("--server=", daemon.address());
  CliRun none = RunCli(server + " --json info");
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_EQ(none.json["error"]["code"], "UNAUTHENTICATED");
  CliRun with = RunCli(server + " --token=secret-a --json sessions");
  EXPECT_EQ(with.exit_code, 0) << with.err;
  CliRun wrong = RunCli(server + " --token=secret-b --json info");
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_EQ(wrong.json["error"]["code"], "UNAUTHENTICATED");
  // $KVKEEP_TOKEN when --token is not given.
  CliRun from_env =
      RunCli(server + " --json sessions", "KVKEEP_TOKEN=secret-a ");
  EXPECT_EQ(from_env.exit_code, 0) << from_env.err;
  EXPECT_TRUE(from_env.json["sessions"].empty());
  EXPECT_EQ(daemon.Stop(), 0);
  std::remove(config.c_str());
}

}  // namespace
}  // namespace kvkeep
