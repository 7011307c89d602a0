#include "services/common/fleet_names.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache_store/quote.h"

namespace kvkeep {

namespace {

constexpr size_t kKeyDigits = 16;

bool IsLabelChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
}

// The key a 16-digit lowercase hex string spells, if it is one.
std::optional<uint64_t> ParseKey(absl::string_view hex) {
  if (hex.size() != kKeyDigits) return std::nullopt;
  uint64_t key = 0;
  for (char c : hex) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    key = key << 4 | static_cast<uint64_t>(digit);
  }
  return key;
}

}  // namespace

absl::Status CheckReplicaName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxReplicaNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica name ", Quote(name), " must have 1 to ",
                     kMaxReplicaNameBytes, " characters (a DNS label)"));
  }
  for (char c : name) {
    if (!IsLabelChar(c)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replica name ", Quote(name),
          " may hold only lowercase letters, digits and '-' (a DNS label)"));
    }
  }
  if (name.front() == '-' || name.back() == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat("replica name ", Quote(name),
                     " must not begin or end with '-' (a DNS label)"));
  }
  return absl::OkStatus();
}

std::string FleetSessionId(absl::string_view replica, uint64_t key) {
  if (replica.empty()) return absl::StrFormat("%016x", key);
  return absl::StrFormat("%s.%016x", replica, key);
}

absl::StatusOr<FleetSessionRef> ParseFleetSessionId(absl::string_view id) {
  const size_t dot = id.rfind('.');
  const absl::string_view hex =
      dot == absl::string_view::npos ? id : id.substr(dot + 1);
  const std::optional<uint64_t> key = ParseKey(hex);
  if (!key.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id ", Quote(id),
        " is not a kvkeep session id (16 lowercase hex digits, after "
        "'<replica>.' on a fleet)"));
  }
  FleetSessionRef ref;
  ref.key = *key;
  if (dot == absl::string_view::npos) return ref;
  ref.replica = std::string(id.substr(0, dot));
  if (absl::Status s = CheckReplicaName(ref.replica); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id ", Quote(id), ": ", s.message()));
  }
  return ref;
}

std::string RenameSessionId(const FleetSessionRef& ref,
                            absl::string_view replica) {
  return FleetSessionId(replica, ref.key);
}

}  // namespace kvkeep
