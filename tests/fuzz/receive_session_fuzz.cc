// The target side of a session transfer, fed by a hostile sender: one
// ReceiveSession call to a real in-process kvkeepd (no data socket, no
// tenants) whose messages are the input's frames, sent as they are so that
// the receiver's own chunk reader (chunk_wire.h) and the generated parser
// both see them. A frame of kind 1 is parsed as a TransferMessage and its
// transfer_id made unique to this input before it is sent (the store
// remembers committed ids, and a header must not be answered from an
// earlier input's commit); every other kind goes raw. The header (the
// session's state), the reservation, each chunk's bounds, bytes and CRC32C
// and the commit are checked by the code a real transfer runs. After the
// input every session is closed and the pools must have every page back.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "tests/fuzz/fuzz_server.h"

namespace kvkeep::fuzz {
namespace {

constexpr uint8_t kUniqueHeader = 1;

grpc::ByteBuffer Buffer(std::string_view bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

void Run(const std::vector<Frame>& frames, uint64_t input) {
  testing::TestServer& server = Server();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // A peer of the test server (its store-to-store token), as a sending
  // store would be.
  ctx.AddMetadata("kvkeep-peer-token", testing::kTestPeerToken);
  const grpc::internal::RpcMethod method(
      "/kvkeep.v1.KvKeep/ReceiveSession",
      grpc::internal::RpcMethod::BIDI_STREAMING, server.channel());
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream(grpc::internal::ClientReaderWriterFactory<
             grpc::ByteBuffer, grpc::ByteBuffer>::Create(server.channel().get(),
                                                         method, &ctx));
  for (const Frame& f : frames) {
    std::string bytes(f.bytes);
    if (f.kind == kUniqueHeader) {
      v1::TransferMessage message;
      if (!message.ParseFromString(bytes)) continue;
      message.set_transfer_id(absl::StrCat(message.transfer_id(), "#", input));
      bytes = message.SerializeAsString();
    }
    if (!stream->Write(Buffer(bytes))) break;  // the receiver ended the call
  }
  stream->WritesDone();
  grpc::ByteBuffer reply;
  while (stream->Read(&reply)) {
    v1::TransferReply r;
    if (grpc::SerializationTraits<v1::TransferReply>::Deserialize(&reply, &r)
            .ok()) {
      Trace(v1::TransferReply::Phase_Name(r.phase()), grpc::Status::OK);
    }
  }
  const grpc::Status status = stream->Finish();
  Trace("ReceiveSession", status);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    Fail(absl::StrCat("ReceiveSession hung: ", status.error_message()));
  }
}

}  // namespace
}  // namespace kvkeep::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep::fuzz;
  static uint64_t inputs = 0;
  Run(Frames(data, size), ++inputs);
  ExpectStoreEmpty(Server().store());
  return 0;
}
