// PolicySpec names a policy and its parameters as text, the way a client sends
// them; ParamSpec describes one parameter a policy takes (the registry's table
// holds them, policy_registry.h); ParamReader turns the text into typed values
// with range checks. Plain values; not thread-safe (a reader is used by one
// factory call).
#ifndef KVKEEP_CACHE_STORE_POLICY_PARAMS_H_
#define KVKEEP_CACHE_STORE_POLICY_PARAMS_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_store/eviction_policy.h"

namespace kvkeep {

struct PolicySpec {
  std::string name;                           // e.g. "h2o"
  std::map<std::string, std::string> params;  // e.g. {"recent": "64"}
  // The first tokens of every layer that are never evicted whatever the
  // policy's own sinks: a session started from a named prefix protects the
  // prefix's tokens this way (docs/prefixes.md). Raises the policy's sinks
  // to at least this (every policy honours sinks); 0: no effect.
  int64_t protect_first = 0;
};

// How a parameter's text is read.
enum class ParamType {
  kInt,     // a decimal integer in [min, max]
  kDouble,  // a number in [min, max]
  kChoice,  // one of `choices`
};

// One parameter of one policy: the only place its default and range are
// written. Static data (string views of literals).
struct ParamSpec {
  absl::string_view name;
  ParamType type = ParamType::kInt;
  absl::string_view default_text;  // the value when absent, as a client writes
  double min = 0;                  // kInt, kDouble: allowed range, inclusive
  double max = 0;
  std::span<const absl::string_view> choices;  // kChoice
  absl::string_view rule;  // a further rule in words ("odd"), "" if none
  absl::string_view help;  // one line
};

// Reads parameters of one policy. Every getter records the first error and
// returns the default after one; Finish() reports it, or any parameter that no
// getter asked for (a typo must not be silently ignored).
class ParamReader {
 public:
  // `known`: the policy's parameters, for the getters that take only a key.
  explicit ParamReader(const PolicySpec& spec,
                       std::span<const ParamSpec> known = {})
      : spec_(spec), known_(known) {}

  // Getters by the policy's ParamSpec: default and range from the table.
  int64_t Int(absl::string_view key);
  double Double(absl::string_view key);
  std::string Choice(absl::string_view key);
  // sinks, recent and slack: those the policy takes, 0 for the others.
  CommonParams Common();

  // Getters with the default and range given here.
  int64_t Int(absl::string_view key, int64_t def, int64_t lo, int64_t hi);
  double Double(absl::string_view key, double def, double lo, double hi);
  // A token count in [0, 2^40].
  int64_t Tokens(absl::string_view key, int64_t def) {
    return Int(key, def, 0, int64_t{1} << 40);
  }
  std::string Choice(absl::string_view key, absl::string_view def,
                     std::initializer_list<absl::string_view> choices);

  // Records an error found by the caller (e.g. a rule across parameters).
  void Fail(std::string message);

  [[nodiscard]] absl::Status Finish() const;

 private:
  const std::string* Find(absl::string_view key);
  // The spec of `key` with `type`; null (and an error recorded) if the policy
  // has none: a bug in the table or the factory, not in the client's input.
  const ParamSpec* Known(absl::string_view key, ParamType type);

  const PolicySpec& spec_;
  const std::span<const ParamSpec> known_;
  std::set<std::string, std::less<>> used_;
  absl::Status error_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_POLICY_PARAMS_H_
