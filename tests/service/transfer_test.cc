// TransferSession over the host transport, between real kvkeepd gRPC
// servers in one process (each with its own store and port): a session
// moves with every byte, version and score, and then decodes exactly as it
// would have where it was; when the target is full or unreachable, a chunk
// is corrupted or the deadline passes, the session stays on the source,
// unchanged and serving, and the target holds no page; a session being sent
// takes no changes. The same against a target whose ReceiveSession is the
// raw reactor (chunks read in place).
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "services/transfer/session_receiver.h"
#include "services/transfer/session_state.h"
#include "services/transfer/tcp_transport.h"
#include "services/transfer/transfer_coordinator.h"
#include "tests/testing/faulty_page_sender.h"
#include "tests/testing/metrics_testing.h"
#include "tests/testing/test_server.h"
#include "tests/testing/transfer_store.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

ModelLayout Layout(int32_t head_dim = 8) {
  ModelLayout l;
  l.name = "m";
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = head_dim;
  l.dtype = DType::kF32;
  l.page_tokens = 4;
  return l;
}

// A store of Layout(head_dim) (testing::TransferStore).
class Store : public testing::TransferStore {
 public:
  explicit Store(int64_t pages, ServiceOptions options = {}, Device device = {},
                 int32_t head_dim = 8,
                 const std::string& data_listen = "127.0.0.1:0")
      : TransferStore(PoolSpec{Layout(head_dim), pages}, std::move(options),
                      device.name(), data_listen) {}
};

// A target whose ReceiveSession is registered raw, as a service switches to
// it (session_receiver.h): its own store and transfer log, nothing else.
class RawTarget {
 public:
  explicit RawTarget(int64_t pages) {
    ServerHooks hooks;
    hooks.stand_in = [this](CacheStore& store) {
      service_ = std::make_unique<Service>(&store, &log_);
      return service_.get();
    };
    server_ = *KvKeepServer::Start(
        testing::TestServerConfig({PoolSpec{Layout(), pages}}),
        std::move(hooks));
  }
  ~RawTarget() { server_->Stop(absl::Seconds(5)); }
  CacheStore& store() { return server_->store(); }
  const std::string& address() const { return server_->address(); }
  int64_t used_pages() { return store().Layouts()[0].pool.used_pages; }

 private:
  class Service final : public v1::KvKeep::CallbackService {
   public:
    Service(CacheStore* store, TransferLog* log) {
      MarkMethodRawCallback(ReceiveSessionMethodIndex(),
                            RawReceiveSessionHandler(
                                [store, log](grpc::CallbackServerContext* ctx) {
                                  return NewReceiveReactor(
                                      store, log, ctx, std::string(),
                                      /*tenants_configured=*/false, nullptr,
                                      nullptr, nullptr);
                                }));
    }
  };

  TransferLog log_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<KvKeepServer> server_;  // last: stops before the rest
};

using testing::TransferSession;

// A session of `policy` on `store` after 40 decode steps with queries.
client::Session Decoded(Store& store, const std::string& policy,
                        std::mt19937& rng) {
  absl::StatusOr<client::Session> s =
      metrics_testing::OpenSession(store.client(), "m", policy, 12);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(metrics_testing::DecodeWithQueries(*s, 40, 0, rng).ok());
  return *std::move(s);
}

// One decode step (a token and queries) as the same message for any store.
v1::DecodeStep MakeStep(const std::string& session, int64_t position,
                        const std::vector<uint64_t>& versions,
                        std::mt19937& rng) {
  v1::DecodeStep step;
  step.set_session_id(session);
  v1::Layout layout;
  layout.set_num_layers(2);
  layout.set_kv_heads(2);
  layout.set_head_dim(8);
  client::TokensToProto(metrics_testing::RandomTokens(layout, {position}, rng),
                        step.mutable_append());
  std::normal_distribution<float> normal;
  std::vector<float> q(4 * 8);
  for (int32_t l = 0; l < 2; ++l) {
    for (float& x : q) x = normal(rng);
    *step.add_scores() = client::QueryScores(l, versions[l], q);
  }
  return step;
}

// The transfer tests run over each transport a plain transfer between two
// stores can use: chunk messages on the stream ("host") and the target's
// data socket ("tcp").
class EachTransport : public ::testing::TestWithParam<std::string> {};

