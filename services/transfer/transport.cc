#include "services/transfer/transport.h"

#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"

namespace kvkeep {

absl::StatusOr<Transport> ParseTransport(absl::string_view name) {
  if (name.empty() || name == "auto") return Transport::kAuto;
  if (name == "host") return Transport::kHost;
  if (name == "tcp") return Transport::kTcp;
  if (name == "nccl") return Transport::kNccl;
  return absl::InvalidArgumentError(absl::StrCat(
      "transport ", Quote(name), " is not one of auto, host, tcp, nccl"));
}

absl::string_view TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kHost:
      return "host";
    case Transport::kTcp:
      return "tcp";
    case Transport::kNccl:
      return "nccl";
  }
  return "auto";
}

}  // namespace kvkeep
