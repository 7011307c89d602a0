#include "services/lm/lm_sequence.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/quantize.h"
#include "services/common/dtype_proto.h"
#include "services/lm/kivi_kv.h"

namespace kvkeep::lm {

namespace {

// What the server says `policy` takes, and its snapkv window (the
// request's, else the published default).
struct PolicyNeeds {
  PolicyInput input = PolicyInput::kNone;
  bool accepts_queries = false;
  int64_t window = 0;
};

absl::StatusOr<PolicyNeeds> NeedsOf(
    const v1::ServerInfo& info, const std::string& policy,
    const std::map<std::string, std::string>& params) {
  for (const v1::PolicyInfo& p : info.policy_info()) {
    if (p.name() != policy) continue;
    PolicyNeeds needs;
    needs.accepts_queries = p.accepts_queries();
    switch (p.input()) {
      case v1::PolicyInfo::INPUT_PER_STEP:
        needs.input = PolicyInput::kPerStep;
        break;
      case v1::PolicyInfo::INPUT_COMPRESS:
        needs.input = PolicyInput::kCompress;
        break;
      default:
        break;
    }
    if (needs.input != PolicyInput::kCompress) return needs;
    std::string window;
    for (const v1::PolicyParam& param : p.params()) {
      if (param.name() == "window") window = param.default_value();
    }
    if (auto it = params.find("window"); it != params.end()) {
      window = it->second;
    }
    if (!absl::SimpleAtoi(window, &needs.window) || needs.window < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy ", policy, ": window '", window, "' is not a count"));
    }
    return needs;
  }
  return absl::NotFoundError(absl::StrCat(
      "the server does not describe policy '", policy,
      "' in ServerInfo.policy_info (kvkeep info lists its policies)"));
}

// Cache: ContiguousKv or EmulatedKv.
template <typename Cache>
class LocalSequence final : public Sequence {
 public:
  template <typename Format>
  LocalSequence(const ModelConfig& config, const Format& format,
                std::string label, int64_t capacity_tokens)
      : cache_(config, format, capacity_tokens),
        layers_(config.layers),
        label_(std::move(label)) {}

  const KvSource& cache() const override { return cache_; }
  AttentionOutput attention(StepKind) const override {
    return AttentionOutput::kNone;
  }
  absl::Status Commit(const SequenceStep& step, StepKind) override {
    return cache_.Append(step);
  }
  absl::StatusOr<CacheUsage> Usage() const override {
    CacheUsage usage;
    usage.resident_tokens_per_layer = static_cast<double>(cache_.resident());
    usage.resident_tokens = cache_.resident() * layers_;
    usage.bytes = cache_.held_bytes();
    return usage;
  }
  absl::Status Close() override { return absl::OkStatus(); }
  const std::string& label() const override { return label_; }
  std::string_view access() const override { return "local"; }

 private:
  Cache cache_;
  int32_t layers_;
  std::string label_;
};

// Reads a session's cache where kvkeepd keeps it: the mapped pool and the
// mirrored block tables.
class MappedSource final : public KvSource {
 public:
  MappedSource(std::shared_ptr<const MappedPool> pool,
               const client::BlockTableMirror* mirror)
      : pool_(std::move(pool)), mirror_(mirror) {}
  ResidentKv Layer(int32_t layer) const override {
    return pool_->Layer(*mirror_, layer);
  }
  absl::Status Check() const { return pool_->CheckPages(*mirror_); }

