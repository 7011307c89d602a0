#include "services/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "services/common/constant_time.h"

namespace kvkeep {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const MetricsServerOptions& options,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  const std::string& address = options.address;
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not HOST:PORT"));
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  try {  // civetweb reports a failed bind by throwing
    exposer = std::make_unique<prometheus::Exposer>(address, /*threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  if (!options.auth_user.empty()) {
    exposer->RegisterAuth(
        [user = options.auth_user, password = options.auth_password](
            const std::string& u, const std::string& p) {
          // Both compared, whichever differs.
          const bool user_ok = ConstantTimeEquals(u, user);
          const bool password_ok = ConstantTimeEquals(p, password);
          return user_ok && password_ok;
        },
        "kvkeepd metrics");
  }
  for (const auto& c : collectables) exposer->RegisterCollectable(c);
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": no port bound"));
  }
  std::string bound = absl::StrCat(address.substr(0, colon), ":", ports[0]);
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(exposer), std::move(bound), ports[0]));
}

MetricsServer::~MetricsServer() {
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    exposer_.reset();
    stopped = true;
  });
  // Each connection makes the listener's poll return; it then sees the stop
  // flag. Loopback works whatever address was bound (0.0.0.0 included); for
  // another interface the stop simply takes the poll timeout.
  while (!stopped) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port_));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
      close(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stopper.join();
}

}  // namespace kvkeep
