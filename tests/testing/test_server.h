// In-process test servers: KvKeepServer (built as kvkeepd builds itself) on
// a loopback port, with a channel and a stub to it. Every service test and
// benchmark starts from TestServerConfig and states only what it changes.
// Thread-safe as KvKeepServer is; destroy from one thread.
#ifndef KVKEEP_TESTS_TESTING_TEST_SERVER_H_
#define KVKEEP_TESTS_TESTING_TEST_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/channel.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/server_config.h"

namespace kvkeep::testing {

// The peer token every TestServerConfig carries, so test stores take
// each other's transfers (docs/security.md).
inline constexpr char kTestPeerToken[] = "kvkeep-test-peer-token";

// `pools` served on 127.0.0.1 (any free port) with no tenants, the peer
// token kTestPeerToken, a 5 s drain, and neither a /metrics endpoint nor a
// data socket (set metrics_listen or transfer_listen to "127.0.0.1:0" for
// one).
// A small f32 layout for service tests: 2 layers, 2 kv heads, 4 query
// heads, head_dim 8, 4-token pages (512-byte pages).
ModelLayout SmallLayout(std::string name);

ServerConfig TestServerConfig(std::vector<PoolSpec> pools);

class TestServer {
 public:
  // KvKeepServer::Start(config, hooks), and an insecure channel to it that
  // receives messages of any size.
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(
      const ServerConfig& config, ServerHooks hooks = {});

  // Stops serving (KvKeepServer::Stop); the store stays readable.
  void Stop(absl::Duration drain = absl::Seconds(5)) { server_->Stop(drain); }

  const std::string& address() const { return server_->address(); }
  KvKeepServer& server() { return *server_; }
  CacheStore& store() { return server_->store(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::KvKeep::Stub& stub() { return *stub_; }

 private:
  TestServer() = default;

  std::unique_ptr<KvKeepServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvKeep::Stub> stub_;
};

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_TESTING_TEST_SERVER_H_
