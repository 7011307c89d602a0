// Tests of kernels/dtype.h: exact f16/bf16 <-> f32 conversions, checked
// exhaustively over the 16-bit patterns and against an independent
// double-precision reference for the rounding direction (round to nearest,
// ties to even).
#include "kernels/dtype.h"

#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace kvkeep {
namespace {

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t ToBits(float f) { return std::bit_cast<uint32_t>(f); }

bool IsF16NaN(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}
bool IsBf16NaN(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
}

// binary16 decoded from its definition, in double: (-1)^s * 2^(e-15) *
// (1 + m/1024) for normal numbers, 2^-14 * m/1024 for subnormals.
double RefF16ToDouble(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity()
               : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  }
  return sign ? -v : v;
}

// Rounds a non-negative, finite double to an integer, ties to even, without
// relying on the floating-point environment.
double RoundHalfEven(double q) {
  const double fl = std::floor(q);
  const double frac = q - fl;
  if (frac > 0.5) return fl + 1;
  if (frac < 0.5) return fl;
  return std::fmod(fl, 2.0) == 0.0 ? fl : fl + 1;
}

// Independent float -> binary16, round to nearest even, written from the
// format's definition: scale |x| so that one unit in the last place of the
// target is 1, round to an integer, rebuild the bits.
uint16_t RefFloatToF16(float f) {
  const double x = f;  // exact
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7e00;
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {  // subnormal range: unit 2^-24
    const double m = RoundHalfEven(a * std::ldexp(1.0, 24));
    // m == 1024 is the smallest normal number, whose bits are 0x0400.
    return sign | static_cast<uint16_t>(m);
  }
  int exp2;
  std::frexp(a, &exp2);  // a in [2^(exp2-1), 2^exp2)
  int e = exp2 - 1;
  double m = RoundHalfEven(a * std::ldexp(1.0, 10 - e));  // [1024, 2048]
  if (m == 2048) {
    m = 1024;
    ++e;
  }
  if (e + 15 >= 31) return sign | 0x7c00;  // overflow
  return sign |
         static_cast<uint16_t>(((e + 15) << 10) | (static_cast<int>(m) - 1024));
}

// Independent float -> bfloat16 (8 exponent bits, 7 mantissa bits), round to
// nearest even. Subnormal bf16 numbers have the unit 2^-133.
uint16_t RefFloatToBf16(float f) {
  const double x = f;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7fc0;
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | 0x7f80;
  if (a < std::ldexp(1.0, -126)) {
    const double m = RoundHalfEven(a * std::ldexp(1.0, 133));  // [0, 128]
    return sign | static_cast<uint16_t>(m);
  }
  int exp2;
  std::frexp(a, &exp2);
  int e = exp2 - 1;
  double m = RoundHalfEven(a * std::ldexp(1.0, 7 - e));  // [128, 256]
  if (m == 256) {
    m = 128;
    ++e;
  }
  if (e + 127 >= 255) return sign | 0x7f80;
  return sign |
         static_cast<uint16_t>(((e + 127) << 7) | (static_cast<int>(m) - 128));
}

