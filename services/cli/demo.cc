// `kvkeep demo` (see demo.h): the synthetic KV and scores it sends, and the
// run itself, one method per stage: start (the policy in force and the
// header), prefill, decode steps, finish (mirror check, stats, close).
#include "services/cli/demo.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "services/cli/output.h"
#include "services/common/dtype_proto.h"

namespace kvkeep::cli {
namespace {

using client::KvKeepClient;
using client::Session;
using nlohmann::json;

constexpr char kCommand[] = "demo";

// n tokens of random keys and values for every layer of `layout`.
client::KvTokens RandomTokens(const v1::Layout& layout, int64_t first,
                              int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  client::KvTokens tokens;
  for (int64_t i = 0; i < n; ++i) tokens.positions.push_back(first + i);
  const int64_t elems = n * layout.kv_heads() * layout.head_dim();
  auto fill = [&](std::string& out) {
    const v1::DType dtype = AppendDTypeOf(layout);
    const int64_t width = dtype == v1::DTYPE_F32 ? 4 : 2;
    out.resize(elems * width);
    for (int64_t e = 0; e < elems; ++e) {
      const float v = normal(rng);
      if (dtype == v1::DTYPE_F32) {
        std::memcpy(out.data() + e * 4, &v, 4);
      } else {
        const uint16_t h =
            dtype == v1::DTYPE_F16 ? FloatToF16(v) : FloatToBf16(v);
        std::memcpy(out.data() + e * 2, &h, 2);
      }
    }
  };
  tokens.layers.resize(layout.num_layers());
  for (client::LayerBytes& l : tokens.layers) {
    fill(l.keys);
    fill(l.values);
  }
  return tokens;
}

// A probability row over n slots (one head): a few tokens get most of the
// mass, as real attention does.
std::vector<float> AttentionRow(int64_t n, std::mt19937& rng) {
  std::exponential_distribution<float> heavy(1.0f);
  std::vector<float> row(n);
  double sum = 0;
  for (float& x : row) {
    const float e = heavy(rng);
    x = e * e * e;
    sum += x;
  }
  for (float& x : row) x = static_cast<float>(x / sum);
  return row;
}

// One layer's scores for a step over n slots at `version`.
absl::StatusOr<v1::LayerScores> StepScores(const std::string& form,
                                           const v1::Layout& layout,
                                           int32_t layer, uint64_t version,
                                           int64_t n, std::mt19937& rng) {
  const int32_t heads = layout.query_heads();
  if (form == "reduced") {
    std::vector<float> sum(n, 0.0f);
    for (int32_t h = 0; h < heads; ++h) {
      const std::vector<float> row = AttentionRow(n, rng);
      for (int64_t i = 0; i < n; ++i) sum[i] += row[i];
    }
    return client::ReducedScores(layer, version, sum);
  }
  if (form == "per_head") {
    std::vector<float> all;
    for (int32_t h = 0; h < heads; ++h) {
      const std::vector<float> row = AttentionRow(n, rng);
      all.insert(all.end(), row.begin(), row.end());
    }
    return client::PerHeadScores(layer, version, all);
  }
  if (form == "queries") {
    std::normal_distribution<float> normal;
    std::vector<float> q(int64_t{heads} * layout.head_dim());
    for (float& x : q) x = normal(rng);
    return client::QueryScores(layer, version, q);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--scores=", form, ": expected reduced, per_head or queries"));
}

// The CreateSession request of a demo: the layout (the server's first when
// none is named), the policy and its parameters, the budget and a fresh
// idempotency key. INVALID_ARGUMENT, a usage error, if a --params entry is
// not name=value.
absl::StatusOr<v1::CreateSessionRequest> SessionRequest(
    const DemoOptions& options, const v1::ServerInfo& info) {
  v1::CreateSessionRequest request;
  request.set_layout(options.layout.empty() ? info.layouts(0).name()
                                            : options.layout);
  request.set_policy(options.policy);
  for (absl::string_view kv_pair :
       absl::StrSplit(options.params, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv_pair, '=');
    if (p.first.empty() || p.second.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("demo: --params: '", kv_pair, "' is not name=value"));
    }
    (*request.mutable_policy_params())[p.first] = p.second;
  }
  request.mutable_budget()->set_tokens(options.budget_tokens);
  // Safe to retry: a retried create returns the first attempt's session.
  // The key is new for every run (not from --seed), or a second demo would
  // get the first one's session back.
  std::random_device entropy;
  request.set_idempotency_key(
      absl::StrFormat("kvkeep-demo-%08x%08x", entropy(), entropy()));
  return request;
}

// One demo on the session it created, stage by stage. A stage's failure
// ends the run: the session is closed (unless --keep) and the failure
// reported. Not thread-safe.
class DemoRun {
 public:
  DemoRun(const DemoOptions& options, const v1::ServerInfo& info,
          const v1::CreateSessionRequest& request, Session session)
      : options_(options),
        info_(info),
        request_(request),
        session_(std::move(session)),
        layout_(session_.layout()),
        rng_(options.seed),
        table_({"STEP", "POSITION", "EVICTED (LAYER 0)", "EVICTED (ALL)",
                "RESIDENT (LAYER 0)", "VERSION (LAYER 0)"}) {}

