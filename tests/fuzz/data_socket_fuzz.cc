// The data socket's wire (tcp_transport.h), from both ends.
//
// Input byte 0 even: the target's side, as a hostile sender sees it. The
// rest is frames: the first is a TransferMessage header, sent on a real
// ReceiveSession call to an in-process kvkeepd with a data socket (its
// transfer_id made unique to the input, and a tcp offer added); when the
// target answers READY over tcp, the harness connects to the data port,
// presents the ticket, and sends the bytes of every later frame, which the
// target reads as chunk headers, slot bytes and CRC32Cs into the reserved
// pages. Then it half-closes, reads the verdict and sends the commit. After
// the input every session is closed and the pools must have every page back.
//
// Input byte 0 odd: the sender's side, as a hostile target sees it: the
// rest is what the target answers on the data socket, read as the welcome
// and then the verdict.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/transfer/tcp_transport.h"
#include "tests/fuzz/fuzz_server.h"

namespace kvkeep::fuzz {
namespace {

// A blocking loopback connection to `port`, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

absl::Status SendAll(DataSocket& socket, std::string_view bytes,
                     absl::Time deadline) {
  iovec v{const_cast<char*>(bytes.data()), bytes.size()};
  return socket.Send({&v, 1}, deadline);
}

void TargetSide(const std::vector<Frame>& frames, uint64_t input) {
  if (frames.empty()) return;
  v1::TransferMessage header;
  if (!header.ParseFromArray(frames[0].bytes.data(),
                             static_cast<int>(frames[0].bytes.size()))) {
    return;
  }
  header.set_transfer_id(absl::StrCat(header.transfer_id(), "#", input));
  header.mutable_tcp();
  std::string wire;
  for (size_t i = 1; i < frames.size(); ++i) wire.append(frames[i].bytes);

  testing::TestServer& server = Server({.data_socket = true});
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // A peer of the test server (its store-to-store token), as a sending
  // store would be.
  ctx.AddMetadata("kvkeep-peer-token", testing::kTestPeerToken);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::TransferMessage, v1::TransferReply>>
      stream = server.stub().ReceiveSession(&ctx);
  v1::TransferReply reply;
  if (stream->Write(header) && stream->Read(&reply) &&
      reply.phase() == v1::TransferReply::READY && reply.transport() == "tcp") {
    const int fd = Connect(reply.data_port());
    if (fd < 0) Fail("cannot connect to the data socket");
    DataSocket socket(fd);
    SlotStream slots(&socket, deadline);
    if (!slots.SendHello(reply.data_ticket()).ok()) {
      Fail("the ticket of READY is not a ticket");
    }
    if (slots.AwaitWelcome(deadline).ok()) {
      // The target may stop reading at its first complaint; then the send
      // fails, and the verdict says why.
      (void)SendAll(socket, wire, deadline);
      shutdown(fd, SHUT_WR);
      const absl::Status verdict = slots.AwaitVerdict();
      Trace(absl::StrCat("verdict ", verdict.ToString()), grpc::Status::OK);
      if (verdict.code() == absl::StatusCode::kDeadlineExceeded) {
        Fail(absl::StrCat("no verdict: ", verdict.ToString()));
      }
    }
    v1::TransferMessage commit;
    commit.set_commit(true);
    if (stream->Write(commit) && stream->Read(&reply)) {
      Trace(v1::TransferReply::Phase_Name(reply.phase()), grpc::Status::OK);
    }
  }
  stream->WritesDone();
  while (stream->Read(&reply)) {
  }
  const grpc::Status status = stream->Finish();
  Trace("ReceiveSession", status);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    Fail(absl::StrCat("ReceiveSession hung: ", status.error_message()));
  }
}

void SenderSide(std::string_view answer) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    Fail("socketpair");
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  DataSocket target(fds[0]);
  DataSocket sender(fds[1]);
  // The socket buffer holds a few hundred KiB: far more than an input.
  if (!SendAll(target, answer, deadline).ok()) Fail("socketpair send");
  target = DataSocket();  // closed: the sender sees the end of the answer
  SlotStream slots(&sender, deadline);
  if (slots.AwaitWelcome(deadline).ok()) {
    const absl::Status verdict = slots.AwaitVerdict();
    // What a target can say is bounded: the message is read only up to
    // the wire's limit.
    if (verdict.message().size() > 4096) Fail("an unbounded verdict");
  }
}

}  // namespace
}  // namespace kvkeep::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep::fuzz;
  static uint64_t inputs = 0;
  if (size == 0) return 0;
  if (data[0] % 2 == 1) {
    SenderSide(
        std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
    return 0;
  }
  TargetSide(Frames(data + 1, size - 1), ++inputs);
  ExpectStoreEmpty(Server({.data_socket = true}).store());
  return 0;
}
