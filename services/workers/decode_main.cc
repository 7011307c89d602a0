// kvkeep-decode: the reference decode worker. Streams decode steps of a
// synthetic workload for a session kvkeep-prefill made (the same workload
// flags), follows every eviction and move, and with --eval keeps a shadow
// full cache and prints what eviction cost (quality.h).
//
//   kvkeep-decode --server=127.0.0.1:50051 --session=ID --eval
//       --workload=needle_repeated --prompt_tokens=1024 --decode_steps=256
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/workers/session_driver.h"
#include "services/workers/worker_flags.h"

ABSL_FLAG(std::string, session, "", "session id (from kvkeep-prefill)");
ABSL_FLAG(std::string, scores, "reduced",
          "how attention is sent: per_head, reduced, queries");
ABSL_FLAG(bool, eval, false,
          "keep a shadow full cache and report attention loss, top-10 "
          "recall, output error and needle survival");
ABSL_FLAG(bool, close, true, "close the session at the end");

int main(int argc, char** argv) {
  using namespace kvkeep::workers;  // NOLINT: a main
  absl::SetProgramUsageMessage(
      "the reference decode worker: streams decode steps for a session");
  absl::ParseCommandLine(argc, argv);
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvkeep-decode: %s\n", s.ToString().c_str());
    return 1;
  };
  absl::StatusOr<kvkeep::client::KvKeepClient> client = ClientFromFlags();
  if (!client.ok()) return fail(client.status());
  absl::StatusOr<kvkeep::client::Session> session =
      client->OpenSession(absl::GetFlag(FLAGS_session));
  if (!session.ok()) return fail(session.status());
  absl::StatusOr<Workload> workload = WorkloadFromFlags(session->layout());
  if (!workload.ok()) return fail(workload.status());
  absl::StatusOr<ScoreMode> scores =
      ParseScoreMode(absl::GetFlag(FLAGS_scores));
  if (!scores.ok()) return fail(scores.status());
  absl::StatusOr<kvkeep::client::BlockTableMirror> mirror = session->Mirror();
  if (!mirror.ok()) return fail(mirror.status());

  DecodeOptions options;
  options.scores = *scores;
  options.evaluate = absl::GetFlag(FLAGS_eval);
  absl::StatusOr<DecodeReport> r =
      Decode(*session, *mirror, *workload, options);
  if (!r.ok()) return fail(r.status());
  const Distribution latency = Summarize(r->step_seconds);
  std::printf("steps %lld, step round trip mean %.3f ms p95 %.3f ms\n",
              static_cast<long long>(r->steps), 1e3 * latency.mean,
              1e3 * latency.p95);
  std::printf("resident tokens per layer (mean) %.1f, bytes at the end %lld\n",
              r->mean_resident_tokens,
              static_cast<long long>(r->final_resident_bytes));
  if (r->needle_asks > 0) {
    std::printf("needle resident when asked: %lld of %lld (step x layer)\n",
                static_cast<long long>(r->needle_hits),
                static_cast<long long>(r->needle_asks));
  }
  if (options.evaluate) {
    for (const auto& [name, d] :
         {std::pair("attention loss", r->quality.attention_loss()),
          std::pair("top-10 recall", r->quality.top_recall()),
          std::pair("output error", r->quality.output_error())}) {
      std::printf("%-15s mean %.4f  p95 %.4f  max %.4f\n", name, d.mean, d.p95,
                  d.max);
    }
  }
  if (absl::GetFlag(FLAGS_close)) session->Close().IgnoreError();
  return 0;
}
