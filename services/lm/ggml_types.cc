#include "services/lm/ggml_types.h"

#include <array>
#include <cstring>
#include <limits>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "services/lm/gguf.h"

namespace kvkeep::lm {
namespace ggml {

const TypeTraits* FindTypeTraits(uint32_t type) {
  static constexpr std::array<TypeTraits, 40> kTraits = {{
      {"f32", 1, 4},         // 0
      {"f16", 1, 2},         // 1
      {"q4_0", 32, 18},      // 2: f16 d, 16 bytes of nibbles
      {"q4_1", 32, 20},      // 3: f16 d, f16 m, 16 bytes of nibbles
      {},                    // 4: q4_2, removed
      {},                    // 5: q4_3, removed
      {"q5_0", 32, 22},      // 6
      {"q5_1", 32, 24},      // 7
      {"q8_0", 32, 34},      // 8: f16 d, 32 int8
      {"q8_1", 32, 36},      // 9
      {"q2_K", 256, 84},     // 10
      {"q3_K", 256, 110},    // 11
      {"q4_K", 256, 144},    // 12
      {"q5_K", 256, 176},    // 13
      {"q6_K", 256, 210},    // 14
      {"q8_K", 256, 292},    // 15
      {"iq2_xxs", 256, 66},  // 16
      {"iq2_xs", 256, 74},   // 17
      {"iq3_xxs", 256, 98},  // 18
      {"iq1_s", 256, 50},    // 19
      {"iq4_nl", 32, 18},    // 20
      {"iq3_s", 256, 110},   // 21
      {"iq2_s", 256, 82},    // 22
      {"iq4_xs", 256, 136},  // 23
      {"i8", 1, 1},          // 24
      {"i16", 1, 2},         // 25
      {"i32", 1, 4},         // 26
      {"i64", 1, 8},         // 27
      {"f64", 1, 8},         // 28
      {"iq1_m", 256, 56},    // 29
      {"bf16", 1, 2},        // 30
      {},                    // 31: q4_0_4_4, removed from GGUF files
      {},                    // 32: q4_0_4_8, removed
      {},                    // 33: q4_0_8_8, removed
      {"tq1_0", 256, 54},    // 34
      {"tq2_0", 256, 66},    // 35
      {},                    // 36: iq4_nl_4_4, removed
      {},                    // 37: iq4_nl_4_8, removed
      {},                    // 38: iq4_nl_8_8, removed
      {"mxfp4", 32, 17},     // 39
  }};
  if (type >= kTraits.size() || kTraits[type].block_elements == 0) {
    return nullptr;
  }
  return &kTraits[type];
}

uint16_t LoadU16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ggml-quants.c's dequantize_row_*: blocks of 32 elements, each led by f16
// scale(s). `out` holds blocks * 32 floats.
void DequantizeQ4_0(const std::byte* data, absl::Span<float> out) {
  constexpr size_t kBlock = 32, kBlockBytes = 18;
  for (size_t b = 0; b < out.size() / kBlock; ++b) {
    const std::byte* block = data + b * kBlockBytes;
    const float d = F16ToFloat(LoadU16(block));
    const auto* qs = reinterpret_cast<const uint8_t*>(block + 2);
    float* y = out.data() + b * kBlock;
    for (size_t j = 0; j < kBlock / 2; ++j) {
      const int x0 = (qs[j] & 0x0F) - 8;
      const int x1 = (qs[j] >> 4) - 8;
      y[j] = x0 * d;
      y[j + kBlock / 2] = x1 * d;
    }
  }
}

void DequantizeQ4_1(const std::byte* data, absl::Span<float> out) {
  constexpr size_t kBlock = 32, kBlockBytes = 20;
  for (size_t b = 0; b < out.size() / kBlock; ++b) {
    const std::byte* block = data + b * kBlockBytes;
    const float d = F16ToFloat(LoadU16(block));
    const float m = F16ToFloat(LoadU16(block + 2));
    const auto* qs = reinterpret_cast<const uint8_t*>(block + 4);
    float* y = out.data() + b * kBlock;
    for (size_t j = 0; j < kBlock / 2; ++j) {
      const int x0 = qs[j] & 0x0F;
      const int x1 = qs[j] >> 4;
      y[j] = x0 * d + m;
      y[j + kBlock / 2] = x1 * d + m;
    }
  }
}

void DequantizeQ8_0(const std::byte* data, absl::Span<float> out) {
  constexpr size_t kBlock = 32, kBlockBytes = 34;
  for (size_t b = 0; b < out.size() / kBlock; ++b) {
    const std::byte* block = data + b * kBlockBytes;
    const float d = F16ToFloat(LoadU16(block));
    const auto* qs = reinterpret_cast<const int8_t*>(block + 2);
    float* y = out.data() + b * kBlock;
    for (size_t j = 0; j < kBlock; ++j) y[j] = qs[j] * d;
  }
}

}  // namespace ggml

absl::StatusOr<uint64_t> GgmlTypeBytes(uint32_t type, int64_t elements) {
  const ggml::TypeTraits* traits = ggml::FindTypeTraits(type);
  if (traits == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown ggml type ", type));
  }
  if (elements < 0 || elements % traits->block_elements != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(elements, " elements are not whole blocks of ",
                     traits->block_elements, " for ", traits->name));
  }
  const uint64_t blocks =
      static_cast<uint64_t>(elements / traits->block_elements);
  if (blocks > std::numeric_limits<uint64_t>::max() / traits->block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        elements, " elements of ", traits->name, " overflow a byte count"));
  }
  return blocks * traits->block_bytes;
}

std::string GgmlTypeName(uint32_t type) {
  const ggml::TypeTraits* traits = ggml::FindTypeTraits(type);
  if (traits == nullptr) return absl::StrCat("type ", type);
  return std::string(traits->name);
}

}  // namespace kvkeep::lm