TEST_P(EachTransport, ASessionMovesAndDecodesAsItWouldHave) {
  const std::string transport = GetParam();
  Store source(256), target(256), reference(256);
  std::mt19937 rng(1);
  for (const std::string policy : {"h2o", "tova", "scissorhands"}) {
    SCOPED_TRACE(policy);
    const client::Session s = Decoded(source, policy, rng);
    const SessionId id = *ParseSessionName(s.id());
    // The reference: the same state, restored in a third store.
    ASSERT_TRUE(reference.store()
                    .ImportSession(*source.store().ExportSession(id))
                    .ok());
    v1::TransferSessionResponse response;
    const grpc::Status status =
        TransferSession(source, s.id(), target.address(), &response, "",
                        absl::Seconds(60), transport);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.session_id(), s.id());
    EXPECT_EQ(response.transport(), transport);
    EXPECT_GT(response.bytes(), 0);
    EXPECT_EQ(source.store().GetStats(id).status().code(),
              absl::StatusCode::kNotFound);

    // Byte for byte, slot for slot.
    for (int32_t l = 0; l < 2; ++l) {
      const LayerKvCopy a = *target.store().ReadLayer(id, l);
      const LayerKvCopy b = *reference.store().ReadLayer(id, l);
      EXPECT_EQ(a.version, b.version);
      EXPECT_EQ(a.positions, b.positions);
      EXPECT_TRUE(a.keys == b.keys && a.values == b.values);
    }
    // The next steps evict the same tokens on the target as they would have
    // where the session was.
    absl::StatusOr<client::Session> moved = target.client().OpenSession(s.id());
    absl::StatusOr<client::Session> ref =
        reference.client().OpenSession(s.id());
    ASSERT_TRUE(moved.ok() && ref.ok());
    client::DecodeStream on_target = moved->Decode();
    client::DecodeStream on_reference = ref->Decode();
    std::vector<uint64_t> versions = target.store().GetStats(id)->layer_version;
    for (int64_t p = 100; p < 140; ++p) {
      std::mt19937 step_rng(p);
      const v1::DecodeStep step = MakeStep(s.id(), p, versions, step_rng);
      absl::StatusOr<v1::DecodeStepResult> x = on_target.Step(step);
      absl::StatusOr<v1::DecodeStepResult> y = on_reference.Step(step);
      ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
      for (int32_t l = 0; l < 2; ++l) {
        const v1::LayerChange& a = x->scores().layers(l);
        const v1::LayerChange& b = y->scores().layers(l);
        EXPECT_THAT(a.evicted_positions(),
                    ::testing::ElementsAreArray(b.evicted_positions()));
        EXPECT_EQ(a.version(), b.version());
        versions[l] = a.version();
      }
    }
    ASSERT_TRUE(on_target.Finish().ok());
    ASSERT_TRUE(on_reference.Finish().ok());
  }
  EXPECT_EQ(source.used_pages(), 0);
}

// The session's lease goes with it: the target keeps the length the create
// asked for, not its own default (3600 s in these stores).
TEST(TransferTest, TheLeaseTravelsWithTheSession) {
  Store source(256), target(256);
  v1::CreateSessionRequest request;
  request.set_layout("m");
  request.set_policy("h2o");
  request.mutable_budget()->set_tokens(12);
  request.set_idle_timeout_seconds(123);
  absl::StatusOr<client::Session> s = source.client().CreateSession(request);
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937 rng(3);
  ASSERT_TRUE(metrics_testing::DecodeWithQueries(*s, 20, 0, rng).ok());
  v1::TransferSessionResponse response;
  const grpc::Status status =
      TransferSession(source, s->id(), target.address(), &response, "",
                      absl::Seconds(60), "tcp");
  ASSERT_TRUE(status.ok()) << status.error_message();
  absl::StatusOr<v1::SessionStats> there =
      target.client().GetSessionStats(s->id());
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->idle_timeout_seconds(), 123);
}

