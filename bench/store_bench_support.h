// What the store benchmarks share: random tokens to append, a row of
// attention per layer, and a check that aborts on an error (a benchmark has
// no one to report to). Header-only.
#ifndef KVKEEP_BENCH_STORE_BENCH_SUPPORT_H_
#define KVKEEP_BENCH_STORE_BENCH_SUPPORT_H_

#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"

namespace kvkeep::bench {

// The benchmarks' layout "bench": 4 layers of `kv_heads` KV heads of
// `head_dim` (8 query heads), bf16, 16-token pages.
inline ModelLayout Bf16Layout(int32_t kv_heads, int32_t head_dim) {
  ModelLayout l;
  l.name = std::string("bench");
  l.num_layers = 4;
  l.kv_heads = kv_heads;
  l.query_heads = 8;
  l.head_dim = head_dim;
  l.dtype = DType::kBF16;
  l.page_tokens = 16;
  return l;
}

// n tokens from `first` on, every layer: random bytes (bf16 bit patterns of
// small numbers would do as well; the store never looks at them).
struct Tokens {
  std::vector<int64_t> positions;
  std::vector<std::vector<std::byte>> bytes;  // per layer: keys then values
  std::vector<LayerKv> layers;
  Tokens(const ModelLayout& l, int64_t first, int64_t n, std::mt19937& rng) {
    const size_t half = static_cast<size_t>(n * l.page_layout().token_bytes());
    for (int64_t i = 0; i < n; ++i) positions.push_back(first + i);
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      bytes.emplace_back(2 * half);
      for (std::byte& b : bytes.back()) b = std::byte(rng() & 0x3f);
    }
    for (const std::vector<std::byte>& b : bytes) {
      layers.push_back(
          LayerKv{std::span(b).first(half), std::span(b).subspan(half)});
    }
  }
  AppendRequest request() const { return AppendRequest{positions, layers}; }
};

// One row of reduced attention per layer over `slots`, at `versions`.
struct Rows {
  std::vector<std::vector<float>> rows;
  std::vector<LayerScores> scores;
  Rows(const SessionStats& s, int64_t growth, std::mt19937& rng) {
    std::uniform_real_distribution<float> w(0.01f, 1);
    for (size_t l = 0; l < s.layer_resident.size(); ++l) {
      std::vector<float> row(s.layer_resident[l] + growth);
      float sum = 0;
      for (float& f : row) sum += (f = w(rng));
      for (float& f : row) f /= sum;
      rows.push_back(std::move(row));
    }
    for (size_t l = 0; l < rows.size(); ++l) {
      scores.push_back(LayerScores{static_cast<int32_t>(l), s.layer_version[l],
                                   ScoreSource::kReduced, 1, rows[l]});
    }
  }
};

inline void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::abort();
  }
}
template <typename T>
T Check(absl::StatusOr<T> s) {
  Check(s.status());
  return *std::move(s);
}

}  // namespace kvkeep::bench

#endif  // KVKEEP_BENCH_STORE_BENCH_SUPPORT_H_
