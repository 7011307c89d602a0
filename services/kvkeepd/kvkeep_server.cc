#include "services/kvkeepd/kvkeep_server.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "services/common/fleet_names.h"
#include "services/kvkeepd/parse_errors.h"
#include "services/metrics/rpc_metrics.h"

namespace kvkeep {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(
    const TlsConfig& tls) {
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "tls client_ca_file needs cert_file and key_file");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadConfigFile(tls.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadConfigFile(tls.key_file);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadConfigFile(tls.client_ca_file);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

// How this store calls other stores' ReceiveSession: TLS (presenting its
// own certificate, checking theirs against peers.ca_file, else
// tls.client_ca_file, else the system's roots) on a store with TLS;
// plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentials(
    const ServerConfig& config) {
  if (config.tls.cert_file.empty()) return nullptr;
  grpc::SslCredentialsOptions options;
  for (const std::string* ca :
       {&config.peers.ca_file, &config.tls.client_ca_file}) {
    if (ca->empty()) continue;
    absl::StatusOr<std::string> pem = ReadConfigFile(*ca);
    if (!pem.ok()) return pem.status();
    options.pem_root_certs = *std::move(pem);
    break;
  }
  absl::StatusOr<std::string> cert = ReadConfigFile(config.tls.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadConfigFile(config.tls.key_file);
  if (!key.ok()) return key.status();
  options.pem_cert_chain = *std::move(cert);
  options.pem_private_key = *std::move(key);
  return grpc::SslCredentials(options);
}

std::string BoundAddress(const std::string& listen, int port) {
  const size_t colon = listen.rfind(':');
  return absl::StrCat(listen.substr(0, colon), ":", port);
}

}  // namespace

StoreOptions StoreOptionsFor(const ServerConfig& config, const Device& device,
                             StoreObserver* observer) {
  StoreOptions options;
  options.device = device;
  options.share_pools = config.share_pools;
  options.allow_public_prefixes = config.allow_public_prefixes;
  options.observer = observer;
  options.pools = config.pools;
  options.max_sessions = config.max_sessions;
  options.max_sessions_per_tenant = config.max_sessions_per_tenant;
  options.max_bytes_per_tenant = config.max_bytes_per_tenant;
  options.unlimited_tenant = kSelfCheckTenant;
  options.lease.default_idle_timeout =
      absl::Seconds(config.session_idle_timeout_seconds);
  for (const TenantToken& t : config.tenants) {
    if (t.max_idle_timeout_seconds > 0) {
      options.lease.tenant_max_idle_timeout[t.tenant] =
          absl::Seconds(t.max_idle_timeout_seconds);
    }
  }
  return options;
}

ServiceOptions ServiceOptionsFor(const ServerConfig& config,
                                 const Device& device) {
  ServiceOptions options;
  for (const TenantToken& t : config.tenants) {
    options.tenants_by_token[t.token] = t.tenant;
  }
  options.default_policy = config.default_policy;
  options.max_sessions = config.max_sessions;
  options.max_message_bytes = config.max_message_bytes;
  options.log_events = config.log_events;
  options.backend = device.name();
  options.transfer_time_limit = absl::Seconds(config.transfer_timeout_seconds);
  options.peer_keepalive = absl::Seconds(config.peer_keepalive_seconds);
  options.transfer_resolve_attempts =
      static_cast<int>(config.transfer_resolve_attempts);
  options.transfer_resolve_wait =
      absl::Seconds(config.transfer_resolve_seconds);
  options.peer_identities = config.peers.identities;
  options.plaintext_data = config.tls.cert_file.empty();
  options.replica_name = config.replica_name;
  options.advertise_address = config.advertise_address;
  return options;
}

absl::StatusOr<std::unique_ptr<KvKeepServer>> KvKeepServer::Start(
    const ServerConfig& config, ServerHooks hooks) {
  auto server = std::unique_ptr<KvKeepServer>(new KvKeepServer(config));
  if (absl::Status s = server->Build(hooks); !s.ok()) return s;
  return server;
}

absl::Status KvKeepServer::Build(ServerHooks& hooks) {
  if (absl::Status s = ValidateConfig(config_); !s.ok()) return s;
  absl::StatusOr<PeerTokens> peer_tokens = ReadPeerTokens(config_);
  if (!peer_tokens.ok()) {
    return absl::InvalidArgumentError(peer_tokens.status().message());
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> peer_credentials =
      PeerCredentials(config_);
  if (!peer_credentials.ok()) {
    return absl::InvalidArgumentError(peer_credentials.status().message());
  }
  absl::StatusOr<Device> device = ResolveDevice(config_.device);
  if (!device.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", device.status().message()));
  }
  device_ = *device;
  // Metrics exist before the store, which reports to them from its first
  // session on (a self-check included).
  registry_ = std::make_shared<prometheus::Registry>();
  metrics_ = std::make_unique<StoreMetrics>(
      *registry_, config_.metrics_session_series, KVKEEP_VERSION);
  transfer_metrics_ = std::make_unique<TransferMetrics>(*registry_);
  event_metrics_ = std::make_unique<EventMetrics>(*registry_);
  drain_metrics_ = std::make_unique<DrainMetrics>(*registry_);
  drain_options_.peers = config_.fleet.peers;
  drain_options_.move_time = absl::Seconds(config_.fleet.move_seconds);
  drain_options_.parallelism = static_cast<int>(config_.fleet.move_parallelism);
  drain_options_.peer_token = peer_tokens->send;
  drain_options_.peer_credentials = *peer_credentials;
  StoreOptions store_options =
      StoreOptionsFor(config_, device_, metrics_.get());
  store_options.lease.clock = hooks.clock;
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(store_options);
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  if (hooks.before_serving) {
    if (absl::Status s = hooks.before_serving(*store_); !s.ok()) return s;
  }

  grpc::Service* service = nullptr;
  if (hooks.stand_in) {
    service = hooks.stand_in(*store_);
  } else {
    ServiceOptions options = ServiceOptionsFor(config_, device_);
    options.peer_token = peer_tokens->send;
    options.accepted_peer_tokens = std::move(peer_tokens->accept);
    options.peer_credentials = *std::move(peer_credentials);
    options.events.observer = event_metrics_.get();
    options.on_transfer =
        [m = transfer_metrics_.get()](const TransferReport& r) {
          m->Record(std::string(TransportName(r.transport)), r.outgoing, r.code,
                    r.bytes, r.duration);
        };
    if (const std::string data = TransferListenAddress(config_);
        !data.empty()) {
      absl::StatusOr<std::unique_ptr<TcpTransport>> tcp =
          TcpTransport::Listen(data);
      if (!tcp.ok()) return tcp.status();
      tcp_ = *std::move(tcp);
      options.tcp = tcp_.get();
    }
    if (hooks.edit_service_options) hooks.edit_service_options(options);
    service_ =
        std::make_unique<KvKeepService>(store_.get(), std::move(options));
    service = service_.get();
  }
  // Every second at least: a lease is never shorter (kMinIdleTimeout).
  reaper_ = std::make_unique<LeaseReaper>(
      store_.get(), absl::Seconds(1),
      [s = service_.get()](const ExpiredSession& expired) {
        if (s == nullptr) return;
        s->LogExpired(expired);
        s->events().SessionEnded(v1::EVENT_SESSION_EXPIRED, expired.info.id,
                                 SessionEventOf(expired));
      });
  if (absl::Status s = Listen(service); !s.ok()) return s;

  if (config_.metrics_listen != "off") {
    // Sessions are labelled as this replica's calls name them.
    collector_ = std::make_shared<StoreCollector>(
        *store_, *metrics_, [replica = config_.replica_name](SessionId id) {
          return FleetSessionId(replica, id);
        });
    absl::StatusOr<std::pair<std::string, std::string>> auth =
        ReadMetricsAuth(config_);
    if (!auth.ok()) return absl::InvalidArgumentError(auth.status().message());
    MetricsServerOptions options{.address = config_.metrics_listen,
                                 .auth_user = auth->first,
                                 .auth_password = auth->second};
    absl::StatusOr<std::unique_ptr<MetricsServer>> http =
        MetricsServer::Start(options, {registry_, collector_});
    if (!http.ok()) return http.status();  // the destructor stops the rest
    metrics_server_ = *std::move(http);
  }
  return absl::OkStatus();
}

absl::Status KvKeepServer::Listen(grpc::Service* service) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      Credentials(config_.tls);
  if (!credentials.ok()) {
    return absl::InvalidArgumentError(credentials.status().message());
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config_.listen, *credentials, &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
  // Large HTTP/2 frames and a deep window for ReceiveSession's chunks (a
  // session's pages arrive in 4 MiB chunks); small calls are unaffected.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  // Peers ping to see that a transfer's target is alive
  // (peer_keepalive_seconds, at least 1 s): allowed without calls and
  // without data, and at up to twice that rate (a ping early by jitter is
  // no strike).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.RegisterService(service);
  std::vector<std::string> methods = MethodsOf({"kvkeep.v1.KvKeep"});
  for (const char* m :
       {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}) {
    methods.push_back(m);
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  // First, so the metrics count the code the client receives.
  interceptors.push_back(NewParseErrorInterceptorFactory({"kvkeep.v1.KvKeep"}));
  interceptors.push_back(NewRpcMetricsFactory(*registry_, std::move(methods)));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", config_.listen));
  }
  address_ = BoundAddress(config_.listen, port_);
  // Without an advertise_address, a store bound to one interface is reached
  // where it listens; one bound to every interface names no address.
  if (service_ != nullptr && config_.advertise_address.empty() &&
      !absl::StartsWith(address_, "0.0.0.0:") &&
      !absl::StartsWith(address_, "[::]:")) {
    service_->set_address(address_);
  }
  return absl::OkStatus();
}

void KvKeepServer::Stop(absl::Duration drain) {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_ || server_ == nullptr) return;
  stopped_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (service_ != nullptr && !drain_options_.peers.empty()) {
    drain_metrics_->Started();
    drain_report_ = DrainByMigration(*service_, drain_options_);
    drain_metrics_->Finished(drain_report_.moved, drain_report_.unmoved,
                             drain_report_.duration);
    absl::SleepFor(absl::Seconds(config_.fleet.linger_seconds));
  }
  const absl::Time end = absl::Now() + drain;
  // Transfers still sending at three quarters of the grace are cancelled
  // (before their commit: the session stays here), so each caller hears
  // how its transfer ended before the server cancels what is left.
  std::thread transfers;
  if (service_ != nullptr) {
    transfers = std::thread(
        [this, at = end - drain / 4] { service_->DrainTransfers(at); });
  }
  // Watch streams never end by themselves: ended now, they do not hold
  // the drain to its deadline.
  if (service_ != nullptr) service_->events().Shutdown();
  server_->Shutdown(absl::ToChronoTime(end));
  server_->Wait();
  if (transfers.joinable()) transfers.join();
}

std::string KvKeepServer::metrics_address() const {
  return metrics_server_ != nullptr ? metrics_server_->address() : "";
}

KvKeepServer::~KvKeepServer() {
  Stop(absl::Seconds(config_.drain_seconds));
  // The shutdown order of the header comment.
  server_.reset();
  reaper_.reset();
  service_.reset();
  tcp_.reset();
  metrics_server_.reset();
  collector_.reset();
  store_.reset();
  transfer_metrics_.reset();
  event_metrics_.reset();
  drain_metrics_.reset();
  metrics_.reset();
}

}  // namespace kvkeep
