// Deterministic token data for store tests: every key and value element
// depends on (layer, position, element, K or V), so a test can check that a
// slot holds exactly the token it claims to. Header-only; thread-safe.
#ifndef KVKEEP_TESTS_TOKEN_DATA_H_
#define KVKEEP_TESTS_TOKEN_DATA_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cache_store/model_layout.h"
#include "cache_store/session_types.h"
#include "tests/testing/noise.h"

namespace kvkeep::test_data {

using ::kvkeep::testing::Noise;  // a value in [-1, 1) for any tuple

// A small layout for store tests: 2 layers, 2 kv / 4 query heads of
// head_dim 64, pages of 4 tokens; a quantised dtype in groups of 32,
// appended as bf16.
inline ModelLayout SmallLayout(DType dtype, std::string name) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 64;
  l.dtype = dtype;
  l.group_size = 32;
  l.append_dtype = DType::kBF16;
  l.page_tokens = 4;
  return l;
}

// The keys (values = false) or values of `positions` in one layer, as a
// worker appends them (the layout's input dtype): [n][kv_heads][head_dim].
inline std::vector<std::byte> TokenBytes(const ModelLayout& l, int32_t layer,
                                         std::span<const int64_t> positions,
                                         bool values) {
  const int64_t per_token = int64_t{l.kv_heads} * l.head_dim;
  std::vector<std::byte> out(positions.size() * per_token *
                             DTypeBytes(l.input_dtype()));
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t e = 0; e < per_token; ++e) {
      const float f = static_cast<float>(
          Noise(layer, static_cast<uint64_t>(positions[t]), e, values ? 1 : 2));
      StoreFromFloat(l.input_dtype(), out.data(), t * per_token + e, f);
    }
  }
  return out;
}

// Owns the buffers of one append request: TokenBytes of `positions` for
// every layer of the layout. A test may change keys or values before
// request().
struct AppendBuffers {
  std::vector<int64_t> positions;
  std::vector<std::vector<std::byte>> keys, values;  // [layer]
  mutable std::vector<LayerKv> layers;  // views, rebuilt by request()

  AppendBuffers(const ModelLayout& l, std::vector<int64_t> pos)
      : positions(std::move(pos)) {
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      keys.push_back(TokenBytes(l, layer, positions, false));
      values.push_back(TokenBytes(l, layer, positions, true));
    }
    request();
  }
  // Positions [first, first + n).
  AppendBuffers(const ModelLayout& l, int64_t first, int64_t n)
      : AppendBuffers(l, Range(first, n)) {}

  // The request over the data as it is now (valid while this lives and
  // until the next request()).
  AppendRequest request() const {
    layers.clear();
    for (size_t layer = 0; layer < keys.size(); ++layer) {
      layers.push_back(LayerKv{keys[layer], values[layer]});
    }
    return AppendRequest{positions, layers};
  }

 private:
  static std::vector<int64_t> Range(int64_t first, int64_t n) {
    std::vector<int64_t> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = first + i;
    return out;
  }
};

}  // namespace kvkeep::test_data

#endif  // KVKEEP_TESTS_TOKEN_DATA_H_
