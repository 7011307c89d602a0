// kvkeep: the command-line client of kvkeepd (docs/cli.md).
//
//   kvkeep [flags] info | sessions | stats SESSION | close SESSION | demo
//
// Human-readable tables by default, one JSON document on stdout with --json.
// Exit status: 0 on success; 1 when the server refused or could not be
// reached (stderr names the gRPC status code, and with --json stdout holds
// {"error": {"code", "message"}}); 2 for a usage error.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "services/client/kvkeep_client.h"
#include "services/common/dtype_proto.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvkeepd address");
ABSL_FLAG(std::string, token, "",
          "bearer token (default: $KVKEEP_TOKEN, if set)");
ABSL_FLAG(bool, json, false, "print one JSON document instead of tables");
ABSL_FLAG(std::string, target_token, "",
          "transfer: bearer token for the target kvkeepd");
ABSL_FLAG(std::string, transport, "auto",
          "transfer: auto (NCCL when both pools are on GPUs), host or nccl");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM file of the CA that signed the server's certificate (enables "
          "TLS)");
ABSL_FLAG(bool, tls, false, "use TLS with the system's root certificates");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(10), "deadline per call");
ABSL_FLAG(int, retries, 2,
          "retries of idempotent calls when the server is unavailable");

// demo
ABSL_FLAG(std::string, layout, "", "demo: layout (default: the first)");
ABSL_FLAG(std::string, policy, "h2o", "demo: eviction policy");
ABSL_FLAG(std::string, params, "sinks=4,recent=8",
          "demo: policy parameters, name=value,...");
ABSL_FLAG(int64_t, budget, 32, "demo: tokens per layer");
ABSL_FLAG(int64_t, prompt, 16, "demo: prompt tokens appended first");
ABSL_FLAG(int64_t, steps, 32, "demo: decode steps");
ABSL_FLAG(std::string, scores, "reduced",
          "demo: what each step sends: reduced (probabilities summed over "
          "heads), per_head, or queries (the store scores them)");
ABSL_FLAG(uint32_t, seed, 1, "demo: random seed of the KV and the scores");
ABSL_FLAG(bool, keep, false, "demo: leave the session open");

