#include "tests/testing/test_server.h"

#include <utility>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvkeep::testing {

ModelLayout SmallLayout(std::string name) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 8;
  l.dtype = DType::kF32;
  l.page_tokens = 4;
  return l;
}

ServerConfig TestServerConfig(std::vector<PoolSpec> pools) {
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.metrics_listen = "off";
  config.transfer_listen = "off";
  config.pools = std::move(pools);
  config.drain_seconds = 5;
  config.peers.token = kTestPeerToken;
  return config;
}

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::Start(
    const ServerConfig& config, ServerHooks hooks) {
  absl::StatusOr<std::unique_ptr<KvKeepServer>> started =
      KvKeepServer::Start(config, std::move(hooks));
  if (!started.ok()) return started.status();
  auto server = std::unique_ptr<TestServer>(new TestServer());
  server->server_ = *std::move(started);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  server->channel_ = grpc::CreateCustomChannel(
      server->server_->address(), grpc::InsecureChannelCredentials(), args);
  server->stub_ = v1::KvKeep::NewStub(server->channel_);
  return server;
}

}  // namespace kvkeep::testing
