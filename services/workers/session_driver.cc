#include "services/workers/session_driver.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "services/common/dtype_proto.h"

namespace kvkeep::workers {
namespace {

// The layout's element type; f32 for a dtype this build does not know (the
// server publishes none).
DType ToDType(v1::DType d) { return DTypeFromProto(d).value_or(DType::kF32); }

// Every token the worker has seen, per layer, in float32 as generated: the
// keys and values a model would hold (the store may hold them rounded to
// f16/bf16), and the queries of the tokens of the current call.
class ShadowCache {
 public:
  explicit ShadowCache(const Workload& w)
      : w_(w),
        shape_(w.shape()),
        kv_floats_(int64_t{shape_.kv_heads} * shape_.head_dim),
        q_floats_(int64_t{shape_.query_heads} * shape_.head_dim),
        k_(w.spec().num_layers),
        v_(w.spec().num_layers),
        q_(w.spec().num_layers) {}

  // Generates tokens [tokens(), tokens() + n) of every layer; their queries
  // replace the previous call's.
  absl::Status Extend(int64_t n) {
    const int64_t first = tokens_;
    for (int32_t l = 0; l < w_.spec().num_layers; ++l) {
      k_[l].resize((first + n) * kv_floats_);
      v_[l].resize((first + n) * kv_floats_);
      q_[l].resize(n * q_floats_);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        absl::Status s =
            w_.Fill(t, l, std::span(q_[l]).subspan(i * q_floats_, q_floats_),
                    std::span(k_[l]).subspan(t * kv_floats_, kv_floats_),
                    std::span(v_[l]).subspan(t * kv_floats_, kv_floats_));
        if (!s.ok()) return s;
      }
    }
    tokens_ = first + n;
    first_query_ = first;
    return absl::OkStatus();
  }

  int64_t tokens() const { return tokens_; }
  const HeadShape& shape() const { return shape_; }
  // The queries of the last Extend: [n][query_heads][head_dim].
  std::span<const float> queries(int32_t layer) const { return q_[layer]; }
  std::span<const float> query(int32_t layer, int64_t t) const {
    return std::span(q_[layer]).subspan((t - first_query_) * q_floats_,
                                        q_floats_);
  }
  FullCache full(int32_t layer, int64_t tokens) const {
    return FullCache{std::span(k_[layer]).first(tokens * kv_floats_),
                     std::span(v_[layer]).first(tokens * kv_floats_), tokens};
  }
  // Keys of `positions`, in that order: [n][kv_heads][head_dim].
  void GatherKeys(int32_t layer, std::span<const int64_t> positions,
                  std::vector<float>& out) const {
    out.resize(positions.size() * kv_floats_);
    for (size_t i = 0; i < positions.size(); ++i) {
      std::memcpy(out.data() + i * kv_floats_,
                  k_[layer].data() + positions[i] * kv_floats_,
                  kv_floats_ * sizeof(float));
    }
  }

  // Tokens [first, first + n) as the store takes them, in `dtype`.
  client::KvTokens Tokens(int64_t first, int64_t n, DType dtype) const {
    client::KvTokens out;
    for (int64_t i = 0; i < n; ++i) out.positions.push_back(first + i);
    out.layers.resize(k_.size());
    const int64_t floats = n * kv_floats_;
    for (size_t l = 0; l < k_.size(); ++l) {
      for (auto [src, dst] : {std::pair(&k_[l], &out.layers[l].keys),
                              std::pair(&v_[l], &out.layers[l].values)}) {
        dst->resize(floats * DTypeBytes(dtype));
        for (int64_t e = 0; e < floats; ++e) {
          StoreFromFloat(dtype, dst->data(), e, (*src)[first * kv_floats_ + e]);
        }
      }
    }
    return out;
  }

