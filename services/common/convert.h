// Translation between kvkeep.v1 messages and the domain's values. Requests
// are borrowed, not copied: a domain request built from a proto points into
// the proto's buffers and lives no longer than it. Thread-safe (stateless).
#ifndef KVKEEP_SERVICES_COMMON_CONVERT_H_
#define KVKEEP_SERVICES_COMMON_CONVERT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/common/dtype_proto.h"

namespace kvkeep {

// A domain AppendRequest over the proto's buffers; `layers` is its storage.
AppendRequest AppendFromProto(const v1::AppendRequest& in,
                              std::vector<LayerKv>& layers);

// Domain LayerScores over the proto's buffers. INVALID_ARGUMENT if an entry
// has no source.
absl::StatusOr<std::vector<LayerScores>> ScoresFromProto(
    const google::protobuf::RepeatedPtrField<v1::LayerScores>& in);
// The same into `out` (cleared first, its capacity reused).
absl::Status ScoresFromProto(
    const google::protobuf::RepeatedPtrField<v1::LayerScores>& in,
    std::vector<LayerScores>& out);

void StepResultToProto(const StepResult& in, v1::StepResult* out);
void LayoutToProto(const ModelLayout& in, v1::Layout* out);
// A policy of the registry as ServerInfo publishes it.
void PolicyInfoToProto(const PolicyInfo& in, v1::PolicyInfo* out);
void StatsToProto(const SessionStats& in, v1::SessionStats* out);
void PrefixToProto(const PrefixInfo& in, v1::PrefixInfo* out);
void BlockTableToProto(const BlockTable& in, v1::BlockTable* out);
// A new session's id, layer budgets and versions into the answer that made
// it (v1::CreateSessionResponse or v1::ForkSessionResponse).
template <typename Response>
void NewSessionToProto(const SessionStats& in, Response* out) {
  out->set_session_id(SessionName(in.id));
  out->mutable_layer_budgets()->Add(in.layer_budget.begin(),
                                    in.layer_budget.end());
  out->mutable_layer_versions()->Add(in.layer_version.begin(),
                                     in.layer_version.end());
}

// The domain spec of a create request (tenant and defaults filled by the
// caller, who also refuses a NaN idle_timeout_seconds first).
SessionSpec SpecFromProto(const v1::CreateSessionRequest& in);
// The domain spec of a fork request. INVALID_ARGUMENT for policy_params
// without a policy.
absl::StatusOr<ForkSpec> ForkSpecFromProto(const v1::ForkSessionRequest& in);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_CONVERT_H_