// A committed move is told (OutgoingTransfer::on_commit) before the session
// closes here, so that a call which finds it gone can already be told where
// it went (a draining replica's redirect, docs/fleet.md); a move that fails
// is never told.
TEST(TransferTest, TheCommitIsToldBeforeTheSessionClosesHere) {
  Store source(256), target(256), full(1);
  std::mt19937 rng(5);
  const client::Session s = Decoded(source, "h2o", rng);
  const SessionId id = *ParseSessionName(s.id());
  // A second coordinator on the source's store, to watch the commit.
  TransferOptions options;
  options.peer_token = testing::kTestPeerToken;
  TransferCoordinator coordinator(&source.store(), options);
  auto send = [&](const std::string& to, int* told, absl::Status* at_commit) {
    OutgoingTransfer transfer;
    transfer.id = id;
    transfer.target = to;
    transfer.transport = Transport::kHost;
    transfer.deadline = absl::Now() + absl::Seconds(60);
    transfer.on_commit = [&, told, at_commit](const std::string&) {
      ++*told;
      *at_commit = source.store().GetStats(id, false).status();
    };
    absl::Notification done;
    TransferOutcome outcome;
    coordinator.Send(std::move(transfer), [&](const TransferOutcome& o) {
      outcome = o;
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(90)));
    return outcome.status;
  };
  int told = 0;
  absl::Status at_commit = absl::UnknownError("not told");
  EXPECT_FALSE(send(full.address(), &told, &at_commit).ok());
  EXPECT_EQ(told, 0);
  EXPECT_TRUE(source.store().GetStats(id, false).ok());  // still serving here

  const absl::Status sent = send(target.address(), &told, &at_commit);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(told, 1);
  EXPECT_TRUE(at_commit.ok())
      << "told after the session closed here: " << at_commit;
  EXPECT_EQ(source.store().GetStats(id, false).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(target.store().GetStats(id, false).ok());
}

// A session started from a named prefix protects the prefix's tokens
// (PolicySpec.protect_first); moved to another store, it still does: the
// target keeps every prefix token resident however much it evicts after.
TEST(TransferTest, AChildOfAPrefixKeepsItsProtectedTokensWhenMoved) {
  Store source(256), target(256);
  absl::StatusOr<client::Session> parent =
      metrics_testing::OpenSession(source.client(), "m", "h2o", 12);
  ASSERT_TRUE(parent.ok()) << parent.status();
  std::mt19937 rng(11);
  constexpr int64_t kPrefixTokens = 8;
  ASSERT_TRUE(
      metrics_testing::DecodeWithQueries(*parent, kPrefixTokens, 0, rng).ok());
  ASSERT_TRUE(parent->Publish("tools").ok());
  v1::CreateSessionRequest from_prefix;
  from_prefix.set_prefix("tools");
  // window evicts the oldest unprotected tokens: without the protection,
  // the prefix's would be the first to go.
  from_prefix.set_policy("window");
  from_prefix.mutable_budget()->set_tokens(12);
  absl::StatusOr<client::Session> child =
      source.client().CreateSession(from_prefix);
  ASSERT_TRUE(child.ok()) << child.status();
  v1::TransferSessionResponse response;
  const grpc::Status status =
      TransferSession(source, child->id(), target.address(), &response, "",
                      absl::Seconds(60), "tcp");
  ASSERT_TRUE(status.ok()) << status.error_message();
  const SessionId id = *ParseSessionName(child->id());
  absl::StatusOr<SessionSnapshot> there =
      target.store().ExportSession(id, /*with_bytes=*/false);
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->policy.protect_first, kPrefixTokens);
  // 24 more tokens into a budget of 12: 24 evictions per layer, none of
  // them a prefix token.
  absl::StatusOr<client::Session> moved =
      target.client().OpenSession(child->id());
  ASSERT_TRUE(moved.ok()) << moved.status();
  ASSERT_TRUE(metrics_testing::DecodeWithQueries(*moved, 24, kPrefixTokens, rng,
                                                 /*with_queries=*/false)
                  .ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    absl::StatusOr<LayerKvCopy> kv = target.store().ReadLayer(id, layer);
    ASSERT_TRUE(kv.ok()) << kv.status();
    for (int64_t p = 0; p < kPrefixTokens; ++p) {
      EXPECT_THAT(kv->positions, ::testing::Contains(p))
          << "layer " << layer << " lost prefix token " << p;
    }
  }
}

