// The transfer's chunk reader (chunk_wire.h), against protobuf's own parser.
// Byte 0 of the input says how many slices the rest is cut into (gRPC
// hands a message over in slices, and a chunk's bytes may straddle them);
// the rest is a TransferMessage as it came off the wire. Whatever
// DecodeChunk returns must agree with protobuf: a chunk it reads is the
// chunk protobuf parses, byte for byte; a message it calls malformed does
// not parse. A chunk read back is encoded again (EncodeChunk) and must
// decode to itself.
//
// DecodeChunk is allowed to be more lenient than the generated parser,
// which refuses what CodedInputStream reads: a tag written in more than
// five bytes, invalid UTF-8 in transfer_id (neither changes the chunk a
// hostile sender could send anyway). Such a message is then only checked
// to round-trip.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/transfer/chunk_wire.h"

namespace kvkeep {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "kvkeep fuzz finding: %s\n", what.c_str());
  std::abort();
}

std::string Joined(const std::vector<std::span<const std::byte>>& pieces) {
  std::string out;
  for (std::span<const std::byte> p : pieces) {
    out.append(reinterpret_cast<const char*>(p.data()), p.size());
  }
  return out;
}

// `bytes` in `n` slices of about equal size (the last takes the rest).
grpc::ByteBuffer Sliced(std::string_view bytes, size_t n) {
  std::vector<grpc::Slice> slices;
  const size_t each = std::max<size_t>(1, bytes.size() / n);
  for (size_t at = 0; at < bytes.size();) {
    const size_t len = slices.size() + 1 == n
                           ? bytes.size() - at
                           : std::min(each, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, len);
    at += len;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void Compare(const Chunk& got, const v1::TransferChunk& want,
             const char* what) {
  if (got.layer != want.layer() || got.first_slot != want.first_slot() ||
      got.crc32c.value_or(0) != want.crc32c() ||
      Joined(got.keys) != want.keys() || Joined(got.values) != want.values()) {
    Fail(absl::StrCat(what, ": DecodeChunk read layer ", got.layer, " slot ",
                      got.first_slot, " crc ", got.crc32c.value_or(0), " with ",
                      Joined(got.keys).size(), "+", Joined(got.values).size(),
                      " bytes; protobuf reads layer ", want.layer(), " slot ",
                      want.first_slot(), " crc ", want.crc32c(), " with ",
                      want.keys().size(), "+", want.values().size()));
  }
}

}  // namespace
}  // namespace kvkeep

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep;
  if (size == 0) return 0;
  const size_t slices = 1 + data[0] % 8;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  grpc::ByteBuffer buffer = Sliced(bytes, slices);
  absl::StatusOr<std::optional<Chunk>> chunk = DecodeChunk(buffer);

  v1::TransferMessage message;
  const bool parses =
      message.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  if (!chunk.ok()) {
    if (parses) {
      Fail(absl::StrCat("DecodeChunk refused a message protobuf parses: ",
                        chunk.status().ToString()));
    }
    return 0;
  }
  if (!chunk->has_value()) return 0;  // left to protobuf
  if (parses && message.kind_case() != v1::TransferMessage::kChunk) {
    Fail("DecodeChunk read a chunk where protobuf reads another kind");
  }
  v1::TransferChunk want;
  if (parses) {
    want = message.chunk();
    Compare(**chunk, want, "the message");
  } else {  // a leniency (above): what DecodeChunk read is the reference
    const Chunk& got = **chunk;
    want.set_layer(got.layer);
    want.set_first_slot(got.first_slot);
    want.set_keys(Joined(got.keys));
    want.set_values(Joined(got.values));
    want.set_crc32c(got.crc32c.value_or(0));
  }

  grpc::ByteBuffer again = EncodeChunk(**chunk);
  absl::StatusOr<std::optional<Chunk>> round = DecodeChunk(again);
  if (!round.ok() || !round->has_value()) {
    Fail("EncodeChunk wrote what DecodeChunk does not read as a chunk");
  }
  Compare(**round, want, "the re-encoded chunk");
  return 0;
}
