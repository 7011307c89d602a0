// CRC32C: the published check value, known vectors, incremental use, the
// hardware path (three interleaved streams) equal to the table path on every
// length and alignment around its block sizes, and combining the checksums
// of two pieces into the checksum of both.
#include "services/common/crc32c.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvkeep {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c(0, Bytes("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable(0, Bytes("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, Bytes("")), 0u);
  // RFC 3720 B.4: 32 bytes of zeros, of 0xFF.
  EXPECT_EQ(Crc32c(0, Bytes(std::string(32, '\0'))), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(0, Bytes(std::string(32, '\xff'))), 0x62A8AB43u);
}

TEST(Crc32cTest, IncrementalAndPortableAgree) {
  std::mt19937 rng(1);
  std::vector<std::byte> data(4099);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  for (size_t offset : {0, 1, 3, 7}) {
    for (size_t len : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4000}) {
      const std::span<const std::byte> part(data.data() + offset, len);
      const uint32_t whole = Crc32c(0, part);
      EXPECT_EQ(whole, Crc32cPortable(0, part)) << offset << "+" << len;
      const size_t cut = len / 3;
      EXPECT_EQ(Crc32c(Crc32c(0, part.first(cut)), part.subspan(cut)), whole);
    }
  }
  // One flipped bit changes it.
  const uint32_t before = Crc32c(0, data);
  data[2000] ^= std::byte{0x10};
  EXPECT_NE(Crc32c(0, data), before);
}

TEST(Crc32cTest, InterleavedStreamsAgreeWithTheTableAcrossBlockSizes) {
  // The hardware path splits 3 x 8192 and 3 x 256 byte blocks into three
  // streams: lengths on, just below and just above those, and mixtures.
  std::mt19937 rng(2);
  std::vector<std::byte> data(3 * 3 * 8192 + 3 * 256 + 64);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  for (size_t offset : {0, 1, 5}) {
    for (size_t len :
         {767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1,
          3 * 8192 + 3 * 256 + 9, 2 * 3 * 8192 + 768, 3 * 3 * 8192 + 800}) {
      const std::span<const std::byte> part(data.data() + offset, len);
      EXPECT_EQ(Crc32c(0, part), Crc32cPortable(0, part))
          << offset << "+" << len;
      EXPECT_EQ(Crc32c(0x12345678, part), Crc32cPortable(0x12345678, part))
          << offset << "+" << len;
    }
  }
}

TEST(Crc32cTest, CombineJoinsTwoPieces) {
  std::mt19937 rng(3);
  std::vector<std::byte> data(70000);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  const std::span<const std::byte> all(data);
  for (size_t len : {0, 1, 9, 1000, 70000}) {
    const std::span<const std::byte> whole = all.first(len);
    for (size_t cut : {size_t{0}, len / 3, len / 2, len}) {
      const std::span<const std::byte> a = whole.first(cut);
      const std::span<const std::byte> b = whole.subspan(cut);
      EXPECT_EQ(Crc32cCombine(Crc32c(0, a), Crc32c(0, b), b.size()),
                Crc32c(0, whole))
          << len << " cut at " << cut;
    }
  }
  // "1234" + "56789" from the check value's pieces.
  EXPECT_EQ(
      Crc32cCombine(Crc32c(0, Bytes("1234")), Crc32c(0, Bytes("56789")), 5),
      0xE3069283u);
}

}  // namespace
}  // namespace kvkeep