// Whether a target that refused or lost a transfer gives back every page it
// reserved. It may do so just after the sender has its answer (a receive
// beside the stream is cleaned up off gRPC's threads), so this waits, up to
// a limit that only a leak reaches.
bool Emptied(Store& target) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (target.used_pages() != 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return target.used_pages() == 0;
}

// The source session after a failed transfer: there, unchanged, serving.
void ExpectServedUnchanged(Store& source, const client::Session& s,
                           const LayerKvCopy& before, std::mt19937& rng) {
  const SessionId id = *ParseSessionName(s.id());
  const LayerKvCopy now = *source.store().ReadLayer(id, 1);
  EXPECT_EQ(now.positions, before.positions);
  EXPECT_TRUE(now.keys == before.keys);
  EXPECT_TRUE(metrics_testing::DecodeWithQueries(s, 3, 1000, rng).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, EachTransport,
                         ::testing::Values("host", "tcp"),
                         [](const auto& info) { return info.param; });

// The transport is chosen per transfer: host pools have no NCCL, so "nccl"
// is refused before the session is touched, "auto" picks the target's data
// socket, and anything else is a bad argument.
TEST(TransferTest, TheTransportIsChosenPerTransfer) {
  Store source(256), target(256);
  std::mt19937 rng(7);
  const client::Session s = Decoded(source, "h2o", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  v1::TransferSessionResponse response;
  grpc::Status status =
      TransferSession(source, s.id(), target.address(), &response, "",
                      absl::Seconds(60), "nccl");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("host memory"));
  status = TransferSession(source, s.id(), target.address(), &response, "",
                           absl::Seconds(60), "carrier-pigeon");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectServedUnchanged(source, s, before, rng);
  EXPECT_TRUE(Emptied(target));

  status = TransferSession(source, s.id(), target.address(), &response, "",
                           absl::Seconds(60), "auto");
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.transport(), "tcp");
}

// Against a target whose data socket cannot serve this transfer: "tcp" is
// refused with `code` and `why`, the session still serving here and nothing
// held there; then "auto" sends chunk messages on the stream, which the
// target takes, byte for byte.
void ExpectTcpRefusedAndChunksTaken(Store& target, grpc::StatusCode code,
                                    const std::string& why) {
  Store source(256);
  std::mt19937 rng(8);
  const client::Session s = Decoded(source, "tova", rng);
  const SessionId id = *ParseSessionName(s.id());
  const LayerKvCopy before = *source.store().ReadLayer(id, 1);
  v1::TransferSessionResponse response;
  grpc::Status status =
      TransferSession(source, s.id(), target.address(), &response, "",
                      absl::Seconds(60), "tcp");
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(why));
  ExpectServedUnchanged(source, s, before, rng);
  EXPECT_TRUE(Emptied(target));

  const LayerKvCopy sent = *source.store().ReadLayer(id, 1);
  status = TransferSession(source, s.id(), target.address(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.transport(), "host");
  absl::StatusOr<LayerKvCopy> arrived = target.store().ReadLayer(id, 1);
  ASSERT_TRUE(arrived.ok()) << arrived.status();
  EXPECT_EQ(arrived->positions, sent.positions);
  EXPECT_TRUE(arrived->keys == sent.keys && arrived->values == sent.values);
}

// A target without a data socket refuses "tcp" before any byte moves.
TEST(TransferTest, ATargetWithoutADataSocketTakesChunkMessages) {
  Store target(256, {}, {}, 8, /*data_listen=*/"");
  ExpectTcpRefusedAndChunksTaken(target, grpc::StatusCode::FAILED_PRECONDITION,
                                 "no data socket");
}

// A data socket the sender cannot reach (here: it listens on another
// loopback address than the target's gRPC one): "tcp" fails; "auto" falls
// back to chunk messages on the same stream.
TEST(TransferTest, AnUnreachableDataSocketFallsBackToChunkMessages) {
  Store target(256, {}, {}, 8, /*data_listen=*/"127.0.0.2:0");
  ExpectTcpRefusedAndChunksTaken(target, grpc::StatusCode::UNAVAILABLE,
                                 "transport 'tcp'");
}

