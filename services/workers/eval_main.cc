// kvkeep-eval: the evaluation harness, against a running kvkeepd.
//
//   kvkeep-eval --server=ADDR --layout=eval --out=results
//       every policy x budgets of 12.5/25/50/75% of the context x every
//       workload family, next to the oracle: a table on stdout, eval.csv
//       and eval.md under --out (bench/eval.sh adds the plot);
//   kvkeep-eval --server=ADDR --speed --out=results
//       decode steps/s and p50/p99 step latency with 1/16/64 concurrent
//       sessions per policy, next to full: speed.csv and speed.md;
//   kvkeep-eval --server=ADDR --demo
//       the README's demo: a needle workload on full, window, streaming_llm
//       and h2o at a 20% budget, with a progress bar; resident memory and
//       needle survival side by side.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "services/workers/evaluation.h"
#include "services/workers/worker_flags.h"

ABSL_FLAG(std::string, out, "", "folder for the CSV and Markdown results");
ABSL_FLAG(std::string, families, "",
          "workload families, comma-separated (default: all)");
ABSL_FLAG(std::string, policies, "",
          "policies, comma-separated (default: all and the oracle)");
ABSL_FLAG(std::string, budgets, "0.125,0.25,0.5,0.75",
          "budgets as fractions of the context");
ABSL_FLAG(std::string, scores, "reduced",
          "how attention is sent: per_head, reduced, queries");
ABSL_FLAG(int32_t, threads, 2, "evaluation runs in parallel");
ABSL_FLAG(bool, speed, false, "run the speed measurement instead");
ABSL_FLAG(std::string, concurrency, "1,16,64", "speed: concurrent sessions");
ABSL_FLAG(int64_t, speed_steps, 64, "speed: decode steps per session");
ABSL_FLAG(bool, demo, false, "run the README's needle demo instead");

namespace kvkeep::workers {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvkeep-eval: %s\n", s.ToString().c_str());
  return 1;
}

std::vector<std::string> List(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipEmpty());
}

// A progress bar on stderr: "[#####.....] label 12/40". On a terminal it
// animates (redrawn in place with \r); anywhere else (a log file, a pipe) it
// prints one line per run, when the run is done, so a log holds no \r
// frames.
void Progress(const std::string& label, int64_t done, int64_t total) {
  constexpr int kWidth = 30;
  static const bool animate = isatty(fileno(stderr)) != 0;
  if (!animate && done != total) return;
  const int filled =
      static_cast<int>(kWidth * done / std::max<int64_t>(1, total));
  // Redraw only when the bar moves.
  static int last_filled = -1;
  if (filled == last_filled && done != 0 && done != total) return;
  last_filled = filled;
  std::fprintf(stderr, "%s[%s%s] %-14s %lld/%lld%s", animate ? "\r" : "",
               std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), label.c_str(),
               static_cast<long long>(done), static_cast<long long>(total),
               done == total ? "\n" : "");
}

absl::Status Write(const std::string& dir, const std::string& name,
                   const std::string& text) {
  if (dir.empty()) return absl::OkStatus();
  std::filesystem::create_directories(dir);
  std::ofstream out(std::filesystem::path(dir) / name);
  out << text;
  if (!out) return absl::InternalError("cannot write " + dir + "/" + name);
  std::fprintf(stderr, "kvkeep-eval: wrote %s/%s\n", dir.c_str(), name.c_str());
  return absl::OkStatus();
}

