#include "cache_store/append_quantizer.h"

#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

std::string Why(QuantError e, DType dtype) {
  const std::string name(DTypeName(dtype));
  if (e == QuantError::kNonFinite) {
    return absl::StrCat("a NaN or an infinity (", name,
                        " stores finite values only)");
  }
  return absl::StrCat("a value too large for ", name,
                      "'s binary16 scales (docs/quantization.md)");
}

}  // namespace

absl::StatusOr<AppendRequest> AppendQuantizer::Quantize(
    const ModelLayout& layout, const AppendRequest& request) {
  const PageLayout page = layout.page_layout();
  const int64_t n = static_cast<int64_t>(request.positions.size());
  const int64_t bytes = n * page.token_bytes();
  records_.resize(static_cast<size_t>(2 * bytes) * request.layers.size());
  layers_.resize(request.layers.size());
  for (size_t l = 0; l < request.layers.size(); ++l) {
    std::byte* keys = records_.data() + 2 * bytes * l;
    std::byte* values = keys + bytes;
    for (const auto& [name, in, out] :
         {std::tuple<const char*, const std::byte*, std::byte*>{
              "keys", request.layers[l].keys.data(), keys},
          {"values", request.layers[l].values.data(), values}}) {
      const QuantizeResult r =
          QuantizeTokens(page, layout.append_dtype, in, n, out);
      if (!r.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", l, " ", name, " of token ", r.token, " (position ",
            request.positions[r.token], "), elements [", r.element, ", ",
            r.element + page.group_size, "): ", Why(r.error, layout.dtype)));
      }
    }
    layers_[l] = LayerKv{std::span<const std::byte>(keys, bytes),
                         std::span<const std::byte>(values, bytes)};
  }
  return AppendRequest{request.positions, layers_};
}

}  // namespace kvkeep
