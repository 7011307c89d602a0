// Chunk: a run of one layer's slots in flight between two stores, the one
// chunk type of session transfer. Every transport moves Chunks: the gRPC
// stream encodes them as TransferMessage{chunk} (chunk_wire.h), the data
// socket with its own framing (tcp_transport.h), NCCL moves the slot run
// pool to pool and ignores the bytes.
//
// A Chunk borrows its bytes (a frozen session's pages, a send buffer, or a
// received message's slices): whoever builds it keeps them alive and
// unchanged while it is used. Plain data, not thread-safe.
#ifndef KVKEEP_SERVICES_TRANSFER_CHUNK_H_
#define KVKEEP_SERVICES_TRANSFER_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "cache_store/slot_spans.h"

namespace kvkeep {

struct Chunk {
  int32_t layer = 0;
  int64_t first_slot = 0;
  int64_t slots = 0;
  // keys: [slots][kv_heads][head_dim], then values alike, each in pieces
  // (a piece may end anywhere, even inside a token). Empty when the bytes
  // do not pass through the host (NCCL) or are not read yet (a header).
  std::vector<std::span<const std::byte>> keys;
  std::vector<std::span<const std::byte>> values;
  // The CRC32C the receiver checks (of the keys, then the values). Unset:
  // the transport computes it from the bytes as it sends them. Set: sent
  // as it is (a test's corrupting transport claims the original bytes'
  // checksum for changed bytes).
  std::optional<uint32_t> crc32c;
};

// A chunk of slots [first, first + slots) of `layer` whose bytes lie in
// `spans` (page addresses, or a buffer).
Chunk ChunkOf(int32_t layer, int64_t first, int64_t slots,
              const SlotSpans& spans);
// Bytes of the keys (or the values) of `chunk`.
size_t KeyBytes(const Chunk& chunk);
size_t ValueBytes(const Chunk& chunk);
// CRC32C of the keys, then the values.
uint32_t ChunkCrc32c(const Chunk& chunk);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_CHUNK_H_
