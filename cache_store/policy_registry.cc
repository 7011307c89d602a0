#include "cache_store/policy_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_store/quote.h"

namespace kvkeep {
namespace {

// A token count.
constexpr double kMaxTokens = static_cast<double>(int64_t{1} << 40);

constexpr ParamSpec Sinks(absl::string_view def) {
  return {"sinks",
          ParamType::kInt,
          def,
          0,
          kMaxTokens,
          {},
          "",
          "the first tokens of a layer, never evicted (attention sinks)"};
}
constexpr ParamSpec kRecent{
    "recent",   ParamType::kInt,
    "0",        0,
    kMaxTokens, {},
    "",         "the most recent tokens of a layer, never evicted"};
constexpr ParamSpec kSlack{
    "slack",
    ParamType::kInt,
    "0",
    0,
    kMaxTokens,
    {},
    "",
    "over budget, evict down to budget - slack (fewer, larger evictions)"};

constexpr ParamSpec kWindowParams[] = {kSlack};
constexpr ParamSpec kStreamingParams[] = {Sinks("4"), kRecent, kSlack};
constexpr ParamSpec kScoredParams[] = {Sinks("0"), kRecent, kSlack};
constexpr ParamSpec kScissorhandsParams[] = {
    Sinks("0"),
    kRecent,
    kSlack,
    {"history",
     ParamType::kInt,
     "32",
     1,
     64,
     {},
     "",
     "steps of importance each token remembers"},
    {"threshold",
     ParamType::kDouble,
     "1.0",
     0,
     1e6,
     {},
     "",
     "a token is unimportant at a step when its head-averaged attention is "
     "below threshold / resident tokens"},
};
constexpr absl::string_view kPoolings[] = {"avgpool", "maxpool"};
constexpr ParamSpec kSnapKvParams[] = {
    {"window",
     ParamType::kInt,
     "32",
     1,
     1 << 20,
     {},
     "",
     "the observation window: the prompt's last tokens, whose attention "
     "ranks the older ones (always kept)"},
    {"kernel",
     ParamType::kInt,
     "5",
     1,
     1025,
     {},
     "odd",
     "pooling width along the sequence"},
    {"pooling", ParamType::kChoice, "avgpool", 0, 0, kPoolings, "",
     "how the window's attention is pooled"},
};

constexpr absl::string_view kProtectedBudget =
    "budget - slack >= max(1, sinks + recent)";

constexpr PolicyInfo kPolicies[] = {
    {"full",
     "keeps every token",
     PolicyInput::kNone,
     {},
     "ignored (any value)",
     NewFullPolicy},
    {"window", "the most recent budget tokens", PolicyInput::kNone,
     kWindowParams, "budget - slack >= 1", NewWindowPolicy},
    {"streaming_llm", "sinks + the most recent tokens (StreamingLLM)",
     PolicyInput::kNone, kStreamingParams, kProtectedBudget,
     NewStreamingLlmPolicy},
    {"h2o",
     "sinks + recent + heavy hitters by attention accumulated over steps "
     "(H2O)",
     PolicyInput::kPerStep, kScoredParams, kProtectedBudget, NewH2OPolicy},
    {"tova", "evicts the token the current query attends least (TOVA)",
     PolicyInput::kPerStep, kScoredParams, kProtectedBudget, NewTovaPolicy},
    {"scissorhands",
     "evicts tokens that stayed unimportant over a history window "
     "(Scissorhands)",
     PolicyInput::kPerStep, kScissorhandsParams, kProtectedBudget,
     NewScissorhandsPolicy},
    {"snapkv",
     "one-shot prompt compression by the observation window's attention "
     "(SnapKV)",
     PolicyInput::kCompress, kSnapKvParams, "budget >= max(1, window)",
     NewSnapKvPolicy},
    {"h2o_page", "h2o scores, evicting whole pages by their mean score",
     PolicyInput::kPerStep, kScoredParams, kProtectedBudget, NewH2OPagePolicy},
};

}  // namespace

std::span<const PolicyInfo> Policies() { return kPolicies; }

const PolicyInfo* FindPolicy(absl::string_view name) {
  for (const PolicyInfo& p : kPolicies) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::vector<absl::string_view> PolicyNames() {
  std::vector<absl::string_view> names;
  for (const PolicyInfo& p : kPolicies) names.push_back(p.name);
  return names;
}

absl::StatusOr<PolicyPtr> NewPolicy(const PolicySpec& spec) {
  const PolicyInfo* info = FindPolicy(spec.name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown policy ", Quote(spec.name),
                     "; known: ", absl::StrJoin(PolicyNames(), ", ")));
  }
  ParamReader params(spec, info->params);
  PolicyPtr policy = info->factory(params);
  if (absl::Status s = params.Finish(); !s.ok()) return s;
  return policy;
}

}  // namespace kvkeep
