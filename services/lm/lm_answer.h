// Question answering for kvkeep-lm (`kvkeep-lm answer`, docs/lm-eval.md):
// each task's prompt (context + question) streams through every sequence
// of the task -- one per eviction run -- and then each sequence answers.
// Many tasks go in one batch: a round is one forward pass over every lane
// (task x run) that still has a step to take.
//
// Per lane:
//   1. the prompt, token by token (the policy evicts as it goes); a policy
//      that compresses a prompt (snapkv) takes it in chunks instead, its
//      last chunk at least the policy's window, then CompressPrompt;
//   2. the answer's log-probability, teacher-forced: the answer's tokens
//      but the last go through the model as one chunk on the cache the
//      prompt left, without being committed to it (no eviction among them;
//      the cache is untouched), so
//        log p(answer) = log p(a0 | prompt) + sum log p(ai | prompt, a<i);
//   3. greedy decoding of `max_new_tokens` tokens, each committed (the
//      policy goes on evicting).
//
// Prompts that begin alike (passkey tasks: the same filler up to the key)
// are streamed once per run: a lane whose task's prompt shares at least
// `share_prefix` leading tokens with an earlier task's waits until a lane
// of the same run (Sequence::share_key) has committed them, then forks its
// sequence (Sequence::Fork: a ForkSession, pages shared copy-on-write) and
// goes on from there. Its answer is the one it would have computed alone up
// to the batch's floating-point order (the forward pass batches whichever
// lanes are active). Lanes that compress their prompt (snapkv) and caches
// that cannot fork stream everything.
//
// Thread-compatible: one caller drives a run.
#ifndef KVKEEP_SERVICES_LM_LM_ANSWER_H_
#define KVKEEP_SERVICES_LM_LM_ANSWER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/lm/lm_sequence.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

struct AnswerTask {
  std::vector<int32_t> prompt;  // context + question
  std::vector<int32_t> answer;  // the expected answer's tokens
  // The tokens to look for in the prompt: the answer as the context spells
  // it (the answer's tokens without a leading bare space, SmolLM2's before
  // digits). Empty: not looked for.
  std::vector<int32_t> needle;
};

// Whether the cache still holds the answer when the question comes: every
// copy of the needle in the prompt, looked up in each layer's resident
// positions once the whole prompt is in (the moment of usage).
struct NeedleInCache {
  int64_t copies = 0;        // the needle's occurrences in the prompt
  int32_t layers_whole = 0;  // layers holding every token of some copy
  // Of (layer, copy, token) triples, the share resident; 0 without copies.
  double token_share = 0;
};

// That measure for `prompt` (token i at original position i) on `cache`.
NeedleInCache FindNeedle(const KvSource& cache, int32_t layers,
                         absl::Span<const int32_t> prompt,
                         absl::Span<const int32_t> needle);

struct AnswerOptions {
  int64_t max_new_tokens = 8;
  int64_t chunk = 128;  // prompt chunks of a policy that compresses them
  // The fewest common leading prompt tokens worth a fork; 0: never fork.
  int64_t share_prefix = 0;
  // Called after each round with (rounds done, rounds in all).
  std::function<void(int64_t, int64_t)> progress;
};

struct Answer {
  std::vector<int32_t> generated;       // greedy, max_new_tokens of them
  std::vector<double> answer_logprobs;  // per answer token, teacher-forced
  double answer_logprob = 0;            // their sum
  CacheUsage usage;                     // the cache when the prompt was in
  NeedleInCache needle;                 // the answer in it, then
  int64_t shared_prefix = 0;  // prompt tokens taken from a fork, not streamed
};

// Runs every task through its sequences: sequences[t] are task t's, one per
// run, each with an empty cache. Returns answers[t][r]. The first failure
// (a store that refused a step or went away) ends the whole batch.
absl::StatusOr<std::vector<std::vector<Answer>>> RunAnswers(
    const LlamaModel& model, absl::Span<const AnswerTask> tasks,
    absl::Span<const std::vector<Sequence*>> sequences,
    const AnswerOptions& options);

// Whether `generated` (the decoded continuation), stripped of leading
// spaces, starts with `answer` (the task format's exact match).
bool ExactMatch(std::string_view generated, std::string_view answer);

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_LM_ANSWER_H_