 private:
  std::shared_ptr<const MappedPool> pool_;  // forks map it once
  const client::BlockTableMirror* mirror_;
};

v1::LayerScores ScoresOf(ScoreForm form, int32_t layer, uint64_t version,
                         const std::vector<float>& values, int32_t rows) {
  switch (form) {
    case ScoreForm::kPerHead:
      return client::PerHeadScores(layer, version, values, rows);
    case ScoreForm::kQueries:
      return client::QueryScores(layer, version, values, rows);
    case ScoreForm::kReduced:
      break;
  }
  return client::ReducedScores(layer, version, values, rows);
}

AttentionOutput OutputOf(ScoreForm form) {
  switch (form) {
    case ScoreForm::kPerHead:
      return AttentionOutput::kPerHead;
    case ScoreForm::kQueries:
      return AttentionOutput::kQueries;
    case ScoreForm::kReduced:
      break;
  }
  return AttentionOutput::kReduced;
}

class StoreSequence final : public Sequence {
 public:
  StoreSequence(client::Session session, client::BlockTableMirror mirror,
                const StoreSequenceOptions& options, const PageLayout& layout,
                DType append_dtype, const PolicyNeeds& needs)
      : layout_(layout),
        append_dtype_(append_dtype),
        session_(std::move(session)),
        stream_(session_.Decode()),
        mirror_(std::move(mirror)),
        options_(options),
        needs_(needs) {
    if (IsKivi(layout_.dtype)) {
      kivi_.emplace(layout_, mirror_.num_layers(), append_dtype_, false);
    } else {
      slots_.emplace(mirror_.num_layers(), layout_.token_bytes());
    }
  }

  // Reads the pool in place instead of mirroring bytes.
  void UsePool(std::shared_ptr<const MappedPool> pool) {
    slots_.reset();
    if (kivi_)
      kivi_.emplace(layout_, mirror_.num_layers(), append_dtype_, true);
    pool_ = pool;
    mapped_.emplace(std::move(pool), &mirror_);
  }

  absl::StatusOr<std::unique_ptr<Sequence>> Fork() const override {
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", session_.id(), " is closed"));
    }
    absl::StatusOr<client::Session> child = session_.Fork();
    if (!child.ok()) return Annotate(child.status());
    // The child's tables start as this session's (its results then say
    // which shared pages it copied before writing).
    auto forked = std::make_unique<StoreSequence>(
        *std::move(child), mirror_, options_, layout_, append_dtype_, needs_);
    if (pool_) {
      forked->UsePool(pool_);
    } else {
      forked->slots_ = slots_;
    }
    forked->kivi_ = kivi_;
    return forked;
  }

  std::string share_key() const override {
    std::string key = absl::StrCat(
        options_.layout, "|", options_.policy, "|", options_.budget_tokens, "|",
        static_cast<int>(options_.scores), "|", std::string(access()));
    for (const auto& [k, v] : options_.params)
      absl::StrAppend(&key, "|", k, "=", v);
    return key;
  }

  const KvSource& cache() const override {
    if (kivi_) return *kivi_;
    if (mapped_) return *mapped_;
    return *slots_;
  }

  AttentionOutput attention(StepKind kind) const override {
    if (needs_.input == PolicyInput::kPerStep) return OutputOf(options_.scores);
    // snapkv: the window's rows of the prompt's last chunk.
    if (needs_.input == PolicyInput::kCompress &&
        kind == StepKind::kPromptEnd) {
      return AttentionOutput::kReduced;
    }
    return AttentionOutput::kNone;
  }

