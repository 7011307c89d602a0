#include "services/lm/model.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/quantize.h"
#include "services/lm/model_ops.h"

namespace kvkeep::lm {
namespace {

using internal::GroupAttentionArgs;
using internal::RopeTable;
using internal::TaskPool;

// Step tokens per attention task: small enough that a prefill chunk makes
// several tasks per kv head, large enough that each pass over the keys
// serves 12 query vectors (4 tokens of SmolLM2's 3 heads per kv head).
constexpr int64_t kTaskTokens = 16;

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The weights, fused where one matrix product can serve several: the Q, K
// and V projections are one [(query_heads + 2 kv_heads) head_dim][embed]
// matrix, gate and up one [2 ffn][embed].
struct LayerWeights {
  std::vector<float> attn_norm;  // [embed]
  std::vector<float> qkv;        // rows: Q heads, K heads, V heads
  std::vector<float> wo;         // [embed][query_heads * head_dim]
  std::vector<float> ffn_norm;   // [embed]
  std::vector<float> gate_up;    // rows: gate [ffn], then up [ffn]
  std::vector<float> down;       // [embed][ffn]
};

struct ModelWeights {
  std::vector<float> token_embd;   // [vocab][embed]
  std::vector<float> output_norm;  // [embed]
  std::vector<float> output;       // [vocab][embed]; empty when tied
  std::vector<LayerWeights> layers;
  std::unique_ptr<RopeTable> rope;
  std::unique_ptr<TaskPool> pool;  // the model's threads

  const std::vector<float>& logits_weight() const {
    return output.empty() ? token_embd : output;
  }
};

// Moves the named tensor out of `tensors`, checking its size.
absl::StatusOr<std::vector<float>> Take(LlamaModel::Tensors& tensors,
                                        const std::string& name,
                                        const std::vector<int64_t>& shape) {
  auto it = tensors.find(name);
  if (it == tensors.end()) {
    return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  }
  const int64_t want = std::accumulate(shape.begin(), shape.end(), int64_t{1},
                                       std::multiplies<int64_t>());
  if (static_cast<int64_t>(it->second.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has %d elements, the config needs %d", name,
                        it->second.size(), want));
  }
  std::vector<float> out = std::move(it->second);
  tensors.erase(it);
  return out;
}

std::vector<float> Concat(std::initializer_list<const std::vector<float>*> in) {
  std::vector<float> out;
  for (const std::vector<float>* v : in) {
    out.insert(out.end(), v->begin(), v->end());
  }
  return out;
}

absl::Status CheckView(int64_t token_bytes, const ResidentKv& v, size_t seq,
                       int32_t layer) {
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence %d layer %d: resident view %s", seq, layer, what));
  };
  if (v.resident < 0) return bad("has a negative resident count");
  if (static_cast<int64_t>(v.positions.size()) != v.resident) {
    return bad("has positions.size() != resident");
  }
  if (v.resident == 0) return absl::OkStatus();
  if (v.arena == nullptr || v.page_tokens <= 0) {
    return bad("has no arena or page_tokens <= 0");
  }
  if (v.page_bytes < 2 * v.page_tokens * token_bytes) {
    return bad(absl::StrFormat("has page_bytes %d < 2 * %d tokens * %d",
                               v.page_bytes, v.page_tokens, token_bytes));
  }
  const int64_t pages = (v.resident + v.page_tokens - 1) / v.page_tokens;
  if (static_cast<int64_t>(v.pages.size()) < pages) {
    return bad(absl::StrFormat("has %d pages for %d slots of %d",
                               v.pages.size(), v.resident, v.page_tokens));
  }
  for (int64_t p = 0; p < pages; ++p) {
    if (v.pages[p] < 0) return bad("has a negative page id");
  }
  return absl::OkStatus();
}

// views: [sequence][layer], filled from each cache in layer order.
absl::Status CheckBatch(const ModelConfig& c, const KvFormat& kv,
                        absl::Span<const SequenceStep> batch,
                        std::vector<std::vector<ResidentKv>>* views) {
  views->resize(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    const SequenceStep& step = batch[b];
    auto bad = [&](std::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence %d: %s", b, what));
    };
    if (step.tokens.empty()) return bad("no tokens");
    if (step.positions.size() != step.tokens.size()) {
      return bad(absl::StrFormat("%d tokens but %d positions",
                                 step.tokens.size(), step.positions.size()));
    }
    for (size_t i = 0; i < step.tokens.size(); ++i) {
      if (step.tokens[i] < 0 || step.tokens[i] >= c.vocab) {
        return bad(absl::StrFormat("token %d is out of the vocabulary [0, %d)",
                                   step.tokens[i], c.vocab));
      }
      if (step.positions[i] < 0) return bad("a position is negative");
    }
    if (step.cache == nullptr) return bad("no cache");
    for (int32_t l = 0; l < c.layers; ++l) {
      (*views)[b].push_back(step.cache->Layer(l));
      if (absl::Status s =
              CheckView(kv.Layout(c).token_bytes(), (*views)[b].back(), b, l);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// One Forward: the batch's activations and scratch, layer by layer.
// Activations are [total][...] with sequence b's tokens at rows
// [row0_[b], row0_[b] + n_b).
class ForwardPass {
 public:
  ForwardPass(const ModelConfig& c, const KvFormat& kv, PositionMode mode,
              const ModelWeights& w, absl::Span<SequenceStep> batch,
              std::vector<std::vector<ResidentKv>> views,
              ForwardProfile* profile);
  // INVALID_ARGUMENT when a quantised format cannot hold a new token.
  absl::Status Run();

 private:
  int64_t n(size_t b) const {
    return static_cast<int64_t>(batch_[b].tokens.size());
  }
  // One task of the attention of sequence b. Tiled: its tokens [first,
  // last), the query heads of kv head g. Streaming: slot chunk `first`, all
  // heads (g unused).
  struct Task {
    size_t b;
    int32_t g;
    int64_t first, last;
  };
  GroupAttentionArgs Args(int32_t layer, size_t b, int32_t g, int64_t first,
                          int64_t last);
  absl::Status Attention(int32_t layer);
  absl::Status PrepareStep(int32_t layer, size_t b);
  void Gather(int32_t layer, size_t b, int32_t g);
  void Attend(int32_t layer, const Task& task);
  void Combine(int32_t layer, size_t b, int32_t g);
  void SumHeads(int32_t layer);
  absl::Status QuantizeStep(int32_t layer, size_t b);
  // Whether sequence b's attention reads its slots once into keys_ and
  // values_ (many passes over them) or streams them from the cache.
  bool Tiled(size_t b) const {
    return n(b) * (c_.query_heads / c_.kv_heads) > internal::kMaxVecs;
  }
  internal::SlotSource Slots(int32_t layer, size_t b, int32_t g) const;
  void FeedForward(int32_t layer);
  void Logits();
  // y [rows][out] = x [rows][in] W^T (+ y when accumulate); W: [out][in].
  void Linear(const float* x, int64_t rows, const std::vector<float>& w,
              int64_t in, int64_t out, bool accumulate, float* y);

  const ModelConfig& c_;
  const KvFormat kv_;
  const PageLayout layout_;  // of the cache (page_tokens unused)
  const bool quantized_;
  const PositionMode mode_;
  const ModelWeights& w_;
  absl::Span<SequenceStep> batch_;
  const std::vector<std::vector<ResidentKv>> views_;  // [b][layer]
  ForwardProfile* profile_;

  const int64_t q_width_;       // query_heads * head_dim
  const int64_t kv_width_;      // kv_heads * head_dim
  const int64_t qkv_width_;     // q_width_ + 2 kv_width_
  const int64_t token_bytes_;   // one token's keys in the cache
  const int64_t append_bytes_;  // ... in the step's output (append_dtype)
  std::vector<int64_t> row0_;
  int64_t total_ = 0;
  std::vector<float> x_;     // [total][embed], the residual stream
  std::vector<float> h_;     // [total][embed], normed
  std::vector<float> qkv_;   // [total][qkv_width]
  std::vector<float> attn_;  // [total][q_width]
  std::vector<float> gu_;    // [total][2 ffn]
  std::vector<float> act_;   // [total][ffn]
  // Per sequence (Tiled ones), this layer's keys and values as float32 in
  // slot order, RoPE applied, per kv head as TiledAttention reads them.
  std::vector<std::vector<float>> keys_, values_;
  // Per sequence, kCachePosition: slot -> rank among the resident
  // positions (empty: the slots are already in position order).
  std::vector<std::vector<int64_t>> ranks_;
  // Per sequence (streaming ones), [kv_heads][chunks] partial results.
  std::vector<std::vector<internal::StreamPartial>> partials_;
  // Per sequence, kReduced: [query_heads][n][resident + n].
  std::vector<std::vector<float>> probs_;
  // Per sequence, a quantised format: this layer's new keys and values as
  // the cache's records ([n][token_bytes]), what the attention reads.
  std::vector<std::vector<std::byte>> key_records_, value_records_;
};

ForwardPass::ForwardPass(const ModelConfig& c, const KvFormat& kv,
                         PositionMode mode, const ModelWeights& w,
                         absl::Span<SequenceStep> batch,
                         std::vector<std::vector<ResidentKv>> views,
                         ForwardProfile* profile)
    : c_(c),
      kv_(kv),
      layout_(kv.Layout(c)),
      quantized_(IsQuantized(kv.dtype)),
      mode_(mode),
      w_(w),
      batch_(batch),
      views_(std::move(views)),
      profile_(profile),
      q_width_(int64_t{c.query_heads} * c.head_dim),
      kv_width_(int64_t{c.kv_heads} * c.head_dim),
      qkv_width_(q_width_ + 2 * kv_width_),
      token_bytes_(layout_.token_bytes()),
      append_bytes_(kv_width_ * DTypeBytes(kv.append_dtype)) {
  for (size_t b = 0; b < batch_.size(); ++b) {
    row0_.push_back(total_);
    total_ += n(b);
  }
  x_.resize(total_ * c.embed);
  h_.resize(x_.size());
  qkv_.resize(total_ * qkv_width_);
  attn_.resize(total_ * q_width_);
  gu_.resize(total_ * 2 * c.ffn);
  act_.resize(total_ * c.ffn);
  keys_.resize(batch_.size());
  values_.resize(batch_.size());
  ranks_.resize(batch_.size());
  probs_.resize(batch_.size());
  partials_.resize(batch_.size());
  key_records_.resize(quantized_ ? batch_.size() : 0);
  value_records_.resize(key_records_.size());
}

absl::Status ForwardPass::Run() {
  for (size_t b = 0; b < batch_.size(); ++b) {
    SequenceStep& step = batch_[b];
    for (int64_t i = 0; i < n(b); ++i) {
      const float* row = &w_.token_embd[step.tokens[i] * int64_t{c_.embed}];
      std::copy(row, row + c_.embed, &x_[(row0_[b] + i) * c_.embed]);
    }
    step.keys.assign(c_.layers, std::string());
    step.values.assign(c_.layers, std::string());
    step.attention_out.assign(
        step.attention == AttentionOutput::kNone ? 0 : c_.layers, {});
  }
  for (int32_t l = 0; l < c_.layers; ++l) {
    if (absl::Status s = Attention(l); !s.ok()) return s;
    FeedForward(l);
  }
  Logits();
  return absl::OkStatus();
}

void ForwardPass::Linear(const float* x, int64_t rows,
                         const std::vector<float>& w, int64_t in, int64_t out,
                         bool accumulate, float* y) {
  const Clock::time_point start = Clock::now();
  const float beta = accumulate ? 1.0f : 0.0f;
  // Output columns in one slice per thread (whole multiples of 16, at least
  // 64), each a single-threaded OpenBLAS call.
  const int64_t threads = w_.pool->threads();
  const int64_t width =
      std::max<int64_t>(64, ((out + threads - 1) / threads + 15) / 16 * 16);
  const int64_t slices = (out + width - 1) / width;
  w_.pool->ParallelFor(slices, [&](int64_t slice) {
    const int64_t c0 = slice * width;
    const int64_t cols = std::min(width, out - c0);
    const float* ws = w.data() + c0 * in;
    if (rows == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, cols, in, 1.0f, ws, in, x, 1,
                  beta, y + c0, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, in, 1.0f,
                  x, in, ws, in, beta, y + c0, out);
    }
  });
  if (profile_ == nullptr) return;
  const double seconds = SecondsSince(start);
  for (ForwardProfile::Product& p : profile_->products) {
    if (p.rows == rows && p.in == in && p.out == out) {
      ++p.calls;
      p.seconds += seconds;
      return;
    }
  }
  profile_->products.push_back({rows, in, out, 1, seconds});
}

absl::Status ForwardPass::Attention(int32_t layer) {
  const LayerWeights& lw = w_.layers[layer];
  internal::RmsNorm(x_.data(), lw.attn_norm.data(), total_, c_.embed,
                    c_.rms_eps, h_.data());
  Linear(h_.data(), total_, lw.qkv, c_.embed, qkv_width_, false, qkv_.data());

  const Clock::time_point start = Clock::now();
  bool any_tiled = false;
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (absl::Status s = PrepareStep(layer, b); !s.ok()) return s;
    any_tiled |= Tiled(b);
  }
  const int32_t kv = c_.kv_heads;
  w_.pool->ParallelFor(
      any_tiled ? static_cast<int64_t>(batch_.size()) * kv : 0,
      [&](int64_t t) { Gather(layer, t / kv, static_cast<int32_t>(t % kv)); });
  std::vector<Task> tasks;
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (!Tiled(b)) {
      const int64_t chunks = internal::StreamChunks(Args(layer, b, 0, 0, n(b)));
      for (int64_t c = 0; c < chunks; ++c) tasks.push_back({b, 0, c, c + 1});
      continue;
    }
    for (int32_t g = 0; g < kv; ++g) {
      for (int64_t i = 0; i < n(b); i += kTaskTokens) {
        tasks.push_back({b, g, i, std::min(i + kTaskTokens, n(b))});
      }
    }
  }
  w_.pool->ParallelFor(static_cast<int64_t>(tasks.size()),
                       [&](int64_t t) { Attend(layer, tasks[t]); });
  bool any_streaming = false;
  for (size_t b = 0; b < batch_.size(); ++b) any_streaming |= !Tiled(b);
  w_.pool->ParallelFor(
      any_streaming ? static_cast<int64_t>(batch_.size()) * kv : 0,
      [&](int64_t t) { Combine(layer, t / kv, static_cast<int32_t>(t % kv)); });
  SumHeads(layer);
  if (profile_ != nullptr) profile_->attention_seconds += SecondsSince(start);
  Linear(attn_.data(), total_, lw.wo, q_width_, c_.embed, true, x_.data());
  return absl::OkStatus();
}

// Reads kv head g's slots of sequence b, if Tiled, into keys_ / values_.
void ForwardPass::Gather(int32_t layer, size_t b, int32_t g) {
  if (!Tiled(b)) return;
  const int64_t total = views_[b][layer].resident + n(b);
  internal::GatherSlots(
      Slots(layer, b, g), total,
      &keys_[b][g * internal::KeyFloats(total, c_.head_dim)],
      &values_[b][g * total * internal::ValueStride(c_.head_dim)]);
}

GroupAttentionArgs ForwardPass::Args(int32_t layer, size_t b, int32_t g,
                                     int64_t first, int64_t last) {
  const int32_t group = c_.query_heads / c_.kv_heads;
  const int64_t resident = views_[b][layer].resident;
  const int64_t head0 = int64_t{g} * group;
  GroupAttentionArgs a;
  a.head_dim = c_.head_dim;
  a.group = group;
  a.resident = resident;
  a.n = n(b);
  a.first = first;
  a.last = last;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c_.head_dim));
  a.q = &qkv_[row0_[b] * qkv_width_ + head0 * c_.head_dim];
  a.q_stride = qkv_width_;
  a.out = &attn_[row0_[b] * q_width_ + head0 * c_.head_dim];
  a.out_stride = q_width_;
  const AttentionOutput want = batch_[b].attention;
  if (want == AttentionOutput::kPerHead || want == AttentionOutput::kReduced) {
    std::vector<float>& p = want == AttentionOutput::kPerHead
                                ? batch_[b].attention_out[layer]
                                : probs_[b];
    a.probs_head_stride = a.n * (resident + a.n);
    a.probs = &p[head0 * a.probs_head_stride];
  }
  return a;
}

