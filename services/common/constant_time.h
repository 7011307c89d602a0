// Comparing secrets (tokens, passwords) without telling a caller, by the
// time taken, where its guess first differs. Header-only.
#ifndef KVKEEP_SERVICES_COMMON_CONSTANT_TIME_H_
#define KVKEEP_SERVICES_COMMON_CONSTANT_TIME_H_

#include <cstddef>

#include "absl/strings/string_view.h"

namespace kvkeep {

// Whether a == b, in a time that depends on their lengths only.
inline bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_CONSTANT_TIME_H_
