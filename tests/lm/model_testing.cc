#include "tests/lm/model_testing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/types/span.h"
#include "gtest/gtest.h"

namespace kvkeep::lm {

std::vector<float> RandomVector(int64_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

std::vector<int32_t> RandomTokens(int64_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

std::vector<int64_t> Iota(int64_t first, int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

SequenceStep Step(const LlamaModel& model, ContiguousKv& cache,
                  const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& positions, int64_t first,
                  int64_t n, AttentionOutput attention) {
  SequenceStep step;
  step.tokens = absl::MakeConstSpan(tokens).subspan(first, n);
  step.positions = absl::MakeConstSpan(positions).subspan(first, n);
  step.cache = &cache;
  step.attention = attention;
  step.all_logits = true;
  EXPECT_TRUE(model.Forward(absl::MakeSpan(&step, 1)).ok());
  EXPECT_TRUE(cache.Append(step).ok());
  return step;
}

}  // namespace kvkeep::lm
