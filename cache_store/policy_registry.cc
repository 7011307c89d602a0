#include "cache_store/policy_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvkeep {
namespace {

using Factory = PolicyPtr (*)(ParamReader&);

constexpr std::pair<absl::string_view, Factory> kPolicies[] = {
    {"full", NewFullPolicy},
    {"window", NewWindowPolicy},
    {"streaming_llm", NewStreamingLlmPolicy},
    {"h2o", NewH2OPolicy},
    {"tova", NewTovaPolicy},
    {"scissorhands", NewScissorhandsPolicy},
    {"snapkv", NewSnapKvPolicy},
    {"h2o_page", NewH2OPagePolicy},
};

}  // namespace

std::vector<absl::string_view> PolicyNames() {
  std::vector<absl::string_view> names;
  for (const auto& [name, factory] : kPolicies) names.push_back(name);
  return names;
}

absl::StatusOr<PolicyPtr> NewPolicy(const PolicySpec& spec) {
  for (const auto& [name, factory] : kPolicies) {
    if (spec.name != name) continue;
    ParamReader params(spec);
    PolicyPtr policy = factory(params);
    if (absl::Status s = params.Finish(); !s.ok()) return s;
    return policy;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", spec.name,
                   "'; known: ", absl::StrJoin(PolicyNames(), ", ")));
}

}  // namespace kvkeep
