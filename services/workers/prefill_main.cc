// kvkeep-prefill: the reference prefill worker. Creates a session on a
// kvkeepd, appends a synthetic workload's prompt (with each chunk's
// attention for policies that score by attention; SnapKV compression for
// snapkv) and prints the session id on stdout for kvkeep-decode.
//
//   kvkeep-prefill --server=127.0.0.1:50051 --policy=h2o --budget=256
//       --workload=needle_repeated --prompt_tokens=1024
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/workers/session_driver.h"
#include "services/workers/worker_flags.h"

ABSL_FLAG(std::string, policy, "h2o", "eviction policy");
ABSL_FLAG(std::string, params, "", "policy parameters, NAME=VALUE,...");
ABSL_FLAG(int64_t, budget, 0, "tokens per layer");
ABSL_FLAG(int64_t, chunk, 128, "prompt tokens per message");
ABSL_FLAG(std::string, scores, "reduced",
          "how attention is sent: per_head, reduced, queries");

int main(int argc, char** argv) {
  using namespace kvkeep::workers;  // NOLINT: a main
  absl::SetProgramUsageMessage(
      "the reference prefill worker: creates a session and appends a "
      "synthetic prompt; prints the session id");
  absl::ParseCommandLine(argc, argv);
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvkeep-prefill: %s\n", s.ToString().c_str());
    return 1;
  };
  absl::StatusOr<kvkeep::client::KvKeepClient> client = ClientFromFlags();
  if (!client.ok()) return fail(client.status());
  absl::StatusOr<kvkeep::v1::Layout> layout = LayoutFromFlags(*client);
  if (!layout.ok()) return fail(layout.status());
  absl::StatusOr<Workload> workload = WorkloadFromFlags(*layout);
  if (!workload.ok()) return fail(workload.status());
  absl::StatusOr<ScoreMode> scores =
      ParseScoreMode(absl::GetFlag(FLAGS_scores));
  if (!scores.ok()) return fail(scores.status());
  absl::StatusOr<std::map<std::string, std::string>> params =
      ParseParams(absl::GetFlag(FLAGS_params));
  if (!params.ok()) return fail(params.status());

  SessionPlan plan;
  plan.layout = layout->name();
  plan.policy = absl::GetFlag(FLAGS_policy);
  plan.params = *params;
  plan.budget_tokens = absl::GetFlag(FLAGS_budget);
  plan.prefill_chunk = absl::GetFlag(FLAGS_chunk);
  plan.scores = *scores;
  absl::StatusOr<PrefilledSession> s = Prefill(*client, *workload, plan);
  if (!s.ok()) return fail(s.status());
  int64_t resident = 0;
  for (int32_t l = 0; l < s->mirror.num_layers(); ++l) {
    resident += s->mirror.resident(l);
  }
  std::fprintf(stderr,
               "kvkeep-prefill: %s session on '%s': %lld prompt tokens, %lld "
               "resident over %d layers\n",
               plan.policy.c_str(), plan.layout.c_str(),
               static_cast<long long>(workload->spec().prompt_tokens),
               static_cast<long long>(resident), s->mirror.num_layers());
  std::printf("%s\n", s->session.id().c_str());
  return 0;
}
