#include "services/workers/evaluation.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvkeep::workers {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

absl::StatusOr<v1::Layout> FindLayout(const client::KvKeepClient& client,
                                      const std::string& name) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  for (const v1::Layout& l : info->layouts()) {
    if (l.name() == name) return l;
  }
  return absl::NotFoundError(
      absl::StrCat("the server has no layout '", name, "'"));
}

// Runs fn(i) for i in [0, n) on `threads` threads; the first error wins.
absl::Status ParallelFor(int64_t n, int threads,
                         const std::function<absl::Status(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  absl::Status first_error;
  std::vector<std::thread> pool;
  for (int t = 0; t < std::max(1, threads); ++t) {
    pool.emplace_back([&] {
      for (int64_t i = next++; i < n; i = next++) {
        absl::Status s = fn(i);
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.ok()) first_error = s;
          next = n;
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
  return first_error;
}

EvalRow RowFrom(const DecodeReport& r) {
  EvalRow row;
  row.attention_loss = r.quality.attention_loss();
  row.top_recall = r.quality.top_recall();
  row.output_error = r.quality.output_error();
  row.needle_survival = r.needle_asks == 0
                            ? -1
                            : static_cast<double>(r.needle_hits) /
                                  static_cast<double>(r.needle_asks);
  row.mean_resident_tokens = r.mean_resident_tokens;
  row.resident_bytes = r.final_resident_bytes;
  return row;
}

}  // namespace

std::vector<std::string> EvalPolicies() {
  return {"full",         "window", "streaming_llm", "h2o",  "tova",
          "scissorhands", "snapkv", "h2o_page",      kOracle};
}

std::map<std::string, std::string> EvalParams(const std::string& policy,
                                              int64_t budget) {
  const auto text = [](int64_t v) { return absl::StrCat(v); };
  if (policy == "h2o" || policy == "h2o_page") {
    return {{"recent", text(budget / 2)}};
  }
  if (policy == "scissorhands") return {{"recent", text(budget / 4)}};
  if (policy == "streaming_llm") {
    return {{"sinks", text(std::min<int64_t>(4, budget - 1))}};
  }
  if (policy == "snapkv") {
    return {{"window",
             text(std::max<int64_t>(1, std::min<int64_t>(32, budget / 2)))},
            {"kernel", "5"},
            {"pooling", "avgpool"}};
  }
  return {};
}

absl::StatusOr<EvalRow> RunCase(const client::KvKeepClient& client,
                                const std::string& layout,
                                const Workload& workload,
                                const std::string& policy, int64_t budget,
                                ScoreMode scores, bool evaluate,
                                EvalRow* bound) {
  const auto start = std::chrono::steady_clock::now();
  DecodeReport report;
  if (policy == kOracle) {
    absl::StatusOr<DecodeReport> r = EvaluateOracle(workload, budget);
    if (!r.ok()) return r.status();
    report = *std::move(r);
  } else {
    SessionPlan plan;
    plan.layout = layout;
    plan.policy = policy;
    plan.params = EvalParams(policy, budget);
    plan.budget_tokens = budget;
    plan.scores = scores;
    absl::StatusOr<PrefilledSession> s = Prefill(client, workload, plan);
    if (!s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat(policy, " at budget ", budget,
                                       ": prefill: ", s.status().message()));
    }
    DecodeOptions options;
    options.scores = scores;
    options.evaluate = evaluate;
    absl::StatusOr<DecodeReport> r =
        Decode(s->session, s->mirror, workload, options);
    s->session.Close().IgnoreError();
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat(policy, " at budget ", budget,
                                       ": decode: ", r.status().message()));
    }
    report = *std::move(r);
  }
  EvalRow row = RowFrom(report);
  row.family = std::string(FamilyName(workload.spec().family));
  row.policy = policy;
  row.budget_tokens = budget;
  row.seconds = Seconds(start);
  if (bound != nullptr && policy == kOracle) {
    *bound = EvalRow{};
    bound->family = row.family;
    bound->policy = kBound;
    bound->budget_tokens = budget;
    bound->attention_loss = Summarize(report.bound_loss);
    bound->mean_resident_tokens = static_cast<double>(budget + 1);
  }
  return row;
}

