#include "services/lm/model_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

namespace kvkeep::lm::internal {
namespace {

// The hot loops are compiled for AVX-512, AVX2+FMA and baseline x86-64, and
// the loader picks the best the CPU has (GCC's function multi-versioning), so
// one binary is fast on any x86 machine it lands on. One machine always runs
// the same clone, so results do not depend on the layout of the cache.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVKEEP_LM_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVKEEP_LM_CLONES
#endif

// One query vector of a block: token i's head j, and the slots it sees.
struct Vec {
  int64_t i;
  int32_t j;
  int64_t limit;  // resident + i + 1
};

// a . b over n floats. Lane-parallel partial sums folded as a tree: an
// `omp simd reduction` ends in a chain of 16 dependent scalar adds, which
// costs more than the products themselves at head_dim 64.
[[gnu::always_inline]] inline float Dot(const float* a, const float* b,
                                        int32_t n) {
  float part[kKeyTile] = {};
  int32_t d0 = 0;
  for (; d0 + kKeyTile <= n; d0 += kKeyTile) {
#pragma omp simd
    for (int l = 0; l < kKeyTile; ++l) part[l] += a[d0 + l] * b[d0 + l];
  }
  for (int32_t d = d0; d < n; ++d) part[d - d0] += a[d] * b[d];
  for (int w = kKeyTile / 2; w >= 1; w /= 2) {
#pragma omp simd
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  }
  return part[0];
}

// Requests the cache lines of `bytes` bytes at `row`. The streaming form
// reads one kv head's quarter of a token's row at a time, which the
// hardware prefetcher does not follow; fetching the whole row a few slots
// ahead keeps memory busy and has the other heads' bytes in cache when
// their turn comes.
constexpr int64_t kPrefetchSlots = 8;
[[gnu::always_inline]] inline void PrefetchRow(const std::byte* row,
                                               int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

// The next block of vectors of tokens [first, last) x the group's heads,
// from flat index *next on (token-major); returns its size, 0 at the end.
[[gnu::always_inline]] inline int NextBlock(const GroupAttentionArgs& a,
                                            int64_t* next, Vec* vecs) {
  const int64_t end = (a.last - a.first) * a.group;
  int count = 0;
  for (; *next < end && count < kMaxVecs; ++*next) {
    const int64_t i = a.first + *next / a.group;
    vecs[count++] = {i, static_cast<int32_t>(*next % a.group),
                     a.resident + i + 1};
  }
  return count;
}

// Copies the block's queries, scaled, into q [count][hd].
[[gnu::always_inline]] inline void LoadQueries(const GroupAttentionArgs& a,
                                               const Vec* vecs, int count,
                                               float* q) {
  for (int v = 0; v < count; ++v) {
    const float* src =
        a.q + vecs[v].i * a.q_stride + int64_t{vecs[v].j} * a.head_dim;
    for (int32_t d = 0; d < a.head_dim; ++d)
      q[v * a.head_dim + d] = src[d] * a.scale;
  }
}

// out (and probs) of the block's vectors from acc [count][acc_stride] and
// the probabilities scores [count][ld] over `keys` slots.
[[gnu::always_inline]] inline void Finish(const GroupAttentionArgs& a,
                                          const Vec* vecs, int count,
                                          const float* acc, int32_t acc_stride,
                                          const float* scores, int64_t ld,
                                          int64_t keys, const float* inv_sum) {
  const int64_t total = a.resident + a.n;
  for (int v = 0; v < count; ++v) {
    float* out =
        a.out + vecs[v].i * a.out_stride + int64_t{vecs[v].j} * a.head_dim;
    for (int32_t d = 0; d < a.head_dim; ++d) {
      out[d] = acc[v * acc_stride + d] * inv_sum[v];
    }
    if (a.probs == nullptr) continue;
    float* p = a.probs + vecs[v].j * a.probs_head_stride + vecs[v].i * total;
    for (int64_t s = 0; s < keys; ++s) p[s] = scores[v * ld + s] * inv_sum[v];
    std::fill(p + keys, p + total, 0.0f);
  }
}

// scores [V][ld] of tiles [t, t + U) = q [V][hd] . keys.
template <int V, int U>
[[gnu::always_inline]] inline void ScoreTileGroup(const float* q, int32_t hd,
                                                  const float* keys, int64_t t,
                                                  float* scores, int64_t ld) {
  float acc[U][V][kKeyTile] = {};
  for (int32_t d = 0; d < hd; ++d) {
    for (int u = 0; u < U; ++u) {
      const float* k = keys + ((t + u) * hd + d) * kKeyTile;
      for (int v = 0; v < V; ++v) {
        const float qd = q[v * hd + d];
#pragma omp simd
        for (int l = 0; l < kKeyTile; ++l) acc[u][v][l] += qd * k[l];
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    for (int v = 0; v < V; ++v) {
      std::copy(acc[u][v], acc[u][v] + kKeyTile,
                scores + v * ld + (t + u) * kKeyTile);
    }
  }
}

// scores [V][ld] = q [V][hd] . keys, for tiles [0, tiles) of kKeyTile slots.
// U tiles at a time, so that small blocks (V = 3) still have enough
// independent accumulators to hide the FMA latency.
template <int V>
[[gnu::always_inline]] inline void ScoreTiles(const float* q, int32_t hd,
                                              const float* keys, int64_t tiles,
                                              float* scores, int64_t ld) {
  constexpr int U = V >= 6 ? 1 : (V >= 3 ? 3 : 6);
  int64_t t = 0;
  for (; t + U <= tiles; t += U)
    ScoreTileGroup<V, U>(q, hd, keys, t, scores, ld);
  for (; t < tiles; ++t) ScoreTileGroup<V, 1>(q, hd, keys, t, scores, ld);
}

// Whole token rows to prefetch around value rows in the cache: `back` bytes
// before each row, `bytes` long (0: none).
struct Prefetch {
  int64_t back = 0;
  int64_t bytes = 0;
};

// acc [V][stride] lanes [d0, d0 + C kKeyTile) = probs [V][ld] . rows over
// slots [0, keys); rows[s]: slot s's value, at least d0 + C kKeyTile floats.
template <int V, int C>
[[gnu::always_inline]] inline void WeightedSumGroup(
    const float* probs, int64_t ld, const float* const* rows, int64_t keys,
    int32_t d0, int32_t stride, float* acc_out, const Prefetch& prefetch) {
  float acc[V][C][kKeyTile] = {};
  for (int64_t s = 0; s < keys; ++s) {
    if (prefetch.bytes > 0 && s + kPrefetchSlots < keys) {
      PrefetchRow(reinterpret_cast<const std::byte*>(rows[s + kPrefetchSlots]) -
                      prefetch.back,
                  prefetch.bytes);
    }
    const float* value = rows[s] + d0;
    for (int v = 0; v < V; ++v) {
      const float w = probs[v * ld + s];
      for (int c = 0; c < C; ++c) {
#pragma omp simd
        for (int l = 0; l < kKeyTile; ++l) {
          acc[v][c][l] += w * value[c * kKeyTile + l];
        }
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    for (int c = 0; c < C; ++c) {
      std::copy(acc[v][c], acc[v][c] + kKeyTile,
                acc_out + v * stride + d0 + c * kKeyTile);
    }
  }
}

// acc [V][stride] = probs [V][ld] . rows over slots [0, keys) (stride: a
// multiple of kKeyTile), C chunks of kKeyTile lanes at a time for the same
// reason as ScoreTiles' U.
template <int V>
[[gnu::always_inline]] inline void WeightedSums(const float* probs, int64_t ld,
                                                const float* const* rows,
                                                int32_t stride, int64_t keys,
                                                float* acc_out,
                                                const Prefetch& prefetch = {}) {
  constexpr int C = V <= 4 ? 4 : 2;
  int32_t d0 = 0;
  for (; d0 + C * kKeyTile <= stride; d0 += C * kKeyTile) {
    WeightedSumGroup<V, C>(probs, ld, rows, keys, d0, stride, acc_out,
                           prefetch);
  }
  for (; d0 < stride; d0 += kKeyTile) {
    WeightedSumGroup<V, 1>(probs, ld, rows, keys, d0, stride, acc_out,
                           prefetch);
  }
}

// Unnormalised probabilities e^(score - max) of one vector's scores row
// over its `limit` slots (zero from there to `keys`); returns 1 / their sum.
[[gnu::always_inline]] inline float Softmax(float* row, int64_t limit,
                                            int64_t keys, float max) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t s = 0; s < limit; ++s) {
    row[s] = FastExp(row[s] - max);
    sum += row[s];
  }
  std::fill(row + limit, row + keys, 0.0f);
  return 1.0f / sum;
}
[[gnu::always_inline]] inline float Softmax(float* row, int64_t limit,
                                            int64_t keys) {
  float max = row[0];
  for (int64_t s = 1; s < limit; ++s) max = std::max(max, row[s]);
  return Softmax(row, limit, keys, max);
}

// Per-thread buffers of the attention, kept between calls.
struct Scratch {
  std::vector<float> q, scores, acc, values, scale;
  std::vector<const float*> rows;
  std::vector<const std::byte*> key_at, value_at;
};
thread_local Scratch scratch;

// One block of V vectors of the tiled form: scores, softmax, weighted
// sums, outputs. rows: each slot's value row.
template <int V>
[[gnu::always_inline]] inline void TiledBlock(const GroupAttentionArgs& a,
                                              const Vec* vecs,
                                              const float* keys,
                                              const float* const* rows) {
  const int32_t hd = a.head_dim;
  const int32_t stride = ValueStride(hd);
  const int64_t count = vecs[V - 1].limit;  // slots the block reads
  const int64_t tiles = (count + kKeyTile - 1) / kKeyTile;
  const int64_t ld = tiles * kKeyTile;
  Scratch& sc = scratch;
  sc.q.resize(V * hd);
  sc.scores.resize(V * ld);
  sc.acc.resize(V * stride);
  LoadQueries(a, vecs, V, sc.q.data());
  ScoreTiles<V>(sc.q.data(), hd, keys, tiles, sc.scores.data(), ld);
  float inv_sum[V];
  for (int v = 0; v < V; ++v) {
    inv_sum[v] = Softmax(&sc.scores[v * ld], vecs[v].limit, count);
  }
  WeightedSums<V>(sc.scores.data(), ld, rows, stride, count, sc.acc.data());
  Finish(a, vecs, V, sc.acc.data(), stride, sc.scores.data(), ld, count,
         inv_sum);
}

// The streaming form's partial over slots [c0, c1): each slot's key read
// from the cache (key_at[s - c0]), its value from rows[s - c0] (value rows
// of `stride` floats).
template <int V>
[[gnu::always_inline]] inline void StreamingBlock(
    const GroupAttentionArgs& a, const Vec* vecs, const SlotSource& slots,
    int64_t c0, int64_t c1, const std::byte* const* key_at,
    const float* const* rows, int32_t stride, const Prefetch& prefetch,
    StreamPartial* part) {
  const int32_t hd = a.head_dim;
  const int64_t count = c1 - c0;
  Scratch& sc = scratch;
  sc.q.resize(V * hd);
  sc.scores.resize(V * count);
  part->stride = stride;
  part->acc.resize(V * stride);
  LoadQueries(a, vecs, V, sc.q.data());
  float buf[kMaxHeadDim];
  for (int64_t k = 0; k < count; ++k) {
    if (k + kPrefetchSlots < count) {
      PrefetchRow(key_at[k + kPrefetchSlots] - slots.head_offset,
                  slots.token_bytes);
    }
    const float* key = slots.Key(c0 + k, key_at[k], buf);
    for (int v = 0; v < V; ++v) {
      sc.scores[v * count + k] = Dot(&sc.q[v * hd], key, hd);
    }
  }
  for (int v = 0; v < V; ++v) {
    float* row = &sc.scores[v * count];
    const int64_t limit = std::min(vecs[v].limit, c1) - c0;
    if (limit <= 0) {  // the whole chunk is past this vector's diagonal
      part->max[v] = 0;
      part->sum[v] = 0;
      std::fill(row, row + count, 0.0f);
      continue;
    }
    part->max[v] = row[0];
    for (int64_t k = 1; k < limit; ++k)
      part->max[v] = std::max(part->max[v], row[k]);
    part->sum[v] = 1.0f / Softmax(row, limit, count, part->max[v]);
  }
  WeightedSums<V>(sc.scores.data(), count, rows, stride, count,
                  part->acc.data(), prefetch);
  if (a.probs == nullptr) return;
  const int64_t total = a.resident + a.n;
  for (int v = 0; v < V; ++v) {
    float* p = a.probs + vecs[v].j * a.probs_head_stride + vecs[v].i * total;
    std::copy(&sc.scores[v * count], &sc.scores[v * count] + count, p + c0);
  }
}

// Block<count>(...) for count in [1, kMaxVecs].
template <int... V>
[[gnu::always_inline]] inline void TiledDispatch(
    const GroupAttentionArgs& a, const Vec* vecs, int count, const float* keys,
    const float* const* rows, std::integer_sequence<int, V...>) {
  ((count == V + 1 ? TiledBlock<V + 1>(a, vecs, keys, rows) : void()), ...);
}
template <int... V>
[[gnu::always_inline]] inline void StreamingDispatch(
    const GroupAttentionArgs& a, const Vec* vecs, int count,
    const SlotSource& slots, int64_t c0, int64_t c1,
    const std::byte* const* key_at, const float* const* rows, int32_t stride,
    const Prefetch& prefetch, StreamPartial* part,
    std::integer_sequence<int, V...>) {
  ((count == V + 1 ? StreamingBlock<V + 1>(a, vecs, slots, c0, c1, key_at, rows,
                                           stride, prefetch, part)
                   : void()),
   ...);
}

}  // namespace

KVKEEP_LM_CLONES
void ToFloat(DType dtype, const std::byte* src, int64_t count, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kF16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(h[i]);
      return;
    }
    case DType::kBF16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < count; ++i) {
        out[i] = std::bit_cast<float>(static_cast<uint32_t>(h[i]) << 16);
      }
      return;
    }
    default:  // quantised records are read through WidenHead (SlotSource)
      std::memset(out, 0, static_cast<size_t>(count) * sizeof(float));
      return;
  }
}

