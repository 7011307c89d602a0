// What the transfer tests share: TransferStore, a kvkeepd (KvKeepServer)
// serving one pool on a loopback port with a data socket for incoming
// transfers and a client to it, and TransferSession, the TransferSession
// call with a deadline. Header-only (links kvkeep::client and
// kvkeep::server_testing). A TransferStore is used from one test thread;
// the server behind it is as thread-safe as KvKeepServer.
#ifndef KVKEEP_TESTS_TESTING_TRANSFER_STORE_H_
#define KVKEEP_TESTS_TESTING_TRANSFER_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/client_context.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "tests/testing/test_server.h"

namespace kvkeep::testing {

class TransferStore {
 public:
  // `pool` on `device` ("host" or "cuda:N"); `data_listen` is its data
  // socket's address (empty: none); `options` gives its outgoing
  // transfers' page-sender wrapper (faults).
  explicit TransferStore(PoolSpec pool, ServiceOptions options = {},
                         std::string device = "host",
                         const std::string& data_listen = "127.0.0.1:0") {
    ServerConfig config = TestServerConfig({std::move(pool)});
    config.device = std::move(device);
    config.transfer_listen = data_listen.empty() ? "off" : data_listen;
    ServerHooks hooks;
    hooks.edit_service_options =
        [wrap = std::move(options.wrap_transfer_sender)](ServiceOptions& o) {
          o.wrap_transfer_sender = wrap;
        };
    server_ = *KvKeepServer::Start(config, std::move(hooks));
    client::ClientOptions client_options;
    client_options.address = address();
    client_ = std::make_unique<client::KvKeepClient>(
        *client::KvKeepClient::Connect(client_options));
  }
  void Stop() { server_->Stop(absl::Seconds(5)); }

  CacheStore& store() { return server_->store(); }
  const std::string& address() const { return server_->address(); }
  client::KvKeepClient& client() { return *client_; }
  int64_t used_pages() { return store().Layouts()[0].pool.used_pages; }
  int data_port() const { return server_->data_port(); }

 private:
  std::unique_ptr<KvKeepServer> server_;
  std::unique_ptr<client::KvKeepClient> client_;
};

// `from` moves `session` to `target` (TransferSession) within `deadline`.
inline grpc::Status TransferSession(TransferStore& from,
                                    const std::string& session,
                                    const std::string& target,
                                    v1::TransferSessionResponse* out,
                                    const std::string& transfer_id = "",
                                    absl::Duration deadline = absl::Seconds(60),
                                    const std::string& transport = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::TransferSessionRequest request;
  request.set_session_id(session);
  request.set_target(target);
  request.set_transfer_id(transfer_id);
  request.set_transport(transport);
  return from.client().stub().TransferSession(&ctx, request, out);
}

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_TESTING_TRANSFER_STORE_H_
