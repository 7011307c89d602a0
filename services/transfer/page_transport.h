// PageSender: how one outgoing transfer moves its page bytes to the target,
// the injection point of session transfer. SendSession (session_sender.h)
// runs the protocol on the gRPC stream (header, READY, commit) and hands
// every chunk to the PageSender of the transport the target chose; one
// implementation per file:
//   message_sender.cc  kHost: chunk messages on the gRPC stream
//   tcp_sender.cc      kTcp:  the target's data socket (tcp_transport.h)
//   nccl_sender.cc     kNccl: slot runs pool to pool over an NCCL link
// Tests wrap the chosen sender (PageSenderWrapper) with a failing, slow or
// corrupting one; kvkeepd wraps nothing.
//
// A PageSender serves one transfer, on the sending thread: not thread-safe.
#ifndef KVKEEP_SERVICES_TRANSFER_PAGE_TRANSPORT_H_
#define KVKEEP_SERVICES_TRANSFER_PAGE_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "services/transfer/chunk.h"
#include "services/transfer/nccl_transport.h"
#include "services/transfer/tcp_transport.h"
#include "services/transfer/transfer_call.h"
#include "services/transfer/transport.h"

namespace kvkeep {

class PageSender {
 public:
  virtual ~PageSender() = default;
  virtual Transport transport() const = 0;
  // The most slots one chunk holds.
  virtual int64_t chunk_slots() const = 0;
  // Whether Send reads the chunk's bytes (false: NCCL moves the pages
  // itself, and chunks come without bytes).
  virtual bool needs_bytes() const = 0;
  // Sends a chunk; its bytes must not change until it returns. Chunks come
  // layer by layer, in slot order.
  virtual absl::Status Send(const Chunk& chunk) = 0;
  // After the last chunk: OK once the target holds every slot, as far as
  // this transport can tell before the commit (tcp: the target's verdict).
  virtual absl::Status Finish() = 0;
  // The transfer ended, committed or not (NCCL: the link goes back).
  virtual void Done(bool committed) {}
  // From another thread: ends a Send or Finish waiting on the target (the
  // transfer was cancelled). Those on the ReceiveSession call end with it.
  virtual void Abort() {}
};

// Wraps the sender a transfer chose (tests: a transport that fails, stalls
// or corrupts on purpose); unset: the sender is used as it is.
using PageSenderWrapper =
    std::function<std::unique_ptr<PageSender>(std::unique_ptr<PageSender>)>;

// kHost: each chunk as a message on `call` (which must outlive the sender).
std::unique_ptr<PageSender> NewMessageSender(TransferCall* call,
                                             int64_t chunk_slots);
// kTcp: each chunk over `socket` (connected and welcomed), then the
// target's verdict.
std::unique_ptr<PageSender> NewTcpSender(DataSocket socket, absl::Time deadline,
                                         int64_t chunk_slots);
// kNccl: each chunk's slot run over `channel` with `move`.
using NcclMove = std::function<absl::Status(NcclChannel& channel, int32_t layer,
                                            int64_t first, int64_t n)>;
std::unique_ptr<PageSender> NewNcclSender(std::unique_ptr<NcclChannel> channel,
                                          NcclMove move, int64_t chunk_slots);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_PAGE_TRANSPORT_H_