KVKEEP_LM_CLONES
void RmsNorm(const float* x, const float* weight, int64_t rows, int32_t dim,
             float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int32_t d = 0; d < dim; ++d) sum += in[d] * in[d];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    float* o = out + r * dim;
#pragma omp simd
    for (int32_t d = 0; d < dim; ++d) o[d] = in[d] * inv * weight[d];
  }
}

KVKEEP_LM_CLONES
void SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    out[i] = gate[i] / (1.0f + FastExp(-gate[i])) * up[i];
  }
}

RopeTable::RopeTable(int32_t head_dim, float theta, int64_t tabulated)
    : half_(head_dim / 2), inv_freq_(half_), tabulated_(tabulated) {
  for (int32_t i = 0; i < half_; ++i) {
    const float exponent =
        static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq_[i] = 1.0f / std::pow(theta, exponent);
  }
  cos_.resize(static_cast<size_t>(tabulated_ * half_));
  sin_.resize(cos_.size());
  for (int64_t p = 0; p < tabulated_; ++p) {
    Angles(p, &cos_[p * half_], &sin_[p * half_]);
  }
}

void RopeTable::Angles(int64_t position, float* cos_out, float* sin_out) const {
  const float p = static_cast<float>(position);
  for (int32_t i = 0; i < half_; ++i) {
    const double angle = static_cast<double>(p * inv_freq_[i]);
    cos_out[i] = static_cast<float>(std::cos(angle));
    sin_out[i] = static_cast<float>(std::sin(angle));
  }
}

