// The hand-made wire form of a transfer chunk (services/transfer/
// chunk_wire.h): byte for byte what protobuf serializes, read back in place
// from any split of a ByteBuffer into slices; other messages are left to
// protobuf and garbage is refused with INVALID_ARGUMENT.
#include "services/transfer/chunk_wire.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "kvkeep/v1/kvkeep.pb.h"

namespace kvkeep {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// `bytes` as a ByteBuffer cut at `cuts` (ascending offsets).
grpc::ByteBuffer Split(const std::string& bytes, std::vector<size_t> cuts) {
  cuts.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + at, cut - at);
    at = cut;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Join(const std::vector<std::span<const std::byte>>& pieces) {
  std::string out;
  for (const auto& p : pieces) {
    out.append(reinterpret_cast<const char*>(p.data()), p.size());
  }
  return out;
}

TEST(TransferWireTest, AChunkMessageIsWhatProtobufSerializes) {
  std::mt19937 rng(8);
  for (const int32_t layer : {0, 1, 31, 300}) {
    for (const int64_t first_slot :
         {int64_t{0}, int64_t{5}, int64_t{1} << 40}) {
      for (const int64_t kv_bytes : {0, 1, 127, 128, 70000}) {
        for (const uint32_t crc : {0u, 1u, 0xE3069283u}) {
          std::string keys(kv_bytes, '\0'), values(kv_bytes, '\0');
          for (char& b : keys) b = static_cast<char>(rng());
          for (char& b : values) b = static_cast<char>(rng());
          Chunk m;
          m.layer = layer;
          m.first_slot = first_slot;
          // In pieces, as a host pool's pages give them.
          const std::span<const std::byte> k = std::as_bytes(std::span(keys));
          const std::span<const std::byte> v = std::as_bytes(std::span(values));
          m.keys = {k.first(kv_bytes / 3), k.subspan(kv_bytes / 3)};
          m.values = {v};
          m.crc32c = crc;
          v1::TransferMessage expected;
          v1::TransferChunk* c = expected.mutable_chunk();
          c->set_layer(layer);
          c->set_first_slot(first_slot);
          c->set_keys(keys);
          c->set_values(values);
          c->set_crc32c(crc);
          const std::string bytes = Flatten(EncodeChunk(m));
          // Unclaimed, the checksum is the bytes' own.
          m.crc32c.reset();
          c->set_crc32c(ChunkCrc32c(m));
          EXPECT_EQ(Flatten(EncodeChunk(m)), expected.SerializeAsString());
          c->set_crc32c(crc);
          EXPECT_EQ(bytes, expected.SerializeAsString())
              << layer << " " << first_slot << " " << kv_bytes << " " << crc;
          v1::TransferMessage parsed;
          ASSERT_TRUE(parsed.ParseFromString(bytes));
          EXPECT_EQ(parsed.chunk().keys(), c->keys());
        }
      }
    }
  }
}

TEST(TransferWireTest, AChunkIsReadInPlaceFromAnySplit) {
  v1::TransferMessage message;
  message.set_transfer_id("t-9");
  v1::TransferChunk* c = message.mutable_chunk();
  c->set_layer(3);
  c->set_first_slot(77);
  std::mt19937 rng(9);
  std::string keys(200, '\0'), values(200, '\0');
  for (char& x : keys) x = static_cast<char>(rng());
  for (char& x : values) x = static_cast<char>(rng());
  c->set_keys(keys);
  c->set_values(values);
  c->set_crc32c(0xDEADBEEF);
  const std::string bytes = message.SerializeAsString();
  auto check = [&](grpc::ByteBuffer buffer) {
    absl::StatusOr<std::optional<Chunk>> view = DecodeChunk(buffer);
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_TRUE(view->has_value());
    const Chunk& v = **view;
    EXPECT_EQ(v.layer, 3);
    EXPECT_EQ(v.first_slot, 77);
    EXPECT_EQ(v.crc32c, 0xDEADBEEFu);
    EXPECT_EQ(Join(v.keys), keys);
    EXPECT_EQ(Join(v.values), values);
  };
  // Every single cut, every pair of cuts 7 bytes apart, and one byte per
  // slice: varints, tags and the checksum split anywhere.
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    SCOPED_TRACE(cut);
    check(Split(bytes, {cut}));
    if (cut + 7 <= bytes.size()) check(Split(bytes, {cut, cut + 7}));
  }
  std::vector<size_t> every;
  for (size_t i = 1; i < bytes.size(); ++i) every.push_back(i);
  check(Split(bytes, every));

  // Fields of the chunk it does not know are skipped, as protobuf does.
  v1::TransferMessage newer = message;
  newer.mutable_chunk()
      ->GetReflection()
      ->MutableUnknownFields(newer.mutable_chunk())
      ->AddVarint(99, 12345);
  check(Split(newer.SerializeAsString(), {9}));
  // A field of the message it does not know may be a newer member of the
  // kind oneof, which wins when it comes last: protobuf decides.
  newer.GetReflection()->MutableUnknownFields(&newer)->AddLengthDelimited(
      77, "later");
  grpc::ByteBuffer unknown = Split(newer.SerializeAsString(), {9});
  absl::StatusOr<std::optional<Chunk>> left = DecodeChunk(unknown);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_FALSE(left->has_value());
}

TEST(TransferWireTest, OtherMessagesAreLeftToProtobufAndGarbageIsRefused) {
  v1::TransferMessage header;
  header.set_transfer_id("t");
  header.mutable_header()->set_session_id("x");
  v1::TransferMessage commit;
  commit.set_commit(true);
  for (const v1::TransferMessage& m : {header, commit}) {
    grpc::ByteBuffer buffer = Split(m.SerializeAsString(), {});
    absl::StatusOr<std::optional<Chunk>> view = DecodeChunk(buffer);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_FALSE(view->has_value());
  }
  // A chunk followed by a resolve is a resolve (found by chunk_wire_fuzz).
  v1::TransferMessage resolve;
  resolve.set_resolve(true);
  {
    v1::TransferMessage chunk;
    chunk.mutable_chunk()->set_keys("abcd");
    grpc::ByteBuffer buffer =
        Split(chunk.SerializeAsString() + resolve.SerializeAsString(), {});
    absl::StatusOr<std::optional<Chunk>> view = DecodeChunk(buffer);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_FALSE(view->has_value());
  }
  // A chunk followed by a commit is a commit (the oneof's last field).
  v1::TransferMessage chunk;
  chunk.mutable_chunk()->set_keys("abcd");
  const std::string both =
      chunk.SerializeAsString() + commit.SerializeAsString();
  grpc::ByteBuffer split = Split(both, {3});
  absl::StatusOr<std::optional<Chunk>> view = DecodeChunk(split);
  ASSERT_TRUE(view.ok());
  EXPECT_FALSE(view->has_value());
  // Truncated anywhere inside: malformed.
  chunk.mutable_chunk()->set_crc32c(7);
  const std::string bytes = chunk.SerializeAsString();
  for (size_t len = 1; len < bytes.size(); ++len) {
    grpc::ByteBuffer truncated = Split(bytes.substr(0, len), {});
    view = DecodeChunk(truncated);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << len;
  }
}

}  // namespace
}  // namespace kvkeep
