// A tier file (cache_store/tier_file.h) is read back from disk, where a
// flipped bit or a truncation can reach it: DecodeTierFile must refuse
// anything it did not write with DATA_LOSS (no crash, no huge allocation),
// and what it takes must encode back to the same bytes. The input is tried
// as a whole file, and as a payload under a valid header (its CRC32C
// computed here) so the fuzzer reaches the field parser behind the checksum.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "cache_store/tier_file.h"
#include "services/common/crc32c.h"

namespace {

void Check(std::span<const std::byte> bytes) {
  using namespace kvkeep;
  absl::StatusOr<SessionSnapshot> decoded = DecodeTierFile(bytes);
  if (!decoded.ok()) {
    if (decoded.status().code() != absl::StatusCode::kDataLoss) {
      std::fprintf(stderr, "kvkeep fuzz finding: DecodeTierFile said %s\n",
                   decoded.status().ToString().c_str());
      std::abort();
    }
    return;
  }
  // Parameters are a map: a payload naming one twice encodes back once.
  absl::StatusOr<SessionSnapshot> again =
      DecodeTierFile(EncodeTierFile(*decoded));
  if (!again.ok() || EncodeTierFile(*again) != EncodeTierFile(*decoded)) {
    std::fprintf(stderr,
                 "kvkeep fuzz finding: a decoded tier file does not encode "
                 "back to itself\n");
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> input(
      reinterpret_cast<const std::byte*>(data), size);
  Check(input);
  // The same bytes as the payload of a well-framed file.
  std::vector<std::byte> framed(24 + size);
  const char magic[8] = {'K', 'V', 'K', 'T', 'I', 'E', 'R', '1'};
  const uint32_t format = 1;
  const uint32_t crc = kvkeep::Crc32c(0, input);
  const uint64_t length = size;
  std::memcpy(framed.data(), magic, 8);
  std::memcpy(framed.data() + 8, &format, 4);
  std::memcpy(framed.data() + 12, &crc, 4);
  std::memcpy(framed.data() + 16, &length, 8);
  if (size > 0) std::memcpy(framed.data() + 24, data, size);
  Check(framed);
  return 0;
}
