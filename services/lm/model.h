// A Llama-architecture causal language model (SmolLM2 and its kin) read from
// a GGUF file and run on the CPU: token embedding, per layer RMSNorm, GQA
// attention with RoPE, RMSNorm, SwiGLU feed-forward; final RMSNorm and the
// output projection (tied to the embedding when the file has no
// output.weight). Weights are dequantised to float32 once, at load; matrix
// products go through OpenBLAS (cblas_sgemm) on all cores.
//
// The KV cache is not the model's: every forward pass reads each sequence's
// resident tokens through a KvSource (the worker's own cache, a mirror of a
// kvkeepd session, or kvkeepd's pool mapped in place) and hands back the new
// tokens' keys and values, already in the cache's dtype, for the caller to
// append. Attention runs over the resident slots in slot order followed by
// the step's own tokens (causal among themselves), so a cache that holds the
// same bytes in the same order gives bit-identical logits.
//
// Positions. kOriginal: keys are stored after RoPE at their original
// positions and queries rotate at theirs (what a model does without
// eviction, and what query scoring in kvkeepd needs). kCachePosition
// (StreamingLLM's re-indexing): keys are stored before RoPE and rotated at
// use by their rank among the resident tokens; the step's tokens take the
// next ranks.
//
// Thread-safety: a loaded LlamaModel is immutable; Forward is thread-safe
// for calls on different sequences (it keeps no state between calls), but
// it already uses every core, so one caller at a time is the fast way.
// Threads: the model has one pool (a thread per core) for everything: each
// matrix product is split by output columns into single-threaded OpenBLAS
// calls, and the attention into tasks of (sequence, kv head, 16 tokens) for
// prefill and (sequence, 512 resident slots) for decode. Load
// therefore sets OpenBLAS to one thread per call, for the whole process
// (openblas_set_num_threads(1)): OpenBLAS's own workers, which spin for
// ~0.1 s after every call, would otherwise compete with the pool's. A
// concurrent caller finds the pool busy and runs its tasks on its own
// thread.
#ifndef KVKEEP_SERVICES_LM_MODEL_H_
#define KVKEEP_SERVICES_LM_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"
#include "kernels/page_layout.h"
#include "services/lm/gguf.h"

namespace kvkeep::lm {

// Hyper-parameters, from the GGUF metadata (llama.* keys).
struct ModelConfig {
  std::string architecture;  // general.architecture ("llama")
  std::string name;          // general.name, if present
  int32_t layers = 0;        // llama.block_count
  int32_t embed = 0;         // llama.embedding_length
  int32_t ffn = 0;           // llama.feed_forward_length
  int32_t query_heads = 0;   // llama.attention.head_count
  int32_t kv_heads = 0;      // llama.attention.head_count_kv
  int32_t head_dim = 0;  // embed / query_heads (or llama.rope.dimension_count)
  int32_t vocab = 0;     // rows of token_embd.weight
  int32_t context = 0;   // llama.context_length
  float rope_theta = 10000;  // llama.rope.freq_base
  float rms_eps = 1e-5f;     // llama.attention.layer_norm_rms_epsilon
  bool tied_output = false;  // no output.weight: logits use token_embd

  // INVALID_ARGUMENT naming the key when one is missing or inconsistent
  // (heads not dividing, head_dim odd, a tensor of the wrong shape).
  static absl::StatusOr<ModelConfig> FromGguf(const GgufFile& file);