  // The exit status.
  int Run();

 private:
  // The policy in force, the run's header and an empty mirror.
  absl::Status Start();
  void PrintHeader(const std::string& policy) const;
  // The prompt, on one AppendPrefill stream.
  absl::Status Prefill();
  // The Decode stream: one table row per step.
  absl::Status DecodeSteps();
  absl::Status DecodeStep(int64_t step);
  // Per layer, the positions `result` evicted (its append's, then its
  // scores'); records the step's row.
  void RecordStep(int64_t step, bool append,
                  const v1::DecodeStepResult& result);
  // The mirror against the store's tables, the statistics, the close.
  int Finish();
  absl::StatusOr<bool> MirrorMatchesStore() const;
  // Closes the session unless --keep; kExitFailure if that fails.
  int CloseOrKeep();
  // Closes the session unless --keep, and reports `status`.
  int Abandon(const absl::Status& status);

  const DemoOptions& options_;
  const v1::ServerInfo& info_;
  const v1::CreateSessionRequest& request_;
  const Session session_;
  const v1::Layout& layout_;  // session_'s
  std::mt19937 rng_;
  // Whether the policy in force evicts on attention (takes a step's scores);
  // the others refuse scores (they evict on append, or never).
  bool scored_ = false;
  // The worker's view of the block tables, kept by what each call reports.
  std::optional<client::BlockTableMirror> mirror_;
  // Destroyed with the run, after any Abandon closed the session.
  std::optional<client::DecodeStream> stream_;
  json out_;
  json steps_json_ = json::array();
  Table table_;
  int64_t evicted_total_ = 0;
  int64_t position_ = 0;  // of the next token
};

int DemoRun::Run() {
  if (absl::Status s = Start(); !s.ok()) return Abandon(s);
  if (options_.prompt_tokens > 0) {
    if (absl::Status s = Prefill(); !s.ok()) return Abandon(s);
  }
  if (absl::Status s = DecodeSteps(); !s.ok()) return Abandon(s);
  return Finish();
}

absl::Status DemoRun::Start() {
  // The policy in force (the server's default when --policy is empty).
  absl::StatusOr<v1::SessionStats> created = session_.Stats();
  if (!created.ok()) return created.status();
  const v1::PolicyInfo* in_force = FindPolicy(info_, created->policy());
  if (in_force == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the server does not describe policy '", created->policy(),
        "' in ServerInfo.policy_info (a kvkeepd older than this kvkeep?)"));
  }
  scored_ = in_force->input() == v1::PolicyInfo::INPUT_PER_STEP;
  out_ = {{"session_id", session_.id()},
          {"layout", LayoutJson(layout_)},
          {"policy", created->policy()},
          {"policy_params", json::object()},
          {"budget", Array(session_.layer_budgets())},
          {"scores", scored_ ? options_.scores : "none"}};
  for (const auto& [k, v] : request_.policy_params()) {
    out_["policy_params"][k] = v;
  }
  if (!options_.json) PrintHeader(created->policy());
  mirror_.emplace(layout_.page_tokens(),
                  std::vector<uint64_t>(created->layer_version().begin(),
                                        created->layer_version().end()));
  return absl::OkStatus();
}

