// CRC32C (Castagnoli, polynomial 0x1EDC6F41, reflected; the checksum of
// iSCSI, ext4 and gRPC's own framing): what every chunk of a session
// transfer carries so the receiver can prove the bytes arrived as sent.
// From 256 bytes up, folds the data with carry-less multiplies
// (VPCLMULQDQ on 512-bit registers) where the CPU has AVX-512 and them;
// otherwise, and for short inputs and the last bytes, uses the SSE4.2
// crc32 instruction on three interleaved streams when the CPU has it
// (memory speed rather than the instruction's latency), a table otherwise;
// all give the same values. Thread-safe.
#ifndef KVKEEP_SERVICES_COMMON_CRC32C_H_
#define KVKEEP_SERVICES_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvkeep {

// Extends `crc` (0 to start) over `data`: Crc32c(Crc32c(0, a), b) ==
// Crc32c(0, a + b). Crc32c(0, "123456789") == 0xE3069283.
uint32_t Crc32c(uint32_t crc, std::span<const std::byte> data);
// The table version, for tests and CPUs without SSE4.2.
uint32_t Crc32cPortable(uint32_t crc, std::span<const std::byte> data);

// The CRC32C of a + b from crc_a = Crc32c(0, a), crc_b = Crc32c(0, b) and
// b's length, without the bytes: two pieces checksummed apart (keys and
// values, a slot range at a time) make the checksum of the whole. Costs
// O(log b_bytes), not O(b_bytes).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t b_bytes);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_CRC32C_H_
