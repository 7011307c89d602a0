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
  int32_t page_tokens = 16;
  // True when keys are stored before RoPE is applied (StreamingLLM-style
  // re-indexing by cache position); false when stored rotated.
  bool keys_pre_rope = false;

  PageLayout page_layout() const {
    return PageLayout{page_tokens, kv_heads, head_dim, dtype};
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

// "f32" | "f16" | "bf16" -> DType; INVALID_ARGUMENT otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_MODEL_LAYOUT_H_
