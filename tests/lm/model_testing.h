// What the forward-pass tests share (model_ops_test, model_test,
// real_model_test): random data, a closeness measure, and one step of a
// model on a contiguous cache.
#ifndef KVKEEP_TESTS_LM_MODEL_TESTING_H_
#define KVKEEP_TESTS_LM_MODEL_TESTING_H_

#include <cstdint>
#include <random>
#include <vector>

#include "services/lm/contiguous_kv.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

// n values from N(0, scale^2).
std::vector<float> RandomVector(int64_t n, float scale, std::mt19937& rng);

// The largest |a[i] - b[i]|; a test failure when the sizes differ.
float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);

// n token ids below `vocab`, drawn from `seed`.
std::vector<int32_t> RandomTokens(int64_t n, int32_t vocab, uint32_t seed);

// first, first + 1, ..., first + n - 1.
std::vector<int64_t> Iota(int64_t first, int64_t n);

// Runs tokens [first, first + n) of `tokens` as one step on `cache` and
// appends their keys and values. Returns the step (its outputs).
SequenceStep Step(const LlamaModel& model, ContiguousKv& cache,
                  const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& positions, int64_t first,
                  int64_t n,
                  AttentionOutput attention = AttentionOutput::kNone);

}  // namespace kvkeep::lm

#endif  // KVKEEP_TESTS_LM_MODEL_TESTING_H_