void RopeTable::Rotate(int64_t position, int32_t heads, float* x) const {
  float cos_buf[kMaxHeadDim / 2], sin_buf[kMaxHeadDim / 2];
  const float* c = cos_buf;
  const float* s = sin_buf;
  if (position < tabulated_) {
    c = &cos_[position * half_];
    s = &sin_[position * half_];
  } else {
    Angles(position, cos_buf, sin_buf);
  }
  for (int32_t h = 0; h < heads; ++h) {
    float* v = x + static_cast<int64_t>(h) * 2 * half_;
    for (int32_t i = 0; i < half_; ++i) {
      const float x0 = v[2 * i];
      const float x1 = v[2 * i + 1];
      v[2 * i] = x0 * c[i] - x1 * s[i];
      v[2 * i + 1] = x0 * s[i] + x1 * c[i];
    }
  }
}

void SlotSource::Addresses(int64_t first, int64_t count, const std::byte** keys,
                           const std::byte** values) const {
  const int64_t end = first + count;
  const int64_t in_cache = std::min(end, resident);
  const int64_t to_value = page_tokens * token_bytes;
  int64_t s = first;
  while (s < in_cache) {
    const int64_t in_page = s % page_tokens;
    const std::byte* key = arena + pages[s / page_tokens] * page_bytes +
                           in_page * token_bytes + head_offset;
    const int64_t last = std::min(s + page_tokens - in_page, in_cache);
    for (; s < last; ++s, key += token_bytes) {
      keys[s - first] = key;
      values[s - first] = key + to_value;
    }
  }
  for (; s < end; ++s) {
    keys[s - first] = new_keys + (s - resident) * token_bytes + head_offset;
    values[s - first] = new_values + (s - resident) * token_bytes + head_offset;
  }
}