void ForwardPass::Attend(int32_t layer, const Task& task) {
  const size_t b = task.b;
  if (Tiled(b)) {
    const int64_t total = views_[b][layer].resident + n(b);
    internal::TiledAttention(
        Args(layer, b, task.g, task.first, task.last),
        &keys_[b][task.g * internal::KeyFloats(total, c_.head_dim)],
        &values_[b][task.g * total * internal::ValueStride(c_.head_dim)]);
    return;
  }
  // Every kv head of the chunk, one after the other: the token rows the
  // first head reads from memory bring the others' bytes into cache.
  const int64_t chunks =
      static_cast<int64_t>(partials_[b].size()) / c_.kv_heads;
  for (int32_t g = 0; g < c_.kv_heads; ++g) {
    internal::StreamingPartial(Args(layer, b, g, 0, n(b)), Slots(layer, b, g),
                               task.first,
                               &partials_[b][g * chunks + task.first]);
  }
}

// Streaming sequences: kv head g's chunks merged into its outputs.
void ForwardPass::Combine(int32_t layer, size_t b, int32_t g) {
  if (Tiled(b)) return;
  const int64_t chunks =
      static_cast<int64_t>(partials_[b].size()) / c_.kv_heads;
  internal::StreamingCombine(Args(layer, b, g, 0, n(b)),
                             &partials_[b][g * chunks]);
}