  absl::Status Commit(const SequenceStep& step, StepKind kind) override {
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", session_.id(), " is closed"));
    }
    client::KvTokens tokens;
    tokens.positions.assign(step.positions.begin(), step.positions.end());
    tokens.layers.resize(step.keys.size());
    // kivi_int4: the forward pass hands back float32; the store takes the
    // layout's append dtype.
    std::vector<std::string> keys, values;
    for (size_t l = 0; l < step.keys.size(); ++l) {
      if (kivi_) {
        keys.push_back(Narrow(step.keys[l]));
        values.push_back(Narrow(step.values[l]));
      }
      tokens.layers[l] = kivi_
                             ? client::LayerBytes{keys[l], values[l]}
                             : client::LayerBytes{step.keys[l], step.values[l]};
    }
    std::vector<v1::LayerScores> scores;
    if (needs_.input == PolicyInput::kPerStep) {
      const int32_t rows = static_cast<int32_t>(step.tokens.size());
      for (int32_t l = 0; l < mirror_.num_layers(); ++l) {
        scores.push_back(ScoresOf(options_.scores, l, mirror_.version(l),
                                  step.attention_out[l], rows));
      }
    }
    absl::StatusOr<v1::DecodeStepResult> result = stream_.Step(tokens, scores);
    if (!result.ok()) return Annotate(result.status());
    if (absl::Status s = kivi_ ? FollowKivi(*result, step, keys, values)
                               : Follow(*result, step);
        !s.ok()) {
      return s;
    }
    if (needs_.input == PolicyInput::kCompress &&
        kind == StepKind::kPromptEnd) {
      return Compress(step);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<CacheUsage> Usage() const override {
    absl::StatusOr<v1::SessionStats> stats = session_.Stats();
    if (!stats.ok()) return Annotate(stats.status());
    CacheUsage usage;
    usage.resident_tokens = stats->resident_tokens();
    usage.resident_tokens_per_layer =
        static_cast<double>(stats->resident_tokens()) / mirror_.num_layers();
    usage.bytes = stats->resident_bytes();
    return usage;
  }

  absl::Status Close() override {
    if (closed_) return absl::OkStatus();
    closed_ = true;
    stream_.Finish().IgnoreError();
    absl::StatusOr<int64_t> freed = session_.Close();
    return freed.ok() ? absl::OkStatus() : Annotate(freed.status());
  }

  const std::string& label() const override { return options_.label; }
  std::string_view access() const override {
    return mapped_ ? "mapped" : "mirror";
  }
  int64_t min_prompt_end_tokens() const override {
    return std::max<int64_t>(needs_.window, 1);
  }

 private:
  absl::Status Annotate(const absl::Status& status) const {
    return absl::Status(
        status.code(), absl::StrCat(options_.label, " (session ", session_.id(),
                                    "): ", status.message()));
  }

  // Applies a step's changes to the block tables and, when mirroring, to
  // the bytes.
  absl::Status Follow(const v1::DecodeStepResult& result,
                      const SequenceStep& step) {
    absl::Status s = mirror_.ApplyDecode(result, step.positions);
    if (s.ok() && slots_ && IsQuantized(layout_.dtype)) {
      std::vector<std::string> keys, values;
      s = Quantize(step, &keys, &values);
      if (s.ok()) {
        s = slots_->Apply(result.append(), step.positions, keys, values);
      }
    } else if (s.ok() && slots_) {
      s = slots_->Apply(result.append(), step.positions, step.keys,
                        step.values);
    }
    if (s.ok() && slots_) s = slots_->Apply(result.scores());
    if (s.ok() && mapped_) s = mapped_->Check();
    if (!s.ok()) {
      return Annotate(absl::InternalError(
          absl::StrCat("the store's reply does not fit this worker's cache: ",
                       s.message())));
    }
    return absl::OkStatus();
  }

  // kivi_int4: the block tables, then the decoded cache (from the pool when
  // mapped, else what the store made of `keys` and `values`, the step's
  // tokens as sent).
  absl::Status FollowKivi(const v1::DecodeStepResult& result,
                          const SequenceStep& step,
                          absl::Span<const std::string> keys,
                          absl::Span<const std::string> values) {
    absl::Status s = mirror_.ApplyDecode(result, step.positions);
    if (s.ok()) {
      s = kivi_->Apply(result.append(), step.positions, keys, values);
    }
    if (s.ok()) s = kivi_->Apply(result.scores());
    if (s.ok() && mapped_) s = mapped_->Check();
    if (s.ok() && mapped_) {
      std::vector<ResidentKv> pool;
      for (int32_t l = 0; l < mirror_.num_layers(); ++l) {
        pool.push_back(mapped_->Layer(l));
      }
      s = kivi_->Decode(pool);
    }
    if (!s.ok()) {
      return Annotate(absl::InternalError(
          absl::StrCat("the store's reply does not fit this worker's cache: ",
                       s.message())));
    }
    return absl::OkStatus();
  }

  // Float32 elements (a kivi step's keys or values) in the append dtype.
  std::string Narrow(const std::string& f32) const {
    const int64_t n = static_cast<int64_t>(f32.size() / sizeof(float));
    std::string out(n * DTypeBytes(append_dtype_), '\0');
    for (int64_t e = 0; e < n; ++e) {
      StoreFromFloat(append_dtype_, out.data(), e,
                     LoadAsFloat(DType::kF32, f32.data(), e));
    }
    return out;
  }

  // A quantised layout's mirror holds the records the store made of what
  // the step sent: the same CPU twin makes the same bytes.
  absl::Status Quantize(const SequenceStep& step,
                        std::vector<std::string>* keys,
                        std::vector<std::string>* values) const {
    const int64_t n = static_cast<int64_t>(step.positions.size());
    const int64_t in_bytes =
        layout_.token_elements() * DTypeBytes(append_dtype_);
    for (size_t l = 0; l < step.keys.size(); ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        const std::string& in = kind == 0 ? step.keys[l] : step.values[l];
        std::string& out = (kind == 0 ? keys : values)->emplace_back();
        if (static_cast<int64_t>(in.size()) != n * in_bytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", l, ": ", in.size(), " bytes for ", n,
                           " tokens of ", in_bytes));
        }
        out.resize(n * layout_.token_bytes());
        if (!QuantizeTokens(layout_, append_dtype_, in.data(), n,
                            reinterpret_cast<std::byte*>(out.data()))
                 .ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", l, ": a token the store would refuse"));
        }
      }
    }
    return absl::OkStatus();
  }

  // snapkv: the last `window` rows of the prompt's last chunk, per layer.
  absl::Status Compress(const SequenceStep& step) {
    const int64_t n = static_cast<int64_t>(step.tokens.size());
    if (n < needs_.window) {
      return absl::InvalidArgumentError(
          absl::StrCat(options_.label, ": the prompt's last chunk has ", n,
                       " tokens, snapkv's window needs ", needs_.window));
    }
    std::vector<v1::LayerScores> window;
    for (int32_t l = 0; l < mirror_.num_layers(); ++l) {
      const std::vector<float>& rows = step.attention_out[l];
      const size_t width = rows.size() / n;  // resident before + n
      if (static_cast<int64_t>(width) != mirror_.resident(l)) {
        return absl::InternalError(absl::StrCat(
            options_.label, ": layer ", l, " holds ", mirror_.resident(l),
            " tokens, the window's attention covers ", width));
      }
      window.push_back(client::ReducedScores(
          l, mirror_.version(l),
          absl::MakeConstSpan(rows).subspan((n - needs_.window) * width),
          static_cast<int32_t>(needs_.window)));
    }
    absl::StatusOr<v1::StepResult> result = session_.CompressPrompt(window);
    if (!result.ok()) return Annotate(result.status());
    v1::DecodeStepResult as_step;
    *as_step.mutable_scores() = *std::move(result);
    SequenceStep none;
    return Follow(as_step, none);
  }

  const PageLayout layout_;  // of the session's cache (page_tokens: kivi's)
  const DType append_dtype_;
  client::Session session_;
  client::DecodeStream stream_;
  client::BlockTableMirror mirror_;
  std::optional<SlotCache> slots_;
  std::optional<KiviKv> kivi_;  // kivi_int4: the decoded cache (slots_ unset)
  std::shared_ptr<const MappedPool> pool_;
  std::optional<MappedSource> mapped_;
  const StoreSequenceOptions options_;
  const PolicyNeeds needs_;
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<Sequence> NewLocalSequence(const ModelConfig& config,
                                           DType kv_dtype, std::string label,
                                           int64_t capacity_tokens) {
  return std::make_unique<LocalSequence<ContiguousKv>>(
      config, KvFormat(kv_dtype), std::move(label), capacity_tokens);
}

