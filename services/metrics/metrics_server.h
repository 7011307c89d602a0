// MetricsServer: serves the Prometheus text format at http://ADDRESS/metrics
// (prometheus-cpp's embedded civetweb server), for the collectables it is
// given; optionally behind HTTP basic authentication. (No HTTPS: Debian
// 12's civetweb 1.15 crashes a worker thread on the first TLS connection,
// docs/security.md.)
// Thread-safe; stops serving when destroyed.
#ifndef KVKEEP_SERVICES_METRICS_METRICS_SERVER_H_
#define KVKEEP_SERVICES_METRICS_METRICS_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace kvkeep {

struct MetricsServerOptions {
  std::string address;  // "HOST:PORT"; port 0 picks a free one
  // HTTP basic authentication: a scrape must send this user and password
  // (401 otherwise). Empty user: none.
  std::string auth_user;
  std::string auth_password;
};

class MetricsServer {
 public:
  // Binds `options.address` and serves the collectables, which must outlive
  // the server. INVALID_ARGUMENT for an address without a port;
  // UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const MetricsServerOptions& options,
      const std::vector<std::shared_ptr<prometheus::Collectable>>&
          collectables);
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address,
      const std::vector<std::shared_ptr<prometheus::Collectable>>&
          collectables) {
    return Start(MetricsServerOptions{.address = address}, collectables);
  }

  // Stops serving. civetweb's listener notices a stop only when its poll
  // returns (a 2 s timeout), so the destructor wakes it with connections
  // rather than wait.
  ~MetricsServer();

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // HOST:PORT with the port actually bound.
  const std::string& address() const { return address_; }

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer,
                std::string address, int port)
      : exposer_(std::move(exposer)),
        address_(std::move(address)),
        port_(port) {}

  std::unique_ptr<prometheus::Exposer> exposer_;
  const std::string address_;
  const int port_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_METRICS_SERVER_H_
