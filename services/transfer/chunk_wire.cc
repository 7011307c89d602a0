#include "services/transfer/chunk_wire.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "services/common/crc32c.h"

namespace kvkeep {
namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using WireFormatLite = google::protobuf::internal::WireFormatLite;

// Copies (and checksums) this many bytes at a time, so a piece is still in
// the core's cache when its checksum reads it.
constexpr size_t kPassBytes = 128 << 10;

constexpr uint32_t Tag(int field, WireFormatLite::WireType type) {
  return static_cast<uint32_t>(field) << 3 | type;
}
// TransferMessage
constexpr uint32_t kChunkTag =
    Tag(3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
// TransferChunk
constexpr uint32_t kLayerTag = Tag(1, WireFormatLite::WIRETYPE_VARINT);
constexpr uint32_t kFirstSlotTag = Tag(2, WireFormatLite::WIRETYPE_VARINT);
constexpr uint32_t kKeysTag = Tag(3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
constexpr uint32_t kValuesTag =
    Tag(4, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
constexpr uint32_t kCrcTag = Tag(5, WireFormatLite::WIRETYPE_FIXED32);
// The framing before the keys: the chunk's tag and length, layer,
// first_slot, and the keys' tag and length, at most.
constexpr size_t kMaxPrefixBytes = 5 * (1 + 10);

bool IsGroup(uint32_t tag) {
  const auto type = WireFormatLite::GetTagWireType(tag);
  return type == WireFormatLite::WIRETYPE_START_GROUP ||
         type == WireFormatLite::WIRETYPE_END_GROUP;
}

// Copies `pieces` to `out` a pass at a time, extending `crc` over each.
std::byte* CopyAndSum(const std::vector<std::span<const std::byte>>& pieces,
                      std::byte* out, uint32_t* crc) {
  for (std::span<const std::byte> piece : pieces) {
    while (!piece.empty()) {
      const size_t n = std::min(piece.size(), kPassBytes);
      std::memcpy(out, piece.data(), n);
      *crc = Crc32c(*crc, {out, n});
      out += n;
      piece = piece.subspan(n);
    }
  }
  return out;
}

// Appends the next `n` bytes of `in` to `pieces`, in place.
bool TakePieces(CodedInputStream& in, uint32_t n,
                std::vector<std::span<const std::byte>>* pieces) {
  while (n > 0) {
    const void* data;
    int size;
    if (!in.GetDirectBufferPointer(&data, &size) || size <= 0) return false;
    const uint32_t here = std::min<uint32_t>(n, static_cast<uint32_t>(size));
    pieces->emplace_back(static_cast<const std::byte*>(data), here);
    if (!in.Skip(static_cast<int>(here))) return false;
    n -= here;
  }
  return true;
}

enum class Read { kOk, kNotOurs, kMalformed };

// The fields of a TransferChunk, up to the current limit.
Read ReadChunkFields(CodedInputStream& in, Chunk* chunk) {
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0)
      return in.ConsumedEntireMessage() ? Read::kOk : Read::kMalformed;
    uint64_t v;
    uint32_t n;
    if (tag == kLayerTag) {
      if (!in.ReadVarint64(&v)) return Read::kMalformed;
      chunk->layer = static_cast<int32_t>(v);
    } else if (tag == kFirstSlotTag) {
      if (!in.ReadVarint64(&v)) return Read::kMalformed;
      chunk->first_slot = static_cast<int64_t>(v);
    } else if (tag == kKeysTag || tag == kValuesTag) {
      auto& pieces = tag == kKeysTag ? chunk->keys : chunk->values;
      pieces.clear();  // a repeated field: the last one counts
      if (!in.ReadVarint32(&n) || !TakePieces(in, n, &pieces)) {
        return Read::kMalformed;
      }
    } else if (tag == kCrcTag) {
      uint32_t crc;
      if (!in.ReadLittleEndian32(&crc)) return Read::kMalformed;
      chunk->crc32c = crc;
    } else if (IsGroup(tag)) {
      return Read::kNotOurs;  // left to protobuf
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return Read::kMalformed;
    }
  }
}

}  // namespace

grpc::ByteBuffer EncodeChunk(const Chunk& chunk) {
  const size_t key_bytes = KeyBytes(chunk);
  const size_t value_bytes = ValueBytes(chunk);
  // [room for the prefix][keys][values' tag and length][values][crc]
  const size_t keys_at = kMaxPrefixBytes;
  const size_t values_at =
      keys_at + key_bytes + 1 + CodedOutputStream::VarintSize64(value_bytes);
  auto buffer = std::make_unique<std::byte[]>(values_at + value_bytes + 5);
  std::byte* const base = buffer.get();
  uint32_t keys_crc = 0;
  uint32_t values_crc = 0;
  CopyAndSum(chunk.keys, base + keys_at, &keys_crc);
  CopyAndSum(chunk.values, base + values_at, &values_crc);
  const uint32_t crc =
      chunk.crc32c.value_or(Crc32cCombine(keys_crc, values_crc, value_bytes));

  // proto3 leaves out fields holding their default (zero, empty), and
  // protobuf writes fields in field-number order: so do we.
  size_t inner = 0;
  if (chunk.layer != 0) inner += 1 + WireFormatLite::Int32Size(chunk.layer);
  if (chunk.first_slot != 0) {
    inner += 1 + WireFormatLite::Int64Size(chunk.first_slot);
  }
  if (key_bytes != 0)
    inner += 1 + WireFormatLite::LengthDelimitedSize(key_bytes);
  if (value_bytes != 0) {
    inner += 1 + WireFormatLite::LengthDelimitedSize(value_bytes);
  }
  if (crc != 0) inner += 1 + 4;

  uint8_t prefix[kMaxPrefixBytes];
  uint8_t* p = WireFormatLite::WriteTagToArray(
      3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, prefix);
  p = CodedOutputStream::WriteVarint64ToArray(inner, p);
  if (chunk.layer != 0)
    p = WireFormatLite::WriteInt32ToArray(1, chunk.layer, p);
  if (chunk.first_slot != 0) {
    p = WireFormatLite::WriteInt64ToArray(2, chunk.first_slot, p);
  }
  if (key_bytes != 0) {
    p = WireFormatLite::WriteTagToArray(
        3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, p);
    p = CodedOutputStream::WriteVarint64ToArray(key_bytes, p);
  }
  size_t end = keys_at + key_bytes;
  if (value_bytes != 0) {
    auto* q = reinterpret_cast<uint8_t*>(base + end);
    q = WireFormatLite::WriteTagToArray(
        4, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, q);
    CodedOutputStream::WriteVarint64ToArray(value_bytes, q);
    end = values_at + value_bytes;
  }
  if (crc != 0) {
    end = reinterpret_cast<std::byte*>(WireFormatLite::WriteFixed32ToArray(
              5, crc, reinterpret_cast<uint8_t*>(base + end))) -
          base;
  }
  const size_t prefix_bytes = static_cast<size_t>(p - prefix);
  const size_t begin = keys_at - prefix_bytes;
  std::memcpy(base + begin, prefix, prefix_bytes);
  // The slice owns the buffer from here; gRPC frees it once it is sent.
  grpc::Slice slice(
      base + begin, end - begin,
      [](void* b) { delete[] static_cast<std::byte*>(b); }, base);
  buffer.release();
  return grpc::ByteBuffer(&slice, 1);
}

absl::StatusOr<std::optional<Chunk>> DecodeChunk(grpc::ByteBuffer& message) {
  const auto malformed = [] {
    return absl::InvalidArgumentError("a malformed transfer message");
  };
  grpc::ProtoBufferReader reader(&message);
  if (!reader.status().ok()) {
    return absl::InvalidArgumentError("an unreadable transfer message");
  }
  CodedInputStream in(&reader);
  std::optional<Chunk> chunk;
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (!in.ConsumedEntireMessage()) return malformed();
      break;
    }
    if (tag != kChunkTag) {
      // transfer_id, nccl and tcp are skipped. Any other field is another
      // member of the kind oneof (header, commit, resolve, or one newer than
      // this reader, which would win if it came last) or a group: protobuf
      // decides.
      const uint32_t field = tag >> 3;
      if (IsGroup(tag) || (field != 1 && field != 5 && field != 6)) {
        return std::nullopt;
      }
      if (!WireFormatLite::SkipField(&in, tag)) return malformed();
      continue;
    }
    if (chunk.has_value()) return std::nullopt;  // protobuf would merge them
    uint32_t bytes;
    if (!in.ReadVarint32(&bytes) || bytes > static_cast<uint32_t>(INT32_MAX)) {
      return malformed();
    }
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(bytes));
    chunk.emplace();
    chunk->crc32c = 0;
    const Read read = ReadChunkFields(in, &*chunk);
    if (read == Read::kNotOurs) return std::nullopt;
    if (read == Read::kMalformed || in.BytesUntilLimit() != 0) {
      return malformed();
    }
    in.PopLimit(limit);
  }
  return chunk;
}

}  // namespace kvkeep
