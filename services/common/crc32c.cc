#include "services/common/crc32c.h"

#include <array>
#include <cstring>

namespace kvkeep {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41 reflected

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(
    uint32_t crc, std::span<const std::byte> data) {
  uint64_t c = ~crc;
  const std::byte* p = data.data();
  size_t n = data.size();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) {
    c32 = __builtin_ia32_crc32qi(c32, static_cast<uint8_t>(*p));
  }
  return ~c32;
}
#endif

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, std::span<const std::byte> data) {
  uint32_t c = ~crc;
  for (std::byte b : data) {
    c = kTable[(c ^ static_cast<uint8_t>(b)) & 0xFF] ^ (c >> 8);
  }
  return ~c;
}

uint32_t Crc32c(uint32_t crc, std::span<const std::byte> data) {
#if defined(__x86_64__)
  static const bool kHasSse42 = __builtin_cpu_supports("sse4.2");
  if (kHasSse42) return Crc32cSse42(crc, data);
#endif
  return Crc32cPortable(crc, data);
}

}  // namespace kvkeep
