// Conformance and invariants of the eviction policies over seeded random
// streams.
//
// Conformance: with slack 0, streaming_llm, h2o and tova keep after every
// step exactly the set that a plain re-implementation of the paper's rule,
// written here independently of cache_store/, keeps. Streams mix prefill
// chunks (several tokens, multi-row attention) and decode steps, several
// layers and heads, GQA and page sizes; attention comes per head or already
// summed over heads (the same sets either way), and two stores fed the same
// stream answer with identical StepResults.
//
// Invariants, for every evicting policy (all of PolicyNames() but full, and
// snapkv apart): no layer over budget, protected tokens never evicted, the
// StepResults let a worker reproduce the block table exactly, ReadLayer
// returns the bytes appended for each resident token, and the pool's pages in
// use are exactly the sessions' pages (none once they close).
//
// Every random choice derives from a fixed seed (SplitMix64, not <random>'s
// distributions, so the streams are the same on every standard library);
// a failure names the seed and step that reproduce it. The environment
// variable KVKEEP_CONFORMANCE_SCALE=N runs N times as many streams and rounds
// (new seeds after the usual ones), for a longer soak.
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

namespace kvkeep {
namespace {

// ---------------------------------------------------------------------------
// Deterministic randomness.

uint64_t Mix(uint64_t x) {  // SplitMix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Hash(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x6b766b656570ull;  // "kvkeep"
  for (uint64_t p : parts) h = Mix(h ^ p);
  return h;
}

// A uniform double in [0, 1) with 53 random bits: continuous enough that two
// attention values are practically never exactly equal.
double Unit(uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

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

ModelLayout MakeLayout(int32_t layers, int32_t kv_heads, int32_t query_heads,
                       int32_t head_dim, DType dtype, int32_t page_tokens) {
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

std::unique_ptr<CacheStore> MakeStore(const ModelLayout& layout,
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
std::vector<std::byte> TokenBytes(const ModelLayout& layout, int32_t layer,
                                  int64_t position, bool key) {
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
std::vector<std::byte> StoredTokenBytes(const ModelLayout& layout,
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
ModelLayout RandomLayout(Rng& rng, absl::Span<const int32_t> head_dims) {
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

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// A readable, complete rendering of a StepResult, for exact comparisons.
std::string Render(const StepResult& r) {
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

// ---------------------------------------------------------------------------
// Conformance streams.

struct StreamSpec {
  uint64_t seed = 0;
  std::string policy;  // streaming_llm | h2o | tova
  ModelLayout layout;
  std::vector<int64_t> budgets;  // per layer
  int64_t sinks = 0;
  int64_t recent = 0;
  // One append per entry: positions, and how many of its newest tokens send
  // attention rows (h2o/tova).
  std::vector<std::vector<int64_t>> chunks;
  std::vector<int32_t> rows;
  double bias_scale = 0;   // per-key importance shared by every query
  double noise_scale = 0;  // per (head, query, key) noise
  // Each key's logit is 0 or 1 for every query and head: keys of one class
  // get exactly equal attention, and two of them that arrived in one chunk
  // ahead of its query rows keep exactly equal h2o scores from then on. So
  // the rule "of two equal scores the older goes" decides many evictions.
  bool quantized = false;

  std::string Describe() const {
    return absl::StrCat(
        "seed ", seed, " policy ", policy, " layers ", layout.num_layers,
        " heads ", layout.query_heads, "/", layout.kv_heads, " page ",
        layout.page_tokens, " budgets [", absl::StrJoin(budgets, ","),
        "] sinks ", sinks, " recent ", recent, quantized ? " quantized" : "");
  }
};

StreamSpec RandomStream(uint64_t seed, const std::string& policy) {
  Rng rng(Hash({seed, 0x5eed}));
  StreamSpec s;
  s.seed = seed;
  s.policy = policy;
  const int32_t query_heads = static_cast<int32_t>(rng.Int(1, 4));
  const int32_t kv_heads = rng.Chance(0.5) ? query_heads : 1;
  s.layout = MakeLayout(static_cast<int32_t>(rng.Int(1, 3)), kv_heads,
                        query_heads, /*head_dim=*/2, DType::kF32,
                        rng.Pick<int32_t>({1, 2, 3, 4, 5, 7, 8, 16}));
  s.sinks = rng.Chance(0.35) ? 0 : rng.Int(1, 4);
  s.recent = rng.Chance(0.35) ? 0 : rng.Int(1, 8);
  for (int32_t l = 0; l < s.layout.num_layers; ++l) {
    s.budgets.push_back(std::max<int64_t>(1, s.sinks + s.recent) +
                        rng.Int(0, 20));
  }
  s.quantized = rng.Chance(0.25);
  int64_t position = rng.Int(0, 5);
  const int64_t tokens = rng.Int(1, 80);
  int64_t appended = 0;
  while (appended < tokens) {
    int64_t n = 1;
    if (appended == 0 && rng.Chance(0.5)) {
      n = rng.Int(2, 40);  // a prompt
    } else if (rng.Chance(s.quantized ? 0.5 : 0.2)) {
      n = rng.Int(2, 12);  // a prefill chunk
    }
    n = std::min(n, tokens - appended);
    std::vector<int64_t> chunk;
    for (int64_t i = 0; i < n; ++i) {
      chunk.push_back(position);
      position += rng.Int(1, 3);
    }
    s.chunks.push_back(std::move(chunk));
    const bool partial = n > 1 && rng.Chance(s.quantized ? 0.8 : 0.25);
    s.rows.push_back(static_cast<int32_t>(partial ? rng.Int(1, n) : n));
    appended += n;
  }
  s.bias_scale = rng.Real(0.0, 4.0);
  s.noise_scale = rng.Real(0.1, 4.0);
  return s;
}

double Logit(const StreamSpec& s, int32_t layer, int32_t head, int64_t query,
             int64_t key) {
  const uint64_t l = static_cast<uint64_t>(layer);
  const double bias =
      Unit(Hash({s.seed, l, static_cast<uint64_t>(key), 0xb1a5}));
  const double noise =
      Unit(Hash({s.seed, l, static_cast<uint64_t>(head),
                 static_cast<uint64_t>(query), static_cast<uint64_t>(key)}));
  if (s.quantized) return bias < 0.5 ? 0.0 : 1.0;
  return s.bias_scale * (2 * bias - 1) + s.noise_scale * (2 * noise - 1);
}

// The papers' rules, written plainly. One instance per layer.
class ReferenceLayer {
 public:
  ReferenceLayer(const StreamSpec& s, int64_t budget)
      : policy_(s.policy),
        sinks_(s.sinks),
        recent_(s.recent),
        budget_(budget) {}

  void Append(const std::vector<int64_t>& positions) {
    for (int64_t p : positions) {
      all_.push_back(p);
      tokens_.push_back(Token{p, appended_++, 0.0f});
    }
  }

  // The tokens currently held, in arrival order (for h2o and tova; the
  // streaming_llm rule below needs no state).
  std::vector<int64_t> Held() const {
    std::vector<int64_t> out;
    for (const Token& t : tokens_) out.push_back(t.position);
    return out;
  }
  // Evictions where the last kept and the first evicted token had equal
  // scores: the tie rule decided them.
  int64_t ties_at_cut() const { return ties_at_cut_; }

  // One step's attention: probs[h][r][i] is what query row r of head h paid
  // Held()[i]. h2o adds the head-summed attention of every row to each score;
  // tova's score is the last row's head mean. Then keep the protected tokens
  // and the best others, up to the budget.
  void Observe(const std::vector<float>& probs, int32_t heads, int32_t rows) {
    const size_t n = tokens_.size();
    for (int32_t r = 0; r < rows; ++r) {
      if (policy_ == "tova" && r != rows - 1) continue;
      for (size_t i = 0; i < n; ++i) {
        // Heads summed in float, head 0 first (as the store reduces them).
        float sum = probs[(int64_t{0} * rows + r) * n + i];
        for (int32_t h = 1; h < heads; ++h) {
          sum += probs[(int64_t{h} * rows + r) * n + i];
        }
        if (policy_ == "h2o") {
          tokens_[i].score += sum;
        } else {
          tokens_[i].score = sum * (1.0f / static_cast<float>(heads));
        }
      }
    }
    KeepBest();
  }

  std::vector<int64_t> Kept() const {
    if (policy_ == "streaming_llm") {
      // The first `sinks` tokens and the last budget - sinks.
      std::vector<int64_t> kept;
      const int64_t total = static_cast<int64_t>(all_.size());
      for (int64_t a = 0; a < total; ++a) {
        if (a < sinks_ || a >= total - (budget_ - sinks_)) {
          kept.push_back(all_[a]);
        }
      }
      return kept;
    }
    return Sorted(Held());
  }

 private:
  struct Token {
    int64_t position;
    int64_t arrival;
    float score;
  };

  // Keeps the sinks, the last `recent` and the top (budget - protected)
  // others by score; of two equal scores the newer stays.
  void KeepBest() {
    if (static_cast<int64_t>(tokens_.size()) <= budget_) return;
    std::vector<Token> kept, others;
    for (const Token& t : tokens_) {
      const bool is_protected =
          t.arrival < sinks_ || t.arrival >= appended_ - recent_;
      (is_protected ? kept : others).push_back(t);
    }
    std::sort(others.begin(), others.end(), [](const Token& a, const Token& b) {
      if (a.score != b.score) return a.score > b.score;
      return a.arrival > b.arrival;
    });
    const int64_t room = budget_ - static_cast<int64_t>(kept.size());
    if (room > 0 && room < static_cast<int64_t>(others.size()) &&
        others[room - 1].score == others[room].score) {
      ++ties_at_cut_;
    }
    for (int64_t i = 0; i < room && i < static_cast<int64_t>(others.size());
         ++i) {
      kept.push_back(others[i]);
    }
    std::sort(kept.begin(), kept.end(), [](const Token& a, const Token& b) {
      return a.arrival < b.arrival;
    });
    tokens_ = std::move(kept);
  }

  const std::string policy_;
  const int64_t sinks_, recent_, budget_;
  int64_t appended_ = 0;
  int64_t ties_at_cut_ = 0;
  std::vector<int64_t> all_;
  std::vector<Token> tokens_;
};

// Per-head attention of the step's query rows over the reference's held
// tokens: probs[h][r][i], softmax in double over the tokens no newer than the
// row's own (causal), rounded to float32.
std::vector<float> StepProbs(const StreamSpec& s, int32_t layer,
                             const ReferenceLayer& ref,
                             const std::vector<int64_t>& chunk, int32_t rows) {
  const std::vector<int64_t> held = ref.Held();
  const size_t n = held.size();
  const int32_t heads = s.layout.query_heads;
  std::vector<float> probs(int64_t{heads} * rows * n, 0.0f);
  std::vector<double> logits(n);
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t r = 0; r < rows; ++r) {
      const int64_t query = chunk[chunk.size() - rows + r];
      double mx = -INFINITY;
      for (size_t i = 0; i < n; ++i) {
        logits[i] =
            held[i] <= query ? Logit(s, layer, h, query, held[i]) : -INFINITY;
        mx = std::max(mx, logits[i]);
      }
      double denom = 0;
      for (size_t i = 0; i < n; ++i) denom += std::exp(logits[i] - mx);
      for (size_t i = 0; i < n; ++i) {
        probs[(int64_t{h} * rows + r) * n + i] =
            static_cast<float>(std::exp(logits[i] - mx) / denom);
      }
    }
  }
  return probs;
}

// What one run of a stream produced: every call's result and, after every
// step, each layer's kept positions.
struct RunTrace {
  std::vector<std::string> results;
  std::vector<std::vector<std::vector<int64_t>>> kept;  // [step][layer]
  int64_t ties_at_cut = 0;                              // summed over layers
};

// Feeds the stream to a fresh store, sending attention as `source`
// (kPerHead or kReduced), and requires the reference's kept set after every
// step. Stops at the first mismatch.
RunTrace RunStream(const StreamSpec& s, ScoreSource source) {
  SCOPED_TRACE(
      absl::StrCat(s.Describe(), " source ",
                   source == ScoreSource::kPerHead ? "per-head" : "reduced"));
  RunTrace trace;
  const ModelLayout& layout = s.layout;
  std::unique_ptr<CacheStore> store = MakeStore(layout, 1024);
  if (store == nullptr) return trace;
  PolicySpec policy{s.policy,
                    {{"sinks", absl::StrCat(s.sinks)},
                     {"recent", absl::StrCat(s.recent)},
                     {"slack", "0"}}};
  BudgetSpec budget;
  budget.per_layer = s.budgets;
  absl::StatusOr<SessionId> id =
      store->CreateSession(SessionSpec{layout.name, policy, budget});
  if (!id.ok()) {
    ADD_FAILURE() << id.status();
    return trace;
  }
  std::vector<ReferenceLayer> ref;
  for (int64_t b : s.budgets) ref.emplace_back(s, b);
  const bool scored = s.policy != "streaming_llm";
  const int32_t heads = layout.query_heads;

  for (size_t step = 0; step < s.chunks.size(); ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const std::vector<int64_t>& chunk = s.chunks[step];
    const AppendBuffers buffers(layout, chunk);
    absl::StatusOr<StepResult> appended = store->Append(*id, buffers.request());
    if (!appended.ok()) {
      ADD_FAILURE() << appended.status();
      return trace;
    }
    trace.results.push_back(Render(*appended));
    for (ReferenceLayer& r : ref) r.Append(chunk);

    if (scored) {
      const int32_t rows = s.rows[step];
      std::vector<std::vector<float>> data(layout.num_layers);
      std::vector<LayerScores> scores;
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        absl::StatusOr<BlockTable> table = store->GetBlockTable(*id, l);
        if (!table.ok()) {
          ADD_FAILURE() << table.status();
          return trace;
        }
        const std::vector<int64_t> held = ref[l].Held();
        if (Sorted(table->positions) != Sorted(held)) {
          ADD_FAILURE() << "layer " << l << " holds ["
                        << absl::StrJoin(Sorted(table->positions), ",")
                        << "] after the append, the reference ["
                        << absl::StrJoin(Sorted(held), ",") << "]";
          return trace;
        }
        absl::flat_hash_map<int64_t, size_t> index;
        for (size_t i = 0; i < held.size(); ++i) index[held[i]] = i;
        const std::vector<float> probs = StepProbs(s, l, ref[l], chunk, rows);
        const int64_t n = static_cast<int64_t>(held.size());
        // Into slot order (slot order is not position order after an
        // eviction), per head or summed over heads by the "worker".
        std::vector<float>& out = data[l];
        if (source == ScoreSource::kPerHead) {
          out.resize(int64_t{heads} * rows * n);
          for (int64_t hr = 0; hr < int64_t{heads} * rows; ++hr) {
            for (int64_t slot = 0; slot < n; ++slot) {
              out[hr * n + slot] =
                  probs[hr * n + index[table->positions[slot]]];
            }
          }
        } else {
          out.resize(int64_t{rows} * n);
          for (int32_t r = 0; r < rows; ++r) {
            for (int64_t slot = 0; slot < n; ++slot) {
              const size_t i = index[table->positions[slot]];
              float sum = probs[int64_t{r} * n + i];
              for (int32_t h = 1; h < heads; ++h) {
                sum += probs[(int64_t{h} * rows + r) * n + i];
              }
              out[int64_t{r} * n + slot] = sum;
            }
          }
        }
        scores.push_back(
            LayerScores{l, appended->layers[l].version, source, rows, out});
        ref[l].Observe(probs, heads, rows);
      }
      absl::StatusOr<StepResult> updated = store->UpdateScores(*id, scores);
      if (!updated.ok()) {
        ADD_FAILURE() << updated.status();
        return trace;
      }
      trace.results.push_back(Render(*updated));
    }

    std::vector<std::vector<int64_t>> kept;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      absl::StatusOr<BlockTable> table = store->GetBlockTable(*id, l);
      if (!table.ok()) {
        ADD_FAILURE() << table.status();
        return trace;
      }
      kept.push_back(Sorted(table->positions));
      const std::vector<int64_t> expected = ref[l].Kept();
      if (kept.back() != expected) {
        ADD_FAILURE() << "layer " << l << " kept ["
                      << absl::StrJoin(kept.back(), ",")
                      << "], the paper's rule keeps ["
                      << absl::StrJoin(expected, ",") << "]";
        return trace;
      }
    }
    trace.kept.push_back(std::move(kept));
  }
  for (const ReferenceLayer& r : ref) trace.ties_at_cut += r.ties_at_cut();
  return trace;
}

// How many times the usual number of streams and rounds to run.
int Scale() {
  const char* env = std::getenv("KVKEEP_CONFORMANCE_SCALE");
  const int scale = env != nullptr ? std::atoi(env) : 1;
  return std::max(scale, 1);
}

constexpr int kStreamsPerPolicy = 600;

class ConformanceTest : public ::testing::TestWithParam<std::string> {};

// Every stream runs three times, each checked against the paper's rule after
// every step: with per-head attention, again on a second store (which must
// answer with the same StepResults, byte for byte), and with attention the
// worker already summed over heads (which must keep the same sets).
TEST_P(ConformanceTest, KeepsThePaperSetDeterministicallyFromAnySource) {
  const std::string& policy = GetParam();
  const bool scored = policy != "streaming_llm";
  int64_t ties_at_cut = 0;
  for (int i = 0; i < kStreamsPerPolicy * Scale(); ++i) {
    const StreamSpec s =
        RandomStream(Hash({0xc0f0, static_cast<uint64_t>(i)}), policy);
    const RunTrace first = RunStream(s, ScoreSource::kPerHead);
    if (HasFailure()) return;
    ASSERT_EQ(first.kept.size(), s.chunks.size());
    ties_at_cut += first.ties_at_cut;
    const RunTrace second = RunStream(s, ScoreSource::kPerHead);
    if (HasFailure()) return;
    ASSERT_EQ(first.results, second.results) << s.Describe();
    if (!scored) continue;
    const RunTrace reduced = RunStream(s, ScoreSource::kReduced);
    if (HasFailure()) return;
    ASSERT_EQ(first.kept, reduced.kept) << s.Describe();
  }
  // The quantized streams make the tie rule decide evictions.
  RecordProperty("ties_at_cut", std::to_string(ties_at_cut));
  if (scored) {
    EXPECT_GT(ties_at_cut, 40);
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, ConformanceTest,
                         ::testing::Values("streaming_llm", "h2o", "tova"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The random streams must actually exercise what they claim to: evictions
// after prefill chunks, multi-row attention, and slot order that differs from
// position order.
TEST(ConformanceStreamsTest, CoverChunksEvictionsAndShuffledSlots) {
  int chunks_over_budget = 0, partial_rows = 0, shuffled = 0;
  for (int i = 0; i < kStreamsPerPolicy; ++i) {
    const StreamSpec s =
        RandomStream(Hash({0xc0f0, static_cast<uint64_t>(i)}), "h2o");
    int64_t total = 0;
    for (size_t c = 0; c < s.chunks.size(); ++c) {
      total += static_cast<int64_t>(s.chunks[c].size());
      if (s.chunks[c].size() > 1 && total > s.budgets[0]) ++chunks_over_budget;
      if (s.rows[c] < static_cast<int32_t>(s.chunks[c].size())) ++partial_rows;
    }
    if (i < 50) {  // slot order vs position order, on a few runs
      std::unique_ptr<CacheStore> store = MakeStore(s.layout, 1024);
      ASSERT_NE(store, nullptr);
      BudgetSpec budget;
      budget.per_layer = s.budgets;
      absl::StatusOr<SessionId> id = store->CreateSession(
          SessionSpec{s.layout.name,
                      PolicySpec{"streaming_llm", {{"sinks", "1"}}}, budget});
      ASSERT_TRUE(id.ok()) << id.status();
      for (const std::vector<int64_t>& chunk : s.chunks) {
        ASSERT_TRUE(
            store->Append(*id, AppendBuffers(s.layout, chunk).request()).ok());
      }
      absl::StatusOr<BlockTable> table = store->GetBlockTable(*id, 0);
      ASSERT_TRUE(table.ok());
      if (!std::is_sorted(table->positions.begin(), table->positions.end())) {
        ++shuffled;
      }
    }
  }
  EXPECT_GT(chunks_over_budget, 50);
  EXPECT_GT(partial_rows, 20);
  EXPECT_GT(shuffled, 5);
}

// ---------------------------------------------------------------------------
// Invariants of every evicting policy.

// A worker's copy of one layer's block table, kept only from StepResults.
struct WorkerLayer {
  std::vector<PageId> pages;
  std::vector<int64_t> positions;  // per slot
};

// Follows one call's change the way session_types.h (LayerChange) tells a
// worker to. `new_positions` are the call's appended positions (none for a
// score update). Returns false (with a failure) if the change cannot apply.
bool Follow(const LayerChange& c, const std::vector<int64_t>& new_positions,
            WorkerLayer& w) {
  const int64_t old_size = static_cast<int64_t>(w.positions.size());
  for (const SlotMove& m : c.moves) {
    if (m.from_slot < 0 || m.from_slot >= old_size || m.to_slot < 0 ||
        m.to_slot >= old_size) {
      ADD_FAILURE() << "move " << m.from_slot << "->" << m.to_slot
                    << " outside the " << old_size << " slots";
      return false;
    }
    w.positions[m.to_slot] = w.positions[m.from_slot];
  }
  std::vector<int64_t> kept_new;
  for (int64_t p : new_positions) {
    if (!std::binary_search(c.evicted_positions.begin(),
                            c.evicted_positions.end(), p)) {
      kept_new.push_back(p);
    }
  }
  const int64_t keep = c.resident - static_cast<int64_t>(kept_new.size());
  if (keep < 0 || keep > old_size) {
    ADD_FAILURE() << "resident " << c.resident << " with " << kept_new.size()
                  << " new tokens kept, from " << old_size << " slots";
    return false;
  }
  w.positions.resize(keep);
  if (c.pages_freed.size() > w.pages.size() ||
      !std::equal(c.pages_freed.begin(), c.pages_freed.end(),
                  w.pages.end() - c.pages_freed.size())) {
    ADD_FAILURE() << "pages_freed [" << absl::StrJoin(c.pages_freed, ",")
                  << "] are not the end of the worker's pages ["
                  << absl::StrJoin(w.pages, ",") << "]";
    return false;
  }
  w.pages.resize(w.pages.size() - c.pages_freed.size());
  w.pages.insert(w.pages.end(), c.pages_added.begin(), c.pages_added.end());
  w.positions.insert(w.positions.end(), kept_new.begin(), kept_new.end());
  return true;
}

// Random parameters for a policy; the caller learns of a policy this test
// does not know through a test failure (its invariants must be covered).
bool RandomPolicy(absl::string_view name, Rng& rng, PolicySpec& spec) {
  spec.name = std::string(name);
  spec.params.clear();
  const int64_t slack = rng.Chance(0.6) ? 0 : rng.Int(1, 6);
  spec.params["slack"] = absl::StrCat(slack);
  if (name == "window") return true;
  if (name == "streaming_llm" || name == "h2o" || name == "tova" ||
      name == "scissorhands" || name == "h2o_page") {
    spec.params["sinks"] = absl::StrCat(rng.Chance(0.3) ? 0 : rng.Int(1, 4));
    spec.params["recent"] = absl::StrCat(rng.Chance(0.3) ? 0 : rng.Int(1, 8));
    if (name == "scissorhands") {
      spec.params["history"] = absl::StrCat(rng.Int(1, 64));
      spec.params["threshold"] = rng.Pick<const char*>({"0.5", "1", "2"});
    }
    return true;
  }
  ADD_FAILURE() << "policy '" << name
                << "' is new: give it parameters in RandomPolicy";
  return false;
}

// One session under test and the test's own view of it.
struct Tracked {
  SessionId id = 0;
  PolicySpec spec;
  PolicyPtr policy;  // for its trigger and protected counts
  std::vector<int64_t> budgets;
  std::vector<int64_t> appended;  // every position appended, in order
  std::vector<WorkerLayer> worker;
  int64_t next_position = 0;
};

int64_t ArrivalOf(const Tracked& t, int64_t position) {
  auto it = std::lower_bound(t.appended.begin(), t.appended.end(), position);
  return it != t.appended.end() && *it == position ? it - t.appended.begin()
                                                   : -1;
}

// Checks one layer change against the session's protection rules:
// `appended_view` is the arrival count the eviction was judged at.
void CheckEvictions(const Tracked& t, const LayerChange& c,
                    const std::vector<int64_t>& held_before,
                    const std::vector<int64_t>& new_positions,
                    int64_t appended_view) {
  EXPECT_TRUE(
      std::is_sorted(c.evicted_positions.begin(), c.evicted_positions.end()) &&
      std::adjacent_find(c.evicted_positions.begin(),
                         c.evicted_positions.end()) ==
          c.evicted_positions.end())
      << "evicted_positions not strictly ascending: ["
      << absl::StrJoin(c.evicted_positions, ",") << "]";
  const CommonParams& common = t.policy->common();
  for (int64_t p : c.evicted_positions) {
    const bool was_held = std::find(held_before.begin(), held_before.end(),
                                    p) != held_before.end() ||
                          std::find(new_positions.begin(), new_positions.end(),
                                    p) != new_positions.end();
    EXPECT_TRUE(was_held) << "evicted position " << p << " was not held";
    const int64_t arrival = ArrivalOf(t, p);
    EXPECT_GE(arrival, common.sinks) << "evicted sink " << p;
    EXPECT_LT(arrival, appended_view - common.recent)
        << "evicted position " << p << " of the recent window";
  }
}

// Everything the test can compare after a call on `t`: the worker's table
// against the store's, the bytes, budgets and protected tokens. `over_budget`
// is how far a layer may be over budget at this point (the tokens appended
// since the last scores of an attention-driven policy).
void CheckSession(CacheStore& store, const Tracked& t,
                  const ModelLayout& layout, int64_t over_budget) {
  absl::StatusOr<SessionStats> stats = store.GetStats(t.id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->layer_budget, t.budgets);
  int64_t pages = 0;
  const int64_t total = static_cast<int64_t>(t.appended.size());
  const CommonParams& common = t.policy->common();
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    absl::StatusOr<BlockTable> table = store.GetBlockTable(t.id, l);
    ASSERT_TRUE(table.ok()) << table.status();
    const int64_t resident = static_cast<int64_t>(table->positions.size());
    ASSERT_EQ(table->pages, t.worker[l].pages);
    ASSERT_EQ(table->positions, t.worker[l].positions);
    EXPECT_EQ(static_cast<int64_t>(table->pages.size()),
              (resident + layout.page_tokens - 1) / layout.page_tokens);
    EXPECT_EQ(stats->layer_resident[l], resident);
    EXPECT_LE(resident, t.budgets[l] + over_budget);
    pages += static_cast<int64_t>(table->pages.size());

    // The protected tokens are all held.
    const std::vector<int64_t> held = Sorted(table->positions);
    for (int64_t a = 0; a < total; ++a) {
      if (a < common.sinks || a >= total - common.recent) {
        EXPECT_TRUE(std::binary_search(held.begin(), held.end(), t.appended[a]))
            << "protected position " << t.appended[a] << " (arrival " << a
            << ") is gone";
      }
    }

    absl::StatusOr<LayerKvCopy> copy = store.ReadLayer(t.id, l);
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->version, table->version);
    ASSERT_EQ(copy->positions, table->positions);
    const int64_t token_bytes = layout.page_layout().token_bytes();
    ASSERT_EQ(static_cast<int64_t>(copy->keys.size()), resident * token_bytes);
    ASSERT_EQ(static_cast<int64_t>(copy->values.size()),
              resident * token_bytes);
    for (int64_t s = 0; s < resident; ++s) {
      const std::vector<std::byte> k =
          StoredTokenBytes(layout, l, table->positions[s], true);
      const std::vector<std::byte> v =
          StoredTokenBytes(layout, l, table->positions[s], false);
      ASSERT_EQ(0, std::memcmp(copy->keys.data() + s * token_bytes, k.data(),
                               token_bytes))
          << "keys of slot " << s << " (position " << table->positions[s]
          << ")";
      ASSERT_EQ(0, std::memcmp(copy->values.data() + s * token_bytes, v.data(),
                               token_bytes))
          << "values of slot " << s << " (position " << table->positions[s]
          << ")";
    }
  }
  EXPECT_EQ(stats->pages, pages);
}

// A call that evicted cut the layer to budget - slack, no further: token
// policies evict exactly the excess, h2o_page rounds up to whole pages.
void CheckNotOverEvicted(const Tracked& t, const ModelLayout& layout,
                         int32_t layer, const LayerChange& c) {
  if (c.evicted_positions.empty()) return;
  const int64_t rounding =
      t.spec.name == "h2o_page" ? layout.page_tokens - 1 : 0;
  EXPECT_GE(c.resident, t.budgets[layer] - t.policy->common().slack - rounding)
      << "layer " << layer << " evicted too much: ["
      << absl::StrJoin(c.evicted_positions, ",") << "]";
}

void CheckPool(CacheStore& store, const std::vector<Tracked>& sessions) {
  int64_t pages = 0;
  for (const Tracked& t : sessions) {
    absl::StatusOr<SessionStats> stats = store.GetStats(t.id);
    ASSERT_TRUE(stats.ok()) << stats.status();
    pages += stats->pages;
  }
  const std::vector<LayoutStats> layouts = store.Layouts();
  ASSERT_EQ(layouts.size(), 1u);
  EXPECT_EQ(layouts[0].pool.used_pages, pages);
}

// Attention for `rows` query rows over the layer's slots, in the given form:
// random positive weights over the causally visible slots, normalised per
// head (per-head and reduced), or random query vectors.
std::vector<float> RandomScores(Rng& rng, const ModelLayout& layout,
                                const Tracked& t, int32_t layer, int32_t rows,
                                ScoreSource source) {
  const std::vector<int64_t>& slots = t.worker[layer].positions;
  const int64_t n = static_cast<int64_t>(slots.size());
  const int32_t heads = layout.query_heads;
  if (source == ScoreSource::kQueries) {
    std::vector<float> q(int64_t{rows} * heads * layout.head_dim);
    for (float& x : q) x = static_cast<float>(rng.Real(-2.0, 2.0));
    return q;
  }
  std::vector<float> per_head(int64_t{heads} * rows * n, 0.0f);
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t r = 0; r < rows; ++r) {
      const int64_t query = t.appended[t.appended.size() - rows + r];
      std::vector<double> w(n, 0.0);
      double sum = 0;
      for (int64_t s = 0; s < n; ++s) {
        if (slots[s] <= query) w[s] = std::exp(rng.Real(-3.0, 3.0));
        sum += w[s];
      }
      for (int64_t s = 0; s < n; ++s) {
        per_head[(int64_t{h} * rows + r) * n + s] =
            static_cast<float>(w[s] / sum);
      }
    }
  }
  if (source == ScoreSource::kPerHead) return per_head;
  std::vector<float> reduced(int64_t{rows} * n, 0.0f);
  for (int32_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < int64_t{rows} * n; ++i) {
      reduced[i] += per_head[int64_t{h} * rows * n + i];
    }
  }
  return reduced;
}

// One round: a random layout, one session per evicting policy, steps
// interleaved at random across the sessions (appends of one or several
// tokens, attention in every form or none at all), checks after every call,
// then every session closed.
void RunInvariantRound(uint64_t seed) {
  Rng rng(Hash({seed, 0x1a7a}));
  const ModelLayout layout = RandomLayout(rng, {1, 3, 4, 8});
  SCOPED_TRACE(absl::StrCat("round seed ", seed, " layers ", layout.num_layers,
                            " heads ", layout.query_heads, "/", layout.kv_heads,
                            " dim ", layout.head_dim, " ",
                            std::string(DTypeName(layout.dtype)), " group ",
                            layout.group_size, " page ", layout.page_tokens));
  std::unique_ptr<CacheStore> store = MakeStore(layout, 4096);
  ASSERT_NE(store, nullptr);

  std::vector<Tracked> sessions;
  for (absl::string_view name : PolicyNames()) {
    if (name == "full" || name == "snapkv") continue;
    Tracked t;
    ASSERT_TRUE(RandomPolicy(name, rng, t.spec));
    absl::StatusOr<PolicyPtr> policy = NewPolicy(t.spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    t.policy = *policy;
    // The least budget the policy accepts: budget - slack keeps a token
    // and the protected ones.
    const int64_t floor = std::max<int64_t>(1, t.policy->protected_tokens()) +
                          t.policy->common().slack;
    BudgetSpec budget;
    switch (rng.Int(0, 2)) {
      case 0:
        budget.tokens = floor + rng.Int(0, 24);
        break;
      case 1:
        for (int32_t l = 0; l < layout.num_layers; ++l) {
          budget.per_layer.push_back(floor + rng.Int(0, 24));
        }
        break;
      default:
        // Pyramid with beta 2: the top layer keeps protected + free / 2,
        // which covers the slack.
        budget.schedule = "pyramid";
        budget.pyramid_beta = 2.0;
        budget.tokens = floor + t.policy->common().slack + 20 + rng.Int(0, 24);
        break;
    }
    absl::StatusOr<SessionId> id =
        store->CreateSession(SessionSpec{layout.name, t.spec, budget});
    ASSERT_TRUE(id.ok()) << id.status() << " for " << name;
    t.id = *id;
    absl::StatusOr<SessionStats> stats = store->GetStats(t.id);
    ASSERT_TRUE(stats.ok());
    t.budgets = stats->layer_budget;
    if (!budget.per_layer.empty()) {
      ASSERT_EQ(t.budgets, budget.per_layer);
    }
    t.worker.resize(layout.num_layers);
    t.next_position = rng.Int(0, 3);
    sessions.push_back(std::move(t));
  }

  const int steps =
      static_cast<int>(rng.Int(40, 70)) * static_cast<int>(sessions.size());
  std::vector<int64_t> pending(sessions.size(), 0);  // tokens awaiting scores
  for (int step = 0; step < steps; ++step) {
    const size_t which = static_cast<size_t>(
        rng.Int(0, static_cast<int64_t>(sessions.size()) - 1));
    Tracked& t = sessions[which];
    SCOPED_TRACE(absl::StrCat("step ", step, " policy ", t.spec.name));
    const bool on_attention =
        t.policy->trigger() == EvictionTrigger::kOnAttention;

    // Append one token, or a chunk.
    const int64_t n = rng.Chance(0.8) ? 1 : rng.Int(2, 20);
    std::vector<int64_t> chunk;
    for (int64_t i = 0; i < n; ++i) {
      chunk.push_back(t.next_position);
      t.next_position += rng.Int(1, 2);
    }
    std::vector<std::vector<int64_t>> held_before(layout.num_layers);
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      held_before[l] = t.worker[l].positions;
    }
    const int64_t appended_before = static_cast<int64_t>(t.appended.size());
    absl::StatusOr<StepResult> appended =
        store->Append(t.id, AppendBuffers(layout, chunk).request());
    ASSERT_TRUE(appended.ok()) << appended.status();
    t.appended.insert(t.appended.end(), chunk.begin(), chunk.end());
    ASSERT_EQ(appended->layers.size(), static_cast<size_t>(layout.num_layers));
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const LayerChange& c = appended->layers[l];
      EXPECT_EQ(c.layer, l);
      // An attention-driven policy settles an earlier append before placing
      // the new tokens; a content-blind one judges as if they had arrived.
      CheckEvictions(t, c, held_before[l], chunk,
                     on_attention ? appended_before
                                  : static_cast<int64_t>(t.appended.size()));
      ASSERT_TRUE(Follow(c, chunk, t.worker[l])) << Render(*appended);
      EXPECT_EQ(c.resident, static_cast<int64_t>(t.worker[l].positions.size()));
      CheckNotOverEvicted(t, layout, l, c);
    }
    pending[which] = on_attention ? n : 0;
    CheckSession(*store, t, layout, pending[which]);
    if (::testing::Test::HasFailure()) return;

    // This step's attention, usually.
    if (on_attention && rng.Chance(0.85)) {
      const ScoreSource source =
          rng.Pick<ScoreSource>({ScoreSource::kPerHead, ScoreSource::kReduced,
                                 ScoreSource::kQueries});
      const int32_t rows = static_cast<int32_t>(rng.Int(1, n));
      std::vector<std::vector<float>> data(layout.num_layers);
      std::vector<LayerScores> scores;
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        held_before[l] = t.worker[l].positions;
        data[l] = RandomScores(rng, layout, t, l, rows, source);
        scores.push_back(
            LayerScores{l, appended->layers[l].version, source, rows, data[l]});
      }
      absl::StatusOr<StepResult> updated = store->UpdateScores(t.id, scores);
      ASSERT_TRUE(updated.ok()) << updated.status();
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        const LayerChange& c = updated->layers[l];
        CheckEvictions(t, c, held_before[l], {},
                       static_cast<int64_t>(t.appended.size()));
        ASSERT_TRUE(Follow(c, {}, t.worker[l])) << Render(*updated);
        CheckNotOverEvicted(t, layout, l, c);
      }
      pending[which] = 0;
      CheckSession(*store, t, layout, 0);
      if (::testing::Test::HasFailure()) return;
    }
    CheckPool(*store, sessions);
    if (::testing::Test::HasFailure()) return;
  }

