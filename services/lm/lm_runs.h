// What kvkeep-lm does with the model and its sequences: perplexity over a
// text, token by token, for several sequences at once (one batched forward
// pass per token: a grid of policies costs little more than one), and greedy
// generation. The caches are the sequences' (lm_sequence.h): the worker's
// own, or kvkeepd sessions whose policies evict as the text goes.
//
// Thread-compatible: one caller drives a run.
#ifndef KVKEEP_SERVICES_LM_LM_RUNS_H_
#define KVKEEP_SERVICES_LM_LM_RUNS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/lm/lm_sequence.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

struct PerplexityOptions {
  // Tokens fed as a prompt first, in chunks of `chunk` (the last chunk holds
  // at least snapkv's window); their predictions count too. 0: token by
  // token from the first.
  int64_t prompt_tokens = 0;
  int64_t chunk = 128;
  // The prompt's last chunk holds at least this many tokens (snapkv's
  // observation window must fit in it).
  int64_t min_last_chunk = 64;
  // Called after each step with (tokens fed, tokens in all).
  std::function<void(int64_t, int64_t)> progress;
};

struct PerplexityResult {
  std::string label;
  int64_t predictions = 0;  // tokens whose log-probability was scored
  double nll_sum = 0;       // -sum of log p(token | what came before)
  double perplexity = 0;    // exp(nll_sum / predictions)
  CacheUsage final_usage;   // the cache at the end
  // Every sequence shares the forward passes: the run's wall time, the
  // part spent in them, and the part spent handing steps to the caches.
  double seconds = 0;
  double forward_seconds = 0;
  double commit_seconds = 0;
  // The token-by-token part after the prompt: its steps and wall time.
  int64_t decode_tokens = 0;
  double decode_seconds = 0;
};

// Feeds `ids` to every sequence in lock step and scores each next token.
// The first failure (a sequence whose store refused a step or went away)
// ends the run with that status.
absl::StatusOr<std::vector<PerplexityResult>> RunPerplexity(
    const LlamaModel& model, absl::Span<const int32_t> ids,
    absl::Span<Sequence* const> sequences, const PerplexityOptions& options);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  int64_t chunk = 128;                    // prompt tokens per forward pass
  int64_t min_last_chunk = 64;            // as in PerplexityOptions
  std::vector<int32_t> stop_ids;          // e.g. the end-of-sequence token
  std::function<void(int32_t)> on_token;  // each generated token, in order
};

struct GenerateResult {
  std::vector<int32_t> ids;  // the generated tokens
  double prompt_seconds = 0;
  double decode_seconds = 0;
};

// Greedy continuation of `prompt` (which the sequence's cache has not seen).
absl::StatusOr<GenerateResult> Generate(const LlamaModel& model,
                                        absl::Span<const int32_t> prompt,
                                        Sequence& sequence,
                                        const GenerateOptions& options);

// log p(target) from one row of logits (double accumulation).
double LogProb(absl::Span<const float> logits, int32_t target);

// The index of the largest logit (the first of equal ones): greedy decoding.
int32_t Argmax(absl::Span<const float> logits);

// The chunk sizes a prompt of `tokens` is cut into: `chunk` each, the last
// at least `min_last` (merged into the one before when shorter).
std::vector<int64_t> PromptChunks(int64_t tokens, int64_t chunk,
                                  int64_t min_last);

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_LM_RUNS_H_
