// kvkeep: the command-line client of kvkeepd (docs/cli.md).
//
//   kvkeep [flags] info | sessions | stats SESSION | close SESSION | demo
//
// Human-readable tables by default, one JSON document on stdout with --json.
// Exit status: 0 on success; 1 when the server refused or could not be
// reached (stderr names the gRPC status code, and with --json stdout holds
// {"error": {"code", "message"}}); 2 for a usage error.
//
// This file holds the flags, main and the one-call commands; `demo` is in
// demo.cc, and what every command prints (tables, JSON, failures) in
// output.cc.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "services/cli/demo.h"
#include "services/cli/output.h"
#include "services/client/kvkeep_client.h"

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

bool Json() { return absl::GetFlag(FLAGS_json); }

int Info(const KvKeepClient& kv) {
  absl::StatusOr<v1::ServerInfo> info = kv.GetServerInfo();
  if (!info.ok()) return Fail("info", info.status(), Json());
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
    Print(
        {{"server", absl::GetFlag(FLAGS_server)},
         {"version", info->version()},
         {"backend", info->backend()},
         {"max_sessions", info->max_sessions()},
         {"max_message_bytes", info->max_message_bytes()},
         {"default_idle_timeout_seconds", info->default_idle_timeout_seconds()},
         {"max_idle_timeout_seconds", info->max_idle_timeout_seconds()},
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
  const auto seconds = [](double s) {
    return absl::FormatDuration(absl::Seconds(s));
  };
  std::printf("leases: %s idle timeout by default, at most %s\n",
              info->default_idle_timeout_seconds() > 0
                  ? seconds(info->default_idle_timeout_seconds()).c_str()
                  : "no",
              seconds(info->max_idle_timeout_seconds()).c_str());
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
  if (!sessions.ok()) return Fail("sessions", sessions.status(), Json());
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
               "BYTES", "EVICTED", "LEASE"});
  for (const v1::SessionStats& s : *sessions) {
    table.Add({s.session_id(), s.layout(), s.policy(),
               s.tenant().empty() ? "-" : s.tenant(),
               absl::StrCat(s.resident_tokens()), absl::StrCat(s.pages()),
               Bytes(s.resident_bytes()), absl::StrCat(s.evicted_tokens()),
               LeaseText(s)});
  }
  table.Print();
  return 0;
}

int Stats(const KvKeepClient& kv, const std::string& id) {
  absl::StatusOr<v1::SessionStats> stats = kv.GetSessionStats(id);
  if (!stats.ok()) return Fail("stats", stats.status(), Json());
  if (Json()) {
    Print(StatsJson(*stats));
  } else {
    PrintStats(*stats);
  }
  return 0;
}

int Close(const KvKeepClient& kv, const std::string& id) {
  absl::StatusOr<int64_t> freed = kv.CloseSession(id);
  if (!freed.ok()) return Fail("close", freed.status(), Json());
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
  if (!moved.ok()) return Fail("transfer", moved.status(), Json());
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

DemoOptions FlagsDemoOptions() {
  DemoOptions o;
  o.layout = absl::GetFlag(FLAGS_layout);
  o.policy = absl::GetFlag(FLAGS_policy);
  o.params = absl::GetFlag(FLAGS_params);
  o.budget_tokens = absl::GetFlag(FLAGS_budget);
  o.prompt_tokens = absl::GetFlag(FLAGS_prompt);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.scores = absl::GetFlag(FLAGS_scores);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.keep = absl::GetFlag(FLAGS_keep);
  o.json = Json();
  return o;
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
    if (!pem.ok()) return Fail("--tls_ca", pem.status(), Json());
    options.tls_root_certs_pem = *pem;
    options.use_tls = true;
  }
  absl::StatusOr<KvKeepClient> kv = KvKeepClient::Connect(options);
  if (!kv.ok()) return Fail("connect", kv.status(), Json());

  const auto want_args = [&](size_t n) { return rest.size() == n; };
  if (command == "info" && want_args(0)) return Info(*kv);
  if (command == "sessions" && want_args(0)) return Sessions(*kv);
  if (command == "stats" && want_args(1)) return Stats(*kv, rest[0]);
  if (command == "close" && want_args(1)) return Close(*kv, rest[0]);
  if (command == "transfer" && want_args(2)) {
    return Transfer(*kv, rest[0], rest[1]);
  }
  if (command == "demo" && want_args(0)) return Demo(*kv, FlagsDemoOptions());
  if (command == "info" || command == "sessions" || command == "stats" ||
      command == "close" || command == "transfer" || command == "demo") {
    return Usage(absl::StrCat("wrong arguments for '", command, "'"));
  }
  return Usage(absl::StrCat("unknown command '", command, "'"));
}

}  // namespace
}  // namespace kvkeep::cli

int main(int argc, char** argv) { return kvkeep::cli::Main(argc, argv); }