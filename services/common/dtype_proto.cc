#include "services/common/dtype_proto.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvkeep {

v1::DType DTypeToProto(DType t) {
  switch (t) {
    case DType::kF32:
      return v1::DTYPE_F32;
    case DType::kF16:
      return v1::DTYPE_F16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kInt8:
      return v1::DTYPE_INT8;
    case DType::kFp8E4M3:
      return v1::DTYPE_FP8_E4M3;
    case DType::kInt4:
      return v1::DTYPE_INT4;
    case DType::kKiviInt4:
      return v1::DTYPE_KIVI_INT4;
  }
  return v1::DTYPE_UNSPECIFIED;
}

v1::DType AppendDTypeOf(const v1::Layout& layout) {
  return layout.append_dtype() != v1::DTYPE_UNSPECIFIED ? layout.append_dtype()
                                                        : layout.dtype();
}

absl::StatusOr<DType> DTypeFromProto(v1::DType t) {
  switch (t) {
    case v1::DTYPE_F32:
      return DType::kF32;
    case v1::DTYPE_F16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_INT8:
      return DType::kInt8;
    case v1::DTYPE_FP8_E4M3:
      return DType::kFp8E4M3;
    case v1::DTYPE_INT4:
      return DType::kInt4;
    case v1::DTYPE_KIVI_INT4:
      return DType::kKiviInt4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown dtype ", static_cast<int>(t)));
  }
}

}  // namespace kvkeep
