// Who may send a session to a store, and what it becomes there
// (docs/security.md), between real kvkeepd servers in one process: only
// configured peers may call ReceiveSession (the peer token, or a client
// certificate's name on a store with mutual TLS), on stores with and
// without tenants; an imported session belongs to a tenant the target
// knows, so it can be closed, counts against that tenant's limits and adds
// no metric series for a made-up tenant; a tenant's session moved to a
// store without tenants is usable there. Two TLS stores move a session over
// their encrypted gRPC stream and never over the plaintext data socket. And
// idle connections to a target's data socket do not hold up a transfer.
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/common/convert.h"
#include "services/kvkeepd/server_config.h"
#include "services/transfer/session_state.h"
#include "services/transfer/tcp_transport.h"
#include "tests/testing/test_server.h"
#include "tests/testing/tls_testing.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;
using testing::kTestPeerToken;
using testing::TestServer;
using testing::TestServerConfig;

ModelLayout Layout() { return testing::SmallLayout("m"); }

ServerConfig Config() { return TestServerConfig({PoolSpec{Layout(), 256}}); }

std::unique_ptr<TestServer> Start(const ServerConfig& config) {
  absl::StatusOr<std::unique_ptr<TestServer>> server =
      TestServer::Start(config);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& token = "") {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

// A session of `tenant` on `store` holding `tokens` tokens (f32 ramps).
SessionId Session(CacheStore& store, const std::string& tenant,
                  int64_t tokens) {
  SessionSpec spec;
  spec.layout = "m";
  spec.policy = {"window", {}};
  spec.budget.tokens = 64;
  spec.tenant = tenant;
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  EXPECT_TRUE(id.ok()) << id.status();
  std::vector<float> k(2 * 8), v(2 * 8);
  for (int64_t pos = 0; pos < tokens; ++pos) {
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(pos * 100 + i);
      v[i] = -k[i];
    }
    std::vector<LayerKv> kv(
        2, LayerKv{std::as_bytes(std::span(k)), std::as_bytes(std::span(v))});
    EXPECT_TRUE(store.Append(*id, AppendRequest{std::span(&pos, 1), kv}).ok());
  }
  return *id;
}

// The tokens a session holds per layer (every layer holds the same here).
int64_t Resident(CacheStore& store, SessionId id) {
  absl::StatusOr<SessionStats> stats = store.GetStats(id);
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->layer_resident[0] : -1;
}

// ReceiveSession driven by hand, as a forger (or a store) would: the header
// of an empty session's `state`, then the commit. OK once COMMITTED.
grpc::Status Import(TestServer& target, const SessionSnapshot& state,
                    const std::string& transfer_id,
                    const std::string& peer_token,
                    const std::string& tenant_token = "") {
  std::unique_ptr<grpc::ClientContext> ctx = Context(tenant_token);
  if (!peer_token.empty()) ctx->AddMetadata("kvkeep-peer-token", peer_token);
  auto stream = target.stub().ReceiveSession(ctx.get());
  v1::TransferMessage header;
  header.set_transfer_id(transfer_id);
  StateToProto(state, header.mutable_header());
  v1::TransferReply reply;
  if (stream->Write(header) && stream->Read(&reply) &&
      reply.phase() == v1::TransferReply::READY) {
    v1::TransferMessage commit;
    commit.set_commit(true);
    if (stream->Write(commit)) stream->Read(&reply);
  }
  stream->WritesDone();
  return stream->Finish();
}

// An empty session's state, as made on a scratch store, with `tenant`
// written into it.
SessionSnapshot Forged(TestServer& scratch, const std::string& tenant) {
  const SessionId id = Session(scratch.store(), "", 0);
  SessionSnapshot state = *scratch.store().ExportSession(id, false);
  state.tenant = tenant;
  return state;
}

