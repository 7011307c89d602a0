// KvKeepServer: one kvkeepd, assembled from a ServerConfig. The daemon
// (main.cc), the in-process service tests and the benchmarks all start
// their servers through it, so a test server is built as kvkeepd is.
//
// It owns, in the order they are built: the metrics registry and the
// store's metrics (StoreMetrics, the store's observer), the store
// (CacheStore on the configured device), the data socket for incoming
// transfers (TcpTransport, unless transfer_listen is "off"), the service
// (KvKeepService; its TransferCoordinator holds the NCCL links), the lease
// reaper (LeaseReaper: closes sessions idle past their timeout, logging
// each), the gRPC server (kvkeep.v1.KvKeep, grpc.health.v1.Health, server
// reflection, the RPC-metrics interceptor) and the /metrics HTTP endpoint
// (unless metrics_listen is "off").
//
// Shutdown, in this order and for these reasons:
//   0. with fleet.peers, the drain by migration (fleet_drain.h): health
//      NOT_SERVING, no new sessions, every session moved to a peer within
//      fleet.move_seconds; then fleet.linger_seconds still serving, so
//      calls on the moved sessions hear where they went;
//   1. health NOT_SERVING: load balancers stop sending new calls;
//   2. drain: the gRPC server finishes in-flight calls until the deadline,
//      then cancels the rest, and waits for every reactor;
//   3. the lease reaper (it logs through the service): joined after a pass
//      in progress;
//   4. the service: its destructor waits for outgoing transfers still
//      sending and closes the NCCL links (nothing calls it any more);
//   5. the data socket: the service held a pointer to it, and receives
//      that were abandoned clean up on its threads, which it waits for;
//   6. the /metrics endpoint: its collector reads the store;
//   7. the store, then the metrics it reported to (its observer).
// Stop() does 0 to 2; the destructor does what is left (and 1-2 with
// the configured drain_seconds if Stop was not called), so a test may stop
// serving and still read the store.
//
// Thread-safe: Stop may be called from any thread, more than once (a call
// while another drains waits for it; later ones return at once); the
// accessors return what was fixed at Start. Destroy it from one thread,
// after every other call has returned.
#ifndef KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVER_H_
#define KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/server.h"
#include "prometheus/registry.h"
#include "services/kvkeepd/fleet_drain.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "services/kvkeepd/lease_reaper.h"
#include "services/kvkeepd/server_config.h"
#include "services/metrics/event_metrics.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/store_metrics.h"
#include "services/metrics/transfer_metrics.h"
#include "services/transfer/tcp_transport.h"

namespace kvkeep {

// The one translation of a ServerConfig into the store's options.
// `observer` (may be null) must outlive the store.
StoreOptions StoreOptionsFor(const ServerConfig& config, const Device& device,
                             StoreObserver* observer);
// ... and into the service's (without `tcp` and `on_transfer`, which
// belong to a running server).
ServiceOptions ServiceOptionsFor(const ServerConfig& config,
                                 const Device& device);

// What a caller adds to what the config says: kvkeepd's self-check and
// daemon hooks; tests' faulty page senders and stand-in services.
struct ServerHooks {
  // Runs on the built store before anything listens (kvkeepd's self-check
  // and layout report); an error stops the start.
  std::function<absl::Status(CacheStore&)> before_serving;
  // Edits the service's options after ServiceOptionsFor (kvkeepd_testing
  // and tests wrap transfers' page senders here: daemon_hooks.h).
  std::function<void(ServiceOptions&)> edit_service_options;
  // Serves the service this returns instead of a KvKeepService (a test's
  // misbehaving service, a benchmark's no-op one); it may use the store.
  // The service must outlive the KvKeepServer. With a stand-in there is no
  // data socket and edit_service_options is not called.
  std::function<grpc::Service*(CacheStore&)> stand_in;
  // The clock the store's leases read (tests: a ManualClock); not owned,
  // must outlive the server. Null: the steady clock.
  const Clock* clock = nullptr;
};

class KvKeepServer {
 public:
  // Builds everything and starts serving. INVALID_ARGUMENT for what the
  // config gets wrong before anything runs (the device, TLS files); the
  // store's, the hooks' or a listener's error otherwise.
  static absl::StatusOr<std::unique_ptr<KvKeepServer>> Start(
      const ServerConfig& config, ServerHooks hooks = {});
  ~KvKeepServer();
  KvKeepServer(const KvKeepServer&) = delete;
  KvKeepServer& operator=(const KvKeepServer&) = delete;

  // Stops serving: moves the sessions away (fleet.peers), health
  // NOT_SERVING, then in-flight calls get `drain` before they are
  // cancelled; returns once none runs.
  void Stop(absl::Duration drain) ABSL_LOCKS_EXCLUDED(stop_mu_);
  // The drain by migration Stop ran (zeros before, or without peers).
  DrainReport drain_report() const ABSL_LOCKS_EXCLUDED(stop_mu_) {
    absl::MutexLock lock(&stop_mu_);
    return drain_report_;
  }

  // "host:port" that gRPC is bound to (the listen address's host).
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // The data socket's port, 0 without one.
  int data_port() const { return tcp_ != nullptr ? tcp_->port() : 0; }
  // "host:port" of /metrics, empty without the endpoint.
  std::string metrics_address() const;
  const Device& device() const { return device_; }
  const ServerConfig& config() const { return config_; }
  CacheStore& store() { return *store_; }
  // Null when a stand-in is served.
  KvKeepService* service() { return service_.get(); }

 private:
  explicit KvKeepServer(ServerConfig config) : config_(std::move(config)) {}
  absl::Status Build(ServerHooks& hooks);
  absl::Status Listen(grpc::Service* service);

  const ServerConfig config_;
  Device device_;
  // Declared in build order; the destructor releases them in reverse
  // (after the server), which is the shutdown order above.
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<StoreMetrics> metrics_;
  std::unique_ptr<TransferMetrics> transfer_metrics_;
  std::unique_ptr<EventMetrics> event_metrics_;
  std::unique_ptr<DrainMetrics> drain_metrics_;
  // How the drain calls the peers (fleet.peers, the peer token and
  // credentials), fixed in Build.
  DrainOptions drain_options_;
  std::unique_ptr<CacheStore> store_;
  std::unique_ptr<TcpTransport> tcp_;
  std::unique_ptr<KvKeepService> service_;
  std::unique_ptr<LeaseReaper> reaper_;
  std::unique_ptr<grpc::Server> server_;
  // The exposer holds collectables weakly: the collector is kept here.
  std::shared_ptr<StoreCollector> collector_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::string address_;
  int port_ = 0;
  mutable absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  DrainReport drain_report_ ABSL_GUARDED_BY(stop_mu_);
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVER_H_