// Connections to the data socket that present no ticket, or one it never
// gave, are closed without disturbing the transfers that follow.
TEST(TransferTest, StrangersOnTheDataSocketAreTurnedAway) {
  Store source(256), target(256);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (const std::string& hello :
       {std::string("GET / HTTP/1.1\r\n\r\n"),
        std::string("KVKDATA1") + std::string(16, 'x')}) {
    absl::StatusOr<DataSocket> stranger =
        DataSocket::Connect("127.0.0.1", target.data_port(), deadline);
    ASSERT_TRUE(stranger.ok()) << stranger.status();
    std::string bytes = hello;
    iovec v{bytes.data(), bytes.size()};
    ASSERT_TRUE(stranger->Send({&v, 1}, deadline).ok());
    char c;
    iovec r{&c, 1};
    EXPECT_EQ(stranger->Receive({&r, 1}, deadline).code(),
              absl::StatusCode::kUnavailable)
        << "closed by the target";
  }
  std::mt19937 rng(10);
  const client::Session s = Decoded(source, "h2o", rng);
  v1::TransferSessionResponse response;
  const grpc::Status status =
      TransferSession(source, s.id(), target.address(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.transport(), "tcp");
}

// Two GPU pools: the pages move pool to pool over NCCL, byte for byte, and
// later transfers between the same stores reuse the communicator. To a host
// pool, "auto" falls back to the host transport and "nccl" is refused with
// the session left serving. Needs two CUDA devices (skipped otherwise).
TEST(TransferNcclTest, GpuPoolsMoveTheirPagesOverNccl) {
  if (CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs two CUDA devices (this machine has "
                 << CudaDeviceCount() << ")";
  }
  Store source(256, {}, Device{Device::Kind::kCuda, 0}, 64);
  Store target(256, {}, Device{Device::Kind::kCuda, 1}, 64);
  Store reference(256, {}, Device{}, 64);
  Store host_target(256, {}, Device{}, 64);
  std::mt19937 rng(8);
  for (int round = 0; round < 2; ++round) {  // the second reuses the link
    SCOPED_TRACE(round);
    const client::Session s = Decoded(source, "h2o", rng);
    const SessionId id = *ParseSessionName(s.id());
    ASSERT_TRUE(reference.store()
                    .ImportSession(*source.store().ExportSession(id))
                    .ok());
    v1::TransferSessionResponse response;
    const grpc::Status status =
        TransferSession(source, s.id(), target.address(), &response, "",
                        absl::Seconds(120), round == 0 ? "nccl" : "auto");
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.transport(), "nccl");
    for (int32_t l = 0; l < 2; ++l) {
      const LayerKvCopy a = *target.store().ReadLayer(id, l);
      const LayerKvCopy b = *reference.store().ReadLayer(id, l);
      EXPECT_EQ(a.version, b.version);
      EXPECT_EQ(a.positions, b.positions);
      EXPECT_TRUE(a.keys == b.keys && a.values == b.values);
    }
    EXPECT_TRUE(metrics_testing::DecodeWithQueries(
                    *target.client().OpenSession(s.id()), 5, 1000, rng)
                    .ok());
  }
  const client::Session s = Decoded(source, "tova", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  v1::TransferSessionResponse response;
  grpc::Status status =
      TransferSession(source, s.id(), host_target.address(), &response, "",
                      absl::Seconds(60), "nccl");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectServedUnchanged(source, s, before, rng);
  EXPECT_EQ(host_target.used_pages(), 0);
  status = TransferSession(source, s.id(), host_target.address(), &response, "",
                           absl::Seconds(60), "auto");
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.transport(), "host");
}

TEST_P(EachTransport, AFullTargetRefusesBeforeAnyByteMoves) {
  const std::string transport = GetParam();
  Store source(256), target(4);
  std::mt19937 rng(2);
  const client::Session s = Decoded(source, "h2o", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  v1::TransferSessionResponse response;
  const grpc::Status status =
      TransferSession(source, s.id(), target.address(), &response, "",
                      absl::Seconds(60), transport);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("stays here"));
  EXPECT_TRUE(Emptied(target));
  EXPECT_TRUE(target.store().ListSessions().empty());
  ExpectServedUnchanged(source, s, before, rng);
}

TEST_P(EachTransport, ACorruptedChunkIsCaughtAndARetrySucceeds) {
  const std::string transport = GetParam();
  std::atomic<bool> corrupt{true};
  ServiceOptions options;
  options.wrap_transfer_sender = testing::FaultyTransport([&](int64_t chunk) {
    testing::ChunkFault fault;
    fault.corrupt = corrupt && chunk == 1;
    fault.in_values = true;
    fault.byte = 3;
    fault.mask = 0x40;
    return fault;
  });
  Store source(256, options), target(256);
  std::mt19937 rng(3);
  const client::Session s = Decoded(source, "h2o", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  v1::TransferSessionResponse response;
  grpc::Status status =
      TransferSession(source, s.id(), target.address(), &response, "t-1",
                      absl::Seconds(60), transport);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("CRC32C"));
  EXPECT_TRUE(Emptied(target));
  ExpectServedUnchanged(source, s, before, rng);

  corrupt = false;
  status = TransferSession(source, s.id(), target.address(), &response, "t-2",
                           absl::Seconds(60), transport);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.transport(), transport);
  EXPECT_TRUE(target.store().GetStats(*ParseSessionName(s.id())).ok());
}

