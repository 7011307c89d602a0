// kvkeep-lm answer: question-answering tasks through every run (docs/lm.md,
// docs/lm-eval.md); the batching is lm_answer.h's.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "services/lm/lm_answer.h"
#include "services/lm/lm_cli.h"

ABSL_FLAG(std::string, tasks, "",
          "answer: the tasks, JSON Lines (bench/lm/make_tasks.py)");
ABSL_FLAG(std::string, out, "",
          "answer: where the results go, JSON Lines (default: stdout)");
ABSL_FLAG(int64_t, parallel, 4,
          "answer: tasks in one batch (each with every run)");
ABSL_FLAG(int64_t, answer_tokens, 8, "answer: greedy tokens per answer");
ABSL_FLAG(int64_t, share_prefix, 64,
          "answer: a run's lanes whose prompts begin with at least this many "
          "common tokens stream them once and fork the session there "
          "(ForkSession; 0: every lane streams its whole prompt)");
ABSL_FLAG(bool, resume, false,
          "answer: keep the (task, run) lines already in --out and append "
          "only the missing ones (a long grid stopped part way goes on)");

namespace kvkeep::lm {
namespace {

// One task of `answer`: its line of the tasks file and its tokens.
struct TaskLine {
  nlohmann::json json;
  AnswerTask tokens;
  std::vector<RunSpec> runs;  // budgets as shares resolve per task
};

absl::StatusOr<std::vector<TaskLine>> ReadTasks(const Tokenizer& tokenizer) {
  if (absl::GetFlag(FLAGS_tasks).empty()) {
    return absl::InvalidArgumentError("answer needs --tasks=FILE.jsonl");
  }
  absl::StatusOr<std::string> text = ReadFile(absl::GetFlag(FLAGS_tasks));
  if (!text.ok()) return text.status();
  // SmolLM2 spells " 2147" as a bare space and the digits: the needle
  // looked for in the context is the digits.
  const std::vector<int32_t> spaces = tokenizer.Encode(" ", false);
  const int32_t space = spaces.size() == 1 ? spaces.front() : -1;
  std::vector<TaskLine> tasks;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    TaskLine task;
    task.json = nlohmann::json::parse(line, nullptr, false);
    const auto has = [&](const char* key) {
      return task.json.is_object() && task.json.contains(key) &&
             task.json[key].is_string();
    };
    if (!has("id") || !has("context") || !has("question") || !has("answer")) {
      return absl::InvalidArgumentError(absl::StrCat(
          absl::GetFlag(FLAGS_tasks), ":", line_number,
          ": not a JSON object with string id, context, question, answer"));
    }
    task.tokens.prompt =
        tokenizer.Encode(task.json["context"].get<std::string>() +
                             task.json["question"].get<std::string>(),
                         false);
    task.tokens.answer = tokenizer.Encode(
        absl::StrCat(" ", task.json["answer"].get<std::string>()), false);
    task.tokens.needle = task.tokens.answer;
    if (task.tokens.needle.size() > 1 && task.tokens.needle.front() == space) {
      task.tokens.needle.erase(task.tokens.needle.begin());
    }
    absl::StatusOr<std::vector<RunSpec>> runs =
        RunsFromFlags(static_cast<int64_t>(task.tokens.prompt.size()));
    if (!runs.ok()) return runs.status();
    task.runs = *std::move(runs);
    task.json.erase("context");
    task.json.erase("question");
    tasks.push_back(std::move(task));
  }
  return tasks;
}

// The result line of one (task, run).
nlohmann::json AnswerLine(const TaskLine& task, const RunSpec& run,
                          const Answer& a, const Tokenizer& tokenizer) {
  absl::StatusOr<std::string> text = tokenizer.Decode(a.generated);
  const std::string generated = text.ok() ? *text : "";
  nlohmann::json line = task.json;
  line["run"] = run.spec;
  line["policy"] = run.policy;
  line["budget_tokens"] = run.budget_tokens;
  line["positions"] = absl::GetFlag(FLAGS_positions);
  line["prompt_tokens"] = task.tokens.prompt.size();
  line["generated"] = generated;
  line["exact"] = ExactMatch(generated, task.json["answer"].get<std::string>());
  line["answer_logprob"] = a.answer_logprob;
  line["answer_token_count"] = task.tokens.answer.size();
  line["resident_tokens_per_layer"] = a.usage.resident_tokens_per_layer;
  line["resident_kv_bytes"] = a.usage.bytes;
  line["shared_prefix_tokens"] = a.shared_prefix;
  line["answer_copies"] = a.needle.copies;
  line["answer_layers_whole"] = a.needle.layers_whole;
  line["answer_token_share"] = a.needle.token_share;
  return line;
}

// --resume: drops from `tasks` the (task, run) pairs whose lines `path`
// already holds, and the tasks left with no run. A line that does not parse
// (a run stopped while writing it) counts for nothing.
absl::Status DropAnswered(const std::string& path,
                          std::vector<TaskLine>& tasks) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return absl::OkStatus();  // nothing answered yet
  absl::flat_hash_set<std::pair<std::string, std::string>> done;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    const nlohmann::json json = nlohmann::json::parse(line, nullptr, false);
    if (!json.is_object() || !json.contains("id") || !json.contains("run") ||
        !json["id"].is_string() || !json["run"].is_string()) {
      continue;
    }
    done.emplace(json["id"].get<std::string>(), json["run"].get<std::string>());
  }
  for (TaskLine& task : tasks) {
    const std::string id = task.json["id"].get<std::string>();
    std::erase_if(task.runs, [&](const RunSpec& run) {
      return done.contains(std::make_pair(id, run.spec));
    });
  }
  std::erase_if(tasks, [](const TaskLine& task) { return task.runs.empty(); });
  return absl::OkStatus();
}

}  // namespace