KVKEEP_LM_CLONES
void GatherSlots(const SlotSource& slots, int64_t total, float* keys,
                 float* values) {
  const int32_t hd = slots.head_dim;
  const int32_t stride = ValueStride(hd);
  float buf[kMaxHeadDim];
  std::vector<const std::byte*>& key_at = scratch.key_at;
  std::vector<const std::byte*>& value_at = scratch.value_at;
  key_at.resize(total);
  value_at.resize(total);
  slots.Addresses(0, total, key_at.data(), value_at.data());
  for (int64_t s = 0; s < total; ++s) {
    const float* key = slots.Key(s, key_at[s], buf);
    float* tile = keys + s / kKeyTile * kKeyTile * hd + s % kKeyTile;
    for (int32_t d = 0; d < hd; ++d) tile[d * kKeyTile] = key[d];
    float* row = values + s * stride;
    const float* value = slots.Value(value_at[s], row);
    if (value != row) std::copy(value, value + hd, row);
    std::fill(row + hd, row + stride, 0.0f);
  }
}

KVKEEP_LM_CLONES
void TiledAttention(const GroupAttentionArgs& a, const float* keys,
                    const float* values) {
  const int32_t stride = ValueStride(a.head_dim);
  const int64_t total = a.resident + a.last;  // the widest block's slots
  std::vector<const float*>& rows = scratch.rows;
  rows.resize(total);
  for (int64_t s = 0; s < total; ++s) rows[s] = values + s * stride;
  Vec vecs[kMaxVecs];
  int64_t next = 0;
  for (int count; (count = NextBlock(a, &next, vecs)) > 0;) {
    TiledDispatch(a, vecs, count, keys, rows.data(),
                  std::make_integer_sequence<int, kMaxVecs>());
  }
}

