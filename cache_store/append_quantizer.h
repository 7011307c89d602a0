// AppendQuantizer: the store's quantise-on-append. Workers append keys and
// values in a quantised layout's append dtype (f32, f16 or bf16); before
// any page is touched, the session has them quantised here into the token
// records its pages hold (kernels/quant_format.h). One per session, used
// under the session's lock; not thread-safe.
#ifndef KVKEEP_CACHE_STORE_APPEND_QUANTIZER_H_
#define KVKEEP_CACHE_STORE_APPEND_QUANTIZER_H_

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/model_layout.h"
#include "cache_store/session_types.h"

namespace kvkeep {

class AppendQuantizer {
 public:
  // The same request with every layer's keys and values replaced by token
  // records of layout.dtype; its spans point into this object and stay
  // valid until the next call. `request` has passed the session's shape
  // checks (input_token_bytes per token). INVALID_ARGUMENT naming the layer,
  // the token, its position and the group for a NaN, an infinity or a value
  // too large for the format's binary16 scales: nothing is stored then.
  // kivi_int4: the keys are float32 [n][kv_heads][head_dim] instead (they
  // are quantised per channel by page, with the page's other tokens), each
  // finite and within kKiviKeyMax.
  absl::StatusOr<AppendRequest> Quantize(const ModelLayout& layout,
                                         const AppendRequest& request);

  // 65504 * 15 / 2: a page channel's range (holding 0) of keys this large
  // fits a binary16 scale of int4 steps.
  static constexpr float kKiviKeyMax = 491280.0f;

 private:
  absl::Status WidenKiviKeys(const ModelLayout& layout,
                             const AppendRequest& request, size_t l,
                             std::byte* out);

  std::vector<std::byte> records_;  // [layers][K, V][n][token_bytes]
  std::vector<LayerKv> layers_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_APPEND_QUANTIZER_H_
