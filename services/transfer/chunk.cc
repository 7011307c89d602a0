#include "services/transfer/chunk.h"

#include "services/common/crc32c.h"

namespace kvkeep {
namespace {

size_t Bytes(const std::vector<std::span<const std::byte>>& pieces) {
  size_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

}  // namespace

Chunk ChunkOf(int32_t layer, int64_t first, int64_t slots,
              const SlotSpans& spans) {
  Chunk chunk;
  chunk.layer = layer;
  chunk.first_slot = first;
  chunk.slots = slots;
  chunk.keys.assign(spans.keys.begin(), spans.keys.end());
  chunk.values.assign(spans.values.begin(), spans.values.end());
  return chunk;
}

size_t KeyBytes(const Chunk& chunk) { return Bytes(chunk.keys); }
size_t ValueBytes(const Chunk& chunk) { return Bytes(chunk.values); }

uint32_t ChunkCrc32c(const Chunk& chunk) {
  uint32_t crc = 0;
  for (const auto& p : chunk.keys) crc = Crc32c(crc, p);
  for (const auto& p : chunk.values) crc = Crc32c(crc, p);
  return crc;
}

}  // namespace kvkeep
