#include "services/metrics/metrics_server.h"

#include <exception>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvkeep {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
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
  for (const auto& c : collectables) exposer->RegisterCollectable(c);
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": no port bound"));
  }
  std::string bound = absl::StrCat(address.substr(0, colon), ":", ports[0]);
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(exposer), std::move(bound)));
}

}  // namespace kvkeep
