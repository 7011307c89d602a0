// PolicySpec names a policy and its parameters as text, the way a client sends
// them; ParamReader turns them into typed values with range checks. Plain
// values; not thread-safe (a reader is used by one factory call).
#ifndef KVKEEP_CACHE_STORE_POLICY_PARAMS_H_
#define KVKEEP_CACHE_STORE_POLICY_PARAMS_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_store/eviction_policy.h"

namespace kvkeep {

struct PolicySpec {
  std::string name;                           // e.g. "h2o"
  std::map<std::string, std::string> params;  // e.g. {"recent": "64"}
};

// Reads parameters of one policy. Every getter records the first error and
// returns the default after one; Finish() reports it, or any parameter that no
// getter asked for (a typo must not be silently ignored).
class ParamReader {
 public:
  explicit ParamReader(const PolicySpec& spec) : spec_(spec) {}

  int64_t Int(absl::string_view key, int64_t def, int64_t lo, int64_t hi);
  double Double(absl::string_view key, double def, double lo, double hi);
  // A token count in [0, 2^40].
  int64_t Tokens(absl::string_view key, int64_t def) {
    return Int(key, def, 0, int64_t{1} << 40);
  }
  std::string Choice(absl::string_view key, absl::string_view def,
                     std::initializer_list<absl::string_view> choices);
  // sinks, recent and slack, with the given defaults.
  CommonParams Common(int64_t default_sinks, int64_t default_recent);

  // Records an error found by the caller (e.g. a rule across parameters).
  void Fail(std::string message);

  [[nodiscard]] absl::Status Finish() const;

 private:
  const std::string* Find(absl::string_view key);

  const PolicySpec& spec_;
  std::set<std::string, std::less<>> used_;
  absl::Status error_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_POLICY_PARAMS_H_