KVKEEP_LM_CLONES
void StreamingPartial(const GroupAttentionArgs& a, const SlotSource& slots,
                      int64_t chunk, StreamPartial* part) {
  const int32_t hd = a.head_dim;
  const int64_t c0 = chunk * kStreamChunk;
  const int64_t c1 = std::min(c0 + kStreamChunk, a.resident + a.last);
  const int64_t count = c1 - c0;
  Scratch& sc = scratch;
  sc.key_at.resize(count);
  sc.value_at.resize(count);
  sc.rows.resize(count);
  slots.Addresses(c0, count, sc.key_at.data(), sc.value_at.data());
  // Value rows straight from the cache when they are float32 of whole
  // kKeyTile lanes, else converted (and padded) here.
  const bool in_place = slots.dtype == DType::kF32 && hd % kKeyTile == 0;
  const int32_t stride = in_place ? hd : ValueStride(hd);
  Prefetch prefetch;  // of the value rows read in place
  if (in_place) {
    prefetch = {slots.head_offset, slots.token_bytes};
    for (int64_t k = 0; k < count; ++k) {
      sc.rows[k] = reinterpret_cast<const float*>(sc.value_at[k]);
    }
  } else {
    sc.values.resize(count * stride);
    for (int64_t k = 0; k < count; ++k) {
      float* row = &sc.values[k * stride];
      if (k + kPrefetchSlots < count) {
        PrefetchRow(sc.value_at[k + kPrefetchSlots] - slots.head_offset,
                    slots.token_bytes);
      }
      slots.Widen(sc.value_at[k], row);
      std::fill(row + hd, row + stride, 0.0f);
      sc.rows[k] = row;
    }
  }
  Vec vecs[kMaxVecs];
  int64_t next = 0;
  const int count_vecs = NextBlock(a, &next, vecs);  // one block: see .h
  StreamingDispatch(a, vecs, count_vecs, slots, c0, c1, sc.key_at.data(),
                    sc.rows.data(), stride, prefetch, part,
                    std::make_integer_sequence<int, kMaxVecs>());
}

