#include "services/workers/worker_flags.h"

#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/workers/session_driver.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvkeepd address");
ABSL_FLAG(std::string, token, "", "bearer token (servers with tenants)");
ABSL_FLAG(std::string, layout, "",
          "server layout the workload takes its shape from (default: the "
          "server's first)");
ABSL_FLAG(std::string, workload, "mixed",
          "workload family: sinks, locality, heavy_hitters, needle_repeated, "
          "needle_once, head_types, mixed (docs/workloads.md)");
ABSL_FLAG(uint64_t, seed, 1, "workload seed");
ABSL_FLAG(int64_t, prompt_tokens, 512, "prompt length, tokens");
ABSL_FLAG(int64_t, decode_steps, 128, "tokens to decode");

namespace kvkeep::workers {

WorkloadSpec SizesFromFlags() {
  WorkloadSpec spec;
  spec.seed = absl::GetFlag(FLAGS_seed);
  spec.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  spec.decode_steps = absl::GetFlag(FLAGS_decode_steps);
  return spec;
}

absl::StatusOr<client::KvKeepClient> ClientFromFlags() {
  client::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.token = absl::GetFlag(FLAGS_token);
  return client::KvKeepClient::Connect(options);
}

absl::StatusOr<v1::Layout> LayoutFromFlags(const client::KvKeepClient& client) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  const std::string name = absl::GetFlag(FLAGS_layout);
  for (const v1::Layout& l : info->layouts()) {
    if (name.empty() || l.name() == name) return l;
  }
  return absl::NotFoundError(
      absl::StrCat("the server has no layout '", name, "'"));
}

absl::StatusOr<Workload> WorkloadFromFlags(const v1::Layout& layout) {
  absl::StatusOr<WorkloadFamily> family =
      ParseFamily(absl::GetFlag(FLAGS_workload));
  if (!family.ok()) return family.status();
  WorkloadSpec spec = DefaultSpec(*family);
  const WorkloadSpec sizes = SizesFromFlags();
  spec.seed = sizes.seed;
  spec.prompt_tokens = sizes.prompt_tokens;
  spec.decode_steps = sizes.decode_steps;
  return Workload::Create(FitToLayout(spec, layout));
}

absl::StatusOr<std::map<std::string, std::string>> ParseParams(
    const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy parameter '", item, "' is not NAME=VALUE"));
    }
    out[kv[0]] = kv[1];
  }
  return out;
}

}  // namespace kvkeep::workers