  // INVALID_ARGUMENT unless the sizes hold together: all positive, kv_heads
  // dividing query_heads, head_dim even and at most 512, theta and eps > 0.
  absl::Status Check() const;
  // Every tensor the model reads, by GGUF name, with its GGUF shape
  // ({n_in, n_out} for a weight, {n} for a norm), in a fixed order.
  std::vector<std::pair<std::string, std::vector<int64_t>>> TensorShapes()
      const;
  // "blk.<layer>.<what>.weight".
  static std::string LayerTensor(int32_t layer, std::string_view what);
};

enum class PositionMode { kOriginal, kCachePosition };

// How the KV cache holds a token, and what a step hands back to it.
//  - f32, f16, bf16: the cache holds the elements the step hands back
//    (append_dtype == dtype).
//  - int8, fp8_e4m3, int4 (a kvkeepd layout with that dtype): the step hands
//    back append_dtype elements (f32, f16 or bf16), the store quantises them
//    into token records (kernels/quant_format.h) with groups of group_size
//    elements, and the resident slots are read through the CPU twin
//    (kernels/quantize.h's WidenHead). The forward pass quantises the step's
//    own tokens with the same twin before its attention reads them, so they
//    are exactly what a later step reads back.
struct KvFormat {
  // A float dtype is its own format.
  KvFormat(DType type = DType::kF32)  // NOLINT(google-explicit-constructor)
      : dtype(type), append_dtype(type) {}
  // A quantised dtype with its append dtype and group size.
  static KvFormat Quantized(DType dtype, DType append_dtype,
                            int32_t group_size);

  DType dtype;
  DType append_dtype;
  int32_t group_size = 0;

  // The cache's page layout for `config` (page_tokens left 0).
  PageLayout Layout(const ModelConfig& config) const;
  // The format the forward pass reads the cache in: this one, except
  // kivi_int4, whose pages kvkeep-lm decodes to float32 (kivi_kv.h): its
  // steps hand back float32 and keep their own tokens unrounded.
  KvFormat Forward() const { return IsKivi(dtype) ? KvFormat() : *this; }
  // "bf16", "int4/g32 (from bf16)".
  std::string Name() const;
  // INVALID_ARGUMENT unless it holds together for `config`: a float
  // append_dtype, equal to dtype when that is a float; for a quantised
  // dtype a group_size dividing head_dim (int4: even).
  absl::Status Check(const ModelConfig& config) const;
};

// One layer's resident tokens of one sequence, in slot order, as a paged
// cache lays them out (kernels/page_layout.h): slot s's keys are the
// kv_heads * head_dim elements of `dtype` at
//   arena + pages[s / page_tokens] * page_bytes
//         + (s % page_tokens) * token_bytes
// and its values page_tokens * token_bytes further (token_bytes: the
// format's PageLayout::token_bytes(), kv_heads * head_dim * DTypeBytes(dtype)
// for a float dtype, the record size for a quantised one). A contiguous cache
// is one page holding every slot.
struct ResidentKv {
  const std::byte* arena = nullptr;
  absl::Span<const int32_t> pages;
  int32_t page_tokens = 0;
  int64_t page_bytes = 0;
  int64_t resident = 0;
  // Per slot, the token's original position (kOriginal: what its key was
  // rotated with; kCachePosition: its rank orders the slots).
  absl::Span<const int64_t> positions;
};

// Where a forward pass reads one sequence's cache. Implementations belong to
// the caller; Layer is called once per layer per Forward, in layer order,
// all of them before anything is computed (Forward checks every view
// first), and the view must stay valid until Forward returns. Different
// layers may hold different numbers of resident tokens.
class KvSource {
 public:
  virtual ~KvSource() = default;
  virtual ResidentKv Layer(int32_t layer) const = 0;
};

// What a step hands back about its attention, per layer, for the store.
enum class AttentionOutput {
  kNone,
  // Probabilities per query head: [query_heads][n][resident + n] over the
  // resident slots in slot order, then the step's n tokens (causal: zero
  // above the diagonal).
  kPerHead,
  // The same summed over query heads: [n][resident + n].
  kReduced,
  // The step's query vectors after RoPE: [n][query_heads][head_dim]. With
  // kOriginal they are rotated at the tokens' original positions, so a
  // store can score its keys (stored rotated at theirs) with them. With
  // kCachePosition they are rotated at this layer's resident + i, and the
  // stored keys are not rotated at all: the vectors are not meaningful to a
  // store, which should ask for kPerHead or kReduced instead.
  kQueries,
};

// One sequence's share of a batched forward pass.
struct SequenceStep {
  // In:
  absl::Span<const int32_t> tokens;     // n >= 1 new tokens
  absl::Span<const int64_t> positions;  // their original positions
  const KvSource* cache = nullptr;      // the resident tokens before them
  AttentionOutput attention = AttentionOutput::kNone;
  bool all_logits = false;  // logits of every new token, or of the last only
  bool no_logits = false;   // none at all (nobody reads this step's): faster

