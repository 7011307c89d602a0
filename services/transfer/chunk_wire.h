// The wire form of a Chunk on the gRPC stream: exactly the bytes protobuf
// serializes for TransferMessage{chunk: {layer, first_slot, keys, values,
// crc32c}}, so any client generated from the .proto can send or read them,
// but built and read with protobuf's own primitives (CodedOutputStream and
// WireFormatLite to write, CodedInputStream over gRPC's ProtoBufferReader
// to read) instead of through a v1::TransferMessage: a chunk's bytes are
// copied once into the message on the way out, and read in place from the
// received slices on the way in (docs/transfer.md, Wire, says why and what
// it saves).
//
// Pure functions; thread-compatible.
#ifndef KVKEEP_SERVICES_TRANSFER_CHUNK_WIRE_H_
#define KVKEEP_SERVICES_TRANSFER_CHUNK_WIRE_H_

#include <optional>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "services/transfer/chunk.h"

namespace kvkeep {

// The message of `chunk`, its bytes copied in a pass at a time with the
// checksum computed over each pass as it is copied (unless chunk.crc32c is
// set, which is sent instead).
grpc::ByteBuffer EncodeChunk(const Chunk& chunk);

// The chunk of `message` if it is a TransferMessage holding a chunk (and
// nothing else but perhaps a transfer_id and unknown fields); nullopt for
// any other message, which the caller parses as a TransferMessage;
// INVALID_ARGUMENT if it is not a well-formed message. The chunk's pieces
// point into `message`, which must outlive them unchanged; its crc32c is
// always set (0 if absent, as protobuf reads it).
absl::StatusOr<std::optional<Chunk>> DecodeChunk(grpc::ByteBuffer& message);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_CHUNK_WIRE_H_
