// The CLI's output (see output.h): usage and failure reports, tables, and the
// text and JSON forms of layouts, session statistics and policies.
#include "services/cli/output.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "services/common/dtype_proto.h"

namespace kvkeep::cli {

using nlohmann::json;

const char kUsage[] =
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

void Print(const json& doc) { std::printf("%s\n", doc.dump(2).c_str()); }

int Fail(absl::string_view command, const absl::Status& status, bool as_json) {
  std::fprintf(stderr, "kvkeep: %s: %s: %s\n", std::string(command).c_str(),
               absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  if (as_json) {
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

void Table::Print() const {
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

std::string LeaseText(const v1::SessionStats& s) {
  if (s.idle_timeout_seconds() <= 0) return "never";
  if (s.lease_held()) return "held";
  // Whole seconds, rounded: a table cell, not a measurement.
  return absl::FormatDuration(
      absl::Seconds(std::llround(s.lease_seconds_left())));
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
          {"layer_version", Array(s.layer_version())},
          {"idle_timeout_seconds", s.idle_timeout_seconds()},
          {"lease_seconds_left", s.lease_seconds_left()},
          {"lease_held", s.lease_held()}};
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
  if (s.idle_timeout_seconds() > 0) {
    std::printf(
        "lease: %s idle timeout, %s left\n\n",
        absl::FormatDuration(absl::Seconds(s.idle_timeout_seconds())).c_str(),
        LeaseText(s).c_str());
  } else {
    std::printf("lease: none (never expires)\n\n");
  }
  Table table({"LAYER", "RESIDENT", "BUDGET", "VERSION"});
  for (int l = 0; l < s.layer_resident_size(); ++l) {
    table.Add(
        {absl::StrCat(l), absl::StrCat(s.layer_resident(l)),
         l < s.layer_budget_size() ? absl::StrCat(s.layer_budget(l)) : "",
         l < s.layer_version_size() ? absl::StrCat(s.layer_version(l)) : ""});
  }
  table.Print();
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

namespace {

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

}  // namespace

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

}  // namespace kvkeep::cli