void DemoRun::PrintHeader(const std::string& policy) const {
  std::printf(
      "session %s on layout '%s' (%d layers, %d/%d kv/query heads, head_dim "
      "%d, %s); policy %s {%s}, budget %lld tokens per layer; scores: %s\n",
      session_.id().c_str(), layout_.name().c_str(), layout_.num_layers(),
      layout_.kv_heads(), layout_.query_heads(), layout_.head_dim(),
      DTypeName(layout_.dtype()).c_str(), policy.c_str(),
      absl::StrJoin(request_.policy_params(), ", ", absl::PairFormatter("="))
          .c_str(),
      static_cast<long long>(options_.budget_tokens),
      scored_ ? options_.scores.c_str() : "none (the policy evicts on append)");
}

absl::Status DemoRun::Prefill() {
  const int64_t prompt = options_.prompt_tokens;
  client::KvTokens tokens = RandomTokens(layout_, 0, prompt, rng_);
  absl::StatusOr<client::PrefillResult> prefill =
      session_.AppendPrefill(tokens);
  if (!prefill.ok()) return prefill.status();
  if (absl::Status s = mirror_->ApplyPrefill(*prefill, tokens.positions);
      !s.ok()) {
    return s;
  }
  for (const v1::StepResult& chunk : prefill->chunks) {
    for (const v1::LayerChange& c : chunk.layers()) {
      evicted_total_ += c.evicted_positions_size();
    }
  }
  position_ = prompt;
  out_["prompt_tokens"] = prompt;
  out_["prefill_chunks"] = prefill->chunks.size();
  if (!options_.json) {
    std::printf("prefill: %lld tokens in %zu chunk(s)\n",
                static_cast<long long>(prompt), prefill->chunks.size());
  }
  return absl::OkStatus();
}

absl::Status DemoRun::DecodeSteps() {
  stream_.emplace(session_.Decode());
  // Step 0 is the prompt's own attention, without a new token: it brings a
  // prompt longer than the budget down before decoding starts.
  for (int64_t step = scored_ && options_.prompt_tokens > 0 ? 0 : 1;
       step <= options_.steps; ++step) {
    if (absl::Status s = DecodeStep(step); !s.ok()) return s;
  }
  return stream_->Finish();
}

absl::Status DemoRun::DecodeStep(int64_t step) {
  const bool append = step > 0;
  std::vector<v1::LayerScores> scores;
  if (scored_) {
    for (int32_t l = 0; l < layout_.num_layers(); ++l) {
      absl::StatusOr<v1::LayerScores> s =
          StepScores(options_.scores, layout_, l, mirror_->version(l),
                     mirror_->resident(l) + (append ? 1 : 0), rng_);
      if (!s.ok()) return s.status();
      scores.push_back(*std::move(s));
    }
  }
  client::KvTokens token;
  if (append) token = RandomTokens(layout_, position_, 1, rng_);
  absl::StatusOr<v1::DecodeStepResult> result =
      append ? stream_->Step(token, scores) : stream_->Step(scores);
  if (!result.ok()) return result.status();
  if (absl::Status s = mirror_->ApplyDecode(*result, token.positions);
      !s.ok()) {
    return s;
  }
  RecordStep(step, append, *result);
  if (append) ++position_;
  return absl::OkStatus();
}

void DemoRun::RecordStep(int64_t step, bool append,
                         const v1::DecodeStepResult& result) {
  std::vector<std::vector<int64_t>> evicted(layout_.num_layers());
  int64_t step_evicted = 0;
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {
    for (const v1::StepResult* part : {&result.append(), &result.scores()}) {
      if (l < part->layers_size()) {
        evicted[l].insert(evicted[l].end(),
                          part->layers(l).evicted_positions().begin(),
                          part->layers(l).evicted_positions().end());
      }
    }
    step_evicted += static_cast<int64_t>(evicted[l].size());
  }
  evicted_total_ += step_evicted;
  const client::BlockTableMirror& mirror = *mirror_;
  steps_json_.push_back({{"step", step},
                         {"position", append ? json(position_) : json(nullptr)},
                         {"evicted", evicted},
                         {"resident_layer0", mirror.resident(0)},
                         {"version_layer0", mirror.version(0)}});
  table_.Add({absl::StrCat(step), append ? absl::StrCat(position_) : "-",
              evicted[0].empty() ? "-" : absl::StrJoin(evicted[0], ","),
              absl::StrCat(step_evicted), absl::StrCat(mirror.resident(0)),
              absl::StrCat(mirror.version(0))});
}