grpc::Status Transfer(TestServer& source, SessionId id,
                      const std::string& target, const std::string& token = "",
                      const std::string& target_token = "",
                      const std::string& transport = "",
                      v1::TransferSessionResponse* out = nullptr) {
  v1::TransferSessionRequest request;
  request.set_session_id(SessionName(id));
  request.set_target(target);
  request.set_target_token(target_token);
  request.set_transport(transport);
  v1::TransferSessionResponse ignored;
  return source.stub().TransferSession(Context(token).get(), request,
                                       out != nullptr ? out : &ignored);
}

TEST(TransferSecurityTest, ReceiveSessionTakesOnlyConfiguredPeers) {
  std::unique_ptr<TestServer> scratch = Start(Config());
  std::unique_ptr<TestServer> target = Start(Config());
  ServerConfig closed = Config();
  closed.peers.token.clear();
  std::unique_ptr<TestServer> no_peers = Start(closed);

  grpc::Status s = Import(*target, Forged(*scratch, ""), "t1", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("kvkeep-peer-token"));
  s = Import(*target, Forged(*scratch, ""), "t2", "not-the-peer-token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  s = Import(*no_peers, Forged(*scratch, ""), "t3", kTestPeerToken);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("no peers are configured"));
  EXPECT_TRUE(target->store().ListSessions().empty());
  EXPECT_TRUE(no_peers->store().ListSessions().empty());

  s = Import(*target, Forged(*scratch, ""), "t4", kTestPeerToken);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(target->store().ListSessions().size(), 1u);

  // A store refused by the target keeps its session, serving.
  const SessionId id = Session(scratch->store(), "", 5);
  s = Transfer(*scratch, id, no_peers->address());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_EQ(Resident(scratch->store(), id), 5);
  EXPECT_TRUE(scratch->store().CloseSession(id).ok());
}

// A fleet changes its peer token one store at a time: a store that
// accepts the old and the new token (peers.also_accept) takes transfers
// from stores still sending the old one and from those already sending the
// new one, and from no one else.
TEST(TransferSecurityTest, AStoreAcceptsEveryTokenOfARollingChange) {
  const std::string kNew = "the-fleet-token-after-the-change";
  std::unique_ptr<TestServer> scratch = Start(Config());
  ServerConfig both = Config();
  both.peers.token = kNew;
  both.peers.also_accept = {kTestPeerToken};
  std::unique_ptr<TestServer> target = Start(both);

  grpc::Status s = Import(*target, Forged(*scratch, ""), "r1", kNew);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Import(*target, Forged(*scratch, ""), "r2", kTestPeerToken);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Import(*target, Forged(*scratch, ""), "r3", "some-other-long-token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  EXPECT_EQ(target->store().ListSessions().size(), 2u);

  // A store still sending the old token moves a session there.
  const SessionId id = Session(scratch->store(), "", 5);
  s = Transfer(*scratch, id, target->address());
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(target->store().ListSessions().size(), 3u);
  EXPECT_FALSE(scratch->store().GetStats(id).ok());
}

// On a store without tenants, an imported session is the anonymous
// tenant's, whatever its header says: anyone may close it, it counts
// against that one tenant's limits, and no series names a made-up tenant.
TEST(TransferSecurityTest, AStoreWithoutTenantsOwnsWhatItImports) {
  std::unique_ptr<TestServer> scratch = Start(Config());
  ServerConfig limited = Config();
  limited.max_sessions_per_tenant = 2;
  std::unique_ptr<TestServer> target = Start(limited);
  int committed = 0;
  for (int i = 0; i < 5; ++i) {
    const grpc::Status s =
        Import(*target, Forged(*scratch, absl::StrCat("mallory-", i)),
               absl::StrCat("m", i), kTestPeerToken);
    if (s.ok()) {
      ++committed;
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.error_message();
    }
  }
  EXPECT_EQ(committed, 2);
  const std::vector<TenantStats> tenants = target->store().Tenants();
  ASSERT_EQ(tenants.size(), 1u);
  EXPECT_EQ(tenants[0].tenant, "");
  for (const SessionInfo& info : target->store().Sessions()) {
    EXPECT_EQ(info.tenant, "");
    v1::CloseSessionRequest close;
    close.set_session_id(SessionName(info.id));
    v1::CloseSessionResponse closed;
    const grpc::Status s =
        target->stub().CloseSession(Context().get(), close, &closed);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(target->store().ListSessions().empty());
}

// With tenants, the caller's target token names the owner, which must be
// the session's tenant; a committed transfer's id is confirmed only to it.
TEST(TransferSecurityTest, AStoreWithTenantsTakesOnlyTheOwnersSessions) {
  std::unique_ptr<TestServer> scratch = Start(Config());
  ServerConfig tenants = Config();
  tenants.tenants = {{"alice", "tok-alice"}, {"bob", "tok-bob"}};
  std::unique_ptr<TestServer> target = Start(tenants);

  grpc::Status s = Import(*target, Forged(*scratch, "alice"), "a1",
                          kTestPeerToken, "tok-alice");
  ASSERT_TRUE(s.ok()) << s.error_message();
  // Bob replays alice's transfer id with a header naming alice.
  s = Import(*target, Forged(*scratch, "alice"), "a1", kTestPeerToken,
             "tok-bob");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  s = Import(*target, Forged(*scratch, "mallory"), "a2", kTestPeerToken,
             "tok-bob");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  s = Import(*target, Forged(*scratch, "alice"), "a3", kTestPeerToken);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  ASSERT_EQ(target->store().Sessions().size(), 1u);
  EXPECT_EQ(target->store().Sessions()[0].tenant, "alice");
}

// A tenant's session sent to a store without tenants serves every caller
// there (the store's one tenant), as the store's own sessions do.
TEST(TransferSecurityTest, ATenantsSessionIsUsableOnAStoreWithoutTenants) {
  ServerConfig with_tenants = Config();
  with_tenants.tenants = {{"alice", "tok-alice"}};
  std::unique_ptr<TestServer> source = Start(with_tenants);
  std::unique_ptr<TestServer> target = Start(Config());
  const SessionId id = Session(source->store(), "alice", 9);
  grpc::Status s = Transfer(*source, id, target->address(), "tok-alice");
  ASSERT_TRUE(s.ok()) << s.error_message();

  v1::GetSessionStatsRequest get;
  get.set_session_id(SessionName(id));
  v1::SessionStats stats;
  s = target->stub().GetSessionStats(Context().get(), get, &stats);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(stats.layer_resident(0), 9);
  EXPECT_EQ(stats.tenant(), "");
  v1::CloseSessionRequest close;
  close.set_session_id(SessionName(id));
  v1::CloseSessionResponse closed;
  s = target->stub().CloseSession(Context().get(), close, &closed);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// Eight connections that never say anything, held open on the target's
// data socket, and a transfer that requires it still goes over it (they
// used to be read one at a time, 2 s each, past the sender's 10 s wait).
TEST(TransferSecurityTest, IdleConnectionsToTheDataSocketDoNotHoldUpATransfer) {
  ServerConfig data = Config();
  data.transfer_listen = "127.0.0.1:0";
  std::unique_ptr<TestServer> source = Start(data);
  std::unique_ptr<TestServer> target = Start(data);
  std::vector<DataSocket> idle;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<DataSocket> s =
        DataSocket::Connect("127.0.0.1", target->server().data_port(),
                            absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(s.ok()) << s.status();
    idle.push_back(*std::move(s));
  }
  const SessionId id = Session(source->store(), "", 40);
  v1::TransferSessionResponse response;
  const grpc::Status s =
      Transfer(*source, id, target->address(), "", "", "tcp", &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.transport(), "tcp");
  EXPECT_EQ(Resident(target->store(), id), 40);
}

// Two stores with TLS and mutual TLS. The store-to-store channel is TLS
// (the target accepts nothing else); neither has a data socket, so pages
// go on the encrypted stream and "tcp" is refused before anything moves;
// a peer is admitted by its certificate's name, or by the token.
class TlsTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!tls_testing::HaveOpenssl()) {
      GTEST_SKIP() << "no " << tls_testing::kOpenssl;
    }
    std::string pattern = ::testing::TempDir() + "kvkeep_tls_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    ASSERT_TRUE(tls_testing::MakeCertificate(dir_, "store", "kvkeepd").ok());
  }
  void TearDown() override {
    if (!dir_.empty()) std::system(("rm -rf " + dir_).c_str());
  }

  // Both stores present store.pem, which (self-signed) is also the CA each
  // checks the other's certificate against.
  ServerConfig TlsConfig(bool mutual) {
    ServerConfig config = Config();
    config.tls.cert_file = dir_ + "/store.pem";
    config.tls.key_file = dir_ + "/store.key";
    if (mutual) config.tls.client_ca_file = dir_ + "/store.pem";
    config.peers.ca_file = dir_ + "/store.pem";
    return config;
  }

  std::string dir_;
};

TEST_F(TlsTransferTest, PagesMoveEncryptedAndNeverOverTheDataSocket) {
  std::unique_ptr<TestServer> source = Start(TlsConfig(false));
  std::unique_ptr<TestServer> target = Start(TlsConfig(false));
  ASSERT_NE(source, nullptr);
  ASSERT_NE(target, nullptr);
  EXPECT_EQ(target->server().data_port(), 0) << "no data socket with TLS";
  // The test's own client needs TLS too.
  grpc::SslCredentialsOptions trust;
  trust.pem_root_certs = *ReadConfigFile(dir_ + "/store.pem");
  auto stub = v1::KvKeep::NewStub(
      grpc::CreateChannel(source->address(), grpc::SslCredentials(trust)));
  const SessionId id = Session(source->store(), "", 30);
  auto transfer = [&](const std::string& transport,
                      v1::TransferSessionResponse* out) {
    v1::TransferSessionRequest request;
    request.set_session_id(SessionName(id));
    request.set_target(target->address());
    request.set_transport(transport);
    return stub->TransferSession(Context().get(), request, out);
  };
  v1::TransferSessionResponse response;
  grpc::Status s = transfer("tcp", &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("plaintext"));
  s = transfer("", &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.transport(), "host");
  EXPECT_EQ(Resident(target->store(), id), 30);
}

TEST_F(TlsTransferTest, APeerIsAdmittedByItsCertificatesName) {
  ServerConfig by_name = TlsConfig(true);
  by_name.peers.token.clear();
  by_name.peers.identities = {"kvkeepd"};
  ServerConfig other_name = by_name;
  other_name.peers.identities = {"some-other-store"};
  std::unique_ptr<TestServer> source = Start(by_name);
  std::unique_ptr<TestServer> target = Start(by_name);
  std::unique_ptr<TestServer> stranger_to = Start(other_name);
  ASSERT_TRUE(source && target && stranger_to);
  grpc::SslCredentialsOptions client;
  client.pem_root_certs = *ReadConfigFile(dir_ + "/store.pem");
  client.pem_cert_chain = client.pem_root_certs;
  client.pem_private_key = *ReadConfigFile(dir_ + "/store.key");
  auto stub = v1::KvKeep::NewStub(
      grpc::CreateChannel(source->address(), grpc::SslCredentials(client)));
  const SessionId id = Session(source->store(), "", 12);
  auto transfer = [&](TestServer& to) {
    v1::TransferSessionRequest request;
    request.set_session_id(SessionName(id));
    request.set_target(to.address());
    v1::TransferSessionResponse response;
    return stub->TransferSession(Context().get(), request, &response);
  };
  grpc::Status s = transfer(*stranger_to);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  EXPECT_TRUE(stranger_to->store().ListSessions().empty());
  s = transfer(*target);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Resident(target->store(), id), 12);
}

}  // namespace
}  // namespace kvkeep