absl::StatusOr<std::vector<EvalRow>> RunEvaluation(
    const client::KvKeepClient& client, const EvalOptions& options) {
  absl::StatusOr<v1::Layout> layout = FindLayout(client, options.layout);
  if (!layout.ok()) return layout.status();
  std::vector<Workload> workloads;
  for (WorkloadFamily f : options.families) {
    WorkloadSpec spec = DefaultSpec(f);
    spec.seed = options.sizes.seed;
    spec.prompt_tokens = options.sizes.prompt_tokens;
    spec.decode_steps = options.sizes.decode_steps;
    absl::StatusOr<Workload> w = Workload::Create(FitToLayout(spec, *layout));
    if (!w.ok()) return w.status();
    workloads.push_back(*std::move(w));
  }
  struct Task {
    size_t workload;
    std::string policy;
    double fraction;
  };
  std::vector<Task> tasks;
  for (size_t w = 0; w < workloads.size(); ++w) {
    for (const std::string& p : options.policies) {
      if (p == "full") {
        tasks.push_back({w, p, 1.0});
        continue;
      }
      for (double f : options.budget_fractions) tasks.push_back({w, p, f});
    }
  }
  std::vector<std::optional<EvalRow>> rows(tasks.size());
  std::vector<std::optional<EvalRow>> bounds(tasks.size());
  std::atomic<int64_t> done{0};
  std::mutex progress_mu;
  absl::Status s =
      ParallelFor(static_cast<int64_t>(tasks.size()), options.threads,
                  [&](int64_t i) -> absl::Status {
                    const Task& task = tasks[i];
                    const Workload& w = workloads[task.workload];
                    const int64_t budget = std::max<int64_t>(
                        2, std::llround(task.fraction * w.total_tokens()));
                    EvalRow bound;
                    absl::StatusOr<EvalRow> row =
                        RunCase(client, options.layout, w, task.policy, budget,
                                options.scores, /*evaluate=*/true, &bound);
                    if (!row.ok()) return row.status();
                    row->budget_fraction = task.fraction;
                    rows[i] = *std::move(row);
                    if (task.policy == kOracle) {
                      bound.budget_fraction = task.fraction;
                      bounds[i] = std::move(bound);
                    }
                    const int64_t n = ++done;
                    if (options.progress) {
                      std::lock_guard<std::mutex> lock(progress_mu);
                      options.progress(n, static_cast<int64_t>(tasks.size()));
                    }
                    return absl::OkStatus();
                  });
  if (!s.ok()) return s;
  std::vector<EvalRow> out;
  for (size_t i = 0; i < rows.size(); ++i) {
    out.push_back(*std::move(rows[i]));
    if (bounds[i].has_value()) out.push_back(*std::move(bounds[i]));
  }
  return out;
}

std::string EvalCsv(const std::vector<EvalRow>& rows) {
  std::string out =
      "family,policy,budget_fraction,budget_tokens,loss_mean,loss_p95,"
      "loss_max,recall_mean,recall_p95,recall_max,error_mean,error_p95,"
      "error_max,needle_survival,mean_resident_tokens,resident_bytes,"
      "seconds\n";
  for (const EvalRow& r : rows) {
    absl::StrAppendFormat(
        &out, "%s,%s,%.4f,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,",
        r.family, r.policy, r.budget_fraction, r.budget_tokens,
        r.attention_loss.mean, r.attention_loss.p95, r.attention_loss.max,
        r.top_recall.mean, r.top_recall.p95, r.top_recall.max,
        r.output_error.mean, r.output_error.p95, r.output_error.max);
    if (r.needle_survival >= 0) {
      absl::StrAppendFormat(&out, "%.4f", r.needle_survival);
    }
    absl::StrAppendFormat(&out, ",%.1f,%d,%.2f\n", r.mean_resident_tokens,
                          r.resident_bytes, r.seconds);
  }
  return out;
}

