#include "services/common/convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvkeep {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace

AppendRequest AppendFromProto(const v1::AppendRequest& in,
                              std::vector<LayerKv>& layers) {
  layers.clear();
  layers.reserve(in.layers_size());
  for (const v1::LayerKv& l : in.layers()) {
    layers.push_back(LayerKv{Bytes(l.keys()), Bytes(l.values())});
  }
  return AppendRequest{
      std::span<const int64_t>(in.positions().data(), in.positions_size()),
      layers};
}

absl::StatusOr<std::vector<LayerScores>> ScoresFromProto(
    const google::protobuf::RepeatedPtrField<v1::LayerScores>& in) {
  std::vector<LayerScores> out;
  if (absl::Status s = ScoresFromProto(in, out); !s.ok()) return s;
  return out;
}

absl::Status ScoresFromProto(
    const google::protobuf::RepeatedPtrField<v1::LayerScores>& in,
    std::vector<LayerScores>& out) {
  out.clear();
  out.reserve(in.size());
  for (const v1::LayerScores& l : in) {
    LayerScores s;
    s.layer = l.layer();
    s.version = l.version();
    const google::protobuf::RepeatedField<float>* values = nullptr;
    switch (l.source_case()) {
      case v1::LayerScores::kPerHead:
        s.source = ScoreSource::kPerHead;
        s.rows = l.per_head().rows();
        values = &l.per_head().values();
        break;
      case v1::LayerScores::kReduced:
        s.source = ScoreSource::kReduced;
        s.rows = l.reduced().rows();
        values = &l.reduced().values();
        break;
      case v1::LayerScores::kQueries:
        s.source = ScoreSource::kQueries;
        s.rows = l.queries().rows();
        values = &l.queries().values();
        break;
      case v1::LayerScores::SOURCE_NOT_SET:
        return absl::InvalidArgumentError(
            absl::StrCat("scores for layer ", l.layer(),
                         " have no source: set per_head, reduced or queries"));
    }
    s.data = std::span<const float>(values->data(), values->size());
    out.push_back(s);
  }
  return absl::OkStatus();
}

void StepResultToProto(const StepResult& in, v1::StepResult* out) {
  out->mutable_layers()->Reserve(static_cast<int>(in.layers.size()));
  for (const LayerChange& c : in.layers) {
    v1::LayerChange* l = out->add_layers();
    l->set_layer(c.layer);
    l->set_version(c.version);
    l->set_resident(c.resident);
    l->mutable_evicted_positions()->Add(c.evicted_positions.begin(),
                                        c.evicted_positions.end());
    for (const SlotMove& m : c.moves) {
      v1::SlotMove* move = l->add_moves();
      move->set_from_slot(m.from_slot);
      move->set_to_slot(m.to_slot);
    }
    l->mutable_pages_freed()->Add(c.pages_freed.begin(), c.pages_freed.end());
    l->mutable_pages_added()->Add(c.pages_added.begin(), c.pages_added.end());
    for (const PageCopy& copy : c.pages_copied) {
      v1::PageCopy* p = l->add_pages_copied();
      p->set_index(copy.index);
      p->set_from_page(copy.from);
      p->set_to_page(copy.to);
    }
  }
}

namespace {

v1::PolicyInfo::Input InputToProto(PolicyInput in) {
  switch (in) {
    case PolicyInput::kNone:
      return v1::PolicyInfo::INPUT_NONE;
    case PolicyInput::kPerStep:
      return v1::PolicyInfo::INPUT_PER_STEP;
    case PolicyInput::kCompress:
      return v1::PolicyInfo::INPUT_COMPRESS;
  }
  return v1::PolicyInfo::INPUT_UNSPECIFIED;
}

v1::PolicyParam::Type ParamTypeToProto(ParamType t) {
  switch (t) {
    case ParamType::kInt:
      return v1::PolicyParam::TYPE_INT;
    case ParamType::kDouble:
      return v1::PolicyParam::TYPE_DOUBLE;
    case ParamType::kChoice:
      return v1::PolicyParam::TYPE_CHOICE;
  }
  return v1::PolicyParam::TYPE_UNSPECIFIED;
}

}  // namespace

void PolicyInfoToProto(const PolicyInfo& in, v1::PolicyInfo* out) {
  out->set_name(std::string(in.name));
  out->set_summary(std::string(in.summary));
  out->set_input(InputToProto(in.input));
  // Every scored policy takes both forms (the session checks and reduces
  // them the same way); the layout decides whether queries can be scored.
  const bool scored = in.input != PolicyInput::kNone;
  out->set_accepts_probabilities(scored);
  out->set_accepts_queries(scored);
  for (const ParamSpec& p : in.params) {
    v1::PolicyParam* param = out->add_params();
    param->set_name(std::string(p.name));
    param->set_type(ParamTypeToProto(p.type));
    param->set_default_value(std::string(p.default_text));
    if (p.type != ParamType::kChoice) {
      param->set_min(p.min);
      param->set_max(p.max);
    }
    for (absl::string_view c : p.choices) param->add_choices(std::string(c));
    param->set_rule(std::string(p.rule));
    param->set_description(std::string(p.help));
  }
  out->set_budget_rule(std::string(in.budget_rule));
}

