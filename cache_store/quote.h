// Quote: a client's value as an error message or a log line may show it,
// bounded. Messages name what was wrong, but a value a client sent can be
// any size and any bytes: echoed whole, a 10,000-byte session id became a
// status too large for gRPC's metadata limit, and the client's channel
// failed every stream on it. Every echo of a request's value goes through
// this. Header-only; thread-safe (stateless).
#ifndef KVKEEP_CACHE_STORE_QUOTE_H_
#define KVKEEP_CACHE_STORE_QUOTE_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvkeep {

// Bytes of a value Quote shows, at most.
inline constexpr size_t kQuotedBytes = 64;

// 'value' in single quotes: printable ASCII as is, a quote or backslash
// escaped with a backslash, any other byte as \xNN. A value longer than
// kQuotedBytes shows its first kQuotedBytes bytes, then "...' (N bytes)".
// The result is at most 4 * kQuotedBytes + 32 bytes, whatever the input.
inline std::string Quote(absl::string_view value) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  const size_t shown =
      value.size() < kQuotedBytes ? value.size() : kQuotedBytes;
  for (size_t i = 0; i < shown; ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  if (shown < value.size()) {
    absl::StrAppend(&out, "...' (", value.size(), " bytes)");
  } else {
    out += '\'';
  }
  return out;
}
#ifndef ABSL_USES_STD_STRING_VIEW  // absl's string_view is its own type
inline std::string Quote(std::string_view value) {
  return Quote(absl::string_view(value.data(), value.size()));
}
inline std::string Quote(const std::string& value) {
  return Quote(absl::string_view(value));
}
inline std::string Quote(const char* value) {
  return Quote(absl::string_view(value));
}
#endif

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_QUOTE_H_
