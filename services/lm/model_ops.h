// The building blocks of LlamaModel's forward pass (model.cc), apart so that
// tests/lm/model_test.cc can hold each one against a naive twin: RMSNorm,
// RoPE on adjacent pairs, exp and the cache's element conversions in forms
// the compiler vectorises, one kv head's causal attention (a streaming form
// for decode, a tiled one for prefill), and the task pool the whole forward
// pass runs on. Internal to services/lm: only model.cc and its tests
// include it.
//
// Thread-safety: the functions are stateless; a RopeTable is immutable after
// construction; a TaskPool is thread-safe.
#ifndef KVKEEP_SERVICES_LM_MODEL_OPS_H_
#define KVKEEP_SERVICES_LM_MODEL_OPS_H_

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "kernels/dtype.h"
#include "kernels/fast_exp.h"
#include "kernels/quantize.h"

namespace kvkeep::lm::internal {

// The largest head the RoPE and attention code takes (ModelConfig refuses
// larger ones).
inline constexpr int32_t kMaxHeadDim = 512;

// e^x (kernels/fast_exp.h) and binary16 -> float (kernels/dtype.h), both
// branch-free so that loops over them vectorise; the store's query scoring
// uses the same two.
using ::kvkeep::FastExp;
using ::kvkeep::HalfToFloat;

// out[i] = element i of the `count` elements of `dtype` at src, exactly.
void ToFloat(DType dtype, const std::byte* src, int64_t count, float* out);

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row r.
// x, out: [rows][dim] (may alias); weight: [dim].
void RmsNorm(const float* x, const float* weight, int64_t rows, int32_t dim,
             float eps, float* out);

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i].
void SwiGlu(const float* gate, const float* up, int64_t count, float* out);

// RoPE as llama.cpp's "normal" mode computes it on the weights its GGUF
// converter permuted: the adjacent pairs (x[2i], x[2i+1]) of a head vector
// rotate by angle p * f_i, f_i = theta^(-2i/head_dim). Angles are formed as
// Hugging Face forms them (f_i and p * f_i in float32), then cos and sin in
// double rounded to float. Positions below `tabulated` read a table made at
// construction; larger ones compute the same values on use.
class RopeTable {
 public:
  RopeTable(int32_t head_dim, float theta, int64_t tabulated);

  // Rotates `heads` consecutive head vectors at x ([heads][head_dim]), all
  // by `position` (>= 0). head_dim <= kMaxHeadDim.
  void Rotate(int64_t position, int32_t heads, float* x) const;

  int32_t head_dim() const { return 2 * half_; }

 private:
  // cos and sin of position * inv_freq_[i], computed (never from the table).
  void Angles(int64_t position, float* cos_out, float* sin_out) const;

  int32_t half_;
  std::vector<float> inv_freq_;  // [half]
  int64_t tabulated_;
  std::vector<float> cos_, sin_;  // [tabulated][half]
};

// Where one kv head's slots of one sequence are, in slot order: the
// resident slots in a paged cache (model.h's ResidentKv), then the step's
// new tokens. Elements are of `dtype` (a float dtype), or every slot is a
// whole quantised token record of `quantized`'s layout of which head `head`
// is read through the CPU twin (kernels/quantize.h's WidenHead); keys are
// rotated at use when `rope` is set (kCachePosition). A plain view; reading
// it is thread-safe.
struct SlotSource {
  DType dtype = DType::kF32;
  int32_t head_dim = 0;
  // Resident slot s's key: arena + pages[s / page_tokens] * page_bytes +
  // (s % page_tokens) * token_bytes + head_offset; its value page_tokens *
  // token_bytes further.
  const std::byte* arena = nullptr;
  const int32_t* pages = nullptr;
  int32_t page_tokens = 1;
  int64_t page_bytes = 0;
  int64_t token_bytes = 0;  // all kv heads of a token
  int64_t head_offset = 0;  // bytes from a token's keys to this head's
  // Quantised records (head_offset 0): their layout, and the head read.
  const PageLayout* quantized = nullptr;
  int32_t head = 0;
  int64_t resident = 0;
  // The step's token i (slot resident + i): new_keys + i * token_bytes +
  // head_offset, and the same in new_values.
  const std::byte* new_keys = nullptr;
  const std::byte* new_values = nullptr;
  // When set, keys rotate at use: resident slot s by ranks[s] (by s when
  // ranks is null), new slots by their slot index.
  const RopeTable* rope = nullptr;
  const int64_t* ranks = nullptr;

  const std::byte* KeyBytes(int64_t s) const {
    return s < resident ? arena + pages[s / page_tokens] * page_bytes +
                              (s % page_tokens) * token_bytes + head_offset
                        : new_keys + (s - resident) * token_bytes + head_offset;
  }
  const std::byte* ValueBytes(int64_t s) const {
    return s < resident
               ? KeyBytes(s) + page_tokens * token_bytes
               : new_values + (s - resident) * token_bytes + head_offset;
  }
  // Slot s's key / value as float32 (the key rotated when asked), from its
  // bytes: a pointer into the cache when it holds exactly that, else `buf`
  // (head_dim floats) filled.
  const float* Key(int64_t s, const std::byte* bytes, float* buf) const {
    if (dtype == DType::kF32 && rope == nullptr) {
      return reinterpret_cast<const float*>(bytes);
    }
    Widen(bytes, buf);
    if (rope != nullptr) {
      rope->Rotate(s < resident && ranks != nullptr ? ranks[s] : s, 1, buf);
    }
    return buf;
  }
  const float* Value(const std::byte* bytes, float* buf) const {
    if (dtype == DType::kF32) return reinterpret_cast<const float*>(bytes);
    Widen(bytes, buf);
    return buf;
  }
  // The head's head_dim elements at `bytes` (KeyBytes / ValueBytes) as
  // float32 into out.
  void Widen(const std::byte* bytes, float* out) const {
    if (quantized != nullptr) {
      WidenHead(*quantized, bytes, head, out);
    } else {
      ToFloat(dtype, bytes, head_dim, out);
    }
  }
  // keys[k] = KeyBytes(first + k) and values[k] = ValueBytes(first + k)
  // for k in [0, count), a page at a time (no division per slot).
  void Addresses(int64_t first, int64_t count, const std::byte** keys,
                 const std::byte** values) const;
};

