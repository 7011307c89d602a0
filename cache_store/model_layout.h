// ModelLayout: the shape of one model's KV cache as the store holds it. A
// store serves one or more layouts by name; each has its own page pool.
// A plain value type; thread-safe to share once built.
#ifndef KVKEEP_CACHE_STORE_MODEL_LAYOUT_H_
#define KVKEEP_CACHE_STORE_MODEL_LAYOUT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/dtype.h"
#include "kernels/page_layout.h"

namespace kvkeep {

struct ModelLayout {
  std::string name;
  int32_t num_layers = 0;
  int32_t kv_heads = 0;
  int32_t query_heads = 0;  // a multiple of kv_heads (GQA group size)
  int32_t head_dim = 0;
  DType dtype = DType::kBF16;
  // Quantised dtypes (int8, fp8_e4m3, int4, kivi_int4) only: elements per
  // scale group along head_dim (must divide head_dim; even for int4 and
  // kivi_int4, whose values use it and whose keys are grouped per channel
  // by page instead, kernels/kivi.h), and the float
  // dtype workers append in (the store quantises). Ignored otherwise.
  int32_t group_size = kDefaultGroupSize;
  DType append_dtype = DType::kBF16;
  int32_t page_tokens = 16;
  // True when keys are stored before RoPE is applied (StreamingLLM-style
  // re-indexing by cache position); false when stored rotated.
  bool keys_pre_rope = false;

  static constexpr int32_t kDefaultGroupSize = 32;

  PageLayout page_layout() const {
    return PageLayout{page_tokens, kv_heads, head_dim, dtype,
                      IsQuantized(dtype) ? group_size : 0};
  }
  // The dtype of the keys and values workers send (AppendRequest): the
  // stored dtype, or append_dtype when the store quantises.
  DType input_dtype() const {
    return IsQuantized(dtype) ? append_dtype : dtype;
  }
  // Bytes of one token's keys (or values) of one layer as workers send them.
  int64_t input_token_bytes() const {
    return static_cast<int64_t>(kv_heads) * head_dim *
           DTypeBytes(input_dtype());
  }
  // Bytes of K and V for one token of one layer.
  int64_t token_kv_bytes() const { return 2 * page_layout().token_bytes(); }
  // Bytes of K and V for one token of every layer.
  int64_t token_kv_bytes_all_layers() const {
    return token_kv_bytes() * num_layers;
  }
};

// INVALID_ARGUMENT naming the field unless every field is in range.
absl::Status ValidateLayout(const ModelLayout& layout);

// "f32" | "f16" | "bf16" | "int8" | "fp8_e4m3" | "int4" | "kivi_int4" ->
// DType;
// INVALID_ARGUMENT otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_MODEL_LAYOUT_H_