  // Close them one by one; the pool gets every page back.
  while (!sessions.empty()) {
    ASSERT_TRUE(store->CloseSession(sessions.back().id).ok());
    sessions.pop_back();
    CheckPool(*store, sessions);
  }
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
}

TEST(PolicyInvariantsTest, HoldOverRandomInterleavedSessions) {
  for (uint64_t round = 0; round < 80u * Scale(); ++round) {
    RunInvariantRound(round);
    if (HasFailure()) return;
  }
}

// A session at its budget holds its pages and needs no more: a content-blind
// policy makes room before placing new tokens (docs/policies.md), so it keeps
// appending in a pool sized exactly for its budget; an attention-driven one
// holds at most budget + one append between an append and its scores, so
// that much pool suffices for it.
void AppendAtBudgetInASizedPool(absl::string_view name, EvictionTrigger trigger,
                                int32_t page_tokens) {
  SCOPED_TRACE(absl::StrCat(name, " page_tokens ", page_tokens));
  constexpr int64_t kBudget = 8;
  constexpr int32_t kLayers = 2;
  const ModelLayout layout =
      MakeLayout(kLayers, 1, 1, 2, DType::kF32, page_tokens);
  const int64_t held = trigger == EvictionTrigger::kOnAppend
                           ? kBudget
                           : kBudget + 1;  // one decode append over
  const int64_t capacity = kLayers * ((held + page_tokens - 1) / page_tokens);
  std::unique_ptr<CacheStore> store = MakeStore(layout, capacity);
  ASSERT_NE(store, nullptr);
  BudgetSpec budget;
  budget.tokens = kBudget;
  absl::StatusOr<SessionId> id = store->CreateSession(
      SessionSpec{layout.name, PolicySpec{std::string(name), {}}, budget});
  ASSERT_TRUE(id.ok()) << id.status();
  for (int64_t position = 0; position < 4 * kBudget; ++position) {
    absl::StatusOr<StepResult> appended =
        store->Append(*id, AppendBuffers(layout, {position}).request());
    ASSERT_TRUE(appended.ok())
        << "position " << position << ": " << appended.status();
    if (trigger != EvictionTrigger::kOnAttention) continue;
    std::vector<std::vector<float>> rows(kLayers);
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < kLayers; ++l) {
      const int64_t n = appended->layers[l].resident;
      rows[l].assign(n, 1.0f / static_cast<float>(n));
      scores.push_back(LayerScores{l, appended->layers[l].version,
                                   ScoreSource::kPerHead, 1, rows[l]});
    }
    ASSERT_TRUE(store->UpdateScores(*id, scores).ok());
  }
  absl::StatusOr<SessionStats> stats = store->GetStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_THAT(stats->layer_resident, ::testing::Each(kBudget));
}

