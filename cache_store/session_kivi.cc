// Session's kivi_int4 parts (cache_store/kivi_keys.h): the appended keys
// quantised with their pages, dequantised reads, and the policies the layout
// takes.
#include <string>

#include "absl/strings/str_cat.h"
#include "cache_store/session.h"
#include "kernels/quantize.h"

namespace kvkeep {

void Session::AppendKiviKeys(size_t l, const AppendPlan& plan,
                             const LayerKv& kv, int64_t n) {
  Layer& layer = layers_[l];
  const auto* keys = reinterpret_cast<const float*>(kv.keys.data());
  const int64_t e_count = page_layout_.token_elements();
  const int64_t first = layer.size();
  const int64_t tail = plan.drop_begin + plan.drop;
  const std::byte* arena = pool_->memory().host_data();
  const auto index = static_cast<int32_t>(l);
  kivi_->Append(index, layer.pages, first, keys, plan.drop_begin, arena,
                batch_);
  kivi_->Append(index, layer.pages, first + plan.drop_begin,
                keys + tail * e_count, n - tail, arena, batch_);
}

absl::StatusOr<LayerKvCopy> Session::ReadKiviLayerAs(int32_t index,
                                                     DType dtype) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  const Layer& layer = layers_[index];
  const int64_t n = layer.size();
  std::vector<std::byte> unused(n * page_layout_.token_bytes());
  std::vector<std::byte> records(unused.size());
  if (absl::Status s = ReadSlots(index, 0, n, unused, records); !s.ok()) {
    return s;
  }
  LayerKvCopy out;
  out.version = layer.version;
  out.positions = layer.position;
  out.dtype = dtype;
  const size_t bytes = static_cast<size_t>(n * page_layout_.token_elements() *
                                           DTypeBytes(dtype));
  out.keys.resize(bytes);
  out.values.resize(bytes);
  kivi_->Read(layer.pages, n, pool_->memory().host_data(), dtype,
              out.keys.data());
  DequantizeTokens(page_layout_, records.data(), n, dtype, out.values.data());
  return out;
}

absl::Status CheckKiviPolicy(const ModelLayout& layout,
                             absl::string_view policy) {
  if (!IsKivi(layout.dtype) || policy == "full" || policy == "h2o_page") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "layout '", layout.name,
      "' stores kivi_int4 (keys per channel by "
      "page), which takes the policies full and h2o_page only: policy '",
      policy,
      "' evicts token by token, and every token compaction moves "
      "re-quantises its new page from keys already rounded once "
      "(docs/quantization.md)"));
}

absl::Status RefuseKivi(const ModelLayout& layout, absl::string_view what) {
  if (!IsKivi(layout.dtype)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " of a session of layout '", layout.name,
      "' is not supported: its kivi_int4 keys are per-page blocks with the "
      "open page's staging outside the pool (docs/quantization.md)"));
}

}  // namespace kvkeep
