#include "cache_store/append_quantizer.h"

#include <cmath>
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
  // kivi_int4's keys stay float32 here: the session quantises them per
  // channel with the rest of their page (cache_store/kivi_keys.h).
  const bool kivi = IsKivi(layout.dtype);
  const int64_t key_bytes =
      kivi ? n * page.token_elements() * int64_t{sizeof(float)} : bytes;
  // Each layer's keys start 4-byte aligned (kivi's are float32).
  const int64_t stride = key_bytes + (bytes + 3) / 4 * 4;
  records_.resize(static_cast<size_t>(stride) * request.layers.size());
  layers_.resize(request.layers.size());
  for (size_t l = 0; l < request.layers.size(); ++l) {
    std::byte* keys = records_.data() + stride * l;
    std::byte* values = keys + key_bytes;
    for (const auto& [name, in, out] :
         {std::tuple<const char*, const std::byte*, std::byte*>{
              "keys", request.layers[l].keys.data(), keys},
          {"values", request.layers[l].values.data(), values}}) {
      if (kivi && out == keys) {
        if (absl::Status s = WidenKiviKeys(layout, request, l, keys); !s.ok()) {
          return s;
        }
        continue;
      }
      const QuantizeResult r =
          QuantizeTokens(page, layout.append_dtype, in, n, out);
      if (!r.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", l, " ", name, " of token ", r.token, " (position ",
            request.positions[r.token], "), elements [", r.element, ", ",
            r.element + page.group_size, "): ", Why(r.error, layout.dtype)));
      }
    }
    layers_[l] = LayerKv{std::span<const std::byte>(keys, key_bytes),
                         std::span<const std::byte>(values, bytes)};
  }
  return AppendRequest{request.positions, layers_};
}

absl::Status AppendQuantizer::WidenKiviKeys(const ModelLayout& layout,
                                            const AppendRequest& request,
                                            size_t l, std::byte* out) {
  const int64_t e_count = layout.page_layout().token_elements();
  const int64_t count =
      static_cast<int64_t>(request.positions.size()) * e_count;
  auto* keys = reinterpret_cast<float*>(out);
  const std::byte* in = request.layers[l].keys.data();
  for (int64_t i = 0; i < count; ++i) {
    keys[i] = LoadAsFloat(layout.append_dtype, in, i);
    // Finite and at most half the widest range a binary16 scale spans, so
    // any page's channel range fits one whatever else the page holds.
    if (!(std::fabs(keys[i]) <= kKiviKeyMax)) {
      const int64_t t = i / e_count;
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " keys of token ", t, " (position ",
          request.positions[t], "), element ", i % e_count, ": ",
          std::isfinite(keys[i])
              ? absl::StrCat("|", keys[i], "| above ", kKiviKeyMax,
                             " (kivi_int4 keys: 65504 * 15 / 2, so a page's "
                             "channel range fits its binary16 scale)")
              : Why(QuantError::kNonFinite, layout.dtype)));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvkeep
