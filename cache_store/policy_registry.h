// The registry of eviction policies by name, and each policy's factory.
// Factories validate their parameters: an unknown name, an unknown parameter
// or a value out of range is INVALID_ARGUMENT with a message. Thread-safe.
//
// Policies and their parameters (docs/policies.md has the full rules):
//   full           never evicts
//   window         the last `budget` tokens                  (slack)
//   streaming_llm  sinks + the most recent tokens             (sinks=4, slack)
//   h2o            sinks + recent + heavy hitters by accumulated attention
//                                                   (sinks=0, recent=0, slack)
//   tova           the tokens the current query attends most (recent=0, slack)
//   scissorhands   drops tokens that stayed unimportant over a history window
//                  (history=32, threshold=1.0, sinks, recent, slack)
//   snapkv         one-shot prompt compression
//                  (window=32, kernel=5, pooling=avgpool|maxpool)
//   h2o_page       h2o scores, evicting whole pages        (sinks, recent,
//   slack)
#ifndef KVKEEP_CACHE_STORE_POLICY_REGISTRY_H_
#define KVKEEP_CACHE_STORE_POLICY_REGISTRY_H_

#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/eviction_policy.h"
#include "cache_store/policy_params.h"

namespace kvkeep {

using PolicyPtr = std::shared_ptr<const EvictionPolicy>;

absl::StatusOr<PolicyPtr> NewPolicy(const PolicySpec& spec);
std::vector<absl::string_view> PolicyNames();

// One factory per policy file. Each reads its parameters from `params`;
// NewPolicy calls params.Finish() afterwards.
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