void StreamingCombine(const GroupAttentionArgs& a, const StreamPartial* parts) {
  const int32_t hd = a.head_dim;
  const int64_t chunks = StreamChunks(a);
  const int64_t total = a.resident + a.n;
  Vec vecs[kMaxVecs];
  int64_t next = 0;
  const int count = NextBlock(a, &next, vecs);
  for (int v = 0; v < count; ++v) {
    float max = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) {
      if (parts[c].sum[v] > 0) max = std::max(max, parts[c].max[v]);
    }
    std::vector<float>& scale = scratch.scale;  // per chunk
    scale.resize(chunks);
    float sum = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      scale[c] = parts[c].sum[v] > 0 ? FastExp(parts[c].max[v] - max) : 0.0f;
      sum += parts[c].sum[v] * scale[c];
    }
    float* out = a.out + vecs[v].i * a.out_stride + int64_t{vecs[v].j} * hd;
    std::fill(out, out + hd, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      scale[c] /= sum;
      if (scale[c] == 0) continue;
      const float* acc = &parts[c].acc[v * parts[c].stride];
      for (int32_t d = 0; d < hd; ++d) out[d] += acc[d] * scale[c];
    }
    if (a.probs == nullptr) continue;
    float* p = a.probs + vecs[v].j * a.probs_head_stride + vecs[v].i * total;
    for (int64_t s = 0; s < vecs[v].limit; ++s) p[s] *= scale[s / kStreamChunk];
    std::fill(p + vecs[v].limit, p + total, 0.0f);
  }
}

void StreamingAttention(const GroupAttentionArgs& a, const SlotSource& slots) {
  std::vector<StreamPartial> parts(StreamChunks(a));
  for (size_t c = 0; c < parts.size(); ++c) {
    StreamingPartial(a, slots, static_cast<int64_t>(c), &parts[c]);
  }
  StreamingCombine(a, parts.data());
}

// A ParallelFor's items, handed out one at a time through `next`.
struct TaskPool::Job {
  absl::FunctionRef<void(int64_t)> fn;
  int64_t count;
  std::atomic<int64_t> next{0};
};

namespace {

// Polls of a spinning wait: about 0.1 ms of x86 `pause`s.
constexpr int kSpins = 4000;

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

TaskPool::TaskPool(int32_t threads) {
  for (int32_t t = 1; t < threads; ++t) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    generation_.fetch_add(1);
    work_cv_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

void TaskPool::RunItems(Job& job) {
  for (int64_t i = job.next.fetch_add(1); i < job.count;
       i = job.next.fetch_add(1)) {
    job.fn(i);
  }
}

void TaskPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    for (int i = 0; i < kSpins && generation_.load() == seen; ++i) Pause();
    Job* job;
    {
      absl::MutexLock lock(&mu_);
      // A job that ended before this worker looked (job_ == nullptr) is
      // skipped.
      while (!stop_ && (generation_.load() == seen || job_ == nullptr)) {
        seen = generation_.load();
        work_cv_.Wait(&mu_);
      }
      if (stop_) return;
      seen = generation_.load();
      job = job_;
      active_.fetch_add(1);
    }
    RunItems(*job);
    if (active_.fetch_sub(1) == 1) {
      absl::MutexLock lock(&mu_);
      done_cv_.SignalAll();
    }
  }
}

void TaskPool::ParallelFor(int64_t count, absl::FunctionRef<void(int64_t)> fn) {
  Job job{fn, count};
  if (count <= 1 || workers_.empty()) {
    RunItems(job);
    return;
  }
  if (!run_mu_.TryLock()) {  // another caller has the workers
    RunItems(job);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_ = &job;
    generation_.fetch_add(1);
    work_cv_.SignalAll();
  }
  RunItems(job);
  {
    // Every item is taken: workers that have not joined never will.
    absl::MutexLock lock(&mu_);
    job_ = nullptr;
  }
  // The job (on this stack) must outlive the workers inside it.
  for (int i = 0; i < kSpins && active_.load() > 0; ++i) Pause();
  {
    absl::MutexLock lock(&mu_);
    while (active_.load() > 0) done_cv_.Wait(&mu_);
  }
  run_mu_.Unlock();
}

}  // namespace kvkeep::lm::internal