namespace kvkeep::cli {
namespace {

using client::KvKeepClient;
using client::Session;
using nlohmann::json;

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// The usage text. absl's --help prints it after "kvkeep: ", so it does not
// name the program itself.
constexpr char kUsage[] =
    "the kvkeepd command-line client.\n"
    "\n"
    "  kvkeep [flags] info            layouts, pools, policies, limits\n"
    "  kvkeep [flags] sessions        open sessions (the caller's tenant's)\n"
    "  kvkeep [flags] stats SESSION   one session's statistics, per layer\n"
    "  kvkeep [flags] close SESSION   close a session, freeing its pages\n"
    "  kvkeep [flags] transfer SESSION TARGET\n"
    "                                 move a session to the kvkeepd at TARGET "
    "(host:port; --target_token when it has tenants)\n"
    "  kvkeep [flags] demo            create a session, stream decode steps "
    "with scores, print the evictions, close it\n"
    "\n"
    "Common flags: --server (127.0.0.1:50051), --token, --json, --tls_ca, "
    "--tls, --deadline, --retries. Demo flags: --layout, --policy, --params, "
    "--budget, --prompt, --steps, --scores, --seed, --keep.";

bool Json() { return absl::GetFlag(FLAGS_json); }

void Print(const json& doc) { std::printf("%s\n", doc.dump(2).c_str()); }

// A failure: the status code name and message on stderr, and as JSON.
int Fail(absl::string_view command, const absl::Status& status) {
  std::fprintf(stderr, "kvkeep: %s: %s: %s\n", std::string(command).c_str(),
               absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  if (Json()) {
    Print(json{{"error",
                {{"code", absl::StatusCodeToString(status.code())},
                 {"message", std::string(status.message())}}}});
  }
  return kExitFailure;
}

int Usage(absl::string_view problem) {
  std::fprintf(stderr, "kvkeep: %s\n\n%s\n", std::string(problem).c_str(),
               kUsage);
  return kExitUsage;
}

// A plain-text table: columns right-aligned except the first.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print() const {
    std::vector<size_t> width(rows_[0].size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        width[c] = std::max(width[c], row[c].size());
      }
    }
    for (const auto& row : rows_) {
      std::string line;
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        const std::string pad(width[c] - row[c].size(), ' ');
        if (c > 0) line += "  ";
        line += c == 0 ? row[c] + pad : pad + row[c];
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      std::printf("%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string DTypeName(v1::DType dtype) {
  absl::StatusOr<DType> d = DTypeFromProto(dtype);
  return d.ok() ? std::string(kvkeep::DTypeName(*d)) : "unspecified";
}

std::string Bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) {
    return absl::StrFormat("%.1f GiB", bytes / 1073741824.0);
  }
  if (bytes >= (1 << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= (1 << 10)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

template <typename Repeated>
json Array(const Repeated& values) {
  json out = json::array();
  for (const auto& v : values) out.push_back(v);
  return out;
}

json LayoutJson(const v1::Layout& l) {
  return {{"name", l.name()},
          {"num_layers", l.num_layers()},
          {"kv_heads", l.kv_heads()},
          {"query_heads", l.query_heads()},
          {"head_dim", l.head_dim()},
          {"dtype", DTypeName(l.dtype())},
          {"page_tokens", l.page_tokens()},
          {"keys_pre_rope", l.keys_pre_rope()},
          {"page_bytes", l.page_bytes()}};
}

json StatsJson(const v1::SessionStats& s) {
  return {{"session_id", s.session_id()},
          {"layout", s.layout()},
          {"policy", s.policy()},
          {"tenant", s.tenant()},
          {"resident_tokens", s.resident_tokens()},
          {"pages", s.pages()},
          {"resident_bytes", s.resident_bytes()},
          {"evicted_tokens", s.evicted_tokens()},
          {"evicted_score", s.evicted_score()},
          {"score_updates", s.score_updates()},
          {"compressed", s.compressed()},
          {"layer_resident", Array(s.layer_resident())},
          {"layer_budget", Array(s.layer_budget())},
          {"layer_version", Array(s.layer_version())}};
}

// ---------------------------------------------------------------------------
// Policies, as the server describes them (ServerInfo.policy_info)

const v1::PolicyInfo* FindPolicy(const v1::ServerInfo& info,
                                 absl::string_view name) {
  for (const v1::PolicyInfo& p : info.policy_info()) {
    if (p.name() == name) return &p;
  }
  return nullptr;
}

std::string InputName(v1::PolicyInfo::Input input) {
  switch (input) {
    case v1::PolicyInfo::INPUT_NONE:
      return "none";
    case v1::PolicyInfo::INPUT_PER_STEP:
      return "per-step";
    case v1::PolicyInfo::INPUT_COMPRESS:
      return "compress";
    default:
      return "?";
  }
}

std::string TypeName(v1::PolicyParam::Type type) {
  switch (type) {
    case v1::PolicyParam::TYPE_INT:
      return "int";
    case v1::PolicyParam::TYPE_DOUBLE:
      return "double";
    case v1::PolicyParam::TYPE_CHOICE:
      return "choice";
    default:
      return "?";
  }
}

// "kernel = 5: int in [1, 1025], odd".
std::string ParamText(const v1::PolicyParam& p) {
  std::string accepts;
  switch (p.type()) {
    case v1::PolicyParam::TYPE_INT:
      accepts = absl::StrCat("int in [", static_cast<int64_t>(p.min()), ", ",
                             static_cast<int64_t>(p.max()), "]");
      break;
    case v1::PolicyParam::TYPE_DOUBLE:
      accepts = absl::StrCat("number in [", p.min(), ", ", p.max(), "]");
      break;
    default:
      accepts = absl::StrCat("one of ", absl::StrJoin(p.choices(), ", "));
      break;
  }
  return absl::StrCat(p.name(), " = ", p.default_value(), ": ", accepts,
                      p.rule().empty() ? "" : ", ", p.rule());
}

json PolicyJson(const v1::PolicyInfo& p) {
  json params = json::array();
  for (const v1::PolicyParam& q : p.params()) {
    json param = {{"name", q.name()},
                  {"type", TypeName(q.type())},
                  {"default", q.default_value()},
                  {"description", q.description()}};
    if (q.type() == v1::PolicyParam::TYPE_CHOICE) {
      param["choices"] = Array(q.choices());
    } else {
      param["min"] = q.min();
      param["max"] = q.max();
    }
    if (!q.rule().empty()) param["rule"] = q.rule();
    params.push_back(param);
  }
  return {{"name", p.name()},
          {"summary", p.summary()},
          {"input", InputName(p.input())},
          {"accepts_probabilities", p.accepts_probabilities()},
          {"accepts_queries", p.accepts_queries()},
          {"params", params},
          {"budget_rule", p.budget_rule()}};
}

void PrintPolicies(const v1::ServerInfo& info) {
  std::printf("policies:\n");
  for (const v1::PolicyInfo& p : info.policy_info()) {
    std::printf("  %-14s %s\n", p.name().c_str(), p.summary().c_str());
    std::printf("  %-14s input: %s; budget: %s\n", "",
                InputName(p.input()).c_str(), p.budget_rule().c_str());
    for (const v1::PolicyParam& q : p.params()) {
      std::printf("  %-14s   %s\n", "", ParamText(q).c_str());
    }
  }
  std::printf("\n");
}

// ---------------------------------------------------------------------------
// Commands

int Info(const KvKeepClient& kv) {
  absl::StatusOr<v1::ServerInfo> info = kv.GetServerInfo();
  if (!info.ok()) return Fail("info", info.status());
  if (Json()) {
    json layouts = json::array();
    for (const v1::Layout& l : info->layouts()) {
      layouts.push_back(LayoutJson(l));
    }
    json pools = json::array();
    for (const v1::Pool& p : info->pools()) {
      pools.push_back({{"layout", p.layout()},
                       {"capacity_pages", p.capacity_pages()},
                       {"used_pages", p.used_pages()},
                       {"page_bytes", p.page_bytes()},
                       {"sessions", p.sessions()},
                       {"allocation_failures", p.allocation_failures()}});
    }
    json policies = json::array();
    for (const v1::PolicyInfo& p : info->policy_info()) {
      policies.push_back(PolicyJson(p));
    }
    Print({{"server", absl::GetFlag(FLAGS_server)},
           {"version", info->version()},
           {"backend", info->backend()},
           {"max_sessions", info->max_sessions()},
           {"max_message_bytes", info->max_message_bytes()},
           {"policies", Array(info->policies())},
           {"policy_info", policies},
           {"layouts", layouts},
           {"pools", pools}});
    return 0;
  }
  std::printf("kvkeepd %s at %s, backend %s\n", info->version().c_str(),
              absl::GetFlag(FLAGS_server).c_str(), info->backend().c_str());
  std::printf("limits: %lld sessions, %s per message\n",
              static_cast<long long>(info->max_sessions()),
              Bytes(info->max_message_bytes()).c_str());
  PrintPolicies(*info);
  Table table({"LAYOUT", "LAYERS", "KV/Q HEADS", "HEAD_DIM", "DTYPE",
               "PAGE_TOKENS", "PAGE", "PAGES_USED", "PAGES", "POOL",
               "SESSIONS"});
  for (const v1::Layout& l : info->layouts()) {
    const v1::Pool* pool = nullptr;
    for (const v1::Pool& p : info->pools()) {
      if (p.layout() == l.name()) pool = &p;
    }
    const v1::Pool empty;
    if (pool == nullptr) pool = &empty;
    table.Add({absl::StrCat(l.name(), l.keys_pre_rope() ? " (pre-RoPE)" : ""),
               absl::StrCat(l.num_layers()),
               absl::StrCat(l.kv_heads(), "/", l.query_heads()),
               absl::StrCat(l.head_dim()), DTypeName(l.dtype()),
               absl::StrCat(l.page_tokens()), Bytes(l.page_bytes()),
               absl::StrCat(pool->used_pages()),
               absl::StrCat(pool->capacity_pages()),
               Bytes(pool->capacity_pages() * pool->page_bytes()),
               absl::StrCat(pool->sessions())});
  }
  table.Print();
  return 0;
}

int Sessions(const KvKeepClient& kv) {
  absl::StatusOr<std::vector<v1::SessionStats>> sessions = kv.ListSessions();
  if (!sessions.ok()) return Fail("sessions", sessions.status());
  if (Json()) {
    json out = json::array();
    for (const v1::SessionStats& s : *sessions) out.push_back(StatsJson(s));
    Print({{"sessions", out}});
    return 0;
  }
  if (sessions->empty()) {
    std::printf("no sessions\n");
    return 0;
  }
  Table table({"SESSION", "LAYOUT", "POLICY", "TENANT", "RESIDENT", "PAGES",
               "BYTES", "EVICTED"});
  for (const v1::SessionStats& s : *sessions) {
    table.Add({s.session_id(), s.layout(), s.policy(),
               s.tenant().empty() ? "-" : s.tenant(),
               absl::StrCat(s.resident_tokens()), absl::StrCat(s.pages()),
               Bytes(s.resident_bytes()), absl::StrCat(s.evicted_tokens())});
  }
  table.Print();
  return 0;
}

void PrintStats(const v1::SessionStats& s) {
  std::printf("session %s: layout %s, policy %s%s\n", s.session_id().c_str(),
              s.layout().c_str(), s.policy().c_str(),
              s.tenant().empty() ? "" : (", tenant " + s.tenant()).c_str());
  std::printf(
      "resident %lld tokens in %lld pages (%s); evicted %lld tokens (score "
      "%.4g); %lld score updates%s\n\n",
      static_cast<long long>(s.resident_tokens()),
      static_cast<long long>(s.pages()), Bytes(s.resident_bytes()).c_str(),
      static_cast<long long>(s.evicted_tokens()), s.evicted_score(),
      static_cast<long long>(s.score_updates()),
      s.compressed() ? "; prompt compressed" : "");
  Table table({"LAYER", "RESIDENT", "BUDGET", "VERSION"});
  for (int l = 0; l < s.layer_resident_size(); ++l) {
    table.Add(
        {absl::StrCat(l), absl::StrCat(s.layer_resident(l)),
         l < s.layer_budget_size() ? absl::StrCat(s.layer_budget(l)) : "",
         l < s.layer_version_size() ? absl::StrCat(s.layer_version(l)) : ""});
  }
  table.Print();
}

int Stats(const KvKeepClient& kv, const std::string& id) {
  absl::StatusOr<v1::SessionStats> stats = kv.GetSessionStats(id);
  if (!stats.ok()) return Fail("stats", stats.status());
  if (Json()) {
    Print(StatsJson(*stats));
  } else {
    PrintStats(*stats);
  }
  return 0;
}

int Close(const KvKeepClient& kv, const std::string& id) {
  absl::StatusOr<int64_t> freed = kv.CloseSession(id);
  if (!freed.ok()) return Fail("close", freed.status());
  const bool known = *freed != Session::kUnknownFreedPages;
  if (Json()) {
    Print({{"session_id", id},
           {"closed", true},
           {"freed_pages", known ? json(*freed) : json(nullptr)}});
  } else if (known) {
    std::printf("closed %s: freed %lld pages\n", id.c_str(),
                static_cast<long long>(*freed));
  } else {
    std::printf("closed %s (by an earlier attempt whose reply was lost)\n",
                id.c_str());
  }
  return 0;
}

int Transfer(const KvKeepClient& kv, const std::string& id,
             const std::string& target) {
  v1::TransferSessionRequest request;
  request.set_session_id(id);
  request.set_target(target);
  request.set_target_token(absl::GetFlag(FLAGS_target_token));
  request.set_transport(absl::GetFlag(FLAGS_transport));
  absl::StatusOr<v1::TransferSessionResponse> moved =
      kv.TransferSession(request);
  if (!moved.ok()) return Fail("transfer", moved.status());
  if (Json()) {
    Print({{"session_id", moved->session_id()},
           {"target", target},
           {"transfer_id", moved->transfer_id()},
           {"transport", moved->transport()},
           {"bytes", moved->bytes()},
           {"seconds", moved->seconds()}});
  } else {
    std::printf("moved %s to %s: %lld bytes in %.3f s (%s transport)\n",
                moved->session_id().c_str(), target.c_str(),
                static_cast<long long>(moved->bytes()), moved->seconds(),
                moved->transport().c_str());
  }
  return 0;
}

// ---------------------------------------------------------------------------
// demo

// n tokens of random keys and values for every layer of `layout`.
client::KvTokens RandomTokens(const v1::Layout& layout, int64_t first,
                              int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  client::KvTokens tokens;
  for (int64_t i = 0; i < n; ++i) tokens.positions.push_back(first + i);
  const int64_t elems = n * layout.kv_heads() * layout.head_dim();
  auto fill = [&](std::string& out) {
    const int64_t width = layout.dtype() == v1::DTYPE_F32 ? 4 : 2;
    out.resize(elems * width);
    for (int64_t e = 0; e < elems; ++e) {
      const float v = normal(rng);
      if (layout.dtype() == v1::DTYPE_F32) {
        std::memcpy(out.data() + e * 4, &v, 4);
      } else {
        const uint16_t h =
            layout.dtype() == v1::DTYPE_F16 ? FloatToF16(v) : FloatToBf16(v);
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

int Demo(const KvKeepClient& kv) {
  const std::string command = "demo";
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t prompt = absl::GetFlag(FLAGS_prompt);
  const std::string form = absl::GetFlag(FLAGS_scores);
  const std::string policy = absl::GetFlag(FLAGS_policy);
  if (steps < 0 || prompt < 0 || prompt + steps == 0) {
    return Usage("demo: --steps and --prompt must be >= 0, not both 0");
  }
  absl::StatusOr<v1::ServerInfo> info = kv.GetServerInfo();
  if (!info.ok()) return Fail(command, info.status());
  if (const v1::PolicyInfo* p = FindPolicy(*info, policy);
      p != nullptr && p->input() == v1::PolicyInfo::INPUT_COMPRESS) {
    return Usage(absl::StrCat("demo: ", policy,
                              " compresses a prompt once; pick a decode "
                              "policy"));
  }
  if (info->layouts().empty()) {
    return Fail(command, absl::NotFoundError("the server serves no layout"));
  }
  v1::CreateSessionRequest request;
  request.set_layout(absl::GetFlag(FLAGS_layout).empty()
                         ? info->layouts(0).name()
                         : absl::GetFlag(FLAGS_layout));
  request.set_policy(policy);
  for (absl::string_view kv_pair :
       absl::StrSplit(absl::GetFlag(FLAGS_params), ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv_pair, '=');
    if (p.first.empty() || p.second.empty()) {
      return Usage(
          absl::StrCat("demo: --params: '", kv_pair, "' is not name=value"));
    }
    (*request.mutable_policy_params())[p.first] = p.second;
  }
  request.mutable_budget()->set_tokens(absl::GetFlag(FLAGS_budget));
  // Safe to retry: a retried create returns the first attempt's session.
  // The key is new for every run (not from --seed), or a second demo would
  // get the first one's session back.
  std::random_device entropy;
  request.set_idempotency_key(
      absl::StrFormat("kvkeep-demo-%08x%08x", entropy(), entropy()));
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  absl::StatusOr<Session> session = kv.CreateSession(request);
  if (!session.ok()) return Fail(command, session.status());
  const v1::Layout& layout = session->layout();
  // On any failure from here on, the session is closed before reporting.
  auto fail = [&](const absl::Status& status) {
    if (!absl::GetFlag(FLAGS_keep)) (void)session->Close();
    return Fail(command, status);
  };
  // The policy in force (the server's default when --policy is empty).
  absl::StatusOr<v1::SessionStats> created = session->Stats();
  if (!created.ok()) return fail(created.status());
  // Policies that evict on attention take a step's scores; the others refuse
  // them (they evict on append, or never).
  const v1::PolicyInfo* in_force = FindPolicy(*info, created->policy());
  if (in_force == nullptr) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "the server does not describe policy '", created->policy(),
        "' in ServerInfo.policy_info (a kvkeepd older than this kvkeep?)")));
  }
  const bool scored = in_force->input() == v1::PolicyInfo::INPUT_PER_STEP;

  json out = {{"session_id", session->id()},
              {"layout", LayoutJson(layout)},
              {"policy", created->policy()},
              {"policy_params", json::object()},
              {"budget", Array(session->layer_budgets())},
              {"scores", scored ? form : "none"}};
  for (const auto& [k, v] : request.policy_params()) {
    out["policy_params"][k] = v;
  }
  if (!Json()) {
    std::printf(
        "session %s on layout '%s' (%d layers, %d/%d kv/query heads, head_dim "
        "%d, %s); policy %s {%s}, budget %lld tokens per layer; scores: %s\n",
        session->id().c_str(), layout.name().c_str(), layout.num_layers(),
        layout.kv_heads(), layout.query_heads(), layout.head_dim(),
        DTypeName(layout.dtype()).c_str(), created->policy().c_str(),
        absl::StrJoin(request.policy_params(), ", ", absl::PairFormatter("="))
            .c_str(),
        static_cast<long long>(absl::GetFlag(FLAGS_budget)),
        scored ? form.c_str() : "none (the policy evicts on append)");
  }
  // The worker's view of the block tables, kept by what each call reports.
  client::BlockTableMirror mirror(
      layout.page_tokens(),
      std::vector<uint64_t>(created->layer_version().begin(),
                            created->layer_version().end()));

  int64_t evicted_total = 0;
  int64_t position = 0;
  if (prompt > 0) {
    client::KvTokens tokens = RandomTokens(layout, 0, prompt, rng);
    absl::StatusOr<client::PrefillResult> prefill =
        session->AppendPrefill(tokens);
    if (!prefill.ok()) return fail(prefill.status());
    if (absl::Status s = mirror.ApplyPrefill(*prefill, tokens.positions);
        !s.ok()) {
      return fail(s);
    }
    for (const v1::StepResult& chunk : prefill->chunks) {
      for (const v1::LayerChange& c : chunk.layers()) {
        evicted_total += c.evicted_positions_size();
      }
    }
    position = prompt;
    out["prompt_tokens"] = prompt;
    out["prefill_chunks"] = prefill->chunks.size();
    if (!Json()) {
      std::printf("prefill: %lld tokens in %zu chunk(s)\n",
                  static_cast<long long>(prompt), prefill->chunks.size());
    }
  }

  client::DecodeStream stream = session->Decode();
  json steps_json = json::array();
  Table table({"STEP", "POSITION", "EVICTED (LAYER 0)", "EVICTED (ALL)",
               "RESIDENT (LAYER 0)", "VERSION (LAYER 0)"});
  // Step 0 is the prompt's own attention, without a new token: it brings a
  // prompt longer than the budget down before decoding starts.
  for (int64_t step = scored && prompt > 0 ? 0 : 1; step <= steps; ++step) {
    const bool append = step > 0;
    std::vector<v1::LayerScores> scores;
    if (scored) {
      for (int32_t l = 0; l < layout.num_layers(); ++l) {
        absl::StatusOr<v1::LayerScores> s =
            StepScores(form, layout, l, mirror.version(l),
                       mirror.resident(l) + (append ? 1 : 0), rng);
        if (!s.ok()) return fail(s.status());
        scores.push_back(*std::move(s));
      }
    }
    client::KvTokens token;
    if (append) token = RandomTokens(layout, position, 1, rng);
    absl::StatusOr<v1::DecodeStepResult> result =
        append ? stream.Step(token, scores) : stream.Step(scores);
    if (!result.ok()) return fail(result.status());
    if (absl::Status s = mirror.ApplyDecode(*result, token.positions);
        !s.ok()) {
      return fail(s);
    }
    // Per layer, the positions this step evicted (its append's, then its
    // scores').
    std::vector<std::vector<int64_t>> evicted(layout.num_layers());
    int64_t step_evicted = 0;
    for (int32_t l = 0; l < layout.num_layers(); ++l) {
      for (const v1::StepResult* part :
           {&result->append(), &result->scores()}) {
        if (l < part->layers_size()) {
          evicted[l].insert(evicted[l].end(),
                            part->layers(l).evicted_positions().begin(),
                            part->layers(l).evicted_positions().end());
        }
      }
      step_evicted += static_cast<int64_t>(evicted[l].size());
    }
    evicted_total += step_evicted;
    steps_json.push_back({{"step", step},
                          {"position", append ? json(position) : json(nullptr)},
                          {"evicted", evicted},
                          {"resident_layer0", mirror.resident(0)},
                          {"version_layer0", mirror.version(0)}});
    table.Add({absl::StrCat(step), append ? absl::StrCat(position) : "-",
               evicted[0].empty() ? "-" : absl::StrJoin(evicted[0], ","),
               absl::StrCat(step_evicted), absl::StrCat(mirror.resident(0)),
               absl::StrCat(mirror.version(0))});
    if (append) ++position;
  }
  if (absl::Status s = stream.Finish(); !s.ok()) return fail(s);

  // The worker's mirror must equal the store's tables.
  absl::StatusOr<v1::GetBlockTablesResponse> tables = session->GetBlockTables();
  if (!tables.ok()) return fail(tables.status());
  bool match = tables->tables_size() == mirror.num_layers();
  for (int32_t l = 0; match && l < mirror.num_layers(); ++l) {
    match = tables->tables(l).SerializeAsString() ==
            mirror.Table(l).SerializeAsString();
  }
  absl::StatusOr<v1::SessionStats> stats = session->Stats();
  if (!stats.ok()) return fail(stats.status());
  out["steps"] = steps_json;
  out["evicted_tokens"] = evicted_total;
  out["block_tables_match"] = match;
  out["stats"] = StatsJson(*stats);
  if (!Json()) {
    table.Print();
    std::printf("\n");
    PrintStats(*stats);
    std::printf("\nblock tables: the client's mirror %s the store's\n",
                match ? "matches" : "DOES NOT MATCH");
  }
  if (absl::GetFlag(FLAGS_keep)) {
    out["closed"] = false;
    if (!Json()) {
      std::printf("kept session %s open (kvkeep close %s)\n",
                  session->id().c_str(), session->id().c_str());
    }
  } else {
    absl::StatusOr<int64_t> freed = session->Close();
    if (!freed.ok()) return Fail(command, freed.status());
    out["closed"] = true;
    out["freed_pages"] = *freed;
    if (!Json()) {
      std::printf("closed %s: freed %lld pages\n", session->id().c_str(),
                  static_cast<long long>(*freed));
    }
  }
  if (Json()) Print(out);
  if (!match) {
    return Fail(command,
                absl::InternalError("the mirrored block tables differ from the "
                                    "store's"));
  }
  return 0;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  // --help and --helpshort list the flags defined in this file (absl's
  // default looks for a file named after the binary, kvkeep.cc or
  // kvkeep_main.cc, finds none and says "No flags matched").
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "kvkeep_cli.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) return Usage("no command given");
  const std::string command = args[1];
  const std::vector<std::string> rest(args.begin() + 2, args.end());

  client::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.token = absl::GetFlag(FLAGS_token);
  if (const char* env = std::getenv("KVKEEP_TOKEN");
      options.token.empty() && env != nullptr) {
    options.token = env;
  }
  options.deadline = absl::GetFlag(FLAGS_deadline);
  options.retries = absl::GetFlag(FLAGS_retries);
  options.use_tls = absl::GetFlag(FLAGS_tls);
  if (const std::string ca = absl::GetFlag(FLAGS_tls_ca); !ca.empty()) {
    absl::StatusOr<std::string> pem = ReadFile(ca);
    if (!pem.ok()) return Fail("--tls_ca", pem.status());
    options.tls_root_certs_pem = *pem;
    options.use_tls = true;
  }
  absl::StatusOr<KvKeepClient> kv = KvKeepClient::Connect(options);
  if (!kv.ok()) return Fail("connect", kv.status());

  const auto want_args = [&](size_t n) { return rest.size() == n; };
  if (command == "info" && want_args(0)) return Info(*kv);
  if (command == "sessions" && want_args(0)) return Sessions(*kv);
  if (command == "stats" && want_args(1)) return Stats(*kv, rest[0]);
  if (command == "close" && want_args(1)) return Close(*kv, rest[0]);
  if (command == "transfer" && want_args(2)) {
    return Transfer(*kv, rest[0], rest[1]);
  }
  if (command == "demo" && want_args(0)) return Demo(*kv);
  if (command == "info" || command == "sessions" || command == "stats" ||
      command == "close" || command == "transfer" || command == "demo") {
    return Usage(absl::StrCat("wrong arguments for '", command, "'"));
  }
  return Usage(absl::StrCat("unknown command '", command, "'"));
}

}  // namespace
}  // namespace kvkeep::cli

int main(int argc, char** argv) { return kvkeep::cli::Main(argc, argv); }
