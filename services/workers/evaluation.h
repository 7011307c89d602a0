// The evaluation harness: every policy x budget x workload family through a
// real kvkeepd, measured against the full cache and next to the oracle; and
// the end-to-end speed run (decode steps per second and step latency with
// concurrent sessions, each policy next to `full`). Results are plain rows,
// printed as tables and written as CSV by the caller (kvkeep-eval).
//
// Thread-safe: each run uses its own sessions.
#ifndef KVKEEP_SERVICES_WORKERS_EVALUATION_H_
#define KVKEEP_SERVICES_WORKERS_EVALUATION_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/client/kvkeep_client.h"
#include "services/workers/quality.h"
#include "services/workers/session_driver.h"
#include "services/workers/workload.h"

namespace kvkeep::workers {

// "oracle" in a policy list: the clairvoyant oracle (no server). Its rows
// come with a "bound" row: the per-step best possible attention loss.
inline constexpr char kOracle[] = "oracle";
inline constexpr char kBound[] = "bound";

// Every policy the harness knows, in table order (oracle last).
std::vector<std::string> EvalPolicies();

// The parameters the harness gives `policy` at `budget` tokens per layer,
// following each paper's split: h2o and h2o_page keep half the budget as the
// recent window (H2O's heavy = recent), scissorhands a quarter,
// streaming_llm 4 sinks, snapkv a window of min(32, budget / 2) with
// kernel 5; window and tova have none. Slack 0 everywhere, so budgets are
// exact.
std::map<std::string, std::string> EvalParams(const std::string& policy,
                                              int64_t budget);

struct EvalOptions {
  std::string layout;  // the server layout the workloads take their shape from
  WorkloadSpec sizes;  // prompt_tokens, decode_steps, seed (the rest: family)
  std::vector<WorkloadFamily> families;
  std::vector<std::string> policies;  // from EvalPolicies()
  // Budgets as fractions of the context (prompt + decode tokens).
  std::vector<double> budget_fractions = {0.125, 0.25, 0.5, 0.75};
  ScoreMode scores = ScoreMode::kReduced;
  int threads = 2;  // runs in parallel
  // Called after each run with (runs done, runs in all).
  std::function<void(int64_t, int64_t)> progress;
};

struct EvalRow {
  std::string family;
  std::string policy;
  double budget_fraction = 0;  // 1 for full
  int64_t budget_tokens = 0;   // per layer
  Distribution attention_loss;
  Distribution top_recall;
  Distribution output_error;
  double needle_survival = -1;      // -1: the workload has no needle asked
  double mean_resident_tokens = 0;  // per layer, over the decode
  int64_t resident_bytes = 0;       // at the end (0 for the oracle)
  double seconds = 0;
};

// Runs the grid: `full` once per family (budget = the whole context), every
// other policy at every budget; each oracle row is followed by its bound row
// (attention loss only). Rows in (family, policy, budget) order.
absl::StatusOr<std::vector<EvalRow>> RunEvaluation(
    const client::KvKeepClient& client, const EvalOptions& options);

// One policy at one budget on one workload (the grid's unit). For the
// oracle, *bound (when given) receives the bound row.
absl::StatusOr<EvalRow> RunCase(const client::KvKeepClient& client,
                                const std::string& layout,
                                const Workload& workload,
                                const std::string& policy, int64_t budget,
                                ScoreMode scores, bool evaluate,
                                EvalRow* bound = nullptr);

std::string EvalCsv(const std::vector<EvalRow>& rows);
// A Markdown pivot at one budget fraction: a row per workload family, a
// column per policy (full, whatever the budget), each cell the mean
// attention loss, with the needle kept where the workload has one.
std::string EvalSummary(const std::vector<EvalRow>& rows, double fraction);
// A Markdown table: one row per (family, policy, budget).
std::string EvalTable(const std::vector<EvalRow>& rows);

struct SpeedOptions {
  std::string layout;
  WorkloadSpec sizes;                 // family kMixed with these sizes
  std::vector<std::string> policies;  // `full` is added first if missing
  std::vector<int> concurrency = {1, 16, 64};
  double budget_fraction = 0.25;
  int64_t steps = 64;  // decode steps per session
  ScoreMode scores = ScoreMode::kReduced;
};

struct SpeedRow {
  std::string policy;
  int sessions = 0;
  double steps_per_second = 0;  // all sessions together
  double p50_ms = 0;            // one step's round trip
  double p99_ms = 0;
};

// For each policy and concurrency: N sessions prefilled (not timed), then N
// threads each decoding `steps` steps at once.
absl::StatusOr<std::vector<SpeedRow>> RunSpeed(
    const client::KvKeepClient& client, const SpeedOptions& options);
std::string SpeedTable(const std::vector<SpeedRow>& rows);
std::string SpeedCsv(const std::vector<SpeedRow>& rows);

}  // namespace kvkeep::workers

#endif  // KVKEEP_SERVICES_WORKERS_EVALUATION_H_
