// The reference attention of workload.h (Attention, AttentionF64): dot
// products and a max-subtracted softmax in float64 over every key given,
// what the quality metrics measure a policy's kept keys against.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "services/workers/workload.h"

namespace kvkeep::workers {
namespace {

absl::Status CheckAttentionSizes(const HeadShape& shape, size_t queries,
                                 size_t keys, int64_t tokens, size_t probs) {
  if (shape.kv_heads < 1 || shape.head_dim < 1 ||
      shape.query_heads < shape.kv_heads ||
      shape.query_heads % shape.kv_heads != 0) {
    return absl::InvalidArgumentError(
        "attention: query_heads must be a positive multiple of kv_heads");
  }
  const size_t d = shape.head_dim;
  if (tokens < 0 || queries != shape.query_heads * d ||
      keys != static_cast<size_t>(tokens) * shape.kv_heads * d ||
      probs != static_cast<size_t>(tokens) * shape.query_heads) {
    return absl::InvalidArgumentError(
        "attention: queries [query_heads][head_dim], keys "
        "[tokens][kv_heads][head_dim], probs [query_heads][tokens]");
  }
  return absl::OkStatus();
}

template <typename Out>
void AttentionImpl(const HeadShape& shape, const float* queries,
                   const float* keys, int64_t tokens, Out* probs,
                   std::vector<double>& logits) {
  const int32_t d = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  logits.resize(tokens);
  for (int32_t h = 0; h < shape.query_heads; ++h) {
    const float* q = queries + static_cast<int64_t>(h) * d;
    const int32_t g = h / shape.group();
    double max_logit = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < tokens; ++j) {
      const float* k = keys + (j * shape.kv_heads + g) * d;
      double dot = 0;
      for (int32_t i = 0; i < d; ++i) {
        dot += static_cast<double>(q[i]) * static_cast<double>(k[i]);
      }
      logits[j] = dot * scale;
      max_logit = std::max(max_logit, logits[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < tokens; ++j) {
      logits[j] = std::exp(logits[j] - max_logit);
      sum += logits[j];
    }
    Out* row = probs + static_cast<int64_t>(h) * tokens;
    for (int64_t j = 0; j < tokens; ++j) {
      row[j] = static_cast<Out>(logits[j] / sum);
    }
  }
}

}  // namespace

absl::Status Attention(const HeadShape& shape, std::span<const float> queries,
                       std::span<const float> keys, int64_t tokens,
                       std::span<float> probs) {
  if (absl::Status st = CheckAttentionSizes(shape, queries.size(), keys.size(),
                                            tokens, probs.size());
      !st.ok()) {
    return st;
  }
  std::vector<double> scratch;
  AttentionImpl(shape, queries.data(), keys.data(), tokens, probs.data(),
                scratch);
  return absl::OkStatus();
}

absl::Status AttentionF64(const HeadShape& shape,
                          std::span<const float> queries,
                          std::span<const float> keys, int64_t tokens,
                          std::span<double> probs) {
  if (absl::Status st = CheckAttentionSizes(shape, queries.size(), keys.size(),
                                            tokens, probs.size());
      !st.ok()) {
    return st;
  }
  std::vector<double> scratch;
  AttentionImpl(shape, queries.data(), keys.data(), tokens, probs.data(),
                scratch);
  return absl::OkStatus();
}

}  // namespace kvkeep::workers