 private:
  const Workload& w_;
  const HeadShape shape_;
  const int64_t kv_floats_;
  const int64_t q_floats_;
  std::vector<std::vector<float>> k_, v_, q_;
  int64_t tokens_ = 0;
  int64_t first_query_ = 0;
};

// One layer's scores for the rows of tokens [first, first + rows), each
// attending causally (position <= its own) over the slots `positions`.
absl::StatusOr<v1::LayerScores> LayerAttention(
    const ShadowCache& shadow, int32_t layer, uint64_t version,
    std::span<const int64_t> positions, int64_t first, int32_t rows,
    ScoreMode mode) {
  const HeadShape& shape = shadow.shape();
  if (mode == ScoreMode::kQueries) {
    std::vector<float> q;
    for (int32_t r = 0; r < rows; ++r) {
      std::span<const float> row = shadow.query(layer, first + r);
      q.insert(q.end(), row.begin(), row.end());
    }
    return client::QueryScores(layer, version, q, rows);
  }
  const int64_t slots = static_cast<int64_t>(positions.size());
  // [query_heads][rows][slots]
  std::vector<float> per_head(int64_t{shape.query_heads} * rows * slots, 0.0f);
  std::vector<int64_t> visible_slots;
  std::vector<int64_t> visible_positions;
  std::vector<float> keys;
  std::vector<float> probs;
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t t = first + r;
    visible_slots.clear();
    visible_positions.clear();
    for (int64_t s = 0; s < slots; ++s) {
      if (positions[s] <= t) {
        visible_slots.push_back(s);
        visible_positions.push_back(positions[s]);
      }
    }
    const int64_t n = static_cast<int64_t>(visible_slots.size());
    shadow.GatherKeys(layer, visible_positions, keys);
    probs.resize(int64_t{shape.query_heads} * n);
    if (absl::Status s =
            Attention(shape, shadow.query(layer, t), keys, n, probs);
        !s.ok()) {
      return s;
    }
    for (int32_t h = 0; h < shape.query_heads; ++h) {
      float* out = per_head.data() + (int64_t{h} * rows + r) * slots;
      for (int64_t i = 0; i < n; ++i) {
        out[visible_slots[i]] = probs[int64_t{h} * n + i];
      }
    }
  }
  if (mode == ScoreMode::kPerHead) {
    return client::PerHeadScores(layer, version, per_head, rows);
  }
  std::vector<float> reduced(int64_t{rows} * slots, 0.0f);
  for (int32_t h = 0; h < shape.query_heads; ++h) {
    for (int64_t i = 0; i < int64_t{rows} * slots; ++i) {
      reduced[i] += per_head[int64_t{h} * rows * slots + i];
    }
  }
  return client::ReducedScores(layer, version, reduced, rows);
}

