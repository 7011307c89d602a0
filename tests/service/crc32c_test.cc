// CRC32C: the published check value, known vectors, incremental use, and the
// hardware path equal to the table path on every length and alignment.
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

}  // namespace
}  // namespace kvkeep
