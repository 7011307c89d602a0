// The forward pass (services/lm/model.h) on a tiny random model
// (LlamaModel::FromTensors, no file): against a naive forward pass, and
// against itself: one prefill chunk vs single steps, a paged view vs a
// contiguous one (bit-identical), the two position modes, a batch vs its
// sequences one by one, the attention outputs and the input checks; and
// ModelConfig::FromGguf on small in-memory files. The building blocks are
// model_ops_test's; the real model, real_model_test's.
#include "services/lm/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "services/lm/contiguous_kv.h"
#include "services/lm/gguf.h"
#include "services/lm/model_ops.h"
#include "tests/lm/model_testing.h"

namespace kvkeep::lm {
namespace {

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

}  // namespace
}  // namespace kvkeep::lm