// kReduced: the per-head probabilities summed over heads, in head order.
void ForwardPass::SumHeads(int32_t layer) {
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (batch_[b].attention != AttentionOutput::kReduced) continue;
    const int64_t plane = n(b) * (views_[b][layer].resident + n(b));
    std::vector<float>& out = batch_[b].attention_out[layer];
    out.assign(probs_[b].begin(), probs_[b].begin() + plane);
    for (int32_t h = 1; h < c_.query_heads; ++h) {
      const float* p = &probs_[b][h * plane];
      for (int64_t k = 0; k < plane; ++k) out[k] += p[k];
    }
  }
}

// Rotates the sequence's new queries (and keys, kOriginal), rounds its keys
// and values into the step's outputs (and quantises them into records for a
// quantised format), and sizes this layer's buffers.
absl::Status ForwardPass::PrepareStep(int32_t layer, size_t b) {
  SequenceStep& step = batch_[b];
  const ResidentKv& view = views_[b][layer];
  const int64_t total = view.resident + n(b);
  std::string& keys = step.keys[layer];
  std::string& values = step.values[layer];
  keys.resize(n(b) * append_bytes_);
  values.resize(keys.size());
  for (int64_t i = 0; i < n(b); ++i) {
    float* q = &qkv_[(row0_[b] + i) * qkv_width_];
    float* k = q + q_width_;
    const float* v = k + kv_width_;
    const bool original = mode_ == PositionMode::kOriginal;
    w_.rope->Rotate(original ? step.positions[i] : view.resident + i,
                    c_.query_heads, q);
    if (original) w_.rope->Rotate(step.positions[i], c_.kv_heads, k);
    for (int64_t e = 0; e < kv_width_; ++e) {
      StoreFromFloat(kv_.append_dtype, &keys[i * append_bytes_], e, k[e]);
      StoreFromFloat(kv_.append_dtype, &values[i * append_bytes_], e, v[e]);
    }
    if (step.attention == AttentionOutput::kQueries) {
      step.attention_out[layer].insert(step.attention_out[layer].end(), q,
                                       q + q_width_);
    }
  }
  if (step.attention == AttentionOutput::kPerHead) {
    step.attention_out[layer].assign(c_.query_heads * n(b) * total, 0.0f);
  } else if (step.attention == AttentionOutput::kReduced) {
    probs_[b].resize(c_.query_heads * n(b) * total);
  }
  if (Tiled(b)) {
    keys_[b].resize(c_.kv_heads * internal::KeyFloats(total, c_.head_dim));
    values_[b].resize(c_.kv_heads * total * internal::ValueStride(c_.head_dim));
  } else {
    const int64_t chunks =
        (total + internal::kStreamChunk - 1) / internal::kStreamChunk;
    partials_[b].resize(c_.kv_heads * chunks);
  }
  if (quantized_) {
    if (absl::Status s = QuantizeStep(layer, b); !s.ok()) return s;
  }
  std::vector<int64_t>& rank = ranks_[b];
  rank.clear();
  if (mode_ != PositionMode::kCachePosition) return absl::OkStatus();
  const absl::Span<const int64_t> pos = view.positions;
  if (std::is_sorted(pos.begin(), pos.end())) return absl::OkStatus();
  std::vector<int64_t> order(pos.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return pos[x] < pos[y]; });
  rank.resize(pos.size());
  for (size_t r = 0; r < order.size(); ++r) rank[order[r]] = r;
  return absl::OkStatus();
}

