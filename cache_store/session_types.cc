#include "cache_store/session_types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvkeep {

std::string SessionName(SessionId id) { return absl::StrFormat("%016x", id); }

std::string SessionLabel(SessionId id) {
  return absl::StrCat("session ", SessionName(id));
}

absl::Status InSession(SessionId id, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), SessionMessage(id, status.message()));
}

std::optional<SessionId> ParseSessionName(std::string_view name) {
  if (name.size() != 16) return std::nullopt;
  SessionId id = 0;
  for (char c : name) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    id = id << 4 | static_cast<SessionId>(digit);
  }
  return id;
}

}  // namespace kvkeep
