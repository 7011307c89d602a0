#include "services/common/fleet_names.h"

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache_store/quote.h"

namespace kvkeep {

namespace {

constexpr size_t kKeyDigits = 16;

bool IsLabelChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
}

// The key a 16-digit lowercase hex string spells, if it is one (uppercase
// digits are refused: an id has one spelling).
std::optional<uint64_t> ParseKey(absl::string_view hex) {
  const bool lower_hex = std::all_of(hex.begin(), hex.end(), [](char c) {
    return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
  });
  uint64_t key = 0;
  if (hex.size() != kKeyDigits || !lower_hex ||
      !absl::SimpleHexAtoi(hex, &key)) {
    return std::nullopt;
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
