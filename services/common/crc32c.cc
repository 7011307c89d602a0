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

// Polynomials over GF(2) modulo the CRC polynomial, reflected as the CRC
// register holds them: x^0 is the top bit. a * b mod P.
constexpr uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;
  }
  return product;
}

// kX2n[k] = x^(2^k) mod P.
constexpr std::array<uint32_t, 64> MakeX2n() {
  std::array<uint32_t, 64> t{};
  uint32_t p = 1u << 30;  // x^1
  for (uint32_t& e : t) {
    e = p;
    p = MultModP(p, p);
  }
  return t;
}
constexpr std::array<uint32_t, 64> kX2n = MakeX2n();

// x^(8 * bytes) mod P: multiplying a CRC register by it is feeding it
// `bytes` zero bytes.
constexpr uint32_t ZerosOperator(uint64_t bytes) {
  uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 3; bytes != 0; bytes >>= 1, ++k) {
    if (bytes & 1) p = MultModP(kX2n[k & 63], p);
  }
  return p;
}

#if defined(__x86_64__)
// Multiplying by ZerosOperator(kBytes) a byte at a time: four lookups.
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t;
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^
           t[3][c >> 24];
  }
};
constexpr ShiftTable MakeShift(uint64_t bytes) {
  const uint32_t op = ZerosOperator(bytes);
  ShiftTable s{};
  for (uint32_t i = 0; i < 4; ++i) {
    for (uint32_t b = 0; b < 256; ++b) s.t[i][b] = MultModP(op, b << (8 * i));
  }
  return s;
}

// Each block is split into three streams of these many bytes, checksummed
// together (crc32 has a latency of three cycles and a throughput of one)
// and joined with a shift: a long one for bulk data, a short one for the
// rest.
constexpr size_t kLongBytes = 8192;
constexpr size_t kShortBytes = 256;
constexpr ShiftTable kLongShift = MakeShift(kLongBytes);
constexpr ShiftTable kShortShift = MakeShift(kShortBytes);

inline uint64_t Load64(const std::byte* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

template <size_t kStreamBytes>
__attribute__((target("sse4.2"), always_inline)) inline uint64_t Blocks3(
    uint64_t c0, const std::byte*& p, size_t& n, const ShiftTable& shift) {
  while (n >= 3 * kStreamBytes) {
    uint64_t c1 = 0;
    uint64_t c2 = 0;
    for (size_t i = 0; i < kStreamBytes; i += 8) {
      c0 = __builtin_ia32_crc32di(c0, Load64(p + i));
      c1 = __builtin_ia32_crc32di(c1, Load64(p + kStreamBytes + i));
      c2 = __builtin_ia32_crc32di(c2, Load64(p + 2 * kStreamBytes + i));
    }
    // The register after stream 0 then stream 1 is stream 0's shifted
    // past stream 1's bytes, plus stream 1's from zero (CRCs are linear).
    c0 = shift(static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift(static_cast<uint32_t>(c0)) ^ c2;
    p += 3 * kStreamBytes;
    n -= 3 * kStreamBytes;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(
    uint32_t crc, std::span<const std::byte> data) {
  uint64_t c = static_cast<uint32_t>(~crc);
  const std::byte* p = data.data();
  size_t n = data.size();
  c = Blocks3<kLongBytes>(c, p, n, kLongShift);
  c = Blocks3<kShortBytes>(c, p, n, kShortShift);
  for (; n >= 8; n -= 8, p += 8) c = __builtin_ia32_crc32di(c, Load64(p));
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

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t b_bytes) {
  // crc(a + b) = crc(a) fed |b| zeros, plus crc(b): the pre- and
  // post-inversions cancel (zlib's crc32_combine).
  return MultModP(ZerosOperator(b_bytes), crc_a) ^ crc_b;
}

}  // namespace kvkeep