int Demo(const client::KvKeepClient& client) {
  absl::StatusOr<v1::Layout> layout = LayoutFromFlags(client);
  if (!layout.ok()) return Fail(layout.status());
  absl::StatusOr<Workload> workload = WorkloadFromFlags(*layout);
  if (!workload.ok()) return Fail(workload.status());
  const int64_t budget = workload->total_tokens() / 5;  // 20%
  std::printf(
      "kvkeep demo: '%s' workload, %lld prompt + %lld decode tokens on layout "
      "'%s' (%d layers); budget %lld tokens per layer (20%%)\n",
      std::string(FamilyName(workload->spec().family)).c_str(),
      static_cast<long long>(workload->spec().prompt_tokens),
      static_cast<long long>(workload->spec().decode_steps),
      layout->name().c_str(), layout->num_layers(),
      static_cast<long long>(budget));
  std::fflush(stdout);  // before the progress bars on stderr
  struct Line {
    std::string policy;
    DecodeReport report;
  };
  std::vector<Line> lines;
  for (const std::string policy : {"full", "window", "streaming_llm", "h2o"}) {
    SessionPlan plan;
    plan.layout = layout->name();
    plan.policy = policy;
    plan.budget_tokens = policy == "full" ? workload->total_tokens() : budget;
    plan.params = EvalParams(policy, plan.budget_tokens);
    plan.scores = ScoreMode::kQueries;  // the store computes the attention
    Progress(policy, 0, workload->spec().decode_steps);
    absl::StatusOr<PrefilledSession> s = Prefill(client, *workload, plan);
    if (!s.ok()) return Fail(s.status());
    DecodeOptions options;
    options.scores = ScoreMode::kQueries;
    options.progress = [&](int64_t done, int64_t total) {
      Progress(policy, done, total);
    };
    absl::StatusOr<DecodeReport> r =
        Decode(s->session, s->mirror, *workload, options);
    s->session.Close().IgnoreError();
    if (!r.ok()) return Fail(r.status());
    lines.push_back({policy, *std::move(r)});
  }
  const double full_bytes =
      static_cast<double>(lines.front().report.final_resident_bytes);
  std::printf("\n%-14s %14s %9s %14s\n", "policy", "resident KV", "vs full",
              "needle kept");
  for (const Line& l : lines) {
    const DecodeReport& r = l.report;
    std::printf(
        "%-14s %10.1f MiB %8.0f%% %13.0f%%\n", l.policy.c_str(),
        r.final_resident_bytes / 1048576.0,
        full_bytes > 0 ? 100.0 * r.final_resident_bytes / full_bytes : 0,
        r.needle_asks > 0 ? 100.0 * r.needle_hits / r.needle_asks : 0.0);
  }
  std::printf(
      "\nneedle kept: of the decode steps whose query asked for the needle "
      "(x layers), the share where it was still resident.\n");
  return 0;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvkeep-eval: what each eviction policy saves and what it loses, "
      "through a running kvkeepd");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<client::KvKeepClient> client = ClientFromFlags();
  if (!client.ok()) return Fail(client.status());
  if (absl::GetFlag(FLAGS_demo)) return Demo(*client);
  absl::StatusOr<v1::Layout> layout = LayoutFromFlags(*client);
  if (!layout.ok()) return Fail(layout.status());
  absl::StatusOr<ScoreMode> scores =
      ParseScoreMode(absl::GetFlag(FLAGS_scores));
  if (!scores.ok()) return Fail(scores.status());
  std::vector<std::string> policies = List(absl::GetFlag(FLAGS_policies));
  if (policies.empty()) policies = EvalPolicies();
  const std::string out = absl::GetFlag(FLAGS_out);
  const WorkloadSpec sizes = SizesFromFlags();

  if (absl::GetFlag(FLAGS_speed)) {
    SpeedOptions options;
    options.layout = layout->name();
    options.sizes = sizes;
    options.policies = policies;
    options.concurrency.clear();
    for (const std::string& c : List(absl::GetFlag(FLAGS_concurrency))) {
      int n = 0;
      if (!absl::SimpleAtoi(c, &n) || n < 1) {
        return Fail(absl::InvalidArgumentError("bad --concurrency " + c));
      }
      options.concurrency.push_back(n);
    }
    options.steps = absl::GetFlag(FLAGS_speed_steps);
    options.scores = *scores;
    absl::StatusOr<std::vector<SpeedRow>> rows = RunSpeed(*client, options);
    if (!rows.ok()) return Fail(rows.status());
    const std::string table = SpeedTable(*rows);
    std::printf("%s", table.c_str());
    for (const auto& [name, text] : {std::pair("speed.md", table),
                                     std::pair("speed.csv", SpeedCsv(*rows))}) {
      if (absl::Status s = Write(out, name, text); !s.ok()) return Fail(s);
    }
    return 0;
  }

  EvalOptions options;
  options.layout = layout->name();
  options.sizes = sizes;
  options.policies = policies;
  options.scores = *scores;
  options.threads = absl::GetFlag(FLAGS_threads);
  std::vector<std::string> families = List(absl::GetFlag(FLAGS_families));
  if (families.empty()) {
    for (WorkloadFamily f : AllFamilies()) {
      families.push_back(std::string(FamilyName(f)));
    }
  }
  for (const std::string& name : families) {
    absl::StatusOr<WorkloadFamily> f = ParseFamily(name);
    if (!f.ok()) return Fail(f.status());
    options.families.push_back(*f);
  }
  options.budget_fractions.clear();
  for (const std::string& b : List(absl::GetFlag(FLAGS_budgets))) {
    double f = 0;
    if (!absl::SimpleAtod(b, &f) || f <= 0 || f > 1) {
      return Fail(absl::InvalidArgumentError("bad --budgets " + b));
    }
    options.budget_fractions.push_back(f);
  }
  options.progress = [](int64_t done, int64_t total) {
    Progress("runs", done, total);
  };
  absl::StatusOr<std::vector<EvalRow>> rows = RunEvaluation(*client, options);
  if (!rows.ok()) return Fail(rows.status());
  const std::string table = EvalTable(*rows);
  std::printf("%s", table.c_str());
  std::string summary;
  for (double f : options.budget_fractions) {
    absl::StrAppendFormat(&summary,
                          "Mean attention loss at a budget of %.1f%% of the "
                          "context (needle kept):\n\n%s\n",
                          100 * f, EvalSummary(*rows, f));
  }
  for (const auto& [name, text] :
       {std::pair("eval.md", table), std::pair("eval.csv", EvalCsv(*rows)),
        std::pair("summary.md", summary)}) {
    if (absl::Status s = Write(out, name, text); !s.ok()) return Fail(s);
  }
  return 0;
}

}  // namespace
}  // namespace kvkeep::workers

int main(int argc, char** argv) { return kvkeep::workers::Main(argc, argv); }
