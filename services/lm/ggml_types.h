// ggml's tensor types as GGUF files hold them: each type's block size and
// bytes (ggml.c's type_traits), and the dequantisers of the block formats
// kvkeep reads (ggml-quants.c's dequantize_row_*). Internal to the GGUF
// reader (gguf.cc); gguf.h has the public GgmlTypeBytes and GgmlTypeName.
// Thread-safe (stateless).
#ifndef KVKEEP_SERVICES_LM_GGML_TYPES_H_
#define KVKEEP_SERVICES_LM_GGML_TYPES_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvkeep::lm::ggml {

// ggml's type traits (ggml.c type_traits[]): elements per block and bytes
// per block. Types ggml has removed (4, 5, 31..33, 36..38) are unknown.
struct TypeTraits {
  absl::string_view name;
  int64_t block_elements = 0;
  uint64_t block_bytes = 0;
};

// The traits of `type`, or null for a type id ggml does not have (or has
// removed).
const TypeTraits* FindTypeTraits(uint32_t type);

// A little-endian u16 (an f16 or bf16) at `p`, which need not be aligned.
uint16_t LoadU16(const std::byte* p);

// Blocks of 32 elements, each led by its f16 scale (and, for q4_1, its f16
// minimum): `out` holds blocks * 32 floats, `data` the blocks.
void DequantizeQ4_0(const std::byte* data, absl::Span<float> out);
void DequantizeQ4_1(const std::byte* data, absl::Span<float> out);
void DequantizeQ8_0(const std::byte* data, absl::Span<float> out);

}  // namespace kvkeep::lm::ggml

#endif  // KVKEEP_SERVICES_LM_GGML_TYPES_H_