absl::Status ForwardPass::QuantizeStep(int32_t layer, size_t b) {
  const SequenceStep& step = batch_[b];
  key_records_[b].resize(n(b) * token_bytes_);
  value_records_[b].resize(n(b) * token_bytes_);
  for (int kind = 0; kind < 2; ++kind) {
    const std::string& in = kind == 0 ? step.keys[layer] : step.values[layer];
    std::vector<std::byte>& out =
        kind == 0 ? key_records_[b] : value_records_[b];
    const QuantizeResult r =
        QuantizeTokens(layout_, kv_.append_dtype, in.data(), n(b), out.data());
    if (!r.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequence %d layer %d: %s of token %d (position %d), group at "
          "element %d: %s for %s",
          b, layer, kind == 0 ? "key" : "value", r.token,
          step.positions[r.token], r.element,
          r.error == QuantError::kNonFinite ? "not finite"
                                            : "too large for a binary16 scale",
          kv_.Name()));
    }
  }
  return absl::OkStatus();
}

internal::SlotSource ForwardPass::Slots(int32_t layer, size_t b,
                                        int32_t g) const {
  const ResidentKv& view = views_[b][layer];
  internal::SlotSource src;
  src.dtype = kv_.dtype;
  src.head_dim = c_.head_dim;
  src.arena = view.arena;
  src.pages = view.pages.data();
  src.page_tokens = std::max(view.page_tokens, 1);
  src.page_bytes = view.page_bytes;
  src.token_bytes = token_bytes_;
  src.resident = view.resident;
  if (quantized_) {  // whole records, head g read through the twin
    src.quantized = &layout_;
    src.head = g;
    src.new_keys = key_records_[b].data();
    src.new_values = value_records_[b].data();
  } else {
    src.head_offset = int64_t{g} * c_.head_dim * DTypeBytes(kv_.dtype);
    src.new_keys =
        reinterpret_cast<const std::byte*>(batch_[b].keys[layer].data());
    src.new_values =
        reinterpret_cast<const std::byte*>(batch_[b].values[layer].data());
  }
  if (mode_ == PositionMode::kCachePosition) {
    src.rope = w_.rope.get();
    src.ranks = ranks_[b].empty() ? nullptr : ranks_[b].data();
  }
  return src;
}

