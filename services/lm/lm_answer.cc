#include "services/lm/lm_answer.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "services/lm/lm_runs.h"

namespace kvkeep::lm {

bool ExactMatch(std::string_view generated, std::string_view answer) {
  const size_t first = generated.find_first_not_of(' ');
  if (first == std::string_view::npos) return answer.empty();
  return generated.substr(first).substr(0, answer.size()) == answer;
}

NeedleInCache FindNeedle(const KvSource& cache, int32_t layers,
                         absl::Span<const int32_t> prompt,
                         absl::Span<const int32_t> needle) {
  NeedleInCache found;
  if (needle.empty()) return found;
  std::vector<int64_t> starts;
  for (auto it = prompt.begin();
       (it = std::search(it, prompt.end(), needle.begin(), needle.end())) !=
       prompt.end();
       ++it) {
    starts.push_back(it - prompt.begin());
  }
  found.copies = static_cast<int64_t>(starts.size());
  if (starts.empty() || layers < 1) return found;
  const int64_t length = static_cast<int64_t>(needle.size());
  std::vector<char> held(prompt.size());
  int64_t held_tokens = 0;
  for (int32_t layer = 0; layer < layers; ++layer) {
    std::fill(held.begin(), held.end(), 0);
    for (const int64_t p : cache.Layer(layer).positions) {
      if (p >= 0 && p < static_cast<int64_t>(held.size())) held[p] = 1;
    }
    bool whole = false;
    for (const int64_t start : starts) {
      const int64_t n =
          std::count(held.begin() + start, held.begin() + start + length, 1);
      held_tokens += n;
      whole = whole || n == length;
    }
    found.layers_whole += whole ? 1 : 0;
  }
  found.token_share = static_cast<double>(held_tokens) /
                      static_cast<double>(layers * found.copies * length);
  return found;
}

namespace {

enum class Phase { kWaiting, kPrompt, kPeek, kDecode, kDone };

// One (task, run): where it is and what it has to do next.
struct Lane {
  const AnswerTask* task = nullptr;
  Sequence* sequence = nullptr;
  Answer* out = nullptr;
  std::vector<int64_t> prompt_steps;  // sizes; 1s unless the policy compresses
  bool compresses = false;
  size_t next_step = 0;
  int64_t fed = 0;  // tokens committed to the cache
  Phase phase = Phase::kPrompt;
  // kWaiting: the lane forks lanes[donor] once it has fed fork_at tokens.
  int64_t donor = -1;
  int64_t fork_at = 0;