// Positions of the slots a layer has after `mirror`, plus `extra` new ones.
std::vector<int64_t> WithNew(const std::vector<int64_t>& resident,
                             int64_t first, int64_t n) {
  std::vector<int64_t> out = resident;
  for (int64_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

// Measures one decode step (token t's queries over each layer's resident
// set) into a report: quality when evaluating, needles always.
class StepMeter {
 public:
  StepMeter(const Workload& w, bool evaluate) : w_(w), evaluate_(evaluate) {}

  absl::Status Measure(const ShadowCache& shadow, int64_t t,
                       const std::vector<std::vector<int64_t>>& resident,
                       DecodeReport& report) {
    const std::vector<int32_t> asked = w_.NeedlesAskedAt(t);
    for (int32_t l = 0; l < w_.spec().num_layers; ++l) {
      resident_sum_ += static_cast<double>(resident[l].size());
      ++resident_samples_;
      for (int32_t n : asked) {
        ++report.needle_asks;
        const int64_t p = w_.needles()[n].position;
        report.needle_hits += std::find(resident[l].begin(), resident[l].end(),
                                        p) != resident[l].end();
      }
      if (!evaluate_) continue;
      absl::StatusOr<std::vector<HeadQuality>> q =
          MeasureStep(shadow.shape(), shadow.query(l, t), shadow.full(l, t + 1),
                      resident[l]);
      if (!q.ok()) return q.status();
      report.quality.Add(*q);
    }
    return absl::OkStatus();
  }

  double mean_resident() const {
    return resident_samples_ == 0 ? 0 : resident_sum_ / resident_samples_;
  }

 private:
  const Workload& w_;
  const bool evaluate_;
  double resident_sum_ = 0;
  int64_t resident_samples_ = 0;
};

}  // namespace

std::string_view ScoreModeName(ScoreMode mode) {
  switch (mode) {
    case ScoreMode::kPerHead:
      return "per_head";
    case ScoreMode::kReduced:
      return "reduced";
    case ScoreMode::kQueries:
      return "queries";
  }
  return "?";
}

absl::StatusOr<ScoreMode> ParseScoreMode(std::string_view name) {
  for (ScoreMode m :
       {ScoreMode::kPerHead, ScoreMode::kReduced, ScoreMode::kQueries}) {
    if (name == ScoreModeName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown score mode '", std::string(name),
                   "'; known: per_head, reduced, queries"));
}

namespace {

const v1::PolicyInfo* FindPolicy(const v1::ServerInfo& info,
                                 std::string_view policy) {
  for (const v1::PolicyInfo& p : info.policy_info()) {
    if (p.name() == policy) return &p;
  }
  return nullptr;
}

// The value of `param` for a session of `policy` created with `params`: the
// one given, else the policy's default as the server publishes it.
absl::StatusOr<int64_t> IntParam(
    const v1::ServerInfo& info, std::string_view policy,
    const std::map<std::string, std::string>& params, std::string_view param) {
  std::string text;
  if (auto it = params.find(std::string(param)); it != params.end()) {
    text = it->second;
  } else if (const v1::PolicyInfo* p = FindPolicy(info, policy); p != nullptr) {
    for (const v1::PolicyParam& q : p->params()) {
      if (q.name() == param) text = q.default_value();
    }
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(policy), " ", std::string(param), " = '", text,
                     "' is not an integer"));
  }
  return value;
}

}  // namespace

absl::StatusOr<PolicyInput> InputOf(const v1::ServerInfo& info,
                                    std::string_view policy) {
  const v1::PolicyInfo* p = FindPolicy(info, policy);
  if (p == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("the server does not describe policy '",
                     std::string(policy), "' in ServerInfo.policy_info"));
  }
  switch (p->input()) {
    case v1::PolicyInfo::INPUT_PER_STEP:
      return PolicyInput::kPerStep;
    case v1::PolicyInfo::INPUT_COMPRESS:
      return PolicyInput::kCompress;
    default:
      return PolicyInput::kNone;
  }
}

WorkloadSpec FitToLayout(WorkloadSpec spec, const v1::Layout& layout) {
  spec.num_layers = layout.num_layers();
  spec.kv_heads = layout.kv_heads();
  spec.query_heads = layout.query_heads();
  spec.head_dim = layout.head_dim();
  return spec;
}