absl::StatusOr<bool> DemoRun::MirrorMatchesStore() const {
  absl::StatusOr<v1::GetBlockTablesResponse> tables = session_.GetBlockTables();
  if (!tables.ok()) return tables.status();
  bool match = tables->tables_size() == mirror_->num_layers();
  for (int32_t l = 0; match && l < mirror_->num_layers(); ++l) {
    match = tables->tables(l).SerializeAsString() ==
            mirror_->Table(l).SerializeAsString();
  }
  return match;
}

int DemoRun::Finish() {
  // The worker's mirror must equal the store's tables.
  absl::StatusOr<bool> match = MirrorMatchesStore();
  if (!match.ok()) return Abandon(match.status());
  absl::StatusOr<v1::SessionStats> stats = session_.Stats();
  if (!stats.ok()) return Abandon(stats.status());
  out_["steps"] = steps_json_;
  out_["evicted_tokens"] = evicted_total_;
  out_["block_tables_match"] = *match;
  out_["stats"] = StatsJson(*stats);
  if (!options_.json) {
    table_.Print();
    std::printf("\n");
    PrintStats(*stats);
    std::printf("\nblock tables: the client's mirror %s the store's\n",
                *match ? "matches" : "DOES NOT MATCH");
  }
  if (int exit = CloseOrKeep(); exit != 0) return exit;
  if (options_.json) Print(out_);
  if (!*match) {
    return Fail(kCommand,
                absl::InternalError("the mirrored block tables differ from the "
                                    "store's"),
                options_.json);
  }
  return 0;
}

int DemoRun::CloseOrKeep() {
  if (options_.keep) {
    out_["closed"] = false;
    if (!options_.json) {
      std::printf("kept session %s open (kvkeep close %s)\n",
                  session_.id().c_str(), session_.id().c_str());
    }
    return 0;
  }
  absl::StatusOr<int64_t> freed = session_.Close();
  if (!freed.ok()) return Fail(kCommand, freed.status(), options_.json);
  out_["closed"] = true;
  out_["freed_pages"] = *freed;
  if (!options_.json) {
    std::printf("closed %s: freed %lld pages\n", session_.id().c_str(),
                static_cast<long long>(*freed));
  }
  return 0;
}

int DemoRun::Abandon(const absl::Status& status) {
  if (!options_.keep) (void)session_.Close();
  return Fail(kCommand, status, options_.json);
}

}  // namespace

int Demo(const KvKeepClient& kv, const DemoOptions& options) {
  if (options.steps < 0 || options.prompt_tokens < 0 ||
      options.prompt_tokens + options.steps == 0) {
    return Usage("demo: --steps and --prompt must be >= 0, not both 0");
  }
  absl::StatusOr<v1::ServerInfo> info = kv.GetServerInfo();
  if (!info.ok()) return Fail(kCommand, info.status(), options.json);
  if (const v1::PolicyInfo* p = FindPolicy(*info, options.policy);
      p != nullptr && p->input() == v1::PolicyInfo::INPUT_COMPRESS) {
    return Usage(absl::StrCat("demo: ", options.policy,
                              " compresses a prompt once; pick a decode "
                              "policy"));
  }
  if (info->layouts().empty()) {
    return Fail(kCommand, absl::NotFoundError("the server serves no layout"),
                options.json);
  }
  absl::StatusOr<v1::CreateSessionRequest> request =
      SessionRequest(options, *info);
  if (!request.ok()) return Usage(request.status().message());
  absl::StatusOr<Session> session = kv.CreateSession(*request);
  if (!session.ok()) return Fail(kCommand, session.status(), options.json);
  return DemoRun(options, *info, *request, *std::move(session)).Run();
}

}  // namespace kvkeep::cli