// Checks the reference itself on values whose answer is known by hand, so a
// bug in it cannot hide a bug in the library.
TEST(DTypeReferenceTest, ReferenceAgreesWithHandValues) {
  EXPECT_EQ(RefFloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(RefFloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(RefFloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(RefFloatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(RefFloatToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(RefFloatToF16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(RefF16ToDouble(0x3555), 0.333251953125);
  EXPECT_EQ(RefFloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(RefFloatToBf16(-3.0f), 0xc040);
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeBytes(DType::kF32), 4);
  EXPECT_EQ(DTypeBytes(DType::kF16), 2);
  EXPECT_EQ(DTypeBytes(DType::kBF16), 2);
  EXPECT_EQ(DTypeName(DType::kF32), "f32");
  EXPECT_EQ(DTypeName(DType::kF16), "f16");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
}

// Every binary16 pattern decodes to its exact value and encodes back to the
// same bits; NaN patterns decode to NaN and encode to a NaN of either sign.
TEST(F16Test, AllPatternsRoundTripExactly) {
  for (uint32_t i = 0; i <= 0xffffu; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = F16ToFloat(h);
    if (IsF16NaN(h)) {
      ASSERT_TRUE(std::isnan(f)) << "bits 0x" << std::hex << i;
      EXPECT_TRUE(IsF16NaN(FloatToF16(f))) << "bits 0x" << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), RefF16ToDouble(h))
        << "bits 0x" << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0)
        << "bits 0x" << std::hex << i;
    ASSERT_EQ(FloatToF16(f), h) << "bits 0x" << std::hex << i;
  }
}

TEST(F16Test, HandPickedRounding) {
  struct Case {
    float in;
    uint16_t want;
  };
  const float min_sub = std::ldexp(1.0f, -24);
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},      // tie: to even (down)
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02},  // tie: to even (up)
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3c01},
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 0.0f), 0x3c00},
      {-1.0f - std::ldexp(1.0f, -11), 0xbc00},
      {65504.0f, 0x7bff},                        // largest finite
      {std::nextafter(65520.0f, 0.0f), 0x7bff},  // just below the tie
      {65520.0f, 0x7c00},                        // tie to even: inf
      {65536.0f, 0x7c00},
      {-65520.0f, 0xfc00},
      {1e10f, 0x7c00},
      {std::numeric_limits<float>::max(), 0x7c00},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {std::ldexp(1.0f, -14), 0x0400},  // smallest normal
      {1023 * min_sub, 0x03ff},         // largest subnormal
      {1023.5f * min_sub, 0x0400},      // tie: up to even 0x400
      {min_sub, 0x0001},                // smallest subnormal
      {-min_sub, 0x8001},
      {min_sub / 2, 0x0000},  // tie: to even zero
      {-min_sub / 2, 0x8000},
      {std::nextafter(min_sub / 2, 1.0f), 0x0001},  // just above half
      {std::nextafter(min_sub / 2, 0.0f), 0x0000},
      {1.5f * min_sub, 0x0002},  // tie 1|2: to even 2
      {2.5f * min_sub, 0x0002},  // tie 2|3: to even 2
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {std::numeric_limits<float>::min(), 0x0000},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToF16(c.in), c.want)
        << "in " << c.in << " (bits 0x" << std::hex << ToBits(c.in) << ")";
    EXPECT_EQ(RefFloatToF16(c.in), c.want) << "reference, in " << c.in;
  }
}

// Every halfway point between adjacent binary16 values (exact in float), and
// the floats just either side of it.
TEST(F16Test, AllHalfwayPointsRoundToEven) {
  for (uint32_t i = 0; i < 0x7c00u; ++i) {  // positive finite, next finite/inf
    const double lo = RefF16ToDouble(static_cast<uint16_t>(i));
    const double hi = i + 1 == 0x7c00u
                          ? 65536.0
                          : RefF16ToDouble(static_cast<uint16_t>(i + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "not exact";
    const uint16_t even =
        (i & 1) ? static_cast<uint16_t>(i + 1) : static_cast<uint16_t>(i);
    for (float sign : {1.0f, -1.0f}) {
      const uint16_t sbit = sign < 0 ? 0x8000 : 0;
      ASSERT_EQ(FloatToF16(sign * mid), sbit | even)
          << "midpoint above 0x" << std::hex << i;
      ASSERT_EQ(FloatToF16(sign * std::nextafter(mid, 0.0f)), sbit | i)
          << "below midpoint above 0x" << std::hex << i;
      ASSERT_EQ(FloatToF16(sign * std::nextafter(mid, 1e30f)),
                sbit | static_cast<uint16_t>(i + 1))
          << "above midpoint above 0x" << std::hex << i;
    }
  }
}

// A stride through all 2^32 float patterns (every exponent, NaNs, infinities,
// float subnormals), plus a dense sweep of the binary16 range.
TEST(F16Test, FloatPatternsMatchReference) {
  auto check = [](uint32_t bits) {
    const float f = FromBits(bits);
    const uint16_t got = FloatToF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(IsF16NaN(got)) << "bits 0x" << std::hex << bits;
      return ::testing::Test::HasFailure();
    }
    EXPECT_EQ(got, RefFloatToF16(f)) << "bits 0x" << std::hex << bits;
    return ::testing::Test::HasFailure();
  };
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    if (check(static_cast<uint32_t>(bits))) return;
  }
  // |x| in [2^-26, 2^17): every binary16 exponent, dense in the mantissa.
  for (uint32_t bits = 0x32800000u; bits < 0x48000000u; bits += 251) {
    if (check(bits) || check(bits | 0x80000000u)) return;
  }
}

TEST(F16Test, RandomFloatsMatchReference) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> exponent(-30.0, 20.0);
  for (int i = 0; i < 200000; ++i) {
    const float f = static_cast<float>(std::exp2(exponent(rng))) *
                    (rng() & 1 ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToF16(f), RefFloatToF16(f))
        << "in " << f << " bits 0x" << std::hex << ToBits(f);
  }
}

TEST(Bf16Test, AllPatternsRoundTripExactly) {
  for (uint32_t i = 0; i <= 0xffffu; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = Bf16ToFloat(h);
    if (IsBf16NaN(h)) {
      ASSERT_TRUE(std::isnan(f)) << "bits 0x" << std::hex << i;
      EXPECT_TRUE(IsBf16NaN(FloatToBf16(f))) << "bits 0x" << std::hex << i;
      continue;
    }
    // bf16 is the top half of a float.
    ASSERT_EQ(ToBits(f), i << 16) << "bits 0x" << std::hex << i;
    ASSERT_EQ(FloatToBf16(f), h) << "bits 0x" << std::hex << i;
  }
}

