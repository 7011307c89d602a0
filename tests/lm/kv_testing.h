// What the tests of kvkeep-lm's float32 caches share (emulated_kv_test,
// kivi_kv_test): a small model shape, random tokens with an outlier key
// channel, appending them to an EmulatedKv and reading a contiguous cache
// back as float32.
#ifndef KVKEEP_TESTS_LM_KV_TESTING_H_
#define KVKEEP_TESTS_LM_KV_TESTING_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "services/lm/emulated_kv.h"
#include "services/lm/model.h"

namespace kvkeep::lm::testing {

inline constexpr int32_t kLayers = 2, kKvHeads = 2, kHeadDim = 8;
inline constexpr int64_t kWidth = kKvHeads * kHeadDim;

inline ModelConfig Config() {
  ModelConfig c;
  c.layers = kLayers;
  c.kv_heads = kKvHeads;
  c.query_heads = 4;
  c.head_dim = kHeadDim;
  return c;
}

// Keys and values [layer][kv][token][width] for n tokens, random with an
// outlier channel in the keys (what makes per-token int4 keys poor).
using Tokens = std::vector<std::vector<std::vector<float>>>;
inline Tokens RandomTokens(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tokens t(kLayers, std::vector<std::vector<float>>(2));
  for (auto& layer : t) {
    for (int kv = 0; kv < 2; ++kv) {
      layer[kv].resize(n * kWidth);
      for (int64_t i = 0; i < n * kWidth; ++i) {
        layer[kv][i] = dist(rng) + (kv == 0 && i % kWidth == 3 ? 20.0f : 0.0f);
      }
    }
  }
  return t;
}

inline std::string Bytes(const std::vector<float>& x, int64_t first,
                         int64_t n) {
  return std::string(reinterpret_cast<const char*>(&x[first * kWidth]),
                     n * kWidth * sizeof(float));
}

// Appends tokens [first, first + n).
inline absl::Status Append(EmulatedKv& cache, const Tokens& t, int64_t first,
                           int64_t n) {
  std::vector<int32_t> ids(n, 1);
  std::vector<int64_t> positions(n);
  for (int64_t i = 0; i < n; ++i) positions[i] = first + i;
  SequenceStep step;
  step.tokens = ids;
  step.positions = positions;
  for (int32_t l = 0; l < kLayers; ++l) {
    step.keys.push_back(Bytes(t[l][0], first, n));
    step.values.push_back(Bytes(t[l][1], first, n));
  }
  return cache.Append(step);
}

// What a cache of one contiguous page per layer hands the model:
// [layer][kv][token][width].
inline Tokens Read(const KvSource& cache) {
  Tokens out(kLayers, std::vector<std::vector<float>>(2));
  for (int32_t l = 0; l < kLayers; ++l) {
    const ResidentKv r = cache.Layer(l);
    const float* arena = reinterpret_cast<const float*>(r.arena);
    for (int kv = 0; kv < 2; ++kv) {
      const float* first = arena + kv * r.page_tokens * kWidth;
      out[l][kv].assign(first, first + r.resident * kWidth);
    }
  }
  return out;
}

}  // namespace kvkeep::lm::testing

#endif  // KVKEEP_TESTS_LM_KV_TESTING_H_