std::unique_ptr<Sequence> NewEmulatedSequence(const ModelConfig& config,
                                              const Emulation& emulation,
                                              std::string label,
                                              int64_t capacity_tokens) {
  return std::make_unique<LocalSequence<EmulatedKv>>(
      config, emulation, std::move(label), capacity_tokens);
}

absl::StatusOr<KvFormat> FormatOf(const v1::Layout& layout) {
  absl::StatusOr<DType> dtype = DTypeFromProto(layout.dtype());
  absl::StatusOr<DType> append = DTypeFromProto(AppendDTypeOf(layout));
  if (!dtype.ok() || !append.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout ", layout.name(), ": ",
                     (dtype.ok() ? append : dtype).status().message()));
  }
  if (!IsQuantized(*dtype)) return KvFormat(*dtype);
  return KvFormat::Quantized(*dtype, *append, layout.group_size());
}

absl::StatusOr<v1::Layout> FindLayout(const v1::ServerInfo& info,
                                      const ModelConfig& config,
                                      PositionMode positions,
                                      const std::string& name) {
  const bool pre_rope = positions == PositionMode::kCachePosition;
  const auto fits = [&](const v1::Layout& l) {
    return l.num_layers() == config.layers && l.kv_heads() == config.kv_heads &&
           l.query_heads() == config.query_heads &&
           l.head_dim() == config.head_dim && l.keys_pre_rope() == pre_rope;
  };
  std::vector<std::string> have;
  for (const v1::Layout& l : info.layouts()) {
    if (name.empty() ? fits(l) : l.name() == name) {
      if (fits(l)) return l;
      return absl::FailedPreconditionError(absl::StrCat(
          "layout ", name, " (", l.num_layers(), " layers, ", l.kv_heads(), "/",
          l.query_heads(), " kv/query heads, head_dim ", l.head_dim(),
          ", keys_pre_rope ", l.keys_pre_rope() ? "true" : "false",
          ") does not fit the model (", config.layers, " layers, ",
          config.kv_heads, "/", config.query_heads, ", head_dim ",
          config.head_dim, ", keys_pre_rope ", pre_rope ? "true" : "false",
          ")"));
    }
    have.push_back(l.name());
  }
  return absl::NotFoundError(absl::StrCat(
      name.empty() ? "no layout" : absl::StrCat("no layout ", name),
      " of the server fits the model (", config.layers, " layers, ",
      config.kv_heads, "/", config.query_heads, " kv/query heads, head_dim ",
      config.head_dim, ", keys_pre_rope ", pre_rope ? "true" : "false",
      "); it has: ", absl::StrJoin(have, ", "),
      " (config/smollm2.json has layouts for SmolLM2-135M)"));
}

