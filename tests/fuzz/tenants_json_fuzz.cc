// The tenants file (docs/config.md, "tenants_file"): ApplyTenantsJson must
// refuse whatever is wrong with a status (no exception, no crash), and a
// list it takes must have a name and a token for every tenant and no
// token twice, as its contract says.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/strings/string_view.h"
#include "services/kvkeepd/server_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep;
  ServerConfig config = DefaultConfig();
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  if (!ApplyTenantsJson(json, config).ok()) return 0;
  std::set<std::string> tokens;
  for (const TenantToken& t : config.tenants) {
    if (t.tenant.empty() || t.token.empty() || !tokens.insert(t.token).second) {
      std::fprintf(stderr,
                   "kvkeep fuzz finding: ApplyTenantsJson took a tenant "
                   "without a name or token, or a token twice\n");
      std::abort();
    }
  }
  return 0;
}
