// ForkSession through a real server on loopback: a parent and its children
// decoding at once through the C++ client, each worker's block-table mirror
// following its own results (copy-on-write included) and every session's
// keys and values read back byte for byte; the pool's shared pages in
// ServerInfo; and the refusals, each with its code and nothing held.
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/grpc_status_matchers.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using client::BlockTableMirror;
using client::KvKeepClient;
using client::KvTokens;
using client::Session;
using ::testing::HasSubstr;

constexpr char kLayout[] = "small";
constexpr int64_t kPoolPages = 512;

std::unique_ptr<testing::TestServer> StartServer(
    std::vector<TenantToken> tenants = {}) {
  ServerConfig config = testing::TestServerConfig(
      {PoolSpec{testing::SmallLayout(kLayout), kPoolPages}});
  config.tenants = std::move(tenants);
  absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
      testing::TestServer::Start(config);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

KvKeepClient Connect(const testing::TestServer& server,
                     const std::string& token = "") {
  client::ClientOptions options;
  options.address = server.address();
  options.token = token;
  absl::StatusOr<KvKeepClient> c = KvKeepClient::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// A worker's view of one session: what it appended (each position's bytes
// per layer, inherited at a fork), its mirror and its decode stream.
struct Worker {
  Session session;
  BlockTableMirror mirror;
  // layer -> position -> key bytes then value bytes
  std::vector<std::map<int64_t, std::string>> bytes;
  int64_t next_position = 0;
};

// n random tokens for `w` at its next positions, remembered in w.bytes.
KvTokens NextTokens(Worker& w, int64_t n, std::mt19937& rng) {
  const v1::Layout& layout = w.session.layout();
  const size_t token_bytes =
      size_t{4} * layout.kv_heads() * layout.head_dim();  // f32
  std::uniform_int_distribution<int> byte(0, 255);
  KvTokens tokens;
  tokens.layers.resize(layout.num_layers());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t position = w.next_position++;
    tokens.positions.push_back(position);
    for (int32_t l = 0; l < layout.num_layers(); ++l) {
      std::string k(token_bytes, '\0'), v(token_bytes, '\0');
      for (char& c : k) c = static_cast<char>(byte(rng));
      for (char& c : v) c = static_cast<char>(byte(rng));
      tokens.layers[l].keys += k;
      tokens.layers[l].values += v;
      w.bytes[l][position] = k + v;
    }
  }
  return tokens;
}

// One row of head-summed attention for every layer, at the mirror's
// versions, over its slots plus `growth` new ones.
std::vector<v1::LayerScores> Attention(const Worker& w, int64_t growth,
                                       std::mt19937& rng) {
  std::vector<v1::LayerScores> out;
  std::uniform_real_distribution<float> weight(0.01f, 1);
  for (int32_t l = 0; l < w.mirror.num_layers(); ++l) {
    std::vector<float> row(w.mirror.resident(l) + growth);
    float sum = 0;
    for (float& f : row) sum += (f = weight(rng));
    for (float& f : row) f /= sum;
    out.push_back(client::ReducedScores(l, w.mirror.version(l), row));
  }
  return out;
}

// The worker's mirror equals the store's tables, and every slot holds the
// bytes the worker appended at that slot's position.
void ExpectInStep(const Worker& w, const std::string& who) {
  absl::StatusOr<v1::GetBlockTablesResponse> tables =
      w.session.GetBlockTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  absl::StatusOr<std::vector<client::LayerKvData>> kv = w.session.ReadKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  for (int32_t l = 0; l < w.mirror.num_layers(); ++l) {
    EXPECT_EQ(w.mirror.Table(l).SerializeAsString(),
              tables->tables(l).SerializeAsString())
        << who << " layer " << l;
    const client::LayerKvData& data = (*kv)[l];
    ASSERT_FALSE(data.positions.empty()) << who;
    const size_t token_bytes = data.keys.size() / data.positions.size();
    for (size_t s = 0; s < data.positions.size(); ++s) {
      const std::string& want = w.bytes[l].at(data.positions[s]);
      ASSERT_EQ(data.keys.substr(s * token_bytes, token_bytes) +
                    data.values.substr(s * token_bytes, token_bytes),
                want)
          << who << " layer " << l << " slot " << s;
    }
  }
}

v1::Pool PoolInfo(const KvKeepClient& c) {
  absl::StatusOr<v1::ServerInfo> info = c.GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->pools(0) : v1::Pool();
}

TEST(ForkServiceTest, ChildrenDecodeAlongsideTheirParentByteExact) {
  std::unique_ptr<testing::TestServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  const KvKeepClient c = Connect(*server);
  std::mt19937 rng(18);
  v1::CreateSessionRequest create;
  create.set_layout(kLayout);
  create.set_policy("h2o");
  (*create.mutable_policy_params())["recent"] = std::string("2");
  create.mutable_budget()->set_tokens(14);
  KV_ASSIGN_OR_FAIL(Session root, c.CreateSession(create));
  KV_ASSIGN_OR_FAIL(BlockTableMirror root_mirror, root.Mirror());
  std::vector<Worker> workers;
  workers.push_back(Worker{root, root_mirror,
                           std::vector<std::map<int64_t, std::string>>(2)});
  const KvTokens prompt = NextTokens(workers[0], 10, rng);
  KV_ASSIGN_OR_FAIL(const client::PrefillResult prefill,
                    root.AppendPrefill(prompt));
  KV_ASSERT_OK(workers[0].mirror.ApplyPrefill(prefill, prompt.positions));

  // Two children, one with a smaller budget; each starts from a copy of
  // the parent's mirror and bytes.
  for (int64_t budget : {0, 8}) {
    v1::ForkSessionRequest fork;
    if (budget > 0) fork.mutable_budget()->set_tokens(budget);
    KV_ASSIGN_OR_FAIL(Session child, root.Fork(fork));
    Worker w = workers[0];
    w.session = child;
    workers.push_back(std::move(w));
  }
  const v1::Pool shared = PoolInfo(c);
  EXPECT_EQ(shared.page_references(), 3 * shared.used_pages());
  EXPECT_EQ(shared.shared_pages(), shared.used_pages());
  for (const Worker& w : workers) ExpectInStep(w, w.session.id());

  std::vector<client::DecodeStream> streams;
  for (Worker& w : workers) {
    streams.push_back(w.session.Decode());
    // Scores alone first: the child over its smaller budget settles here.
    KV_ASSIGN_OR_FAIL(const v1::DecodeStepResult r,
                      streams.back().Step(Attention(w, 0, rng)));
    KV_ASSERT_OK(w.mirror.ApplyDecode(r));
    ExpectInStep(w, w.session.id());
  }
  int64_t copies = 0;
  for (int step = 0; step < 40; ++step) {
    for (size_t i = 0; i < workers.size(); ++i) {
      Worker& w = workers[i];
      const KvTokens token = NextTokens(w, 1, rng);
      KV_ASSIGN_OR_FAIL(const v1::DecodeStepResult r,
                        streams[i].Step(token, Attention(w, 1, rng)));
      for (const v1::LayerChange& change : r.append().layers()) {
        copies += change.pages_copied_size();
      }
      for (const v1::LayerChange& change : r.scores().layers()) {
        copies += change.pages_copied_size();
      }
      KV_ASSERT_OK(w.mirror.ApplyDecode(r, token.positions));
      ExpectInStep(w, absl::StrCat("worker ", i, " step ", step));
    }
  }
  EXPECT_GT(copies, 0);
  for (client::DecodeStream& s : streams) KV_ASSERT_OK(s.Finish());
  const v1::Pool after = PoolInfo(c);
  EXPECT_LT(after.shared_pages(), shared.shared_pages());
  for (const Worker& w : workers) KV_ASSERT_OK(w.session.Close().status());
  const v1::Pool closed = PoolInfo(c);
  EXPECT_EQ(closed.used_pages(), 0);
  EXPECT_EQ(closed.page_references(), 0);
}

TEST(ForkServiceTest, RefusalsHaveTheirCodesAndHoldNothing) {
  std::unique_ptr<testing::TestServer> server = StartServer(
      {TenantToken{"alice", "token-a"}, TenantToken{"bob", "token-b"}});
  ASSERT_NE(server, nullptr);
  const KvKeepClient alice = Connect(*server, "token-a");
  const KvKeepClient bob = Connect(*server, "token-b");
  std::mt19937 rng(19);
  v1::CreateSessionRequest create;
  create.set_layout(kLayout);
  create.set_policy("h2o");
  create.mutable_budget()->set_tokens(16);
  KV_ASSIGN_OR_FAIL(Session parent, alice.CreateSession(create));
  Worker w{parent, BlockTableMirror(4, {1, 1}),
           std::vector<std::map<int64_t, std::string>>(2)};
  KV_ASSERT_OK(parent.Append(NextTokens(w, 6, rng)).status());
  const v1::Pool before = PoolInfo(alice);

  const auto fork = [&](const KvKeepClient& as, v1::ForkSessionRequest req) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + as.options().token);
    v1::ForkSessionResponse resp;
    return as.stub().ForkSession(&ctx, req, &resp);
  };
  v1::ForkSessionRequest req;
  req.set_session_id(parent.id());
  // Another tenant's session is not found, as an unknown one.
  testing::ExpectStatus(fork(bob, req), grpc::StatusCode::NOT_FOUND,
                        {parent.id()});
  v1::ForkSessionRequest unknown;
  unknown.set_session_id("00000000000000ff");
  testing::ExpectStatus(fork(alice, unknown), grpc::StatusCode::NOT_FOUND,
                        {"not found"});
  v1::ForkSessionRequest params_alone = req;
  (*params_alone.mutable_policy_params())["recent"] = std::string("2");
  testing::ExpectStatus(fork(alice, params_alone),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        {"policy_params without a policy"});
  v1::ForkSessionRequest bad_budget = req;
  bad_budget.mutable_budget()->set_tokens(0);
  testing::ExpectStatus(fork(alice, bad_budget),
                        grpc::StatusCode::INVALID_ARGUMENT, {"budget"});
  // Being transferred: not now; once the transfer is over, yes.
  const SessionId id = *ParseSessionName(parent.id());
  KV_ASSERT_OK(server->store().FreezeForTransfer(id).status());
  testing::ExpectStatus(fork(alice, req), grpc::StatusCode::UNAVAILABLE,
                        {"being transferred"});
  const v1::Pool refused = PoolInfo(alice);
  EXPECT_EQ(refused.used_pages(), before.used_pages());
  EXPECT_EQ(refused.page_references(), before.page_references());
  KV_ASSERT_OK(server->store().FinishTransfer(id, /*committed=*/false));
  KV_ASSIGN_OR_FAIL(Session child, parent.Fork());
  KV_ASSIGN_OR_FAIL(const v1::SessionStats stats, child.Stats());
  EXPECT_EQ(stats.tenant(), "alice");
  EXPECT_EQ(stats.shared_pages(), stats.pages());
  KV_ASSERT_OK(child.Close().status());
  KV_ASSERT_OK(parent.Close().status());
  EXPECT_EQ(PoolInfo(alice).used_pages(), 0);
}

}  // namespace
}  // namespace kvkeep
