#include "services/common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// x^bits mod P, reflected as MultModP holds it.
constexpr uint32_t XPowModP(uint64_t bits) {
  uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 0; bits != 0; bits >>= 1, ++k) {
    if (bits & 1) p = MultModP(kX2n[k], p);
  }
  return p;
}
static_assert(XPowModP(1) == 1u << 30 && XPowModP(32) == kPolynomial);

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

// Folding (Intel, "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ Instruction"). The data is a polynomial, each 16-byte lane
// A = H x^64 + L with H its first 8 bytes (the low qword as loaded, bit 0
// the highest power: the reflected order of the crc32 instruction). A lane
// `bits` before another can be replaced by a polynomial of degree < 128
// with the same remainder, H (x^(bits+64) mod P) + L (x^bits mod P), and
// XORed into that lane: the CRC of the data is unchanged. Repeating it
// folds everything into the last 16 bytes, whose CRC the crc32 instruction
// then takes.
//
// pclmulqdq multiplies two qwords as polynomials; for reflected operands
// the reflected product sits in bits 0..126, one place short of a 128-bit
// lane. So each constant holds K = x^e mod P (reflected) shifted left one
// bit, which makes a product read as a lane H K x^32, or L K x^32: e is
// bits + 32 for H and bits - 32 for L. Neither product leaves the lane.
struct FoldConstants {
  uint64_t high_half;  // for H, the low qword
  uint64_t low_half;   // for L, the high qword
};
constexpr FoldConstants MakeFold(uint64_t bits) {
  return {uint64_t{XPowModP(bits + 32)} << 1,
          uint64_t{XPowModP(bits - 32)} << 1};
}
constexpr FoldConstants kFold128 = MakeFold(128);    // the next lane
constexpr FoldConstants kFold256 = MakeFold(256);    // two lanes on
constexpr FoldConstants kFold384 = MakeFold(384);    // three
constexpr FoldConstants kFold512 = MakeFold(512);    // a zmm register on
constexpr FoldConstants kFold2048 = MakeFold(2048);  // four zmm registers on

#define KVKEEP_FOLD_TARGET "avx512f,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(KVKEEP_FOLD_TARGET), always_inline)) inline __m128i
Constants128(const FoldConstants& k) {
  return _mm_set_epi64x(static_cast<int64_t>(k.low_half),
                        static_cast<int64_t>(k.high_half));
}

__attribute__((target(KVKEEP_FOLD_TARGET), always_inline)) inline __m128i
Fold128(__m128i x, __m128i k, __m128i into) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                     _mm_clmulepi64_si128(x, k, 0x11)),
                       into);
}

// The same constants in all four lanes. (Not _mm512_broadcast_i32x4, nor
// _mm512_extracti32x4_epi32 below: GCC 12's versions trip
// -Wmaybe-uninitialized, GCC bug 105593.)
__attribute__((target(KVKEEP_FOLD_TARGET), always_inline)) inline __m512i
Constants512(const FoldConstants& k) {
  const auto h = static_cast<int64_t>(k.high_half);
  const auto l = static_cast<int64_t>(k.low_half);
  return _mm512_set_epi64(l, h, l, h, l, h, l, h);
}

// Lane `i` of `x`.
template <int i>
__attribute__((target(KVKEEP_FOLD_TARGET), always_inline)) inline __m128i Lane(
    __m512i x) {
  return _mm512_maskz_extracti32x4_epi32(0xF, x, i);
}

// Four lanes at once.
__attribute__((target(KVKEEP_FOLD_TARGET), always_inline)) inline __m512i
Fold512(__m512i x, __m512i k, __m512i into) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), into,
                                   0x96);  // a ^ b ^ c
}

// Folding starts from four registers' worth of bytes; shorter inputs take
// the crc32 instruction. (From 256 bytes up folding is already faster: the
// crc32 streams only start at 768.)
constexpr size_t kFoldMinBytes = 256;

// The CRC register `c` (inverted, as Crc32cSse42 holds it) extended over
// `data`, a multiple of 16 bytes and at least kFoldMinBytes long.
__attribute__((target(KVKEEP_FOLD_TARGET))) uint32_t FoldVpclmul(
    uint32_t c, std::span<const std::byte> data) {
  const std::byte* p = data.data();
  size_t n = data.size();
  // Starting from register c is starting from 0 with c XORed into the
  // first four bytes.
  __m512i x0 = _mm512_xor_si512(
      _mm512_loadu_si512(p),
      _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  p += 256;
  n -= 256;
  // Four registers in flight hide the multiplier's latency.
  const __m512i k2048 = Constants512(kFold2048);
  for (; n >= 256; n -= 256, p += 256) {
    x0 = Fold512(x0, k2048, _mm512_loadu_si512(p));
    x1 = Fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = Fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = Fold512(x3, k2048, _mm512_loadu_si512(p + 192));
  }
  const __m512i k512 = Constants512(kFold512);
  x1 = Fold512(x0, k512, x1);
  x2 = Fold512(x1, k512, x2);
  x0 = Fold512(x2, k512, x3);
  for (; n >= 64; n -= 64, p += 64) {
    x0 = Fold512(x0, k512, _mm512_loadu_si512(p));
  }
  // x0's lanes 0, 1 and 2 onto lane 3.
  __m128i r = Lane<3>(x0);
  r = Fold128(Lane<2>(x0), Constants128(kFold128), r);
  r = Fold128(Lane<1>(x0), Constants128(kFold256), r);
  r = Fold128(Lane<0>(x0), Constants128(kFold384), r);
  const __m128i k128 = Constants128(kFold128);
  for (; n >= 16; n -= 16, p += 16) {
    r = Fold128(r, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  uint64_t c64 =
      __builtin_ia32_crc32di(0, static_cast<uint64_t>(_mm_cvtsi128_si64(r)));
  c64 = __builtin_ia32_crc32di(c64,
                               static_cast<uint64_t>(_mm_extract_epi64(r, 1)));
  return static_cast<uint32_t>(c64);
}

__attribute__((target(KVKEEP_FOLD_TARGET))) uint32_t Crc32cVpclmul(
    uint32_t crc, std::span<const std::byte> data) {
  if (data.size() < kFoldMinBytes) return Crc32cSse42(crc, data);
  const size_t folded = data.size() & ~size_t{15};
  const uint32_t c = FoldVpclmul(~crc, data.first(folded));
  return Crc32cSse42(~c, data.subspan(folded));
}
#undef KVKEEP_FOLD_TARGET
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
  static const bool kHasVpclmul = __builtin_cpu_supports("avx512f") &&
                                  __builtin_cpu_supports("vpclmulqdq") &&
                                  __builtin_cpu_supports("pclmul") &&
                                  __builtin_cpu_supports("sse4.2");
  if (kHasVpclmul) return Crc32cVpclmul(crc, data);
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