TEST_P(EachTransport, AnUnreachableTargetLeavesTheSessionServing) {
  const std::string transport = GetParam();
  Store source(256);
  std::string gone;
  {
    Store target(256);
    gone = target.address();
  }
  std::mt19937 rng(4);
  const client::Session s = Decoded(source, "tova", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  v1::TransferSessionResponse response;
  const grpc::Status status = TransferSession(source, s.id(), gone, &response,
                                              "", absl::Seconds(60), transport);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  ExpectServedUnchanged(source, s, before, rng);
}

TEST_P(EachTransport, ASessionBeingSentTakesNoChangesAndADeadlineAbortsIt) {
  const std::string transport = GetParam();
  absl::Notification sending;
  absl::Notification release;
  ServiceOptions options;
  options.wrap_transfer_sender = testing::FaultyTransport([&](int64_t chunk) {
    if (chunk == 0) {
      sending.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(30));
    }
    return testing::ChunkFault{};
  });
  Store source(256, options), target(256);
  std::mt19937 rng(5);
  const client::Session s = Decoded(source, "h2o", rng);
  const LayerKvCopy before =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  grpc::Status status;
  std::thread caller([&] {
    v1::TransferSessionResponse response;
    status = TransferSession(source, s.id(), target.address(), &response, "",
                             absl::Milliseconds(500), transport);
  });
  sending.WaitForNotification();
  // Frozen: a step is refused with a status that says why; reads work.
  const absl::Status step = metrics_testing::DecodeWithQueries(s, 1, 2000, rng);
  EXPECT_EQ(step.code(), absl::StatusCode::kUnavailable) << step;
  EXPECT_THAT(std::string(step.message()), HasSubstr("being transferred"));
  EXPECT_TRUE(s.Stats().ok());
  caller.join();  // the deadline passes while the send is held
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << status.error_message();
  // Held well past the deadline (the send shares the caller's deadline; a
  // send released right at it could still commit, which is allowed: the
  // caller then finds the session on the target).
  absl::SleepFor(absl::Seconds(1));
  release.Notify();
  // The send fails on its deadline too and thaws the session.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until &&
         !metrics_testing::DecodeWithQueries(s, 1, 3000, rng).ok()) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const LayerKvCopy after =
      *source.store().ReadLayer(*ParseSessionName(s.id()), 1);
  EXPECT_GT(after.version, before.version) << "it serves again";
  EXPECT_TRUE(Emptied(target));
  EXPECT_TRUE(target.store().ListSessions().empty());
}