// One kv head's share of a sequence's attention: its `group` query heads,
// for the step's tokens [first, last). Token i (0 <= i < n) attends to the
// first resident + i + 1 slots. Scores are q.k * scale, softmaxed in
// float32 after subtracting their max. Query vectors (tokens x heads) go
// kMaxVecs at a time, each block one pass over the slots.
inline constexpr int kMaxVecs = 12;
struct GroupAttentionArgs {
  int32_t head_dim = 0;
  int32_t group = 0;  // query heads per kv head
  int64_t resident = 0;
  int64_t n = 0;
  int64_t first = 0;  // tokens [first, last) of the step's n
  int64_t last = 0;
  float scale = 0;
  // q + i * q_stride + j * head_dim: token i's query head j of the group.
  const float* q = nullptr;
  int64_t q_stride = 0;
  // out + i * out_stride + j * head_dim: the result for the same.
  float* out = nullptr;
  int64_t out_stride = 0;
  // When set, probs + j * probs_head_stride + i * (resident + n) + s gets
  // head j's probability of slot s for token i (0 past the diagonal).
  float* probs = nullptr;
  int64_t probs_head_stride = 0;
};

// The streaming form, for steps whose vectors fit one block (decode:
// (last - first) * group <= kMaxVecs), where one pass over the slots is all
// there is: keys and values are read from the cache as they are used (no
// copy when it is float32 and needs no rotation). The slots go in chunks of
// kStreamChunk, each giving a partial softmax (its max, its sum and its
// weighted sum per vector) that StreamingCombine merges, so that chunks can
// run in parallel and a task can run every kv head of a chunk while the
// token rows it shares with the other heads are in cache. The chunking is
// fixed, so results do not depend on how many threads ran them.
inline constexpr int64_t kStreamChunk = 512;
inline int64_t StreamChunks(const GroupAttentionArgs& a) {
  return (a.resident + a.last + kStreamChunk - 1) / kStreamChunk;
}
struct StreamPartial {
  int32_t stride = 0;  // of acc's rows
  float max[kMaxVecs];
  float sum[kMaxVecs];     // 0: the chunk lies past the vector's diagonal
  std::vector<float> acc;  // [vectors][stride], not normalised
};
// Chunk `chunk` of the slots into *part. probs (when set) get the chunk's
// unnormalised probabilities, which StreamingCombine rescales.
void StreamingPartial(const GroupAttentionArgs& a, const SlotSource& slots,
                      int64_t chunk, StreamPartial* part);
// The chunks' partials (in chunk order) into out and probs.
void StreamingCombine(const GroupAttentionArgs& a, const StreamPartial* parts);
// Both, over every chunk, on this thread.
void StreamingAttention(const GroupAttentionArgs& a, const SlotSource& slots);

// The tiled form, for steps of many passes (prefill): the slots read once,
// by GatherSlots, into
//   keys:   [ceil(total / kKeyTile)][head_dim][kKeyTile] (slot s is lane
//           s % kKeyTile of tile s / kKeyTile), so that scores are
//           kKeyTile-wide vector products with 12 vectors' accumulators;
//   values: [total][ValueStride(head_dim)], zero past head_dim.
inline constexpr int32_t kKeyTile = 16;
inline int64_t KeyFloats(int64_t total, int32_t head_dim) {
  return (total + kKeyTile - 1) / kKeyTile * kKeyTile * head_dim;
}
inline int32_t ValueStride(int32_t head_dim) {
  return (head_dim + kKeyTile - 1) / kKeyTile * kKeyTile;
}
// Reads slots [0, total) of `slots` into keys and values laid out so.
void GatherSlots(const SlotSource& slots, int64_t total, float* keys,
                 float* values);
void TiledAttention(const GroupAttentionArgs& args, const float* keys,
                    const float* values);

// A fixed set of threads that run ParallelFor's items alongside its caller.
// Between jobs a worker spins for about 0.1 ms before it sleeps, so the
// short jobs of a forward pass (one per matrix product and two per layer's
// attention) do not each wait for a wake-up. Thread-safe; a ParallelFor
// made while another one runs does its items on its own thread rather than
// wait.
class TaskPool {
 public:
  // `threads` counts the caller: threads - 1 workers are started.
  explicit TaskPool(int32_t threads = static_cast<int32_t>(
                        std::thread::hardware_concurrency()));
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;
  ~TaskPool();

  int32_t threads() const { return static_cast<int32_t>(workers_.size()) + 1; }

  // Runs fn(i) once for every i in [0, count), in no particular order, and
  // returns when all have returned.
  void ParallelFor(int64_t count, absl::FunctionRef<void(int64_t)> fn);

 private:
  struct Job;
  void WorkerLoop();
  static void RunItems(Job& job);

  absl::Mutex run_mu_;  // held by the ParallelFor that uses the workers
  absl::Mutex mu_;
  absl::CondVar work_cv_;
  absl::CondVar done_cv_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Bumped (under mu_) for every job; read without it while spinning.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int32_t> active_{0};  // workers inside the current job
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvkeep::lm::internal

#endif  // KVKEEP_SERVICES_LM_MODEL_OPS_H_