TEST(Bf16Test, HandPickedRounding) {
  struct Case {
    uint32_t in_bits;
    uint16_t want;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1
      {0x3f808000u, 0x3f80},  // tie, even below
      {0x3f818000u, 0x3f82},  // tie, even above
      {0x3f808001u, 0x3f81},  // just above the tie
      {0x3f807fffu, 0x3f80},  // just below the tie
      {0xbf808000u, 0xbf80},  // negative tie
      {0x7f7f0000u, 0x7f7f},  // largest finite bf16
      {0x7f7f7fffu, 0x7f7f},
      {0x7f7f8000u, 0x7f80},  // tie above the largest finite: to inf
      {0x7f7fffffu, 0x7f80},  // FLT_MAX rounds to inf
      {0xff7fffffu, 0xff80},
      {0x7f800000u, 0x7f80},  // inf
      {0xff800000u, 0xff80},
      {0x00000001u, 0x0000},  // float subnormals
      {0x00008000u, 0x0000},  // tie to even zero
      {0x00008001u, 0x0001},
      {0x00018000u, 0x0002},
      {0x807fffffu, 0x8080},  // largest float subnormal -> smallest normal
      {0x80000000u, 0x8000},
  };
  for (const Case& c : cases) {
    const float f = FromBits(c.in_bits);
    EXPECT_EQ(FloatToBf16(f), c.want) << "bits 0x" << std::hex << c.in_bits;
    EXPECT_EQ(RefFloatToBf16(f), c.want)
        << "reference, bits 0x" << std::hex << c.in_bits;
  }
}

// A NaN whose payload sits only in the low 16 bits must not truncate to inf.
TEST(Bf16Test, NaNStaysNaN) {
  for (uint32_t bits : {0x7f800001u, 0xff800001u, 0x7f80ffffu, 0x7fc00000u,
                        0xffffffffu, 0x7fffffffu}) {
    EXPECT_TRUE(IsBf16NaN(FloatToBf16(FromBits(bits))))
        << "bits 0x" << std::hex << bits;
  }
  EXPECT_TRUE(IsF16NaN(FloatToF16(FromBits(0x7f800001u))));
  EXPECT_TRUE(IsF16NaN(FloatToF16(FromBits(0xff800001u))));
}

TEST(Bf16Test, FloatPatternsMatchReference) {
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    const float f = FromBits(static_cast<uint32_t>(bits));
    const uint16_t got = FloatToBf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(IsBf16NaN(got)) << "bits 0x" << std::hex << bits;
    } else {
      ASSERT_EQ(got, RefFloatToBf16(f)) << "bits 0x" << std::hex << bits;
    }
  }
  // Every halfway point, and the floats either side of it.
  for (uint32_t i = 0; i < 0x7f80u; ++i) {
    const uint32_t mid = (i << 16) | 0x8000u;
    const uint16_t even = (i & 1) ? i + 1 : i;
    ASSERT_EQ(FloatToBf16(FromBits(mid)), even) << std::hex << i;
    ASSERT_EQ(FloatToBf16(FromBits(mid - 1)), i) << std::hex << i;
    ASSERT_EQ(FloatToBf16(FromBits(mid + 1)), i + 1) << std::hex << i;
    ASSERT_EQ(FloatToBf16(FromBits(mid | 0x80000000u)), even | 0x8000)
        << std::hex << i;
  }
}

TEST(DTypeTest, LoadAndStoreUseTheConversions) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  float f32[16];
  uint16_t f16[16];
  uint16_t bf16[16];
  for (int i = 0; i < 16; ++i) {
    const float v = normal(rng);
    StoreFromFloat(DType::kF32, f32, i, v);
    StoreFromFloat(DType::kF16, f16, i, v);
    StoreFromFloat(DType::kBF16, bf16, i, v);
    EXPECT_EQ(ToBits(f32[i]), ToBits(v));
    EXPECT_EQ(f16[i], RefFloatToF16(v));
    EXPECT_EQ(bf16[i], RefFloatToBf16(v));
  }
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(LoadAsFloat(DType::kF32, f32, i), f32[i]);
    EXPECT_EQ(static_cast<double>(LoadAsFloat(DType::kF16, f16, i)),
              RefF16ToDouble(f16[i]));
    EXPECT_EQ(ToBits(LoadAsFloat(DType::kBF16, bf16, i)),
              static_cast<uint32_t>(bf16[i]) << 16);
  }
}

}  // namespace
}  // namespace kvkeep