absl::StatusOr<PrefilledSession> Prefill(const client::KvKeepClient& client,
                                         const Workload& workload,
                                         const SessionPlan& plan) {
  v1::CreateSessionRequest request;
  request.set_layout(plan.layout);
  request.set_policy(plan.policy);
  for (const auto& [k, v] : plan.params) {
    (*request.mutable_policy_params())[k] = v;
  }
  request.mutable_budget()->set_tokens(plan.budget_tokens);
  absl::StatusOr<client::Session> session = client.CreateSession(request);
  if (!session.ok()) return session.status();
  const v1::Layout& layout = session->layout();
  const WorkloadSpec& spec = workload.spec();
  if (layout.num_layers() != spec.num_layers ||
      layout.kv_heads() != spec.kv_heads ||
      layout.query_heads() != spec.query_heads ||
      layout.head_dim() != spec.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the workload's shape is not layout '", plan.layout, "''s"));
  }
  absl::StatusOr<client::BlockTableMirror> mirror = session->Mirror();
  if (!mirror.ok()) return mirror.status();
  const DType dtype = ToDType(AppendDTypeOf(layout));
  const int64_t prompt = spec.prompt_tokens;
  const int64_t chunk = std::max<int64_t>(1, plan.prefill_chunk);
  ShadowCache shadow(workload);
  // The policy in force (the server's default when plan.policy is empty),
  // and what it takes.
  absl::StatusOr<v1::SessionStats> stats = session->Stats();
  if (!stats.ok()) return stats.status();
  absl::StatusOr<v1::ServerInfo> info = session->GetServerInfo();
  if (!info.ok()) return info.status();
  absl::StatusOr<PolicyInput> policy_input = InputOf(*info, stats->policy());
  if (!policy_input.ok()) return policy_input.status();
  const PolicyInput input = *policy_input;

  if (input != PolicyInput::kPerStep) {
    if (absl::Status s = shadow.Extend(prompt); !s.ok()) return s;
    const client::KvTokens tokens = shadow.Tokens(0, prompt, dtype);
    absl::StatusOr<client::PrefillResult> r =
        session->AppendPrefill(tokens, chunk);
    if (!r.ok()) return r.status();
    if (absl::Status s = mirror->ApplyPrefill(*r, tokens.positions); !s.ok()) {
      return s;
    }
    if (input == PolicyInput::kCompress) {
      // The observation window: the prompt's last `window` tokens.
      absl::StatusOr<int64_t> window_param =
          IntParam(*info, stats->policy(), plan.params, "window");
      if (!window_param.ok()) return window_param.status();
      const int64_t window = std::min(*window_param, prompt);
      std::vector<v1::LayerScores> scores;
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        absl::StatusOr<v1::LayerScores> s = LayerAttention(
            shadow, l, mirror->version(l), mirror->positions(l),
            prompt - window, static_cast<int32_t>(window), plan.scores);
        if (!s.ok()) return s.status();
        scores.push_back(*std::move(s));
      }
      absl::StatusOr<v1::StepResult> c = session->CompressPrompt(scores);
      if (!c.ok()) return c.status();
      if (absl::Status s = mirror->Apply(*c); !s.ok()) return s;
    }
    return PrefilledSession{*std::move(session), *std::move(mirror)};
  }

  // Attention-driven: each chunk with its own causal attention.
  client::DecodeStream stream = session->Decode();
  for (int64_t first = 0; first < prompt; first += chunk) {
    const int64_t n = std::min(chunk, prompt - first);
    if (absl::Status s = shadow.Extend(n); !s.ok()) return s;
    std::vector<v1::LayerScores> scores;
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      absl::StatusOr<v1::LayerScores> s =
          LayerAttention(shadow, l, mirror->version(l),
                         WithNew(mirror->positions(l), first, n), first,
                         static_cast<int32_t>(n), plan.scores);
      if (!s.ok()) return s.status();
      scores.push_back(*std::move(s));
    }
    const client::KvTokens tokens = shadow.Tokens(first, n, dtype);
    absl::StatusOr<v1::DecodeStepResult> r = stream.Step(tokens, scores);
    if (!r.ok()) return r.status();
    if (absl::Status s = mirror->ApplyDecode(*r, tokens.positions); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = stream.Finish(); !s.ok()) return s;
  return PrefilledSession{*std::move(session), *std::move(mirror)};
}