std::string EvalSummary(const std::vector<EvalRow>& rows, double fraction) {
  std::vector<std::string> families;
  std::vector<std::string> policies;
  std::map<std::pair<std::string, std::string>, const EvalRow*> cells;
  for (const EvalRow& r : rows) {
    if (r.policy != "full" && std::abs(r.budget_fraction - fraction) > 1e-9) {
      continue;
    }
    if (std::find(families.begin(), families.end(), r.family) ==
        families.end()) {
      families.push_back(r.family);
    }
    if (std::find(policies.begin(), policies.end(), r.policy) ==
        policies.end()) {
      policies.push_back(r.policy);
    }
    cells[{r.family, r.policy}] = &r;
  }
  std::string out = "| workload |";
  for (const std::string& p : policies) absl::StrAppend(&out, " ", p, " |");
  absl::StrAppend(&out, "\n|---|");
  for (size_t i = 0; i < policies.size(); ++i) absl::StrAppend(&out, "---|");
  absl::StrAppend(&out, "\n");
  for (const std::string& f : families) {
    absl::StrAppend(&out, "| ", f, " |");
    for (const std::string& p : policies) {
      auto it = cells.find({f, p});
      if (it == cells.end()) {
        absl::StrAppend(&out, " |");
        continue;
      }
      const EvalRow& r = *it->second;
      absl::StrAppendFormat(&out, " %.3f", r.attention_loss.mean);
      if (r.needle_survival >= 0) {
        absl::StrAppendFormat(&out, " (%.0f%%)", 100 * r.needle_survival);
      }
      absl::StrAppend(&out, " |");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

std::string EvalTable(const std::vector<EvalRow>& rows) {
  std::string out =
      "| workload | policy | budget | attention loss mean / p95 / max | "
      "top-10 recall mean | output error mean / p95 | needle kept | "
      "resident tokens |\n|---|---|---|---|---|---|---|---|\n";
  for (const EvalRow& r : rows) {
    const std::string needle =
        r.needle_survival < 0
            ? "-"
            : absl::StrFormat("%.0f%%", 100 * r.needle_survival);
    const std::string recall = r.top_recall.count == 0
                                   ? "-"
                                   : absl::StrFormat("%.3f", r.top_recall.mean);
    const std::string error =
        r.output_error.count == 0
            ? "-"
            : absl::StrFormat("%.3f / %.3f", r.output_error.mean,
                              r.output_error.p95);
    absl::StrAppendFormat(
        &out,
        "| %s | %s | %.1f%% (%d) | %.3f / %.3f / %.3f | %s | %s | %s | %.0f "
        "|\n",
        r.family, r.policy, 100 * r.budget_fraction, r.budget_tokens,
        r.attention_loss.mean, r.attention_loss.p95, r.attention_loss.max,
        recall, error, needle, r.mean_resident_tokens);
  }
  return out;
}

absl::StatusOr<std::vector<SpeedRow>> RunSpeed(
    const client::KvKeepClient& client, const SpeedOptions& options) {
  absl::StatusOr<v1::Layout> layout = FindLayout(client, options.layout);
  if (!layout.ok()) return layout.status();
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kMixed);
  spec.seed = options.sizes.seed;
  spec.prompt_tokens = options.sizes.prompt_tokens;
  spec.decode_steps = options.steps;
  absl::StatusOr<Workload> workload =
      Workload::Create(FitToLayout(spec, *layout));
  if (!workload.ok()) return workload.status();
  const int64_t budget = std::max<int64_t>(
      2, std::llround(options.budget_fraction * workload->total_tokens()));

  std::vector<std::string> policies = options.policies;
  if (std::find(policies.begin(), policies.end(), "full") == policies.end()) {
    policies.insert(policies.begin(), "full");
  }
  std::vector<SpeedRow> out;
  for (const std::string& policy : policies) {
    if (policy == kOracle) continue;
    for (int sessions : options.concurrency) {
      SessionPlan plan;
      plan.layout = options.layout;
      plan.policy = policy;
      plan.params = EvalParams(policy, budget);
      plan.budget_tokens = budget;
      plan.scores = options.scores;
      std::vector<PrefilledSession> prefilled;
      std::mutex prefilled_mu;
      absl::Status status = ParallelFor(sessions, 2, [&](int64_t) {
        absl::StatusOr<PrefilledSession> s = Prefill(client, *workload, plan);
        if (!s.ok()) return s.status();
        std::lock_guard<std::mutex> lock(prefilled_mu);
        prefilled.push_back(*std::move(s));
        return absl::OkStatus();
      });
      std::vector<std::vector<double>> latencies(prefilled.size());
      const auto start = std::chrono::steady_clock::now();
      if (status.ok()) {
        status = ParallelFor(static_cast<int64_t>(prefilled.size()), sessions,
                             [&](int64_t i) -> absl::Status {
                               DecodeOptions d;
                               d.scores = options.scores;
                               absl::StatusOr<DecodeReport> r =
                                   Decode(prefilled[i].session,
                                          prefilled[i].mirror, *workload, d);
                               if (!r.ok()) return r.status();
                               latencies[i] = std::move(r->step_seconds);
                               return absl::OkStatus();
                             });
      }
      const double wall = Seconds(start);
      for (PrefilledSession& s : prefilled) s.session.Close().IgnoreError();
      if (!status.ok()) {
        return absl::Status(status.code(),
                            absl::StrCat(policy, " x ", sessions,
                                         " sessions: ", status.message()));
      }
      std::vector<double> all;
      for (const std::vector<double>& l : latencies) {
        all.insert(all.end(), l.begin(), l.end());
      }
      SpeedRow row;
      row.policy = policy;
      row.sessions = sessions;
      row.steps_per_second = static_cast<double>(all.size()) / wall;
      row.p50_ms = 1e3 * NearestRankPercentile(all, 0.5);
      row.p99_ms = 1e3 * NearestRankPercentile(all, 0.99);
      out.push_back(row);
    }
  }
  return out;
}

std::string SpeedTable(const std::vector<SpeedRow>& rows) {
  std::string out =
      "| policy | sessions | decode steps/s | vs full | p50 step ms | p99 step "
      "ms |\n|---|---|---|---|---|---|\n";
  std::map<int, double> full;
  for (const SpeedRow& r : rows) {
    if (r.policy == "full") full[r.sessions] = r.steps_per_second;
  }
  for (const SpeedRow& r : rows) {
    const double base = full.count(r.sessions) ? full[r.sessions] : 0;
    absl::StrAppendFormat(&out, "| %s | %d | %.0f | %.2fx | %.2f | %.2f |\n",
                          r.policy, r.sessions, r.steps_per_second,
                          base > 0 ? r.steps_per_second / base : 0.0, r.p50_ms,
                          r.p99_ms);
  }
  return out;
}

std::string SpeedCsv(const std::vector<SpeedRow>& rows) {
  std::string out = "policy,sessions,steps_per_second,p50_ms,p99_ms\n";
  for (const SpeedRow& r : rows) {
    absl::StrAppendFormat(&out, "%s,%d,%.1f,%.3f,%.3f\n", r.policy, r.sessions,
                          r.steps_per_second, r.p50_ms, r.p99_ms);
  }
  return out;
}

}  // namespace kvkeep::workers
