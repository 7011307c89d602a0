#include "services/common/fleet_discovery.h"

#include "absl/strings/match.h"

namespace kvkeep {

bool IsResolvedTarget(const std::string& target) {
  return absl::StrContains(target, ":///") ||
         absl::StartsWith(target, "ipv4:") ||
         absl::StartsWith(target, "ipv6:") || absl::StartsWith(target, "dns:");
}

absl::Status DiscoverReplicas(
    int quiet_calls, const std::function<absl::StatusOr<v1::ServerInfo>()>& ask,
    const std::function<bool(const std::string& replica)>& known,
    const std::function<absl::Status(const v1::ServerInfo&)>& found) {
  for (int quiet = 0; quiet < quiet_calls;) {
    absl::StatusOr<v1::ServerInfo> info = ask();
    if (!info.ok()) return info.status();
    if (known(info->replica())) {
      ++quiet;
      continue;
    }
    quiet = 0;
    if (absl::Status s = found(*info); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvkeep
