// The forward pass (services/lm/model.h) and its building blocks
// (model_ops.h). Three kinds of test:
//  - each building block against a naive twin in double precision, over
//    awkward sizes;
//  - a tiny random model (LlamaModel::FromTensors, no file) against a naive
//    forward pass, and against itself: one prefill chunk vs single steps,
//    a paged view vs a contiguous one (bit-identical), the two position
//    modes, a batch vs its sequences one by one, the attention outputs and
//    the input checks;
//  - the real SmolLM2-135M-Instruct (skipped, saying so, when $KVKEEP_MODEL
//    is absent) against its metadata and Hugging Face's logits.
#include "services/lm/model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "nlohmann/json.hpp"
#include "services/lm/contiguous_kv.h"
#include "services/lm/gguf.h"
#include "services/lm/model_ops.h"

namespace kvkeep::lm {
namespace {

using internal::GroupAttentionArgs;

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

// ---- Building blocks ----

TEST(ModelOpsTest, ExpIsWithinTwoUlpOfLibm) {
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double want = std::exp(static_cast<double>(x));
    ASSERT_NEAR(internal::Exp(x), want, want * 2.5e-7) << "x = " << x;
  }
  EXPECT_EQ(internal::Exp(0.0f), 1.0f);
  EXPECT_LT(internal::Exp(-1000.0f), 1e-37f);
  EXPECT_TRUE(std::isfinite(internal::Exp(1000.0f)));
}

TEST(ModelOpsTest, HalfToFloatMatchesTheExactConversionForEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = internal::HalfToFloat(static_cast<uint16_t>(h));
    const float want = F16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
        << "h = " << h;
  }
}

TEST(ModelOpsTest, ToFloatReadsEveryDTypeExactly) {
  std::mt19937 rng(1);
  const std::vector<float> v = RandomVector(77, 3.0f, rng);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<std::byte> bytes(v.size() * DTypeBytes(t));
    for (size_t i = 0; i < v.size(); ++i)
      StoreFromFloat(t, bytes.data(), i, v[i]);
    std::vector<float> out(v.size());
    internal::ToFloat(t, bytes.data(), static_cast<int64_t>(v.size()),
                      out.data());
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(out[i], LoadAsFloat(t, bytes.data(), i)) << DTypeName(t);
    }
  }
}

TEST(ModelOpsTest, RmsNormAndSwiGluMatchNaive) {
  std::mt19937 rng(2);
  for (int32_t dim : {1, 7, 64, 576}) {
    const int64_t rows = 3;
    const std::vector<float> x = RandomVector(rows * dim, 2.0f, rng);
    const std::vector<float> w = RandomVector(dim, 1.0f, rng);
    std::vector<float> out(x.size());
    internal::RmsNorm(x.data(), w.data(), rows, dim, 1e-5f, out.data());
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int32_t d = 0; d < dim; ++d)
        ss += double{x[r * dim + d]} * x[r * dim + d];
      const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
      for (int32_t d = 0; d < dim; ++d) {
        const double want = x[r * dim + d] * inv * w[d];
        ASSERT_NEAR(out[r * dim + d], want, 1e-5 * (1 + std::abs(want)));
      }
    }
    const std::vector<float> up = RandomVector(dim, 1.0f, rng);
    std::vector<float> act(dim);
    internal::SwiGlu(x.data(), up.data(), dim, act.data());
    for (int32_t d = 0; d < dim; ++d) {
      const double g = x[d];
      const double want = g / (1 + std::exp(-g)) * up[d];
      ASSERT_NEAR(act[d], want, 1e-6 * (1 + std::abs(want)));
    }
  }
}

TEST(ModelOpsTest, RopeRotatesAdjacentPairsAndTheTableChangesNothing) {
  std::mt19937 rng(3);
  for (int32_t hd : {2, 8, 64, 80, 128}) {
    const internal::RopeTable tabulated(hd, 100000.0f, 64);
    const internal::RopeTable computed(hd, 100000.0f, 0);
    for (int64_t pos : {0, 1, 5, 63, 64, 1000, 8191}) {
      const std::vector<float> x = RandomVector(2 * hd, 1.0f, rng);
      std::vector<float> a = x, b = x;
      tabulated.Rotate(pos, 2, a.data());
      computed.Rotate(pos, 2, b.data());
      ASSERT_EQ(a, b) << "hd " << hd << " pos " << pos;
      for (int32_t h = 0; h < 2; ++h) {
        for (int32_t i = 0; i < hd / 2; ++i) {
          const double angle = pos * std::pow(100000.0, -2.0 * i / hd);
          const double x0 = x[h * hd + 2 * i], x1 = x[h * hd + 2 * i + 1];
          // float32 angles, as Hugging Face forms them: ~pos * 6e-8 rad off.
          const double tol = 1e-6 + 4e-7 * pos;
          ASSERT_NEAR(a[h * hd + 2 * i],
                      x0 * std::cos(angle) - x1 * std::sin(angle), tol);
          ASSERT_NEAR(a[h * hd + 2 * i + 1],
                      x0 * std::sin(angle) + x1 * std::cos(angle), tol);
        }
      }
    }
  }
}

// Naive causal attention of one query head: probabilities and output.
void NaiveHead(const float* q, const std::vector<float>& keys,
               const std::vector<float>& values, int32_t hd, int64_t visible,
               std::vector<double>* probs, std::vector<double>* out) {
  probs->assign(visible, 0);
  double max = -1e300;
  for (int64_t s = 0; s < visible; ++s) {
    double dot = 0;
    for (int32_t d = 0; d < hd; ++d) dot += double{q[d]} * keys[s * hd + d];
    (*probs)[s] = dot / std::sqrt(double{1.0 * hd});
    max = std::max(max, (*probs)[s]);
  }
  double sum = 0;
  for (double& p : *probs) sum += (p = std::exp(p - max));
  out->assign(hd, 0);
  for (int64_t s = 0; s < visible; ++s) {
    (*probs)[s] /= sum;
    for (int32_t d = 0; d < hd; ++d)
      (*out)[d] += (*probs)[s] * values[s * hd + d];
  }
}

// Both forms of the attention against NaiveHead: head dims 8, 64, 80;
// groups 1, 3, 5, 16 (blocks of 12 vectors split a token's heads); caches
// of 0 to 1100 resident slots (three streaming chunks) in pages of 3 (and
// float16); steps of 1 to 17 tokens, run as two calls over [0, n/2) and
// [n/2, n) as tasks split them. The streaming form only where its vectors
// fit one block, as the model uses it.
TEST(ModelOpsTest, AttentionMatchesNaiveOverAwkwardSizes) {
  std::mt19937 rng(4);
  for (int32_t hd : {8, 64, 80}) {
    for (int32_t group : {1, 3, 5, 16}) {
      for (int64_t resident : {0, 1, 7, 33, 1100}) {
        for (int64_t n : {1, 5, 17}) {
          for (DType dtype : {DType::kF32, DType::kF16}) {
            if (resident > 100 && (hd != 64 || n > 5)) continue;  // time
            const int64_t total = resident + n;
            const int32_t page_tokens = 3;
            const int64_t pages = (resident + page_tokens - 1) / page_tokens;
            const int64_t head_bytes = hd * DTypeBytes(dtype);
            // One kv head of two (the second one's bytes sit between).
            const int64_t token_bytes = 2 * head_bytes;
            std::vector<float> keys = RandomVector(total * hd, 1.0f, rng);
            std::vector<float> values = RandomVector(total * hd, 1.0f, rng);
            std::vector<std::byte> arena((pages + 1) * 2 * page_tokens *
                                         token_bytes);
            std::vector<std::byte> new_keys(n * token_bytes),
                new_values(n * token_bytes);
            std::vector<int32_t> page_ids(pages);
            for (int64_t p = 0; p < pages; ++p)
              page_ids[p] = static_cast<int32_t>(pages - p);
            internal::SlotSource slots;
            slots.dtype = dtype;
            slots.head_dim = hd;
            slots.arena = arena.data();
            slots.pages = page_ids.data();
            slots.page_tokens = page_tokens;
            slots.page_bytes = 2 * page_tokens * token_bytes;
            slots.token_bytes = token_bytes;
            slots.head_offset = head_bytes;
            slots.resident = resident;
            slots.new_keys = new_keys.data();
            slots.new_values = new_values.data();
            for (int64_t s = 0; s < total; ++s) {
              auto* k = const_cast<std::byte*>(slots.KeyBytes(s));
              auto* v = const_cast<std::byte*>(slots.ValueBytes(s));
              for (int32_t d = 0; d < hd; ++d) {
                StoreFromFloat(dtype, k, d, keys[s * hd + d]);
                keys[s * hd + d] = LoadAsFloat(dtype, k, d);
                StoreFromFloat(dtype, v, d, values[s * hd + d]);
                values[s * hd + d] = LoadAsFloat(dtype, v, d);
              }
            }
            std::vector<float> tiled_keys(internal::KeyFloats(total, hd), NAN);
            std::vector<float> padded_values(total * internal::ValueStride(hd),
                                             NAN);
            internal::GatherSlots(slots, total, tiled_keys.data(),
                                  padded_values.data());
            const std::vector<float> q =
                RandomVector(n * group * hd, 1.0f, rng);
            for (bool tiled : {false, true}) {
              if (!tiled && (n - n / 2) * group > internal::kMaxVecs) continue;
              std::vector<float> out(n * group * hd, -1.0f);
              std::vector<float> probs(group * n * total, -1.0f);
              for (auto [first, last] :
                   {std::pair{int64_t{0}, n / 2}, std::pair{n / 2, n}}) {
                GroupAttentionArgs a;
                a.head_dim = hd;
                a.group = group;
                a.resident = resident;
                a.n = n;
                a.first = first;
                a.last = last;
                a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
                a.q = q.data();
                a.q_stride = group * hd;
                a.out = out.data();
                a.out_stride = group * hd;
                a.probs = probs.data();
                a.probs_head_stride = n * total;
                if (tiled) {
                  internal::TiledAttention(a, tiled_keys.data(),
                                           padded_values.data());
                } else {
                  internal::StreamingAttention(a, slots);
                }
              }
              std::vector<double> p, o;
              for (int64_t i = 0; i < n; ++i) {
                for (int32_t j = 0; j < group; ++j) {
                  NaiveHead(&q[(i * group + j) * hd], keys, values, hd,
                            resident + i + 1, &p, &o);
                  for (int64_t s = 0; s < total; ++s) {
                    const double want = s < resident + i + 1 ? p[s] : 0.0;
                    ASSERT_NEAR(probs[(j * n + i) * total + s], want, 2e-6);
                  }
                  for (int32_t d = 0; d < hd; ++d) {
                    ASSERT_NEAR(out[(i * group + j) * hd + d], o[d], 2e-5)
                        << "tiled " << tiled << " hd " << hd << " group "
                        << group << " resident " << resident << " n " << n
                        << " " << DTypeName(dtype);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(TaskPoolTest, RunsEveryItemOnceAlsoWithConcurrentCallers) {
  internal::TaskPool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  pool.ParallelFor(0, [](int64_t) { FAIL() << "no items"; });
  auto check = [&pool](int64_t count) {
    std::vector<std::atomic<int>> hits(count);
    for (int round = 0; round < 50; ++round) {
      pool.ParallelFor(count, [&](int64_t i) { hits[i].fetch_add(1); });
    }
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(hits[i].load(), 50);
  };
  std::thread other(check, 37);
  check(101);
  other.join();
}

// ---- A tiny random model ----

ModelConfig TinyConfig(bool tied) {
  ModelConfig c;
  c.architecture = "llama";
  c.layers = 2;
  c.embed = 48;
  c.ffn = 64;
  c.query_heads = 6;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.vocab = 97;
  c.context = 64;
  c.rope_theta = 10000;
  c.rms_eps = 1e-5f;
  c.tied_output = tied;
  return c;
}

LlamaModel::Tensors TinyTensors(const ModelConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t e = c.embed, q = c.query_heads * c.head_dim,
                kv = c.kv_heads * c.head_dim;
  auto w = [&](int64_t out, int64_t in) {
    return RandomVector(out * in, 1.0f / std::sqrt(static_cast<float>(in)),
                        rng);
  };
  auto norm = [&] {
    std::vector<float> v = RandomVector(e, 0.1f, rng);
    for (float& x : v) x += 1.0f;
    return v;
  };
  LlamaModel::Tensors t;
  t["token_embd.weight"] = RandomVector(c.vocab * e, 1.0f, rng);
  t["output_norm.weight"] = norm();
  if (!c.tied_output) t["output.weight"] = w(c.vocab, e);
  for (int32_t l = 0; l < c.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    t[p + "attn_norm.weight"] = norm();
    t[p + "attn_q.weight"] = w(q, e);
    t[p + "attn_k.weight"] = w(kv, e);
    t[p + "attn_v.weight"] = w(kv, e);
    t[p + "attn_output.weight"] = w(e, q);
    t[p + "ffn_norm.weight"] = norm();
    t[p + "ffn_gate.weight"] = w(c.ffn, e);
    t[p + "ffn_up.weight"] = w(c.ffn, e);
    t[p + "ffn_down.weight"] = w(e, c.ffn);
  }
  return t;
}

// The whole model in double precision, positions 0..n-1, no cache: what
// the forward pass must compute. Returns logits [n][vocab].
std::vector<double> NaiveForward(const ModelConfig& c,
                                 const LlamaModel::Tensors& t,
                                 const std::vector<int32_t>& tokens) {
  const int64_t n = tokens.size(), e = c.embed, hd = c.head_dim;
  auto linear = [&](const std::vector<double>& x, const std::string& name,
                    int64_t in) {
    const std::vector<float>& w = t.at(name);
    const int64_t out = w.size() / in;
    std::vector<double> y(n * out);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i)
          y[r * out + o] += x[r * in + i] * w[o * in + i];
    return y;
  };
  auto rmsnorm = [&](const std::vector<double>& x, const std::string& name) {
    const std::vector<float>& w = t.at(name);
    std::vector<double> y(x.size());
    for (int64_t r = 0; r < n; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < e; ++d) ss += x[r * e + d] * x[r * e + d];
      const double inv = 1 / std::sqrt(ss / e + c.rms_eps);
      for (int64_t d = 0; d < e; ++d) y[r * e + d] = x[r * e + d] * inv * w[d];
    }
    return y;
  };
  auto rope = [&](std::vector<double>& x, int64_t heads) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const double a = r * std::pow(double{c.rope_theta}, -2.0 * i / hd);
          double* v = &x[(r * heads + h) * hd + 2 * i];
          const double x0 = v[0], x1 = v[1];
          v[0] = x0 * std::cos(a) - x1 * std::sin(a);
          v[1] = x0 * std::sin(a) + x1 * std::cos(a);
        }
  };
  std::vector<double> x(n * e);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < e; ++d)
      x[r * e + d] = t.at("token_embd.weight")[tokens[r] * e + d];
  const int64_t qh = c.query_heads, kvh = c.kv_heads, group = qh / kvh;
  for (int32_t l = 0; l < c.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    std::vector<double> h = rmsnorm(x, p + "attn_norm.weight");
    std::vector<double> q = linear(h, p + "attn_q.weight", e);
    std::vector<double> k = linear(h, p + "attn_k.weight", e);
    std::vector<double> v = linear(h, p + "attn_v.weight", e);
    rope(q, qh);
    rope(k, kvh);
    std::vector<double> attn(n * qh * hd);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t hq = 0; hq < qh; ++hq) {
        const int64_t g = hq / group;
        std::vector<double> s(i + 1);
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < hd; ++d)
            s[j] += q[(i * qh + hq) * hd + d] * k[(j * kvh + g) * hd + d];
          s[j] /= std::sqrt(double(hd));
        }
        const double max = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& z : s) sum += (z = std::exp(z - max));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < hd; ++d)
            attn[(i * qh + hq) * hd + d] +=
                s[j] / sum * v[(j * kvh + g) * hd + d];
      }
    std::vector<double> o = linear(attn, p + "attn_output.weight", qh * hd);
    for (size_t z = 0; z < x.size(); ++z) x[z] += o[z];
    h = rmsnorm(x, p + "ffn_norm.weight");
    std::vector<double> gate = linear(h, p + "ffn_gate.weight", e);
    std::vector<double> up = linear(h, p + "ffn_up.weight", e);
    for (size_t z = 0; z < gate.size(); ++z)
      gate[z] = gate[z] / (1 + std::exp(-gate[z])) * up[z];
    o = linear(gate, p + "ffn_down.weight", c.ffn);
    for (size_t z = 0; z < x.size(); ++z) x[z] += o[z];
  }
  return linear(rmsnorm(x, "output_norm.weight"),
                c.tied_output ? "token_embd.weight" : "output.weight", e);
}

std::unique_ptr<LlamaModel> TinyModel(const KvFormat& dtype, PositionMode mode,
                                      bool tied = false, uint32_t seed = 7) {
  const ModelConfig c = TinyConfig(tied);
  absl::StatusOr<std::unique_ptr<LlamaModel>> m =
      LlamaModel::FromTensors(c, TinyTensors(c, seed), dtype, mode);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
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

// Runs tokens [first, first + n) of `tokens` as one step on `cache` and
// appends their keys and values. Returns the step (its outputs).
SequenceStep Step(const LlamaModel& model, ContiguousKv& cache,
                  const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& positions, int64_t first,
                  int64_t n,
                  AttentionOutput attention = AttentionOutput::kNone) {
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

// The bytes of a ContiguousKv rearranged: slots in `slot_order` (slot s of
// this view is slot slot_order[s] of the source), in pages of
// `page_tokens` placed in a shuffled order in a larger arena.
class PagedKv : public KvSource {
 public:
  PagedKv(const ContiguousKv& source, int32_t layers, int32_t page_tokens,
          std::vector<int64_t> slot_order, uint32_t seed)
      : page_tokens_(page_tokens) {
    const int64_t tb = source.token_bytes(), cap = source.capacity_tokens();
    const int64_t resident = slot_order.size();
    const int64_t pages = (resident + page_tokens - 1) / page_tokens;
    page_bytes_ = 2 * page_tokens * tb + 16;  // padding: page_bytes is free
    pages_.resize(pages);
    std::iota(pages_.begin(), pages_.end(), 1);  // page 0 stays unused
    std::shuffle(pages_.begin(), pages_.end(), std::mt19937(seed));
    const std::vector<int64_t> src_positions(source.Layer(0).positions.begin(),
                                             source.Layer(0).positions.end());
    for (int64_t s = 0; s < resident; ++s) {
      positions_.push_back(src_positions[slot_order[s]]);
    }
    for (int32_t l = 0; l < layers; ++l) {
      std::vector<std::byte>& arena =
          arenas_.emplace_back((pages + 1) * page_bytes_, std::byte{0x7f});
      for (int64_t s = 0; s < resident; ++s) {
        std::byte* key = arena.data() + pages_[s / page_tokens] * page_bytes_ +
                         (s % page_tokens) * tb;
        const std::byte* src = source.arena(l).data() + slot_order[s] * tb;
        std::copy(src, src + tb, key);
        std::copy(src + cap * tb, src + cap * tb + tb, key + page_tokens * tb);
      }
    }
  }
  ResidentKv Layer(int32_t layer) const override {
    return {arenas_[layer].data(),
            pages_,
            page_tokens_,
            page_bytes_,
            static_cast<int64_t>(positions_.size()),
            positions_};
  }

 private:
  int32_t page_tokens_;
  int64_t page_bytes_;
  std::vector<int32_t> pages_;
  std::vector<int64_t> positions_;
  std::vector<std::vector<std::byte>> arenas_;
};

TEST(TinyModelTest, PrefillMatchesANaiveForwardPass) {
  for (bool tied : {false, true}) {
    const ModelConfig c = TinyConfig(tied);
    const LlamaModel::Tensors tensors = TinyTensors(c, 11);
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::FromTensors(
        c, tensors, DType::kF32, PositionMode::kOriginal);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::vector<int32_t> tokens = RandomTokens(23, c.vocab, 1);
    const std::vector<int64_t> positions = Iota(0, tokens.size());
    ContiguousKv cache(c, DType::kF32, 64);
    const SequenceStep step = Step(**model, cache, tokens, positions, 0, 23);
    const std::vector<double> want = NaiveForward(c, tensors, tokens);
    ASSERT_EQ(step.logits.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(step.logits[i], want[i], 1e-4)
          << "tied " << tied << " at " << i;
    }
  }
}

TEST(TinyModelTest, OneChunkEqualsSingleStepsForEveryDTypeAndMode) {
  const std::vector<int32_t> tokens = RandomTokens(20, 97, 2);
  const std::vector<int64_t> positions = Iota(0, tokens.size());
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (PositionMode mode :
         {PositionMode::kOriginal, PositionMode::kCachePosition}) {
      std::unique_ptr<LlamaModel> model = TinyModel(dtype, mode);
      ContiguousKv chunk_cache(model->config(), dtype, 32);
      ContiguousKv step_cache(model->config(), dtype, 32);
      const SequenceStep chunk =
          Step(*model, chunk_cache, tokens, positions, 0, 20);
      for (int64_t i = 0; i < 20; ++i) {
        const SequenceStep one =
            Step(*model, step_cache, tokens, positions, i, 1);
        const std::vector<float> want(chunk.logits.begin() + i * 97,
                                      chunk.logits.begin() + (i + 1) * 97);
        ASSERT_LT(MaxAbsDiff(one.logits, want), 1e-4)
            << DTypeName(dtype) << " token " << i;
      }
    }
  }
}

// Decode steps over a cache of several streaming chunks (kStreamChunk
// slots each) against the tiled form of one long prefill; and a paged view
// of that cache against the contiguous one, bit for bit.
TEST(TinyModelTest, LongCachesDecodeLikeOneLongPrefill) {
  const int64_t kTokens = 1200;
  const std::vector<int32_t> tokens = RandomTokens(kTokens, 97, 12);
  const std::vector<int64_t> positions = Iota(0, kTokens);
  for (PositionMode mode :
       {PositionMode::kOriginal, PositionMode::kCachePosition}) {
    std::unique_ptr<LlamaModel> model = TinyModel(DType::kBF16, mode);
    ContiguousKv whole(model->config(), DType::kBF16, kTokens);
    const SequenceStep prefill =
        Step(*model, whole, tokens, positions, 0, kTokens);
    ContiguousKv cache(model->config(), DType::kBF16, kTokens);
    for (int64_t first = 0; first < kTokens - 3; first += 299) {
      Step(*model, cache, tokens, positions, first,
           std::min<int64_t>(299, kTokens - 3 - first));
    }
    const PagedKv paged(cache, model->config().layers, 7,
                        Iota(0, cache.resident()), 2);
    for (int64_t i = kTokens - 3; i < kTokens; ++i) {
      SequenceStep on_paged;
      on_paged.tokens = absl::MakeConstSpan(tokens).subspan(i, 1);
      on_paged.positions = absl::MakeConstSpan(positions).subspan(i, 1);
      on_paged.cache = &paged;
      on_paged.attention = AttentionOutput::kPerHead;
      const SequenceStep step = Step(*model, cache, tokens, positions, i, 1,
                                     AttentionOutput::kPerHead);
      const std::vector<float> want(prefill.logits.begin() + i * 97,
                                    prefill.logits.begin() + (i + 1) * 97);
      EXPECT_LT(MaxAbsDiff(step.logits, want), 1e-4) << i;
      if (i == kTokens - 3) {  // the paged view holds this step's cache
        ASSERT_TRUE(model->Forward(absl::MakeSpan(&on_paged, 1)).ok());
        EXPECT_EQ(on_paged.logits, step.logits);
        EXPECT_EQ(on_paged.attention_out, step.attention_out);
        double sum = 0;
        for (int64_t s = 0; s <= i; ++s) sum += step.attention_out[1][s];
        EXPECT_NEAR(sum, 1.0, 1e-5);
      }
    }
  }
}

// The quantised formats of kvkeepd layouts for the tiny model (head_dim 8):
// groups of 4 elements, appended as f32 or bf16.
std::vector<KvFormat> QuantizedFormats() {
  return {KvFormat::Quantized(DType::kInt8, DType::kF32, 4),
          KvFormat::Quantized(DType::kFp8E4M3, DType::kBF16, 4),
          KvFormat::Quantized(DType::kInt4, DType::kF32, 4)};
}

TEST(TinyModelTest, PagedViewsAreBitIdenticalToContiguousOnes) {
  const std::vector<int32_t> tokens = RandomTokens(26, 97, 3);
  const std::vector<int64_t> positions = Iota(0, tokens.size());
  std::vector<KvFormat> formats = QuantizedFormats();
  formats.insert(formats.begin(), {DType::kF32, DType::kBF16});
  for (const KvFormat& dtype : formats) {
    for (PositionMode mode :
         {PositionMode::kOriginal, PositionMode::kCachePosition}) {
      std::unique_ptr<LlamaModel> model = TinyModel(dtype, mode);
      ContiguousKv cache(model->config(), dtype, 32);
      Step(*model, cache, tokens, positions, 0, 19);
      const PagedKv paged(cache, model->config().layers, 3, Iota(0, 19), 5);
      for (AttentionOutput out :
           {AttentionOutput::kPerHead, AttentionOutput::kReduced,
            AttentionOutput::kQueries}) {
        SequenceStep a, b;
        for (SequenceStep* s : {&a, &b}) {
          s->tokens = absl::MakeConstSpan(tokens).subspan(19, 7);
          s->positions = absl::MakeConstSpan(positions).subspan(19, 7);
          s->attention = out;
          s->all_logits = true;
        }
        a.cache = &cache;
        b.cache = &paged;
        ASSERT_TRUE(model->Forward(absl::MakeSpan(&a, 1)).ok());
        ASSERT_TRUE(model->Forward(absl::MakeSpan(&b, 1)).ok());
        EXPECT_EQ(a.logits, b.logits);
        EXPECT_EQ(a.keys, b.keys);
        EXPECT_EQ(a.values, b.values);
        EXPECT_EQ(a.attention_out, b.attention_out);
      }
    }
  }
}

// A quantised cache holds the CPU twin's records of what the step handed
// back (in the append dtype), and a later step reads them back as the step
// itself saw its own tokens: one chunk equals token-by-token steps.
TEST(TinyModelTest, QuantizedCachesReadBackWhatTheStepSaw) {
  const std::vector<int32_t> tokens = RandomTokens(20, 97, 5);
  const std::vector<int64_t> positions = Iota(0, tokens.size());
  for (const KvFormat& format : QuantizedFormats()) {
    for (PositionMode mode :
         {PositionMode::kOriginal, PositionMode::kCachePosition}) {
      SCOPED_TRACE(format.Name());
      std::unique_ptr<LlamaModel> model = TinyModel(format, mode);
      ASSERT_NE(model, nullptr);
      const PageLayout layout = format.Layout(model->config());
      ContiguousKv chunk_cache(model->config(), format, 32);
      ContiguousKv step_cache(model->config(), format, 32);
      const SequenceStep chunk =
          Step(*model, chunk_cache, tokens, positions, 0, 20);
      ASSERT_EQ(chunk.keys[1].size(),
                20 * layout.token_elements() * DTypeBytes(format.append_dtype));
      std::vector<std::byte> records(20 * layout.token_bytes());
      ASSERT_TRUE(QuantizeTokens(layout, format.append_dtype,
                                 chunk.keys[1].data(), 20, records.data())
                      .ok());
      const std::vector<std::byte>& arena = chunk_cache.arena(1);
      EXPECT_TRUE(std::equal(records.begin(), records.end(), arena.begin()));
      for (int64_t i = 0; i < 20; ++i) {
        const SequenceStep one =
            Step(*model, step_cache, tokens, positions, i, 1);
        const std::vector<float> want(chunk.logits.begin() + i * 97,
                                      chunk.logits.begin() + (i + 1) * 97);
        ASSERT_LT(MaxAbsDiff(one.logits, want), 1e-4) << "token " << i;
      }
    }
  }
}

// The step's own tokens go through the format as the cache would hold
// them: a quantised cache's logits move away from f32's, by more for int4
// than for int8.
TEST(TinyModelTest, QuantizedFormatsChangeTheLogitsByTheirPrecision) {
  const std::vector<int32_t> tokens = RandomTokens(20, 97, 6);
  const std::vector<int64_t> positions = Iota(0, tokens.size());
  auto logits = [&](const KvFormat& f) {
    std::unique_ptr<LlamaModel> model = TinyModel(f, PositionMode::kOriginal);
    ContiguousKv cache(model->config(), f, 32);
    return Step(*model, cache, tokens, positions, 0, 20).logits;
  };
  const std::vector<float> f32 = logits(DType::kF32);
  const double int8 = MaxAbsDiff(
      logits(KvFormat::Quantized(DType::kInt8, DType::kF32, 4)), f32);
  const double int4 = MaxAbsDiff(
      logits(KvFormat::Quantized(DType::kInt4, DType::kF32, 4)), f32);
  EXPECT_GT(int8, 0);
  EXPECT_LT(int8, int4);
}

TEST(TinyModelTest, PositionModesAgreeWhenNothingWasEvicted) {
  const std::vector<int32_t> tokens = RandomTokens(21, 97, 4);
  const std::vector<int64_t> positions = Iota(0, tokens.size());
  for (DType dtype : {DType::kF32, DType::kF16}) {
    std::unique_ptr<LlamaModel> original =
        TinyModel(dtype, PositionMode::kOriginal);
    std::unique_ptr<LlamaModel> cached =
        TinyModel(dtype, PositionMode::kCachePosition);
    ContiguousKv a(original->config(), dtype, 32),
        b(cached->config(), dtype, 32);
    Step(*original, a, tokens, positions, 0, 13);
    Step(*cached, b, tokens, positions, 0, 13);
    const SequenceStep sa = Step(*original, a, tokens, positions, 13, 8);
    const SequenceStep sb = Step(*cached, b, tokens, positions, 13, 8);
    // Ranks equal positions, so float32 caches give the same arithmetic;
    // 16-bit ones round keys before RoPE in one mode and after it in the
    // other.
    if (dtype == DType::kF32) {
      EXPECT_EQ(sa.logits, sb.logits);
    } else {
      EXPECT_LT(MaxAbsDiff(sa.logits, sb.logits), 2e-2);
    }
  }
}

TEST(TinyModelTest, CachePositionRotatesResidentKeysByRank) {
  // Positions with gaps (as after eviction) and slots out of position
  // order: a slot's rotation follows its rank, so reordering the slots
  // (with their positions) only reorders the softmax's sums.
  const std::vector<int32_t> tokens = RandomTokens(18, 97, 5);
  std::vector<int64_t> positions = {0,  3,  4,  9,  10, 11, 20, 21, 30,
                                    31, 32, 40, 41, 42, 50, 51, 52, 53};
  std::unique_ptr<LlamaModel> model =
      TinyModel(DType::kF32, PositionMode::kCachePosition);
  ContiguousKv cache(model->config(), DType::kF32, 32);
  Step(*model, cache, tokens, positions, 0, 14);
  std::vector<int64_t> order = Iota(0, 14);
  std::shuffle(order.begin(), order.end(), std::mt19937(9));
  const PagedKv shuffled(cache, model->config().layers, 4, order, 3);
  SequenceStep a, b;
  for (SequenceStep* s : {&a, &b}) {
    s->tokens = absl::MakeConstSpan(tokens).subspan(14, 4);
    s->positions = absl::MakeConstSpan(positions).subspan(14, 4);
    s->all_logits = true;
  }
  a.cache = &cache;
  b.cache = &shuffled;
  ASSERT_TRUE(model->Forward(absl::MakeSpan(&a, 1)).ok());
  ASSERT_TRUE(model->Forward(absl::MakeSpan(&b, 1)).ok());
  EXPECT_LT(MaxAbsDiff(a.logits, b.logits), 1e-5);
  // In kOriginal mode the same shuffle also changes nothing but order, and
  // the result differs from kCachePosition's (positions have gaps).
  std::unique_ptr<LlamaModel> original =
      TinyModel(DType::kF32, PositionMode::kOriginal);
  ContiguousKv c(original->config(), DType::kF32, 32);
  Step(*original, c, tokens, positions, 0, 14);
  a.cache = &c;
  ASSERT_TRUE(original->Forward(absl::MakeSpan(&a, 1)).ok());
  EXPECT_GT(MaxAbsDiff(a.logits, b.logits), 1e-3);
}

TEST(TinyModelTest, ABatchComputesWhatItsSequencesComputeAlone) {
  std::unique_ptr<LlamaModel> model =
      TinyModel(DType::kF16, PositionMode::kOriginal);
  const int32_t kSeqs = 3;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::unique_ptr<ContiguousKv>> caches;
  const std::vector<int64_t> positions = Iota(0, 40);
  for (int32_t b = 0; b < kSeqs; ++b) {
    tokens.push_back(RandomTokens(20, 97, 10 + b));
    caches.push_back(
        std::make_unique<ContiguousKv>(model->config(), DType::kF16, 40));
    Step(*model, *caches[b], tokens[b], positions, 0, 5 + 4 * b);
  }
  std::vector<SequenceStep> batch(kSeqs);
  for (int32_t b = 0; b < kSeqs; ++b) {
    const int64_t first = 5 + 4 * b, n = 1 + 3 * b;
    batch[b].tokens = absl::MakeConstSpan(tokens[b]).subspan(first, n);
    batch[b].positions = absl::MakeConstSpan(positions).subspan(first, n);
    batch[b].cache = caches[b].get();
    batch[b].attention = AttentionOutput::kReduced;
    batch[b].all_logits = b == 1;
  }
  ASSERT_TRUE(model->Forward(absl::MakeSpan(batch)).ok());
  for (int32_t b = 0; b < kSeqs; ++b) {
    SequenceStep alone;
    alone.tokens = batch[b].tokens;
    alone.positions = batch[b].positions;
    alone.cache = caches[b].get();
    alone.attention = AttentionOutput::kReduced;
    alone.all_logits = b == 1;
    ASSERT_TRUE(model->Forward(absl::MakeSpan(&alone, 1)).ok());
    EXPECT_EQ(batch[b].logits.size(), (b == 1 ? 4 : 1) * 97u);
    EXPECT_LT(MaxAbsDiff(batch[b].logits, alone.logits), 1e-5);
    ASSERT_EQ(batch[b].attention_out.size(), 2u);
    EXPECT_LT(MaxAbsDiff(batch[b].attention_out[1], alone.attention_out[1]),
              1e-5);
    // float16 bytes may differ by one rounding step where the activations
    // differ in the last bit.
    EXPECT_EQ(batch[b].keys[0].size(), alone.keys[0].size());
  }
}

TEST(TinyModelTest, NoLogitsSkipsThatSequencesLogitsAndNothingElse) {
  std::unique_ptr<LlamaModel> model =
      TinyModel(DType::kF32, PositionMode::kOriginal);
  const std::vector<int64_t> positions = Iota(0, 8);
  const std::vector<int32_t> tokens = RandomTokens(8, 97, 3);
  ContiguousKv cache(model->config(), DType::kF32, 8);
  Step(*model, cache, tokens, positions, 0, 4);
  // The same step three times: with logits, without, all of a batch without.
  const auto step = [&](bool no_logits) {
    SequenceStep s;
    s.tokens = absl::MakeConstSpan(tokens).subspan(4, 2);
    s.positions = absl::MakeConstSpan(positions).subspan(4, 2);
    s.cache = &cache;
    s.attention = AttentionOutput::kReduced;
    s.no_logits = no_logits;
    return s;
  };
  std::vector<SequenceStep> mixed = {step(true), step(false)};
  ASSERT_TRUE(model->Forward(absl::MakeSpan(mixed)).ok());
  EXPECT_TRUE(mixed[0].logits.empty());
  EXPECT_EQ(mixed[1].logits.size(), 97u);
  std::vector<SequenceStep> none = {step(true)};
  ASSERT_TRUE(model->Forward(absl::MakeSpan(none)).ok());
  EXPECT_TRUE(none[0].logits.empty());
  // Keys, values and attention are computed as ever (to rounding: a
  // product of another batch size may sum in another order).
  const auto floats = [](const std::string& bytes) {
    std::vector<float> out(bytes.size() / sizeof(float));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
    return out;
  };
  for (const SequenceStep* s : {&mixed[0], &none[0]}) {
    ASSERT_EQ(s->keys.size(), mixed[1].keys.size());
    ASSERT_EQ(s->keys[1].size(), mixed[1].keys[1].size());
    EXPECT_LT(MaxAbsDiff(floats(s->keys[1]), floats(mixed[1].keys[1])), 1e-5);
    EXPECT_LT(MaxAbsDiff(floats(s->values[1]), floats(mixed[1].values[1])),
              1e-5);
    EXPECT_LT(MaxAbsDiff(s->attention_out[1], mixed[1].attention_out[1]), 1e-6);
  }
}

TEST(TinyModelTest, AttentionOutputsHaveTheirShapesAndAgree) {
  std::unique_ptr<LlamaModel> model =
      TinyModel(DType::kF32, PositionMode::kOriginal);
  const ModelConfig& c = model->config();
  const std::vector<int32_t> tokens = RandomTokens(15, 97, 6);
  const std::vector<int64_t> positions = Iota(0, 15);
  ContiguousKv cache(c, DType::kF32, 32);
  Step(*model, cache, tokens, positions, 0, 10);
  std::vector<SequenceStep> steps(3);
  const AttentionOutput kinds[] = {AttentionOutput::kPerHead,
                                   AttentionOutput::kReduced,
                                   AttentionOutput::kQueries};
  for (int k = 0; k < 3; ++k) {
    steps[k].tokens = absl::MakeConstSpan(tokens).subspan(10, 5);
    steps[k].positions = absl::MakeConstSpan(positions).subspan(10, 5);
    steps[k].cache = &cache;
    steps[k].attention = kinds[k];
  }
  ASSERT_TRUE(model->Forward(absl::MakeSpan(steps)).ok());
  const int64_t n = 5, total = 15;
  for (int32_t l = 0; l < c.layers; ++l) {
    const std::vector<float>& per_head = steps[0].attention_out[l];
    const std::vector<float>& reduced = steps[1].attention_out[l];
    ASSERT_EQ(per_head.size(), size_t(c.query_heads * n * total));
    ASSERT_EQ(reduced.size(), size_t(n * total));
    ASSERT_EQ(steps[2].attention_out[l].size(),
              size_t(n * c.query_heads * c.head_dim));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t s = 0; s < total; ++s) {
        double sum = 0;
        for (int32_t h = 0; h < c.query_heads; ++h) {
          const float p = per_head[(h * n + i) * total + s];
          if (s > 10 + i) {
            ASSERT_EQ(p, 0.0f);
          }
          sum += p;
        }
        ASSERT_NEAR(reduced[i * total + s], sum, 1e-6);
      }
      double row = 0;
      for (int64_t s = 0; s < total; ++s) row += per_head[i * total + s];
      ASSERT_NEAR(row, 1.0, 1e-5);
    }
  }
  EXPECT_EQ(steps[0].logits.size(), 97u);  // the last token's only
  // The same rows at another place in the batch's matrix products: OpenBLAS
  // may round them differently.
  EXPECT_LT(MaxAbsDiff(steps[0].logits, steps[1].logits), 1e-5);
}

TEST(TinyModelTest, RefusesBadInputsAndComputesNothing) {
  std::unique_ptr<LlamaModel> model =
      TinyModel(DType::kF32, PositionMode::kOriginal);
  ContiguousKv cache(model->config(), DType::kF32, 8);
  const std::vector<int32_t> good = {1, 2, 3}, out_of_range = {1, 97, 3},
                             negative = {-1};
  const std::vector<int64_t> pos = {0, 1, 2}, short_pos = {0, 1},
                             neg_pos = {0, -1, 2};
  auto forward = [&](absl::Span<const int32_t> t, absl::Span<const int64_t> p,
                     const KvSource* kv) {
    SequenceStep ok_step, bad_step;
    ok_step.tokens = good;
    ok_step.positions = pos;
    ok_step.cache = &cache;
    bad_step.tokens = t;
    bad_step.positions = p;
    bad_step.cache = kv;
    std::vector<SequenceStep> batch = {ok_step, bad_step};
    const absl::Status s = model->Forward(absl::MakeSpan(batch));
    if (!s.ok()) {
      EXPECT_TRUE(batch[0].logits.empty() && batch[0].keys.empty());
    }
    return s.code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(forward(good, pos, &cache), absl::StatusCode::kOk);
  EXPECT_EQ(forward(out_of_range, pos, &cache), kInvalid);
  EXPECT_EQ(forward(negative, absl::MakeConstSpan(pos).first(1), &cache),
            kInvalid);
  EXPECT_EQ(forward(good, short_pos, &cache), kInvalid);
  EXPECT_EQ(forward(good, neg_pos, &cache), kInvalid);
  EXPECT_EQ(forward({}, {}, &cache), kInvalid);
  EXPECT_EQ(forward(good, pos, nullptr), kInvalid);

  // Views that do not fit: fewer pages than slots, pages too small,
  // positions that do not match, a negative page.
  class BadView : public KvSource {
   public:
    explicit BadView(ResidentKv v) : v_(v) {}
    ResidentKv Layer(int32_t) const override { return v_; }
    ResidentKv v_;
  };
  std::vector<std::byte> arena(4096);
  const int32_t one_page[] = {0}, negative_page[] = {-1};
  const int64_t four_positions[] = {0, 1, 2, 3};
  const int64_t tb = 2 * 8 * 4;  // kv_heads * head_dim * f32
  const ResidentKv fine = {arena.data(), one_page, 4,
                           2 * 4 * tb,   4,        four_positions};
  auto with_view = [&](const ResidentKv& view) {
    const BadView kv(view);
    return forward(good, pos, &kv);
  };
  EXPECT_EQ(with_view(fine), absl::StatusCode::kOk);
  ResidentKv v = fine;
  v.page_tokens = 3;  // 4 slots need 2 pages
  EXPECT_EQ(with_view(v), kInvalid);
  v = fine;
  v.page_bytes = 2 * 4 * tb - 1;
  EXPECT_EQ(with_view(v), kInvalid);
  v = fine;
  v.resident = 3;
  EXPECT_EQ(with_view(v), kInvalid);
  v = fine;
  v.pages = negative_page;
  EXPECT_EQ(with_view(v), kInvalid);
  v = fine;
  v.arena = nullptr;
  EXPECT_EQ(with_view(v), kInvalid);
}

TEST(TinyModelTest, FromTensorsRefusesMissingOrMisshapenTensors) {
  const ModelConfig c = TinyConfig(false);
  LlamaModel::Tensors t = TinyTensors(c, 1);
  t.erase("blk.1.ffn_up.weight");
  absl::StatusOr<std::unique_ptr<LlamaModel>> m =
      LlamaModel::FromTensors(c, t, DType::kF32, PositionMode::kOriginal);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("blk.1.ffn_up.weight"),
            std::string::npos);
  t = TinyTensors(c, 1);
  t["blk.0.attn_k.weight"].pop_back();
  m = LlamaModel::FromTensors(c, t, DType::kF32, PositionMode::kOriginal);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  ModelConfig bad = c;
  bad.kv_heads = 4;  // does not divide 6
  m = LlamaModel::FromTensors(bad, TinyTensors(bad, 1), DType::kF32,
                              PositionMode::kOriginal);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- ModelConfig::FromGguf on small in-memory files ----

// A GGUF v3 file with string and uint32 metadata and no tensors.
std::string GgufBytes(
    const std::vector<std::pair<std::string, std::string>>& strings,
    const std::vector<std::pair<std::string, uint32_t>>& ints) {
  std::string b;
  auto put = [&b](const auto& v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof v);
  };
  auto put_string = [&](const std::string& v) {
    put(uint64_t{v.size()});
    b += v;
  };
  b += "GGUF";
  put(uint32_t{3});
  put(uint64_t{0});  // tensors
  put(uint64_t{strings.size() + ints.size()});
  for (const auto& [k, v] : strings) {
    put_string(k);
    put(uint32_t{8});  // string
    put_string(v);
  }
  for (const auto& [k, v] : ints) {
    put_string(k);
    put(uint32_t{4});  // uint32
    put(v);
  }
  return b;
}

TEST(ModelConfigTest, FromGgufRefusesOtherArchitecturesAndMissingKeys) {
  absl::StatusOr<std::unique_ptr<GgufFile>> gpt2 =
      GgufFile::FromBytes(GgufBytes({{"general.architecture", "gpt2"}}, {}));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  absl::StatusOr<ModelConfig> c = ModelConfig::FromGguf(**gpt2);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("gpt2"), std::string::npos);

  absl::StatusOr<std::unique_ptr<GgufFile>> partial = GgufFile::FromBytes(
      GgufBytes({{"general.architecture", "llama"}},
                {{"llama.block_count", 2}, {"llama.embedding_length", 48}}));
  ASSERT_TRUE(partial.ok()) << partial.status();
  c = ModelConfig::FromGguf(**partial);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("llama.feed_forward_length"),
            std::string::npos)
      << c.status();
}

// ---- The real model ----

// Loaded once for the suite: f32 caches, both position modes.
class RealModelTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* path = std::getenv("KVKEEP_MODEL");
    if (path == nullptr || !std::filesystem::exists(path)) return;
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    file_ = std::move(*file).release();
    for (PositionMode mode :
         {PositionMode::kOriginal, PositionMode::kCachePosition}) {
      absl::StatusOr<std::unique_ptr<LlamaModel>> m =
          LlamaModel::Load(*file_, DType::kF32, mode);
      ASSERT_TRUE(m.ok()) << m.status();
      (mode == PositionMode::kOriginal ? original_ : cached_) =
          std::move(*m).release();
    }
  }
  static void TearDownTestSuite() {
    delete original_;
    delete cached_;
    delete file_;
    original_ = cached_ = nullptr;
    file_ = nullptr;
  }
  void SetUp() override {
    if (original_ == nullptr)
      GTEST_SKIP() << "model absent: run scripts/fetch-model";
  }
  static nlohmann::json TestData(const std::string& name) {
    const char* dir = std::getenv("KVKEEP_LM_TESTDATA");
    std::ifstream f(std::string(dir == nullptr ? "tests/lm/data" : dir) + "/" +
                    name);
    EXPECT_TRUE(f.good()) << name;
    return nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  }
  // Logits of every position of `ids` run as one prefill chunk.
  static std::vector<float> Prefill(const LlamaModel& model,
                                    const std::vector<int32_t>& ids) {
    ContiguousKv cache(model.config(), model.kv_dtype(), ids.size());
    const std::vector<int64_t> positions = Iota(0, ids.size());
    return Step(model, cache, ids, positions, 0, ids.size()).logits;
  }

  static GgufFile* file_;
  static LlamaModel* original_;
  static LlamaModel* cached_;
};
GgufFile* RealModelTest::file_ = nullptr;
LlamaModel* RealModelTest::original_ = nullptr;
LlamaModel* RealModelTest::cached_ = nullptr;

TEST_F(RealModelTest, ConfigIsSmolLm2s) {
  const ModelConfig& c = original_->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.layers, 30);
  EXPECT_EQ(c.embed, 576);
  EXPECT_EQ(c.query_heads, 9);
  EXPECT_EQ(c.kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.ffn, 1536);
  EXPECT_EQ(c.vocab, 49152);
  EXPECT_EQ(c.context, 8192);
  EXPECT_EQ(c.rope_theta, 100000.0f);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_TRUE(c.tied_output);
  // And what the reference's reading of the metadata says.
  const nlohmann::json facts = TestData("model_facts.json");
  if (facts.is_discarded()) return;
  EXPECT_EQ(c.name, facts["general.name"]);
  EXPECT_EQ(c.layers, facts["block_count"]);
  EXPECT_EQ(c.embed, facts["embedding_length"]);
  EXPECT_EQ(c.ffn, facts["feed_forward_length"]);
  EXPECT_EQ(c.query_heads, facts["head_count"]);
  EXPECT_EQ(c.kv_heads, facts["head_count_kv"]);
  EXPECT_EQ(c.head_dim, facts["rope.dimension_count"]);
  EXPECT_EQ(c.vocab, facts["vocab_size"]);
  EXPECT_EQ(c.rope_theta, facts["rope.freq_base"].get<float>());
  EXPECT_EQ(c.rms_eps, facts["layer_norm_rms_epsilon"].get<float>());
  EXPECT_EQ(c.tied_output, !facts["has_output_weight"].get<bool>());
}

// Hugging Face transformers (float32, the same GGUF dequantised) gave the
// reference rows: some ids' logits at some positions, and the logsumexp
// over the whole vocabulary. Measured here (x86-64 with AVX-512, OpenBLAS
// 0.3.21): logits within 4.4e-5 to 4.7e-5 (8.8e-5 in the sanitizer build,
// whose loops vectorise differently), logsumexp within 3.8e-5 (5.9e-5),
// so log-probabilities within ~1.5e-4 at worst. The
// tolerances are a few times that, to absorb another BLAS's or CPU's
// summation order, and still far below what a wrong RoPE pairing, norm
// epsilon or scale does (those move logits by 1e-1 and more).
TEST_F(RealModelTest, LogitsMatchHuggingFace) {
  constexpr double kLogitTolerance = 2e-4;
  constexpr double kLogsumexpTolerance = 2e-4;
  constexpr double kLogProbTolerance = 3e-4;
  const nlohmann::json ref = TestData("logits_reference.json");
  ASSERT_FALSE(ref.is_discarded());
  ASSERT_FALSE(ref["cases"].empty());
  const int64_t vocab = original_->config().vocab;
  double worst_logit = 0, worst_lse = 0;
  for (const nlohmann::json& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const std::vector<float> logits = Prefill(*original_, ids);
    for (const nlohmann::json& row : c["rows"]) {
      const int64_t p = row["position"];
      const float* mine = &logits[p * vocab];
      double max = mine[0];
      for (int64_t v = 1; v < vocab; ++v) max = std::max<double>(max, mine[v]);
      double sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(mine[v] - max);
      const double lse = max + std::log(sum);
      const double want_lse = row["logsumexp"];
      EXPECT_NEAR(lse, want_lse, kLogsumexpTolerance) << c["name"] << " @" << p;
      worst_lse = std::max(worst_lse, std::abs(lse - want_lse));
      const std::vector<int32_t> row_ids =
          row["ids"].get<std::vector<int32_t>>();
      const std::vector<double> want = row["logits"].get<std::vector<double>>();
      ASSERT_EQ(row_ids.size(), want.size());
      for (size_t k = 0; k < row_ids.size(); ++k) {
        const double got = mine[row_ids[k]];
        EXPECT_NEAR(got, want[k], kLogitTolerance)
            << c["name"] << " @" << p << " id " << row_ids[k];
        EXPECT_NEAR(got - lse, want[k] - want_lse, kLogProbTolerance);
        worst_logit = std::max(worst_logit, std::abs(got - want[k]));
      }
    }
  }
  std::printf(
      "max |logit - reference| %.3g, max |logsumexp - reference| %.3g\n",
      worst_logit, worst_lse);
}

TEST_F(RealModelTest, PositionModesGiveIdenticalLogitsWithoutEviction) {
  const std::vector<int32_t> ids = RandomTokens(40, 49152, 8);
  EXPECT_EQ(Prefill(*original_, ids), Prefill(*cached_, ids));
}

TEST_F(RealModelTest, OneChunkMatchesSingleStepsAndDecodeBatches) {
  const std::vector<int32_t> ids = RandomTokens(24, 49152, 9);
  const std::vector<int64_t> positions = Iota(0, ids.size());
  const std::vector<float> chunk = Prefill(*original_, ids);
  // The same tokens: 16 in one chunk, then 8 single steps of a batch of
  // two sequences (the same ids) decoding together.
  ContiguousKv a(original_->config(), DType::kF32, 24),
      b(original_->config(), DType::kF32, 24);
  Step(*original_, a, ids, positions, 0, 16);
  Step(*original_, b, ids, positions, 0, 16);
  const int64_t vocab = original_->config().vocab;
  float worst = 0;
  for (int64_t i = 16; i < 24; ++i) {
    std::vector<SequenceStep> batch(2);
    for (int k = 0; k < 2; ++k) {
      batch[k].tokens = absl::MakeConstSpan(ids).subspan(i, 1);
      batch[k].positions = absl::MakeConstSpan(positions).subspan(i, 1);
      batch[k].cache = k == 0 ? &a : &b;
    }
    ASSERT_TRUE(original_->Forward(absl::MakeSpan(batch)).ok());
    ASSERT_TRUE(a.Append(batch[0]).ok());
    ASSERT_TRUE(b.Append(batch[1]).ok());
    const std::vector<float> want(chunk.begin() + i * vocab,
                                  chunk.begin() + (i + 1) * vocab);
    worst = std::max({worst, MaxAbsDiff(batch[0].logits, want),
                      MaxAbsDiff(batch[1].logits, want)});
  }
  // Matrix-vector vs matrix-matrix products and two forms of the attention
  // sum in other orders: measured 4.7e-5 on logits of magnitude ~20.
  EXPECT_LT(worst, 2e-4);
  std::printf("max |single step - chunk| %.3g\n", worst);
}

TEST_F(RealModelTest, RefusesAnOutOfVocabularyToken) {
  ContiguousKv cache(original_->config(), DType::kF32, 4);
  const std::vector<int32_t> ids = {1, 49152};
  const std::vector<int64_t> positions = {0, 1};
  SequenceStep step;
  step.tokens = ids;
  step.positions = positions;
  step.cache = &cache;
  EXPECT_EQ(original_->Forward(absl::MakeSpan(&step, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(step.logits.empty());
}

}  // namespace
}  // namespace kvkeep::lm
