// The registry of eviction policies: one table that names every policy, what
// input it takes, its parameters (name, type, default, range) and its budget
// rule. Factories read their parameters through that table, and ServerInfo
// publishes it, so a default or a range is written in one place. An unknown
// name, an unknown parameter or a value out of range is INVALID_ARGUMENT with
// a message. Thread-safe (the table is constant).
//
// docs/policies.md has the full rules of each policy.
#ifndef KVKEEP_CACHE_STORE_POLICY_REGISTRY_H_
#define KVKEEP_CACHE_STORE_POLICY_REGISTRY_H_

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/eviction_policy.h"
#include "cache_store/policy_params.h"

namespace kvkeep {

using PolicyPtr = std::shared_ptr<const EvictionPolicy>;

// What a policy needs from the worker, and when it evicts.
enum class PolicyInput {
  kNone,      // evicts on append (window, streaming_llm) or never (full);
              // refuses scores
  kPerStep,   // evicts on a step's attention: probabilities or queries for
              // any subset of layers, with or without an append
  kCompress,  // evicts once, on CompressPrompt: the observation window's
              // attention (probabilities or queries) for every layer
};

// One policy as the registry knows it.
struct PolicyInfo {
  absl::string_view name;
  absl::string_view summary;  // one line
  PolicyInput input = PolicyInput::kNone;
  std::span<const ParamSpec> params;  // every parameter it takes
  // What CreateSession's per-layer budget must satisfy, in words (the
  // policy's ValidateBudget enforces it).
  absl::string_view budget_rule;
  // Builds the policy from parameters read through a ParamReader that knows
  // `params`; NewPolicy calls it and then params.Finish().
  PolicyPtr (*factory)(ParamReader&) = nullptr;
};

// Every policy, in a fixed order (the order ServerInfo lists them in).
std::span<const PolicyInfo> Policies();
// The policy named `name`; null if there is none.
const PolicyInfo* FindPolicy(absl::string_view name);
std::vector<absl::string_view> PolicyNames();

absl::StatusOr<PolicyPtr> NewPolicy(const PolicySpec& spec);

// One factory per policy file. Each reads its parameters from `params` by
// name (ParamReader::Int(key), ...); NewPolicy calls params.Finish()
// afterwards.
PolicyPtr NewFullPolicy(ParamReader& params);
PolicyPtr NewWindowPolicy(ParamReader& params);
PolicyPtr NewStreamingLlmPolicy(ParamReader& params);
PolicyPtr NewH2OPolicy(ParamReader& params);
PolicyPtr NewTovaPolicy(ParamReader& params);
PolicyPtr NewScissorhandsPolicy(ParamReader& params);
PolicyPtr NewSnapKvPolicy(ParamReader& params);
PolicyPtr NewH2OPagePolicy(ParamReader& params);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_POLICY_REGISTRY_H_