  StepKind kind() const {
    if (phase != Phase::kPrompt || !compresses) return StepKind::kDecode;
    return next_step + 1 < prompt_steps.size() ? StepKind::kPrompt
                                               : StepKind::kPromptEnd;
  }
  int64_t rounds() const {
    return static_cast<int64_t>(prompt_steps.size()) +
           (task->answer.size() > 1 ? 1 : 0);
  }
};

// Sets up the step `lane` takes this round.
void PrepareStep(const Lane& lane, absl::Span<const int64_t> positions,
                 SequenceStep& step) {
  const AnswerTask& task = *lane.task;
  step.cache = &lane.sequence->cache();
  switch (lane.phase) {
    case Phase::kPrompt: {
      const int64_t n = lane.prompt_steps[lane.next_step];
      step.tokens = absl::MakeConstSpan(task.prompt).subspan(lane.fed, n);
      step.attention = lane.sequence->attention(lane.kind());
      // Only the prompt's last token predicts anything we read.
      step.no_logits = lane.next_step + 1 < lane.prompt_steps.size();
      break;
    }
    case Phase::kPeek: {
      const int64_t n = static_cast<int64_t>(task.answer.size()) - 1;
      step.tokens = absl::MakeConstSpan(task.answer).subspan(0, n);
      step.attention = AttentionOutput::kNone;
      step.all_logits = true;
      break;
    }
    case Phase::kDecode:
      step.tokens = absl::MakeConstSpan(&lane.out->generated.back(), 1);
      step.attention = lane.sequence->attention(StepKind::kDecode);
      break;
    case Phase::kWaiting:  // not active
    case Phase::kDone:
      break;
  }
  step.positions = positions.subspan(lane.fed, step.tokens.size());
}

// Takes the step's result: commits it (not a peek), reads the logits, moves
// the lane on.
absl::Status FinishStep(Lane& lane, const SequenceStep& step,
                        const ModelConfig& config, int64_t max_new_tokens) {
  const int32_t vocab = config.vocab;
  Answer& out = *lane.out;
  const AnswerTask& task = *lane.task;
  const auto row = [&](int64_t r) {
    return absl::MakeConstSpan(step.logits).subspan(r * vocab, vocab);
  };
  if (lane.phase == Phase::kPeek) {
    for (size_t i = 1; i < task.answer.size(); ++i) {
      out.answer_logprobs.push_back(LogProb(row(i - 1), task.answer[i]));
    }
    lane.phase = Phase::kDecode;
  } else {
    if (absl::Status s = lane.sequence->Commit(step, lane.kind()); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("at token ", lane.fed, ": ", s.message()));
    }
    lane.fed += static_cast<int64_t>(step.tokens.size());
    if (lane.phase == Phase::kPrompt &&
        ++lane.next_step == lane.prompt_steps.size()) {
      absl::StatusOr<CacheUsage> usage = lane.sequence->Usage();
      if (!usage.ok()) return usage.status();
      out.usage = *usage;
      out.needle = FindNeedle(lane.sequence->cache(), config.layers,
                              task.prompt, task.needle);
      if (!task.answer.empty()) {
        out.answer_logprobs.push_back(LogProb(row(0), task.answer[0]));
      }
      lane.phase = task.answer.size() > 1 ? Phase::kPeek : Phase::kDecode;
      out.generated.push_back(Argmax(row(0)));
    } else if (lane.phase == Phase::kDecode) {
      out.generated.push_back(Argmax(row(0)));
    }
  }
  if (lane.phase == Phase::kDecode &&
      static_cast<int64_t>(out.generated.size()) >= max_new_tokens) {
    lane.phase = Phase::kDone;
  }
  return absl::OkStatus();
}

int64_t CommonPrefix(absl::Span<const int32_t> a, absl::Span<const int32_t> b) {
  const auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return ia - a.begin();
}

// Which lanes wait for a donor: each token-by-token lane takes the earliest
// earlier lane of the same share key whose prompt shares the most leading
// tokens with its own (at least min_shared, and at most all but its last
// token, whose logits it needs). The earliest such donor forks no later
// than that point itself: a common prefix with a third prompt that reached
// further would make the third an earlier donor of at least as much.
void PlanForks(std::vector<Lane>& lanes, int64_t min_shared) {
  if (min_shared < 1) return;
  std::vector<std::string> keys;
  for (const Lane& lane : lanes) {
    keys.push_back(lane.compresses ? "" : lane.sequence->share_key());
  }
  for (size_t i = 0; i < lanes.size(); ++i) {
    if (keys[i].empty()) continue;
    Lane& lane = lanes[i];
    const int64_t n = static_cast<int64_t>(lane.task->prompt.size());
    int64_t best = 0, donor = -1;
    for (size_t j = 0; j < i; ++j) {
      if (keys[j] != keys[i] || lanes[j].task == lane.task) continue;
      const int64_t k = std::min(
          n - 1, CommonPrefix(lane.task->prompt, lanes[j].task->prompt));
      if (k > best) best = k, donor = static_cast<int64_t>(j);
    }
    if (donor < 0 || best < min_shared ||
        (lanes[donor].donor >= 0 && lanes[donor].fork_at > best)) {
      continue;
    }
    lane.phase = Phase::kWaiting;
    lane.donor = donor;
    lane.fork_at = best;
  }
}

// Starts every waiting lane whose donor has just fed its fork point (in
// lane order, so a donor that forks at the same point goes first); with
// `all`, every waiting lane (nothing else can move them on), the ones
// without a donor there from their first token.
absl::Status StartForks(std::vector<Lane>& lanes,
                        std::vector<std::unique_ptr<Sequence>>& forks,
                        bool all) {
  for (Lane& lane : lanes) {
    if (lane.phase != Phase::kWaiting) continue;
    const Lane& donor = lanes[lane.donor];
    const bool ready = donor.phase != Phase::kWaiting &&
                       donor.fed == lane.fork_at &&
                       donor.next_step == static_cast<size_t>(lane.fork_at);
    if (!ready && !all) continue;
    lane.phase = Phase::kPrompt;
    if (!ready) continue;
    absl::StatusOr<std::unique_ptr<Sequence>> fork = donor.sequence->Fork();
    if (absl::IsUnimplemented(fork.status())) continue;  // from scratch
    if (!fork.ok()) return fork.status();
    // The sequence the lane was opened with is empty and never used again.
    // NOT_FOUND: the server already freed it (its lease ran out while the
    // donor fed the prefix), which loses nothing.
    if (absl::Status s = lane.sequence->Close();
        !s.ok() && !absl::IsNotFound(s)) {
      return s;
    }
    lane.sequence = fork->get();
    forks.push_back(*std::move(fork));
    lane.fed = lane.fork_at;
    lane.next_step = static_cast<size_t>(lane.fork_at);
    lane.out->shared_prefix = lane.fork_at;
  }
  return absl::OkStatus();
}

// Closes the sequences RunAnswers forked; the first failure, if any.
absl::Status CloseForks(std::vector<std::unique_ptr<Sequence>>& forks) {
  absl::Status status;
  for (auto& fork : forks) status.Update(fork->Close());
  forks.clear();
  return status;
}

// Runs the lanes to the end; their answers land where Lane::out points.
absl::Status Run(const LlamaModel& model, std::vector<Lane>& lanes,
                 int64_t longest, const AnswerOptions& options,
                 std::vector<std::unique_ptr<Sequence>>& forks) {
  std::vector<int64_t> positions(longest);
  std::iota(positions.begin(), positions.end(), 0);
  int64_t total_rounds = 0;
  for (const Lane& lane : lanes) {
    total_rounds =
        std::max(total_rounds, lane.rounds() + options.max_new_tokens - 1);
  }

  std::vector<Lane*> active;
  std::vector<SequenceStep> batch;
  for (int64_t round = 0;; ++round) {
    if (absl::Status s = StartForks(lanes, forks, false); !s.ok()) return s;
    active.clear();
    bool waiting = false;
    for (Lane& lane : lanes) {
      if (lane.phase == Phase::kWaiting) waiting = true;
      if (lane.phase != Phase::kDone && lane.phase != Phase::kWaiting) {
        active.push_back(&lane);
      }
    }
    if (active.empty() && waiting) {
      if (absl::Status s = StartForks(lanes, forks, true); !s.ok()) return s;
      continue;
    }
    if (active.empty()) break;
    batch.assign(active.size(), SequenceStep());
    for (size_t i = 0; i < active.size(); ++i) {
      PrepareStep(*active[i], positions, batch[i]);
    }
    if (absl::Status s = model.Forward(absl::MakeSpan(batch)); !s.ok()) {
      return s;
    }
    for (size_t i = 0; i < active.size(); ++i) {
      if (absl::Status s = FinishStep(*active[i], batch[i], model.config(),
                                      options.max_new_tokens);
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(active[i]->sequence->label(),
                                                   ": ", s.message()));
      }
      // A lane done early frees its pages now rather than when the whole
      // batch ends (and cannot outlive its session's lease idling).
      if (active[i]->phase == Phase::kDone) {
        if (absl::Status s = active[i]->sequence->Close(); !s.ok()) return s;
      }
    }
    if (options.progress) {
      options.progress(std::min(round + 1, total_rounds), total_rounds);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<Answer>>> RunAnswers(
    const LlamaModel& model, absl::Span<const AnswerTask> tasks,
    absl::Span<const std::vector<Sequence*>> sequences,
    const AnswerOptions& options) {
  if (tasks.size() != sequences.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        tasks.size(), " tasks but sequences for ", sequences.size()));
  }
  if (options.max_new_tokens < 1) {
    return absl::InvalidArgumentError("max_new_tokens must be at least 1");
  }
  std::vector<std::vector<Answer>> answers(tasks.size());
  std::vector<Lane> lanes;
  int64_t longest = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const int64_t n = static_cast<int64_t>(tasks[t].prompt.size());
    if (n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("task ", t, ": no prompt"));
    }
    longest =
        std::max(longest, n + static_cast<int64_t>(tasks[t].answer.size()) +
                              options.max_new_tokens);
    answers[t].resize(sequences[t].size());
    for (size_t r = 0; r < sequences[t].size(); ++r) {
      Lane lane;
      lane.task = &tasks[t];
      lane.sequence = sequences[t][r];
      lane.out = &answers[t][r];
      const int64_t min_last = lane.sequence->min_prompt_end_tokens();
      lane.compresses = min_last > 1;
      lane.prompt_steps = lane.compresses
                              ? PromptChunks(n, options.chunk, min_last)
                              : std::vector<int64_t>(n, 1);
      lanes.push_back(std::move(lane));
    }
  }
  PlanForks(lanes, options.share_prefix);
  std::vector<std::unique_ptr<Sequence>> forks;
  absl::Status status = Run(model, lanes, longest, options, forks);
  status.Update(CloseForks(forks));
  if (!status.ok()) return status;
  for (auto& task_answers : answers) {
    for (Answer& a : task_answers) {
      a.answer_logprob = std::accumulate(a.answer_logprobs.begin(),
                                         a.answer_logprobs.end(), 0.0);
    }
  }
  return answers;
}

}  // namespace kvkeep::lm