void ForwardPass::FeedForward(int32_t layer) {
  const LayerWeights& lw = w_.layers[layer];
  const int64_t f = c_.ffn;
  internal::RmsNorm(x_.data(), lw.ffn_norm.data(), total_, c_.embed, c_.rms_eps,
                    h_.data());
  Linear(h_.data(), total_, lw.gate_up, c_.embed, 2 * f, false, gu_.data());
  for (int64_t r = 0; r < total_; ++r) {
    internal::SwiGlu(&gu_[r * 2 * f], &gu_[r * 2 * f + f], f, &act_[r * f]);
  }
  Linear(act_.data(), total_, lw.down, f, c_.embed, true, x_.data());
}

void ForwardPass::Logits() {
  std::vector<int64_t> rows;  // of x_, in batch order
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (batch_[b].no_logits) continue;
    for (int64_t i = batch_[b].all_logits ? 0 : n(b) - 1; i < n(b); ++i) {
      rows.push_back(row0_[b] + i);
    }
  }
  const int64_t m = static_cast<int64_t>(rows.size());
  if (m == 0) {
    for (SequenceStep& step : batch_) step.logits.clear();
    return;
  }
  for (int64_t r = 0; r < m; ++r) {
    internal::RmsNorm(&x_[rows[r] * c_.embed], w_.output_norm.data(), 1,
                      c_.embed, c_.rms_eps, &h_[r * c_.embed]);
  }
  std::vector<float> logits(m * c_.vocab);
  Linear(h_.data(), m, w_.logits_weight(), c_.embed, c_.vocab, false,
         logits.data());
  int64_t r = 0;
  for (size_t b = 0; b < batch_.size(); ++b) {
    const int64_t count = batch_[b].no_logits    ? 0
                          : batch_[b].all_logits ? n(b)
                                                 : 1;
    batch_[b].logits.assign(logits.begin() + r * c_.vocab,
                            logits.begin() + (r + count) * c_.vocab);
    r += count;
  }
}

}  // namespace