void LayoutToProto(const ModelLayout& in, v1::Layout* out) {
  out->set_name(in.name);
  out->set_num_layers(in.num_layers);
  out->set_kv_heads(in.kv_heads);
  out->set_query_heads(in.query_heads);
  out->set_head_dim(in.head_dim);
  out->set_dtype(DTypeToProto(in.dtype));
  out->set_page_tokens(in.page_tokens);
  out->set_keys_pre_rope(in.keys_pre_rope);
  out->set_page_bytes(in.page_layout().page_bytes());
  out->set_group_size(in.page_layout().group_size);
  out->set_append_dtype(DTypeToProto(in.input_dtype()));
}

void StatsToProto(const SessionStats& in, v1::SessionStats* out) {
  out->set_session_id(SessionName(in.id));
  out->set_layout(in.layout);
  out->set_policy(in.policy);
  out->set_tenant(in.tenant);
  out->set_resident_tokens(in.resident_tokens);
  out->set_pages(in.pages);
  out->set_resident_bytes(in.bytes);
  out->set_evicted_tokens(in.evicted_tokens);
  out->set_evicted_score(in.evicted_score);
  out->set_score_updates(in.score_updates);
  out->set_compressed(in.compressed);
  out->mutable_layer_resident()->Add(in.layer_resident.begin(),
                                     in.layer_resident.end());
  out->mutable_layer_budget()->Add(in.layer_budget.begin(),
                                   in.layer_budget.end());
  out->mutable_layer_version()->Add(in.layer_version.begin(),
                                    in.layer_version.end());
  out->set_idle_timeout_seconds(absl::ToDoubleSeconds(in.idle_timeout));
  out->set_lease_seconds_left(absl::ToDoubleSeconds(in.lease_left));
  out->set_lease_held(in.lease_held);
  out->set_shared_pages(in.shared_pages);
}

void BlockTableToProto(const BlockTable& in, v1::BlockTable* out) {
  out->set_layer(in.layer);
  out->set_version(in.version);
  out->set_page_tokens(in.page_tokens);
  out->mutable_pages()->Add(in.pages.begin(), in.pages.end());
  out->mutable_positions()->Add(in.positions.begin(), in.positions.end());
  out->mutable_cache_positions()->Add(in.cache_positions.begin(),
                                      in.cache_positions.end());
}

namespace {

BudgetSpec BudgetFromProto(const v1::Budget& in) {
  BudgetSpec budget;
  budget.tokens = in.tokens();
  budget.per_layer.assign(in.per_layer().begin(), in.per_layer().end());
  if (!in.schedule().empty()) budget.schedule = in.schedule();
  if (in.pyramid_beta() != 0) budget.pyramid_beta = in.pyramid_beta();
  return budget;
}

}  // namespace

SessionSpec SpecFromProto(const v1::CreateSessionRequest& in) {
  SessionSpec spec;
  spec.layout = in.layout();
  spec.policy.name = in.policy();
  spec.policy.params.insert(in.policy_params().begin(),
                            in.policy_params().end());
  spec.budget = BudgetFromProto(in.budget());
  spec.idempotency_key = in.idempotency_key();
  // Out-of-range values saturate (to an infinite duration, which the store
  // refuses as too long); NaN is the caller's to refuse first.
  spec.idle_timeout = absl::Seconds(in.idle_timeout_seconds());
  spec.prefix = in.prefix();
  spec.prefix_evictable = in.prefix_evictable();
  return spec;
}

void PrefixToProto(const PrefixInfo& in, v1::PrefixInfo* out) {
  out->set_name(in.name);
  out->set_tenant(in.tenant);
  out->set_is_public(in.is_public);
  out->set_published(in.published);
  out->set_layout(in.layout);
  out->set_source_session_id(SessionName(in.source));
  out->set_tokens(in.tokens);
  out->set_resident_tokens(in.resident_tokens);
  out->set_pages(in.pages);
  out->set_shared_pages(in.shared_pages);
  out->set_holders(in.holders);
}

absl::StatusOr<ForkSpec> ForkSpecFromProto(const v1::ForkSessionRequest& in) {
  ForkSpec spec;
  if (!in.policy().empty()) {
    spec.policy = PolicySpec{in.policy(), {}};
    spec.policy->params.insert(in.policy_params().begin(),
                               in.policy_params().end());
  } else if (!in.policy_params().empty()) {
    return absl::InvalidArgumentError(
        "policy_params without a policy: a child keeps its parent's "
        "parameters unless it names its own policy");
  }
  if (in.has_budget()) spec.budget = BudgetFromProto(in.budget());
  spec.idempotency_key = in.idempotency_key();
  if (!std::isfinite(in.idle_timeout_seconds())) {
    return absl::InvalidArgumentError(
        absl::StrCat("idle_timeout_seconds must be a finite number, not ",
                     in.idle_timeout_seconds()));
  }
  // 0: the parent's idle timeout; out-of-range values saturate as above.
  spec.idle_timeout = absl::Seconds(in.idle_timeout_seconds());
  return spec;
}

}  // namespace kvkeep