TEST(TransferTest, ARawTargetReceivesTheSameSessionAndChecksEveryChunk) {
  std::atomic<bool> corrupt{true};
  ServiceOptions options;
  options.wrap_transfer_sender = testing::FaultyTransport([&](int64_t chunk) {
    testing::ChunkFault fault;
    fault.corrupt = corrupt && chunk == 1;
    fault.byte = 5;
    fault.mask = 0x02;
    return fault;
  });
  Store source(256, options), reference(256);
  RawTarget target(256), full(4);
  std::mt19937 rng(6);
  const client::Session s = Decoded(source, "h2o", rng);
  const SessionId id = *ParseSessionName(s.id());
  ASSERT_TRUE(
      reference.store().ImportSession(*source.store().ExportSession(id)).ok());
  const LayerKvCopy before = *source.store().ReadLayer(id, 1);
  v1::TransferSessionResponse response;

  grpc::Status status =
      TransferSession(source, s.id(), full.address(), &response, "raw-1");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_EQ(full.used_pages(), 0);

  status =
      TransferSession(source, s.id(), target.address(), &response, "raw-2");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("CRC32C"));
  EXPECT_EQ(target.used_pages(), 0);
  EXPECT_TRUE(target.store().ListSessions().empty());
  ExpectServedUnchanged(source, s, before, rng);

  corrupt = false;
  const SessionSnapshot sent = *source.store().ExportSession(id);
  status =
      TransferSession(source, s.id(), target.address(), &response, "raw-3");
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (int32_t l = 0; l < 2; ++l) {
    const LayerKvCopy a = *target.store().ReadLayer(id, l);
    EXPECT_EQ(a.positions, sent.layers[l].position);
    EXPECT_TRUE(a.keys == sent.layers[l].keys &&
                a.values == sent.layers[l].values);
  }
  EXPECT_EQ(source.used_pages(), 0);
}

TEST(TransferTest, ARawTargetHoldsTheBytesByteForByte) {
  Store source(256), reference(256);
  RawTarget target(256);
  std::mt19937 rng(7);
  for (const std::string policy : {"tova", "scissorhands"}) {
    const client::Session s = Decoded(source, policy, rng);
    const SessionId id = *ParseSessionName(s.id());
    ASSERT_TRUE(reference.store()
                    .ImportSession(*source.store().ExportSession(id))
                    .ok());
    v1::TransferSessionResponse response;
    const grpc::Status status =
        TransferSession(source, s.id(), target.address(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    for (int32_t l = 0; l < 2; ++l) {
      const LayerKvCopy a = *target.store().ReadLayer(id, l);
      const LayerKvCopy b = *reference.store().ReadLayer(id, l);
      EXPECT_EQ(a.version, b.version);
      EXPECT_EQ(a.positions, b.positions);
      EXPECT_TRUE(a.keys == b.keys && a.values == b.values);
    }
    const SessionSnapshot a = *target.store().ExportSession(id);
    const SessionSnapshot b = *reference.store().ExportSession(id);
    ASSERT_EQ(a.layers.size(), b.layers.size());
    for (size_t l = 0; l < a.layers.size(); ++l) {
      EXPECT_EQ(a.layers[l].score, b.layers[l].score);
      EXPECT_EQ(a.layers[l].arrival, b.layers[l].arrival);
    }
  }
}

TEST(TransferTest, ARawTargetReadsLargeChunksSplitAcrossSlices) {
  // 6000 tokens of 64 bytes per layer: each layer is a chunk of ~750 KiB,
  // which arrives in many slices whose boundaries cut tokens in two.
  Store source(4096);
  RawTarget target(4096);
  const SessionId id =
      *source.store().CreateSession(SessionSpec{"m", {"full", {}}, {}});
  std::mt19937 rng(10);
  constexpr int64_t kTokens = 6000;
  constexpr int64_t kTokenBytes = 2 * 8 * sizeof(float);
  std::vector<std::byte> keys(kTokens * kTokenBytes), values(keys.size());
  for (std::byte& b : keys) b = static_cast<std::byte>(rng());
  for (std::byte& b : values) b = static_cast<std::byte>(rng());
  std::vector<int64_t> positions(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) positions[i] = i;
  const std::vector<LayerKv> layers(2, LayerKv{keys, values});
  ASSERT_TRUE(source.store().Append(id, AppendRequest{positions, layers}).ok());
  v1::TransferSessionResponse response;
  const grpc::Status status =
      TransferSession(source, SessionName(id), target.address(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.bytes(), 2 * 2 * kTokens * kTokenBytes);
  for (int32_t l = 0; l < 2; ++l) {
    const LayerKvCopy a = *target.store().ReadLayer(id, l);
    EXPECT_EQ(a.positions, positions);
    EXPECT_TRUE(a.keys == keys && a.values == values) << "layer " << l;
  }
}

}  // namespace
}  // namespace kvkeep
