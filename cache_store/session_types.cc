#include "cache_store/session_types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache_store/quote.h"

namespace kvkeep {

std::string SessionName(SessionId id) { return absl::StrFormat("%016x", id); }

std::string SessionLabel(SessionId id) {
  return absl::StrCat("session ", SessionName(id));
}

absl::Status InSession(SessionId id, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), SessionMessage(id, status.message()));
}

absl::Status ValidatePrefixName(std::string_view name) {
  constexpr size_t kMaxPrefixName = 128;
  auto alnum = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c >= '0' && c <= '9');
  };
  absl::string_view wrong;
  if (name.empty()) {
    wrong = "is empty";
  } else if (name.size() > kMaxPrefixName) {
    wrong = "is longer than 128 characters";
  } else if (!alnum(name[0])) {
    wrong = "must start with a letter or digit";
  } else {
    for (char c : name) {
      if (!alnum(c) && c != '.' && c != '_' && c != ':' && c != '/' &&
          c != '-') {
        wrong = "may hold only letters, digits and . _ : / -";
        break;
      }
    }
  }
  if (wrong.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("prefix name ", Quote(name), " ", wrong));
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