struct LlamaModel::Weights : ModelWeights {};

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const GgufFile& file, const KvFormat& kv, PositionMode positions) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromGguf(file);
  if (!config.ok()) return config.status();
  Tensors tensors;
  for (const auto& [name, shape] : config->TensorShapes()) {
    absl::StatusOr<const GgufTensor*> t = file.Tensor(name);
    if (!t.ok()) return t.status();
    absl::StatusOr<std::vector<float>> values = GgufFile::Dequantize(**t);
    if (!values.ok()) return values.status();
    tensors[name] = *std::move(values);
  }
  return FromTensors(*config, std::move(tensors), kv, positions);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromTensors(
    const ModelConfig& config, Tensors tensors, const KvFormat& kv,
    PositionMode positions) {
  if (absl::Status s = config.Check(); !s.ok()) return s;
  if (absl::Status s = kv.Check(config); !s.ok()) return s;
  std::map<std::string, std::vector<float>> t;
  for (const auto& [name, shape] : config.TensorShapes()) {
    absl::StatusOr<std::vector<float>> values = Take(tensors, name, shape);
    if (!values.ok()) return values.status();
    t[name] = *std::move(values);
  }
  auto w = std::make_unique<Weights>();
  w->token_embd = std::move(t["token_embd.weight"]);
  w->output_norm = std::move(t["output_norm.weight"]);
  if (!config.tied_output) w->output = std::move(t["output.weight"]);
  for (int32_t l = 0; l < config.layers; ++l) {
    auto take = [&](std::string_view what) {
      return std::move(t[ModelConfig::LayerTensor(l, what)]);
    };
    LayerWeights& lw = w->layers.emplace_back();
    lw.attn_norm = take("attn_norm");
    std::vector<float> q = take("attn_q"), k = take("attn_k"),
                       v = take("attn_v");
    lw.qkv = Concat({&q, &k, &v});
    lw.wo = take("attn_output");
    lw.ffn_norm = take("ffn_norm");
    std::vector<float> gate = take("ffn_gate"), up = take("ffn_up");
    lw.gate_up = Concat({&gate, &up});
    lw.down = take("ffn_down");
  }
  // Tabulate RoPE for the model's context (4096 positions when unknown).
  w->rope = std::make_unique<RopeTable>(
      config.head_dim, config.rope_theta,
      std::clamp<int64_t>(config.context, 4096, 1 << 17));
  w->pool = std::make_unique<TaskPool>();
  openblas_set_num_threads(1);
  std::unique_ptr<LlamaModel> model(new LlamaModel());
  model->config_ = config;
  model->kv_ = kv;
  model->positions_ = positions;
  model->weights_ = std::move(w);
  return model;
}

LlamaModel::~LlamaModel() = default;

absl::Status LlamaModel::Forward(absl::Span<SequenceStep> batch,
                                 ForwardProfile* profile) const {
  const Clock::time_point start = Clock::now();
  std::vector<std::vector<ResidentKv>> views;
  if (absl::Status s = CheckBatch(config_, kv_, batch, &views); !s.ok()) {
    return s;
  }
  if (batch.empty()) return absl::OkStatus();
  if (absl::Status s = ForwardPass(config_, kv_, positions_, *weights_, batch,
                                   std::move(views), profile)
                           .Run();
      !s.ok()) {
    return s;
  }
  if (profile != nullptr) profile->total_seconds += SecondsSince(start);
  return absl::OkStatus();
}

}  // namespace kvkeep::lm
