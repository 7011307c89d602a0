// The bytes of a session moved down a tier (tiers.h): a SessionSnapshot with
// its keys and values, framed and checksummed so that a restore proves it
// reads what was written. Layout (little-endian):
//   "KVKTIER1" | u32 format | u32 CRC32C of the payload | u64 payload bytes |
//   payload (the snapshot's fields in a fixed order; tier_file.cc)
// Format 1 holds token records; format 2 a kivi_int4 session (its key
// blocks, and each layer's staging after its values).
// The checksum covers every payload byte; a decode checks it before reading
// any field and bounds-checks every length against what is left, so damaged
// or hostile bytes give DATA_LOSS, never a crash or a huge allocation.
//
// Pure functions; thread-safe.
#ifndef KVKEEP_CACHE_STORE_TIER_FILE_H_
#define KVKEEP_CACHE_STORE_TIER_FILE_H_

#include <cstddef>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/session_snapshot.h"

namespace kvkeep {

// The snapshot as the framed, checksummed bytes above.
std::vector<std::byte> EncodeTierFile(const SessionSnapshot& snapshot);

// The snapshot `bytes` hold. DATA_LOSS, saying what is wrong (bad magic or
// format, a length past the end, a checksum mismatch with both values), for
// anything EncodeTierFile did not write. The snapshot's consistency is the
// caller's to check (ValidateSnapshot).
absl::StatusOr<SessionSnapshot> DecodeTierFile(
    std::span<const std::byte> bytes);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_TIER_FILE_H_
