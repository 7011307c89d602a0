// CRC32C: the published check value, known vectors, incremental use, the
// hardware paths (carry-less-multiply folding from 256 bytes where the CPU
// has VPCLMULQDQ, three interleaved crc32 streams otherwise and for what is
// left) equal to the table path on every length and alignment around their
// block sizes and on random lengths, alignments and starting values, and
// combining the checksums of two pieces into the checksum of both.
#include "services/common/crc32c.h"

#include <algorithm>
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

// `n` bytes from `rng`.
std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> data(n);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  return data;
}

TEST(Crc32cTest, EveryShortLengthAndAlignmentAgreesWithTheTable) {
  // Folding needs 256 bytes, takes them 256 at a time, then 64 and 16 at a
  // time, and leaves the last 0..15 bytes to crc32: every length up to
  // 1100 meets each way in and out at several alignments.
  std::mt19937_64 rng(4);
  const std::vector<std::byte> data = RandomBytes(rng, 1100 + 64);
  for (size_t offset : {0, 1, 8, 15, 63}) {
    for (size_t len = 0; len <= 1100; ++len) {
      const std::span<const std::byte> part(data.data() + offset, len);
      const auto crc = static_cast<uint32_t>(rng());
      ASSERT_EQ(Crc32c(crc, part), Crc32cPortable(crc, part))
          << offset << "+" << len << " from " << crc;
    }
  }
}

TEST(Crc32cTest, RandomLengthsAlignmentsAndStartsAgreeWithTheTable) {
  std::mt19937_64 rng(5);
  const std::vector<std::byte> data = RandomBytes(rng, 5000 + 64);
  for (int i = 0; i < 3000; ++i) {
    const size_t offset = rng() % 64;
    const size_t len = rng() % 5001;
    const auto crc = static_cast<uint32_t>(rng());
    const std::span<const std::byte> part(data.data() + offset, len);
    ASSERT_EQ(Crc32c(crc, part), Crc32cPortable(crc, part))
        << offset << "+" << len << " from " << crc;
  }
}

TEST(Crc32cTest, LargeOddBuffersAgreeWithTheTable) {
  std::mt19937_64 rng(6);
  const size_t kMiB = size_t{1} << 20;
  const std::vector<std::byte> data = RandomBytes(rng, 3 * kMiB + 64);
  for (size_t len : {kMiB, kMiB + 1, kMiB + 13, kMiB + 255, 3 * kMiB + 7}) {
    const size_t offset = rng() % 64;
    const auto crc = static_cast<uint32_t>(rng());
    const std::span<const std::byte> part(data.data() + offset, len);
    EXPECT_EQ(Crc32c(crc, part), Crc32cPortable(crc, part))
        << offset << "+" << len << " from " << crc;
  }
}

TEST(Crc32cTest, UniformBytesAgreeWithTheTable) {
  // All zeros and all ones: the folded lanes cancel or saturate in ways
  // random bytes rarely do.
  for (uint8_t fill : {0x00, 0xFF}) {
    const std::vector<std::byte> data(70000, std::byte{fill});
    for (size_t len : {256, 1024, 4096 + 15, 70000}) {
      const std::span<const std::byte> part(data.data(), len);
      for (uint32_t crc : {0u, 0xFFFFFFFFu}) {
        EXPECT_EQ(Crc32c(crc, part), Crc32cPortable(crc, part))
            << int{fill} << " x " << len << " from " << crc;
      }
    }
  }
}

TEST(Crc32cTest, ChainingRandomPiecesGivesTheWhole) {
  std::mt19937_64 rng(7);
  const std::vector<std::byte> data = RandomBytes(rng, 200000);
  const std::span<const std::byte> all(data);
  for (int i = 0; i < 200; ++i) {
    const std::span<const std::byte> whole =
        all.subspan(rng() % 64, rng() % (all.size() - 64));
    const uint32_t expected = Crc32cPortable(0, whole);
    ASSERT_EQ(Crc32c(0, whole), expected) << whole.size();
    // One cut anywhere.
    const size_t cut = rng() % (whole.size() + 1);
    ASSERT_EQ(Crc32c(Crc32c(0, whole.first(cut)), whole.subspan(cut)), expected)
        << whole.size() << " cut at " << cut;
    // Several pieces of random sizes, small and large.
    uint32_t crc = 0;
    for (size_t at = 0; at < whole.size();) {
      const size_t piece_max = (rng() & 1) ? 300 : 40000;
      const size_t piece = std::min(whole.size() - at, rng() % piece_max);
      crc = Crc32c(crc, whole.subspan(at, piece));
      at += piece;
    }
    ASSERT_EQ(crc, expected) << whole.size();
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