absl::StatusOr<std::unique_ptr<Sequence>> NewStoreSequence(
    const client::KvKeepClient& client, const v1::ServerInfo& info,
    const ModelConfig& config, const StoreSequenceOptions& options) {
  absl::StatusOr<PolicyNeeds> needs =
      NeedsOf(info, options.policy, options.params);
  if (!needs.ok()) return needs.status();
  if (options.scores == ScoreForm::kQueries &&
      needs->input == PolicyInput::kPerStep && !needs->accepts_queries) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy ", options.policy, " does not take query scores"));
  }
  v1::CreateSessionRequest request;
  request.set_layout(options.layout);
  request.set_policy(options.policy);
  for (const auto& [k, v] : options.params) {
    (*request.mutable_policy_params())[k] = v;
  }
  request.mutable_budget()->set_tokens(options.budget_tokens);
  absl::StatusOr<client::Session> session = client.CreateSession(request);
  if (!session.ok()) return session.status();
  if (options.scores == ScoreForm::kQueries &&
      session->layout().keys_pre_rope()) {
    session->Close().IgnoreError();
    return absl::FailedPreconditionError(
        "query scores need keys stored after RoPE (--positions=original)");
  }
  absl::StatusOr<KvFormat> format = FormatOf(session->layout());
  if (!format.ok()) return format.status();
  absl::StatusOr<client::BlockTableMirror> mirror = session->Mirror();
  if (!mirror.ok()) return mirror.status();
  PageLayout layout = format->Layout(config);
  layout.page_tokens = session->layout().page_tokens();
  auto sequence =
      std::make_unique<StoreSequence>(*session, *std::move(mirror), options,
                                      layout, format->append_dtype, *needs);
  if (options.access != CacheAccess::kMirror) {
    absl::StatusOr<v1::MapPoolResponse> pool = session->MapPool();
    absl::StatusOr<std::unique_ptr<MappedPool>> mapped =
        pool.ok() ? MappedPool::Map(*pool)
                  : absl::StatusOr<std::unique_ptr<MappedPool>>(pool.status());
    if (mapped.ok()) {
      sequence->UsePool(*std::move(mapped));
    } else if (options.access == CacheAccess::kMapped) {
      sequence->Close().IgnoreError();
      return mapped.status();
    }
  }
  return sequence;
}

}  // namespace kvkeep::lm
