#include "services/lm/lm_runs.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvkeep::lm {

std::vector<int64_t> PromptChunks(int64_t tokens, int64_t chunk,
                                  int64_t min_last) {
  std::vector<int64_t> sizes;
  chunk = std::max<int64_t>(chunk, 1);
  for (int64_t left = tokens; left > 0;) {
    const int64_t n = std::min(left, chunk);
    sizes.push_back(n);
    left -= n;
  }
  while (sizes.size() > 1 && sizes.back() < min_last) {
    const int64_t last = sizes.back();
    sizes.pop_back();
    sizes.back() += last;
  }
  return sizes;
}

double LogProb(absl::Span<const float> logits, int32_t target) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return static_cast<double>(logits[target]) - max - std::log(sum);
}

int32_t Argmax(absl::Span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                              logits.begin());
}

namespace {

double Since(absl::Time start) {
  return absl::ToDoubleSeconds(absl::Now() - start);
}

}  // namespace

absl::StatusOr<std::vector<PerplexityResult>> RunPerplexity(
    const LlamaModel& model, absl::Span<const int32_t> ids,
    absl::Span<Sequence* const> sequences, const PerplexityOptions& options) {
  const int64_t total = static_cast<int64_t>(ids.size());
  const int64_t prompt = std::min(options.prompt_tokens, total);
  std::vector<int64_t> steps =
      PromptChunks(prompt, options.chunk, options.min_last_chunk);
  const size_t prompt_steps = steps.size();
  steps.insert(steps.end(), total - prompt, 1);

  std::vector<PerplexityResult> results(sequences.size());
  for (size_t i = 0; i < sequences.size(); ++i) {
    results[i].label = sequences[i]->label();
  }
  std::vector<int64_t> positions(total);
  for (int64_t p = 0; p < total; ++p) positions[p] = p;
  const absl::Time start = absl::Now();
  double forward_seconds = 0, commit_seconds = 0, decode_seconds = 0;
  int64_t first = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    const absl::Time step_start = absl::Now();
    const int64_t n = steps[s];
    const StepKind kind = s + 1 < prompt_steps    ? StepKind::kPrompt
                          : s + 1 == prompt_steps ? StepKind::kPromptEnd
                                                  : StepKind::kDecode;
    std::vector<SequenceStep> batch(sequences.size());
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch[i].tokens = ids.subspan(first, n);
      batch[i].positions = absl::MakeConstSpan(positions).subspan(first, n);
      batch[i].cache = &sequences[i]->cache();
      batch[i].attention = sequences[i]->attention(kind);
      batch[i].all_logits = n > 1;
    }
    absl::Time t = absl::Now();
    if (absl::Status st = model.Forward(absl::MakeSpan(batch)); !st.ok()) {
      return st;
    }
    forward_seconds += Since(t);
    t = absl::Now();
    for (size_t i = 0; i < sequences.size(); ++i) {
      if (absl::Status st = sequences[i]->Commit(batch[i], kind); !st.ok()) {
        return absl::Status(
            st.code(), absl::StrCat("at token ", first, ": ", st.message()));
      }
    }
    commit_seconds += Since(t);
    // Row r of the logits predicts token first + r + 1.
    const int32_t vocab = model.config().vocab;
    for (size_t i = 0; i < sequences.size(); ++i) {
      const int64_t rows = static_cast<int64_t>(batch[i].logits.size()) / vocab;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t target = first + (n - rows) + r + 1;
        if (target >= total) break;
        results[i].nll_sum -= LogProb(
            absl::MakeConstSpan(batch[i].logits).subspan(r * vocab, vocab),
            ids[target]);
        ++results[i].predictions;
      }
    }
    first += n;
    if (kind == StepKind::kDecode) decode_seconds += Since(step_start);
    if (options.progress) options.progress(first, total);
  }
  const double seconds = Since(start);
  for (size_t i = 0; i < sequences.size(); ++i) {
    PerplexityResult& r = results[i];
    r.perplexity = r.predictions > 0 ? std::exp(r.nll_sum / r.predictions) : 0;
    r.seconds = seconds;
    r.forward_seconds = forward_seconds;
    r.commit_seconds = commit_seconds;
    r.decode_tokens = static_cast<int64_t>(steps.size() - prompt_steps);
    r.decode_seconds = decode_seconds;
    absl::StatusOr<CacheUsage> usage = sequences[i]->Usage();
    if (!usage.ok()) return usage.status();
    r.final_usage = *usage;
  }
  return results;
}

absl::StatusOr<GenerateResult> Generate(const LlamaModel& model,
                                        absl::Span<const int32_t> prompt,
                                        Sequence& sequence,
                                        const GenerateOptions& options) {
  if (prompt.empty()) {
    return absl::InvalidArgumentError("an empty prompt");
  }
  GenerateResult result;
  const std::vector<int64_t> chunks =
      PromptChunks(static_cast<int64_t>(prompt.size()), options.chunk,
                   options.min_last_chunk);
  std::vector<int64_t> positions(prompt.size() + options.max_new_tokens);
  for (size_t p = 0; p < positions.size(); ++p) positions[p] = p;

  // One forward step of `tokens` at positions [first, first + n).
  const auto step = [&](absl::Span<const int32_t> tokens, int64_t first,
                        StepKind kind) -> absl::StatusOr<int32_t> {
    SequenceStep s;
    s.tokens = tokens;
    s.positions = absl::MakeConstSpan(positions).subspan(first, tokens.size());
    s.cache = &sequence.cache();
    s.attention = sequence.attention(kind);
    if (absl::Status st = model.Forward(absl::MakeSpan(&s, 1)); !st.ok()) {
      return st;
    }
    if (absl::Status st = sequence.Commit(s, kind); !st.ok()) return st;
    return Argmax(s.logits);
  };

  absl::Time t = absl::Now();
  int64_t first = 0;
  absl::StatusOr<int32_t> next = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    next =
        step(prompt.subspan(first, chunks[c]), first,
             c + 1 == chunks.size() ? StepKind::kPromptEnd : StepKind::kPrompt);
    if (!next.ok()) return next.status();
    first += chunks[c];
  }
  result.prompt_seconds = Since(t);
  t = absl::Now();
  while (static_cast<int64_t>(result.ids.size()) < options.max_new_tokens) {
    const int32_t token = *next;
    result.ids.push_back(token);
    if (options.on_token) options.on_token(token);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) !=
            options.stop_ids.end() ||
        static_cast<int64_t>(result.ids.size()) == options.max_new_tokens) {
      break;
    }
    next = step(absl::MakeConstSpan(&result.ids.back(), 1), first,
                StepKind::kDecode);
    if (!next.ok()) return next.status();
    ++first;
  }
  result.decode_seconds = Since(t);
  return result;
}

}  // namespace kvkeep::lm
