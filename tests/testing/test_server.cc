#include "tests/testing/test_server.h"

#include <utility>

namespace kvkeep::testing {

ServerConfig TestServerConfig(std::vector<PoolSpec> pools) {
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.metrics_listen = "off";
  config.transfer_listen = "off";
  config.pools = std::move(pools);
  config.drain_seconds = 5;
  return config;
}

}  // namespace kvkeep::testing
