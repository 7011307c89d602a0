// kvkeepd's JSON config (docs/config.md) over the embedded default, as
// kvkeepd reads a config file: ApplyConfigJson must refuse whatever is
// wrong with a status (no exception, no crash). A config it takes is
// translated into the store's and the service's options as KvKeepServer
// does, and must name a data-socket address.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/server_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep;
  ServerConfig config = DefaultConfig();
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  if (!ApplyConfigJson(json, config).ok()) return 0;
  (void)TransferListenAddress(config);
  (void)StoreOptionsFor(config, Device{}, nullptr);
  (void)ServiceOptionsFor(config, Device{});
  return 0;
}