TEST(PolicyInvariantsTest, SessionAtBudgetAppendsIntoAPoolSizedForIt) {
  for (absl::string_view name : PolicyNames()) {
    absl::StatusOr<PolicyPtr> policy =
        NewPolicy(PolicySpec{std::string(name), {}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    const EvictionTrigger trigger = (*policy)->trigger();
    if (trigger != EvictionTrigger::kOnAppend &&
        trigger != EvictionTrigger::kOnAttention) {
      continue;  // full and snapkv grow without bound during decode
    }
    for (int32_t page_tokens : {1, 3, 4}) {
      AppendAtBudgetInASizedPool(name, trigger, page_tokens);
    }
  }
}

// evicted_positions is documented as ascending; a policy that picks victims
// by score must still report them in position order.
TEST(PolicyInvariantsTest, EvictedPositionsAreAscending) {
  const ModelLayout layout = MakeLayout(1, 1, 1, 2, DType::kF32, 4);
  for (absl::string_view name : {"h2o", "tova", "h2o_page", "scissorhands"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<CacheStore> store = MakeStore(layout, 64);
    ASSERT_NE(store, nullptr);
    BudgetSpec budget;
    budget.tokens = 8;
    absl::StatusOr<SessionId> id = store->CreateSession(
        SessionSpec{layout.name, PolicySpec{std::string(name), {}}, budget});
    ASSERT_TRUE(id.ok()) << id.status();
    std::vector<int64_t> positions(20);
    for (int64_t i = 0; i < 20; ++i) positions[i] = i;
    absl::StatusOr<StepResult> appended =
        store->Append(*id, AppendBuffers(layout, positions).request());
    ASSERT_TRUE(appended.ok());
    // Attention falling with position: the newest tokens score least, so a
    // score-ordered victim list would be descending.
    std::vector<float> row(20);
    double sum = 0;
    for (int i = 0; i < 20; ++i) sum += 20 - i;
    for (int i = 0; i < 20; ++i) row[i] = static_cast<float>((20 - i) / sum);
    const LayerScores scores{0, appended->layers[0].version,
                             ScoreSource::kPerHead, 1, row};
    absl::StatusOr<StepResult> updated =
        store->UpdateScores(*id, std::span<const LayerScores>(&scores, 1));
    ASSERT_TRUE(updated.ok()) << updated.status();
    const std::vector<int64_t>& evicted = updated->layers[0].evicted_positions;
    EXPECT_GE(evicted.size(), 12u);
    EXPECT_TRUE(std::is_sorted(evicted.begin(), evicted.end()))
        << absl::StrJoin(evicted, ",");
  }
}

// snapkv: after compression every layer holds exactly its budget, the window
// included; decode afterwards never evicts; score updates and a second
// compression are refused.
TEST(PolicyInvariantsTest, SnapKvKeepsTheBudgetThenNeverEvicts) {
  for (uint64_t round = 0; round < 120u * Scale(); ++round) {
    Rng rng(Hash({round, 0x5a9}));
    const ModelLayout layout = RandomLayout(rng, {2, 4, 8});
    const int64_t window = rng.Int(1, 12);
    const int64_t kernel = rng.Pick<int64_t>({1, 3, 5, 7});
    Tracked t;
    t.spec = PolicySpec{
        "snapkv",
        {{"window", absl::StrCat(window)},
         {"kernel", absl::StrCat(kernel)},
         {"pooling", rng.Pick<const char*>({"avgpool", "maxpool"})}}};
    SCOPED_TRACE(absl::StrCat("round ", round, " window ", window, " kernel ",
                              kernel, " layers ", layout.num_layers));
    absl::StatusOr<PolicyPtr> policy = NewPolicy(t.spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    t.policy = *policy;
    BudgetSpec budget;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      budget.per_layer.push_back(window + rng.Int(0, 30));
    }
    std::unique_ptr<CacheStore> store = MakeStore(layout, 4096);
    ASSERT_NE(store, nullptr);
    absl::StatusOr<SessionId> id =
        store->CreateSession(SessionSpec{layout.name, t.spec, budget});
    ASSERT_TRUE(id.ok()) << id.status();
    t.id = *id;
    t.budgets = budget.per_layer;
    t.worker.resize(layout.num_layers);

    // The prompt, in one or a few chunks, longer than every budget.
    const int64_t prompt =
        *std::max_element(t.budgets.begin(), t.budgets.end()) + rng.Int(1, 40);
    StepResult last;
    int64_t position = 0;
    while (static_cast<int64_t>(t.appended.size()) < prompt) {
      const int64_t n = std::min<int64_t>(
          prompt - static_cast<int64_t>(t.appended.size()), rng.Int(1, prompt));
      std::vector<int64_t> chunk;
      for (int64_t i = 0; i < n; ++i) chunk.push_back(position++);
      absl::StatusOr<StepResult> appended =
          store->Append(t.id, AppendBuffers(layout, chunk).request());
      ASSERT_TRUE(appended.ok()) << appended.status();
      t.appended.insert(t.appended.end(), chunk.begin(), chunk.end());
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        EXPECT_TRUE(appended->layers[l].evicted_positions.empty());
        ASSERT_TRUE(Follow(appended->layers[l], chunk, t.worker[l]));
      }
      last = *std::move(appended);
    }
    const ScoreSource source = rng.Pick<ScoreSource>(
        {ScoreSource::kPerHead, ScoreSource::kReduced, ScoreSource::kQueries});
    std::vector<std::vector<float>> data(layout.num_layers);
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      data[l] =
          RandomScores(rng, layout, t, l, static_cast<int32_t>(window), source);
      scores.push_back(LayerScores{l, last.layers[l].version, source,
                                   static_cast<int32_t>(window), data[l]});
    }
    absl::StatusOr<StepResult> compressed = store->CompressPrompt(t.id, scores);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const LayerChange& c = compressed->layers[l];
      EXPECT_EQ(c.resident, t.budgets[l]);
      EXPECT_EQ(static_cast<int64_t>(c.evicted_positions.size()),
                prompt - t.budgets[l]);
      CheckEvictions(t, c, t.worker[l].positions, {},
                     static_cast<int64_t>(t.appended.size()));
      ASSERT_TRUE(Follow(c, {}, t.worker[l]));
    }
    CheckSession(*store, t, layout, 0);  // the window (recent) is held
    if (::testing::Test::HasFatalFailure()) return;

    // Decode: the cache grows, nothing is evicted.
    for (int64_t step = 0; step < 20; ++step) {
      const std::vector<int64_t> chunk = {position++};
      absl::StatusOr<StepResult> appended =
          store->Append(t.id, AppendBuffers(layout, chunk).request());
      ASSERT_TRUE(appended.ok()) << appended.status();
      t.appended.push_back(chunk[0]);
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        const LayerChange& c = appended->layers[l];
        EXPECT_TRUE(c.evicted_positions.empty());
        EXPECT_TRUE(c.moves.empty());
        EXPECT_TRUE(c.pages_freed.empty());
        EXPECT_EQ(c.resident, t.budgets[l] + step + 1);
        ASSERT_TRUE(Follow(c, chunk, t.worker[l]));
      }
      CheckSession(*store, t, layout, step + 1);
      if (::testing::Test::HasFatalFailure()) return;
      std::vector<float> one(layout.query_heads * t.worker[0].positions.size(),
                             0.0f);
      const LayerScores update{0, appended->layers[0].version,
                               ScoreSource::kPerHead, 1, one};
      EXPECT_EQ(
          store->UpdateScores(t.id, std::span<const LayerScores>(&update, 1))
              .status()
              .code(),
          absl::StatusCode::kFailedPrecondition);
    }
    EXPECT_EQ(store->CompressPrompt(t.id, scores).status().code(),
              absl::StatusCode::kFailedPrecondition);
    CheckPool(*store, {t});
    ASSERT_TRUE(store->CloseSession(t.id).ok());
    EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  }
}

}  // namespace
}  // namespace kvkeep
