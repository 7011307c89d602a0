// What the policy conformance and invariant tests share: deterministic
// randomness (SplitMix64, not <random>'s distributions, so the streams are
// the same on every standard library), small layouts and stores, the bytes
// of each token, and exact renderings of StepResults. Header-only: each
// test binary links its own .cc alone (tests/CMakeLists.txt).
#ifndef KVKEEP_TESTS_CONFORMANCE_SUPPORT_H_
#define KVKEEP_TESTS_CONFORMANCE_SUPPORT_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "tests/test_device.h"

namespace kvkeep::conformance_testing {

// ---------------------------------------------------------------------------
// Deterministic randomness.

inline uint64_t Mix(uint64_t x) {  // SplitMix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t Hash(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x6b766b656570ull;  // "kvkeep"
  for (uint64_t p : parts) h = Mix(h ^ p);
  return h;
}

// A uniform double in [0, 1) with 53 random bits: continuous enough that two
// attention values are practically never exactly equal.
inline double Unit(uint64_t h) {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix(state_++); }
  // Uniform in [lo, hi] (inclusive; the modulo bias is irrelevant here).
  int64_t Int(int64_t lo, int64_t hi) {
    return lo +
           static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  double Real(double lo, double hi) { return lo + (hi - lo) * Unit(Next()); }
  bool Chance(double p) { return Unit(Next()) < p; }
  template <typename T>
  T Pick(std::initializer_list<T> items) {
    return *(items.begin() + Int(0, static_cast<int64_t>(items.size()) - 1));
  }

 private:
  uint64_t state_;
};

// ---------------------------------------------------------------------------
// Layouts, stores and the bytes of each token.

inline ModelLayout MakeLayout(int32_t layers, int32_t kv_heads,
                              int32_t query_heads, int32_t head_dim,
                              DType dtype, int32_t page_tokens) {
  ModelLayout layout;
  layout.name = "conformance";
  layout.num_layers = layers;
  layout.kv_heads = kv_heads;
  layout.query_heads = query_heads;
  layout.head_dim = head_dim;
  layout.dtype = dtype;
  layout.page_tokens = page_tokens;
  return layout;
}

inline std::unique_ptr<CacheStore> MakeStore(const ModelLayout& layout,
                                             int64_t capacity_pages) {
  absl::StatusOr<std::unique_ptr<CacheStore>> store = CacheStore::Create(
      StoreOptions{.pools = {PoolSpec{layout, capacity_pages}},
                   .device = test_support::TestDevice()});
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// The bytes of one token's keys or values in one layer, as a worker sends
// them (the layout's input dtype): [kv_heads][head_dim] elements, each a hash
// of (layer, position, K/V, element). Key elements are finite numbers of
// moderate size (the store may score queries against them); value elements
// are any bit pattern, except for a quantised layout, which refuses
// non-finite input: there they are moderate numbers too.
inline std::vector<std::byte> TokenBytes(const ModelLayout& layout,
                                         int32_t layer, int64_t position,
                                         bool key) {
  const DType in = layout.input_dtype();
  const bool moderate = key || IsQuantized(layout.dtype);
  const int64_t elements = int64_t{layout.kv_heads} * layout.head_dim;
  const int es = DTypeBytes(in);
  std::vector<std::byte> bytes(elements * es);
  for (int64_t e = 0; e < elements; ++e) {
    const uint64_t h =
        Hash({static_cast<uint64_t>(layer), static_cast<uint64_t>(position),
              key ? 1u : 2u, static_cast<uint64_t>(e)});
    const uint64_t exp_pick = (h >> 40) % 12;
    if (es == 4) {
      uint32_t bits = static_cast<uint32_t>(h);
      if (moderate) bits = (bits & 0x807fffffu) | ((121u + exp_pick) << 23);
      std::memcpy(bytes.data() + e * es, &bits, 4);
    } else {
      uint16_t bits = static_cast<uint16_t>(h);
      if (moderate && in == DType::kF16) {
        bits =
            static_cast<uint16_t>((bits & 0x83ffu) | ((9u + exp_pick) << 10));
      } else if (moderate) {  // bf16
        bits =
            static_cast<uint16_t>((bits & 0x807fu) | ((121u + exp_pick) << 7));
      }
      std::memcpy(bytes.data() + e * es, &bits, 2);
    }
  }
  return bytes;
}

// The bytes the store holds for that token: the same bytes, or for a
// quantised layout the twin's record of them (kernels/quantize.h).
inline std::vector<std::byte> StoredTokenBytes(const ModelLayout& layout,
                                               int32_t layer, int64_t position,
                                               bool key) {
  std::vector<std::byte> sent = TokenBytes(layout, layer, position, key);
  if (!IsQuantized(layout.dtype)) return sent;
  const PageLayout page = layout.page_layout();
  std::vector<std::byte> record(page.token_bytes());
  const QuantizeResult r =
      QuantizeTokens(page, layout.input_dtype(), sent.data(), 1, record.data());
  EXPECT_TRUE(r.ok()) << "position " << position;
  return record;
}

// A random small layout of any dtype the store holds; a quantised one gets
// a group size that divides head_dim (even for int4) and an append dtype.
inline ModelLayout RandomLayout(Rng& rng, absl::Span<const int32_t> head_dims) {
  const int32_t query_heads = static_cast<int32_t>(rng.Int(1, 4));
  const DType dtype =
      rng.Pick<DType>({DType::kF32, DType::kF16, DType::kBF16, DType::kInt8,
                       DType::kFp8E4M3, DType::kInt4});
  std::vector<int32_t> dims;
  for (int32_t d : head_dims) {
    if (!IsQuantized(dtype) || d % 2 == 0) dims.push_back(d);
  }
  ModelLayout layout = MakeLayout(
      static_cast<int32_t>(rng.Int(1, 3)), rng.Chance(0.5) ? query_heads : 1,
      query_heads, dims[rng.Int(0, static_cast<int64_t>(dims.size()) - 1)],
      dtype, rng.Pick<int32_t>({1, 2, 3, 4, 7, 16}));
  if (IsQuantized(dtype)) {
    std::vector<int32_t> groups;
    for (int32_t g = 1; g <= layout.head_dim; ++g) {
      if (layout.head_dim % g == 0 && (dtype != DType::kInt4 || g % 2 == 0)) {
        groups.push_back(g);
      }
    }
    layout.group_size =
        groups[rng.Int(0, static_cast<int64_t>(groups.size()) - 1)];
    layout.append_dtype =
        rng.Pick<DType>({DType::kF32, DType::kF16, DType::kBF16});
  }
  return layout;
}

// An AppendRequest for `positions` on every layer, owning its buffers.
class AppendBuffers {
 public:
  AppendBuffers(const ModelLayout& layout, std::vector<int64_t> positions)
      : positions_(std::move(positions)),
        keys_(layout.num_layers),
        values_(layout.num_layers) {
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      for (int64_t p : positions_) {
        const std::vector<std::byte> k = TokenBytes(layout, l, p, true);
        const std::vector<std::byte> v = TokenBytes(layout, l, p, false);
        keys_[l].insert(keys_[l].end(), k.begin(), k.end());
        values_[l].insert(values_[l].end(), v.begin(), v.end());
      }
      layers_.push_back(LayerKv{keys_[l], values_[l]});
    }
  }
  AppendRequest request() const { return AppendRequest{positions_, layers_}; }

 private:
  std::vector<int64_t> positions_;
  std::vector<std::vector<std::byte>> keys_, values_;
  std::vector<LayerKv> layers_;
};

inline std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// A readable, complete rendering of a StepResult, for exact comparisons.
inline std::string Render(const StepResult& r) {
  std::string out;
  for (const LayerChange& c : r.layers) {
    absl::StrAppend(&out, "layer ", c.layer, " v", c.version, " resident ",
                    c.resident, " evicted [",
                    absl::StrJoin(c.evicted_positions, ","), "] moves [");
    for (const SlotMove& m : c.moves) {
      absl::StrAppend(&out, m.from_slot, ">", m.to_slot, " ");
    }
    absl::StrAppend(&out, "] freed [", absl::StrJoin(c.pages_freed, ","),
                    "] added [", absl::StrJoin(c.pages_added, ","), "]\n");
  }
  return out;
}

// How many times the usual number of streams and rounds to run.
inline int Scale() {
  const char* env = std::getenv("KVKEEP_CONFORMANCE_SCALE");
  const int scale = env != nullptr ? std::atoi(env) : 1;
  return std::max(scale, 1);
}

}  // namespace kvkeep::conformance_testing

#endif  // KVKEEP_TESTS_CONFORMANCE_SUPPORT_H_