  // Out, per layer: the new tokens' keys and values ([n][kv_heads][head_dim]
  // of the format's append_dtype, little-endian; keys after RoPE for kOriginal,
  // before it for kCachePosition) and the requested attention.
  std::vector<std::string> keys;
  std::vector<std::string> values;
  std::vector<std::vector<float>> attention_out;
  // [n][vocab] with all_logits, else [1][vocab] (the last token's); empty
  // with no_logits.
  std::vector<float> logits;
};

// Where a Forward spent its time (benchmarks: bench/lm/lm_bench.cc). Each
// matrix product is listed once per shape, in first-use order.
struct ForwardProfile {
  struct Product {
    int64_t rows = 0;  // activations: [rows][in]
    int64_t in = 0;    // the weight: [out][in]
    int64_t out = 0;
    int64_t calls = 0;   // summed over layers and Forward calls
    double seconds = 0;  // wall time of the (split) product
  };
  std::vector<Product> products;
  double attention_seconds = 0;  // RoPE, cache reads and attention
  double total_seconds = 0;      // all of Forward
};

class LlamaModel {
 public:
  // Float32 weights by their GGUF names, each in ggml order (a weight with
  // GGUF shape {n_in, n_out} is row-major [n_out][n_in]):
  //   token_embd.weight [vocab][embed], output_norm.weight [embed],
  //   output.weight [vocab][embed] (absent when config.tied_output), and per
  //   layer blk.L.{attn_norm, ffn_norm}.weight [embed],
  //   blk.L.attn_q.weight [query_heads * head_dim][embed],
  //   blk.L.attn_{k,v}.weight [kv_heads * head_dim][embed],
  //   blk.L.attn_output.weight [embed][query_heads * head_dim],
  //   blk.L.ffn_{gate,up}.weight [ffn][embed], blk.L.ffn_down.weight
  //   [embed][ffn].
  using Tensors = std::map<std::string, std::vector<float>, std::less<>>;

  // Reads the config and dequantises every weight. `kv`: the KV cache's
  // format (new keys and values are rounded, or quantised, to it before the
  // step's own attention uses them, exactly as a later step reads them
  // back). INVALID_ARGUMENT for a format that does not fit the model.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(
      const GgufFile& file, const KvFormat& kv, PositionMode positions);
  // Builds a model from `config` and float32 `tensors` (consumed): what Load
  // does after dequantising, and how tests make a tiny random model without
  // a file. INVALID_ARGUMENT naming a missing tensor or one of the wrong
  // size, or a config that does not hold together.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> FromTensors(
      const ModelConfig& config, Tensors tensors, const KvFormat& kv,
      PositionMode positions);

  const ModelConfig& config() const { return config_; }
  DType kv_dtype() const { return kv_.dtype; }
  const KvFormat& kv_format() const { return kv_; }
  PositionMode position_mode() const { return positions_; }

  // Runs the batch's new tokens through every layer at once (one matrix
  // product per weight for all of them). INVALID_ARGUMENT (nothing computed)
  // for a token id out of range, mismatched tokens/positions, a negative
  // position, a missing cache or a view whose shape does not fit;
  // INVALID_ARGUMENT also when a quantised format cannot hold a new key or
  // value (not finite, or past a binary16 scale). With
  // `profile`, adds this call's times to it.
  absl::Status Forward(absl::Span<SequenceStep> batch,
                       ForwardProfile* profile = nullptr) const;

  ~LlamaModel();

 private:
  LlamaModel() = default;
  struct Weights;

  ModelConfig config_;
  KvFormat kv_;
  PositionMode positions_ = PositionMode::kOriginal;
  std::unique_ptr<Weights> weights_;
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_MODEL_H_
