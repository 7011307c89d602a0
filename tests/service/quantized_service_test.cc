// Quantised layouts through real kvkeepd gRPC servers on loopback: the
// server describes the format (GetServerInfo, MapPool's layout); appends in
// the append dtype are stored as the records QuantizeTokens makes; ReadKv
// returns those records (dtype unset) or their values (f32, bf16), and
// refuses another quantised dtype; NaN is refused with INVALID_ARGUMENT and
// the session serves on; a transfer (host chunks and the tcp data socket)
// moves the records byte for byte, with fewer bytes than bf16 would.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

ModelLayout Int4Layout() {
  ModelLayout l;
  l.name = "int4-layout";  // not "q": GCC 12 -Wrestrict misfires under ASan
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 64;
  l.dtype = DType::kInt4;
  l.group_size = 32;
  l.append_dtype = DType::kBF16;
  l.page_tokens = 4;
  return l;
}

std::unique_ptr<testing::TestServer> Start(const ModelLayout& l,
                                           bool data_socket = false) {
  ServerConfig config = testing::TestServerConfig({PoolSpec{l, 64}});
  if (data_socket) config.transfer_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<testing::TestServer>> s =
      testing::TestServer::Start(config);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// bf16 keys and values of n tokens, element e of token t of layer l (and
// K or V) a fixed function of them, with one outlier channel.
std::string Bf16Tokens(const ModelLayout& l, int32_t layer, int64_t first,
                       int64_t n, bool values) {
  const int64_t per = int64_t{l.kv_heads} * l.head_dim;
  std::string out(n * per * 2, '\0');
  for (int64_t i = 0; i < n * per; ++i) {
    const int64_t e = i % per;
    float v = static_cast<float>(((first + i / per) * 131 + e * 17 + layer * 7 +
                                  (values ? 3 : 0)) %
                                 97) /
                  48.0f -
              1.0f;
    if (e % 64 == 9) v *= 30.0f;
    const uint16_t h = FloatToBf16(v);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

std::string SessionWith(v1::KvKeep::Stub& stub, const ModelLayout& l,
                        int64_t n) {
  grpc::ClientContext create_ctx;
  v1::CreateSessionRequest create;
  create.set_layout(l.name);
  create.set_policy("full");
  v1::CreateSessionResponse created;
  EXPECT_TRUE(stub.CreateSession(&create_ctx, create, &created).ok());
  grpc::ClientContext ctx;
  v1::AppendRequest append;
  append.set_session_id(created.session_id());
  for (int64_t p = 0; p < n; ++p) append.add_positions(p);
  for (int32_t layer = 0; layer < l.num_layers; ++layer) {
    v1::LayerKv* kv = append.add_layers();
    kv->set_keys(Bf16Tokens(l, layer, 0, n, false));
    kv->set_values(Bf16Tokens(l, layer, 0, n, true));
  }
  v1::StepResult result;
  const grpc::Status s = stub.Append(&ctx, append, &result);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return created.session_id();
}

// Every chunk of a ReadKv, keys and values concatenated per layer.
struct Read {
  grpc::Status status;
  std::vector<v1::DType> dtypes;
  std::vector<std::string> keys, values;  // per layer
};

Read ReadKv(v1::KvKeep::Stub& stub, const std::string& session,
            v1::DType dtype) {
  grpc::ClientContext ctx;
  v1::ReadKvRequest request;
  request.set_session_id(session);
  request.set_dtype(dtype);
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
      stub.ReadKv(&ctx, request);
  Read out;
  v1::KvChunk chunk;
  while (reader->Read(&chunk)) {
    out.keys.resize(chunk.layer() + 1);
    out.values.resize(chunk.layer() + 1);
    out.keys[chunk.layer()] += chunk.keys();
    out.values[chunk.layer()] += chunk.values();
    out.dtypes.push_back(chunk.dtype());
  }
  out.status = reader->Finish();
  return out;
}

std::string Quantised(const ModelLayout& l, const std::string& bf16) {
  const int64_t n =
      static_cast<int64_t>(bf16.size()) / (l.kv_heads * l.head_dim * 2);
  std::string out(n * l.page_layout().token_bytes(), '\0');
  EXPECT_TRUE(QuantizeTokens(l.page_layout(), DType::kBF16, bf16.data(), n,
                             reinterpret_cast<std::byte*>(out.data()))
                  .ok());
  return out;
}

TEST(QuantizedServiceTest, ServerDescribesTheFormat) {
  const ModelLayout l = Int4Layout();
  std::unique_ptr<testing::TestServer> server = Start(l);
  ASSERT_NE(server, nullptr);
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(server->stub().GetServerInfo(&ctx, {}, &info).ok());
  ASSERT_EQ(info.layouts_size(), 1);
  const v1::Layout& layout = info.layouts(0);
  EXPECT_EQ(layout.dtype(), v1::DTYPE_INT4);
  EXPECT_EQ(layout.group_size(), 32);
  EXPECT_EQ(layout.append_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(layout.page_bytes(), 2 * 4 * (64 + 4 * 3));
}

TEST(QuantizedServiceTest, ReadKvReturnsRecordsOrValues) {
  const ModelLayout l = Int4Layout();
  std::unique_ptr<testing::TestServer> server = Start(l);
  ASSERT_NE(server, nullptr);
  const std::string id = SessionWith(server->stub(), l, 10);

  const Read stored = ReadKv(server->stub(), id, v1::DTYPE_UNSPECIFIED);
  ASSERT_TRUE(stored.status.ok()) << stored.status.error_message();
  ASSERT_EQ(stored.keys.size(), 2u);
  for (v1::DType d : stored.dtypes) EXPECT_EQ(d, v1::DTYPE_INT4);
  for (int32_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(stored.keys[layer],
              Quantised(l, Bf16Tokens(l, layer, 0, 10, false)));
    EXPECT_EQ(stored.values[layer],
              Quantised(l, Bf16Tokens(l, layer, 0, 10, true)));
  }

  for (v1::DType as : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    const Read values = ReadKv(server->stub(), id, as);
    ASSERT_TRUE(values.status.ok()) << values.status.error_message();
    for (v1::DType d : values.dtypes) EXPECT_EQ(d, as);
    const DType out = as == v1::DTYPE_F32 ? DType::kF32 : DType::kBF16;
    for (int32_t layer = 0; layer < 2; ++layer) {
      std::string want(10 * 128 * DTypeBytes(out), '\0');
      DequantizeTokens(
          l.page_layout(),
          reinterpret_cast<const std::byte*>(stored.keys[layer].data()), 10,
          out, want.data());
      EXPECT_EQ(values.keys[layer], want);
    }
  }

  const Read wrong = ReadKv(server->stub(), id, v1::DTYPE_INT8);
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(wrong.status.error_message(),
              HasSubstr("the layout stores int4"));
}

TEST(QuantizedServiceTest, NaNIsRefusedAndTheSessionServesOn) {
  const ModelLayout l = Int4Layout();
  std::unique_ptr<testing::TestServer> server = Start(l);
  ASSERT_NE(server, nullptr);
  const std::string id = SessionWith(server->stub(), l, 3);
  const Read before = ReadKv(server->stub(), id, v1::DTYPE_UNSPECIFIED);
  grpc::ClientContext ctx;
  v1::AppendRequest append;
  append.set_session_id(id);
  append.add_positions(3);
  for (int32_t layer = 0; layer < l.num_layers; ++layer) {
    v1::LayerKv* kv = append.add_layers();
    kv->set_keys(Bf16Tokens(l, layer, 3, 1, false));
    kv->set_values(Bf16Tokens(l, layer, 3, 1, true));
  }
  const uint16_t nan = 0x7fc0;
  std::memcpy(append.mutable_layers(0)->mutable_keys()->data() + 2 * 70, &nan,
              2);
  v1::StepResult result;
  const grpc::Status s = server->stub().Append(&ctx, append, &result);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("layer 0 keys of token 0"));
  EXPECT_THAT(s.error_message(), HasSubstr("NaN"));
  const Read after = ReadKv(server->stub(), id, v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(after.keys, before.keys);
  EXPECT_EQ(after.values, before.values);
  grpc::ClientContext again;
  append.mutable_layers(0)->set_keys(Bf16Tokens(l, 0, 3, 1, false));
  EXPECT_TRUE(server->stub().Append(&again, append, &result).ok());
}

TEST(QuantizedServiceTest, TransfersMoveTheRecordsByteForByte) {
  const ModelLayout l = Int4Layout();
  for (const std::string transport : {"host", "tcp"}) {
    SCOPED_TRACE(transport);
    std::unique_ptr<testing::TestServer> from = Start(l);
    std::unique_ptr<testing::TestServer> to = Start(l, /*data_socket=*/true);
    ASSERT_NE(from, nullptr);
    ASSERT_NE(to, nullptr);
    const std::string id = SessionWith(from->stub(), l, 13);
    const Read sent = ReadKv(from->stub(), id, v1::DTYPE_UNSPECIFIED);
    grpc::ClientContext ctx;
    v1::TransferSessionRequest request;
    request.set_session_id(id);
    request.set_target(to->address());
    request.set_transport(transport);
    v1::TransferSessionResponse response;
    const grpc::Status s =
        from->stub().TransferSession(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.transport(), transport);
    // 2 layers x 13 tokens x K and V of 76-byte records (bf16: 256).
    EXPECT_EQ(response.bytes(), 2 * 13 * 2 * 76);
    const Read received = ReadKv(to->stub(), id, v1::DTYPE_UNSPECIFIED);
    ASSERT_TRUE(received.status.ok()) << received.status.error_message();
    EXPECT_EQ(received.keys, sent.keys);
    EXPECT_EQ(received.values, sent.values);
  }
}

}  // namespace
}  // namespace kvkeep