absl::Status AnswerCommand() {
  Setup setup;
  if (absl::Status s = OpenFile(setup); !s.ok()) return s;
  absl::StatusOr<std::vector<TaskLine>> tasks = ReadTasks(*setup.tokenizer);
  if (!tasks.ok()) return tasks.status();
  if (tasks->empty()) return absl::InvalidArgumentError("no tasks");
  const bool resume = absl::GetFlag(FLAGS_resume);
  if (resume) {
    if (absl::GetFlag(FLAGS_out).empty()) {
      return absl::InvalidArgumentError("--resume needs --out=FILE");
    }
    if (absl::Status s = DropAnswered(absl::GetFlag(FLAGS_out), *tasks);
        !s.ok()) {
      return s;
    }
    if (tasks->empty()) {
      std::fprintf(stderr, "every (task, run) is already in %s\n",
                   absl::GetFlag(FLAGS_out).c_str());
      return absl::OkStatus();
    }
  }
  if (absl::Status s = Connect(setup); !s.ok()) return s;
  FILE* out = stdout;
  if (!absl::GetFlag(FLAGS_out).empty()) {
    out = std::fopen(absl::GetFlag(FLAGS_out).c_str(), resume ? "a" : "w");
    if (out == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("cannot write ", absl::GetFlag(FLAGS_out)));
    }
  }
  AnswerOptions options;
  options.max_new_tokens = absl::GetFlag(FLAGS_answer_tokens);
  options.chunk = absl::GetFlag(FLAGS_chunk);
  options.share_prefix = absl::GetFlag(FLAGS_share_prefix);
  const size_t parallel =
      static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_parallel)));
  const bool tty = isatty(STDERR_FILENO);
  absl::Status status;
  int64_t exact = 0, answered = 0;
  for (size_t first = 0; first < tasks->size() && status.ok();
       first += parallel) {
    const size_t end = std::min(tasks->size(), first + parallel);
    std::vector<AnswerTask> batch;
    std::vector<std::vector<std::unique_ptr<Sequence>>> owned;
    std::vector<std::vector<Sequence*>> sequences;
    for (size_t t = first; t < end && status.ok(); ++t) {
      const TaskLine& task = (*tasks)[t];
      absl::StatusOr<std::vector<std::unique_ptr<Sequence>>> opened =
          OpenSequences(setup, task.runs,
                        static_cast<int64_t>(task.tokens.prompt.size() +
                                             task.tokens.answer.size()) +
                            options.max_new_tokens);
      if (!opened.ok()) {
        status = opened.status();
        break;
      }
      if (first == 0 && t == 0 && setup.client.has_value()) {
        absl::StrAppend(&setup.where, std::string(opened->front()->access()),
                        ")");
      }
      batch.push_back(task.tokens);
      owned.push_back(*std::move(opened));
      sequences.emplace_back();
      for (auto& s : owned.back()) sequences.back().push_back(s.get());
    }
    if (tty) {
      options.progress = [&, first, end](int64_t done, int64_t total) {
        if (done != total && done % 16 != 0) return;
        std::fprintf(stderr, "\rtasks %zu-%zu of %zu: step %lld / %lld   ",
                     first + 1, end, tasks->size(),
                     static_cast<long long>(done),
                     static_cast<long long>(total));
      };
    }
    absl::StatusOr<std::vector<std::vector<Answer>>> answers;
    const absl::Time started = absl::Now();
    if (status.ok())
      answers = RunAnswers(*setup.model, batch, sequences, options);
    if (status.ok() && !answers.ok()) status = answers.status();
    if (status.ok() && !tty) {  // a log: one line a batch, with its time
      int64_t prompt = 0, forked = 0;
      for (size_t t = 0; t < answers->size(); ++t) {
        for (const Answer& a : (*answers)[t]) {
          prompt += static_cast<int64_t>(batch[t].prompt.size());
          forked += a.shared_prefix;
        }
      }
      std::fprintf(stderr,
                   "tasks %zu-%zu of %zu: %.0f s, %lld prompt tokens over "
                   "the runs (%lld from forks)\n",
                   first + 1, end, tasks->size(),
                   absl::ToDoubleSeconds(absl::Now() - started),
                   static_cast<long long>(prompt),
                   static_cast<long long>(forked));
    }
    for (size_t t = 0; status.ok() && t < answers->size(); ++t) {
      const TaskLine& task = (*tasks)[first + t];
      for (size_t r = 0; r < task.runs.size(); ++r) {
        const nlohmann::json line =
            AnswerLine(task, task.runs[r], (*answers)[t][r], *setup.tokenizer);
        exact += line["exact"].get<bool>() ? 1 : 0;
        ++answered;
        std::fprintf(out, "%s\n", line.dump().c_str());
      }
    }
    std::fflush(out);
    for (auto& task_sequences : owned) {
      for (auto& s : task_sequences) {
        absl::Status closed = s->Close();
        if (status.ok() && !closed.ok()) status = closed;
      }
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  if (out != stdout) std::fclose(out);
  if (!status.ok()) return status;
  std::fprintf(stderr, "%s: %zu tasks, %lld answers, %lld exact\n",
               setup.where.c_str(), tasks->size(),
               static_cast<long long>(answered), static_cast<long long>(exact));
  return absl::OkStatus();
}

}  // namespace kvkeep::lm
