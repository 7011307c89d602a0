#include "cache_store/model_layout.h"

#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace kvkeep {
namespace {

absl::Status CheckRange(absl::string_view layout, absl::string_view field,
                        int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout '", layout, "': ", field, " = ", value,
                     " is outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateQuantized(const ModelLayout& l) {
  const std::string dtype(DTypeName(l.dtype));
  if (IsQuantized(l.append_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout '", l.name, "': append_dtype must be f32, f16 or bf16 (got ",
        std::string(DTypeName(l.append_dtype)), ")"));
  }
  if (l.group_size < 1 || l.head_dim % l.group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout '", l.name, "': group_size ", l.group_size,
                     " does not divide head_dim ", l.head_dim, " (", dtype,
                     " keeps one scale per group of head_dim)"));
  }
  const bool int4 = l.dtype == DType::kInt4 || l.dtype == DType::kKiviInt4;
  if (int4 && l.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout '", l.name, "': ", dtype, " needs an even head_dim (got ",
        l.head_dim, "): two codes share a byte"));
  }
  if (int4 && l.group_size % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout '", l.name, "': ", dtype, " needs an even group_size (got ",
        l.group_size, "): a group's codes fill whole bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLayout(const ModelLayout& l) {
  if (l.name.empty()) {
    return absl::InvalidArgumentError("layout name must not be empty");
  }
  for (const auto& [field, value, hi] :
       {std::tuple<absl::string_view, int64_t, int64_t>{"num_layers",
                                                        l.num_layers, 1024},
        {"kv_heads", l.kv_heads, 1024},
        {"query_heads", l.query_heads, 4096},
        {"head_dim", l.head_dim, 1024},
        {"page_tokens", l.page_tokens, 4096}}) {
    if (absl::Status s = CheckRange(l.name, field, value, 1, hi); !s.ok()) {
      return s;
    }
  }
  if (l.query_heads % l.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout '", l.name, "': query_heads (", l.query_heads,
                     ") must be a multiple of kv_heads (", l.kv_heads, ")"));
  }
  if (IsQuantized(l.dtype)) return ValidateQuantized(l);
  return absl::OkStatus();
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8,
                  DType::kFp8E4M3, DType::kInt4, DType::kKiviInt4}) {
    if (name == absl::string_view(DTypeName(t).data(), DTypeName(t).size())) {
      return t;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "' (expected f32, f16, bf16, int8, fp8_e4m3, int4 or "
                   "kivi_int4)"));
}

}  // namespace kvkeep