absl::StatusOr<DecodeReport> Decode(const client::Session& session,
                                    client::BlockTableMirror& mirror,
                                    const Workload& workload,
                                    const DecodeOptions& options) {
  absl::StatusOr<v1::SessionStats> stats = session.Stats();
  if (!stats.ok()) return stats.status();
  absl::StatusOr<v1::ServerInfo> info = session.GetServerInfo();
  if (!info.ok()) return info.status();
  absl::StatusOr<PolicyInput> input = InputOf(*info, stats->policy());
  if (!input.ok()) return input.status();
  const bool send_scores = *input == PolicyInput::kPerStep;
  const WorkloadSpec& spec = workload.spec();
  const DType dtype = ToDType(AppendDTypeOf(session.layout()));
  const int64_t prompt = spec.prompt_tokens;
  const int64_t steps = options.steps < 0
                            ? spec.decode_steps
                            : std::min(options.steps, spec.decode_steps);

  ShadowCache shadow(workload);
  if (absl::Status s = shadow.Extend(prompt); !s.ok()) return s;
  StepMeter meter(workload, options.evaluate);
  DecodeReport report;
  client::DecodeStream stream = session.Decode();
  std::vector<std::vector<int64_t>> seen(spec.num_layers);
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t t = prompt + step;
    if (absl::Status s = shadow.Extend(1); !s.ok()) return s;
    std::vector<v1::LayerScores> scores;
    for (int32_t l = 0; send_scores && l < spec.num_layers; ++l) {
      absl::StatusOr<v1::LayerScores> s = LayerAttention(
          shadow, l, mirror.version(l), WithNew(mirror.positions(l), t, 1), t,
          1, options.scores);
      if (!s.ok()) return s.status();
      scores.push_back(*std::move(s));
    }
    const client::KvTokens token = shadow.Tokens(t, 1, dtype);
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<v1::DecodeStepResult> r = stream.Step(token, scores);
    const std::chrono::duration<double> took =
        std::chrono::steady_clock::now() - start;
    if (!r.ok()) return r.status();
    report.step_seconds.push_back(took.count());
    // The query attends over the tokens resident after the append (an
    // append-time eviction, e.g. window's, happens first); the scores'
    // eviction comes after it.
    if (absl::Status s = mirror.Apply(r->append(), token.positions); !s.ok()) {
      return s;
    }
    for (int32_t l = 0; l < spec.num_layers; ++l) seen[l] = mirror.positions(l);
    if (absl::Status s = meter.Measure(shadow, t, seen, report); !s.ok()) {
      return s;
    }
    if (absl::Status s = mirror.Apply(r->scores()); !s.ok()) return s;
    ++report.steps;
    if (options.progress) options.progress(step + 1, steps);
  }
  if (absl::Status s = stream.Finish(); !s.ok()) return s;
  report.mean_resident_tokens = meter.mean_resident();
  absl::StatusOr<v1::SessionStats> end = session.Stats();
  if (!end.ok()) return end.status();
  report.final_resident_bytes = end->resident_bytes();
  return report;
}

absl::StatusOr<DecodeReport> EvaluateOracle(const Workload& workload,
                                            int64_t budget) {
  const WorkloadSpec& spec = workload.spec();
  std::vector<OracleCache> oracles;
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    absl::StatusOr<std::vector<double>> mass = FutureAttentionMass(workload, l);
    if (!mass.ok()) return mass.status();
    oracles.emplace_back(*std::move(mass), std::max<int64_t>(1, budget));
  }
  ShadowCache shadow(workload);
  if (absl::Status s = shadow.Extend(spec.prompt_tokens); !s.ok()) return s;
  for (OracleCache& o : oracles) {
    for (int64_t t = 0; t < spec.prompt_tokens; ++t) o.Admit();
  }
  StepMeter meter(workload, /*evaluate=*/true);
  DecodeReport report;
  std::vector<std::vector<int64_t>> resident(spec.num_layers);
  std::vector<double> step_mass;
  for (int64_t step = 0; step < spec.decode_steps; ++step) {
    const int64_t t = spec.prompt_tokens + step;
    if (absl::Status s = shadow.Extend(1); !s.ok()) return s;
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      oracles[l].Admit();
      resident[l] = oracles[l].Resident();
    }
    if (absl::Status s = meter.Measure(shadow, t, resident, report); !s.ok()) {
      return s;
    }
    // This step's attention leaves the oracle's future; and the bound.
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      step_mass.assign(t + 1, 0.0);
      const FullCache full = shadow.full(l, t + 1);
      if (absl::Status s = AccumulateAttention(
              shadow.shape(), shadow.query(l, t), full.keys, t + 1, step_mass);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = oracles[l].Consume(step_mass); !s.ok()) return s;
      report.bound_loss.push_back(
          BestPossibleLoss(step_mass, spec.query_heads, budget + 1));
    }
    ++report.steps;
  }
  report.mean_resident_tokens = meter.mean_resident();
  return report;
}

}  // namespace kvkeep::workers
