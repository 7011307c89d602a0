// The tcp transport of session transfer: a session's page bytes over a
// plain TCP connection of their own (the data socket), while the header,
// the reservation and the commit stay on the gRPC stream. It exists for
// speed: gRPC's HTTP/2 transport costs more CPU per byte than the page
// copies themselves (docs/transfer.md, Cost), and here the kernel copies the
// bytes straight out of the sender's pages and into the reserved ones.
//
// The wire (all integers little-endian):
//   sender -> target, once:  "KVKDATA1" (8 bytes), the ticket (16 bytes)
//                            the target gave in READY
//   target -> sender, once:  "KVKA", if the ticket is one it waits for
//                            (otherwise it closes the connection)
//   per chunk:               u32 0x4B564B43 ("CKVK"), i32 layer,
//                            i64 first_slot, i64 slots; the keys
//                            [slots][kv_heads][head_dim], then the values;
//                            u32 CRC32C of the keys then the values
//   target -> sender, once:  u32 0x4B564B56 ("VKVK"), i32 status code,
//                            u32 length, the status message: the verdict,
//                            sent when every slot arrived and checked out,
//                            or at the first failure
// Chunks come layer by layer, in slot order, each within one layer.
//
// Thread-safe: TcpTransport is; a DataSocket or SlotStream is used by one
// thread at a time, except DataSocket::Shutdown, which any thread may call.
#ifndef KVKEEP_SERVICES_TRANSFER_TCP_TRANSPORT_H_
#define KVKEEP_SERVICES_TRANSFER_TCP_TRANSPORT_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/page_layout.h"
#include "services/transfer/aside_threads.h"
#include "services/transfer/chunk.h"

namespace kvkeep {

// The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port",
// "ipv4:..."), where its data socket is; nullopt for targets that name no
// TCP host (unix sockets).
std::optional<std::string> TargetHost(absl::string_view target);

// A connected TCP socket. Sends and receives block until done, the
// deadline, or a Shutdown from another thread. Move-only.
class DataSocket {
 public:
  DataSocket() = default;
  // Takes `fd` (a connected, blocking stream socket) and its wake-up
  // timeouts, which let sends and receives look at their deadlines.
  explicit DataSocket(int fd);
  DataSocket(DataSocket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  DataSocket& operator=(DataSocket&& other) noexcept;
  ~DataSocket();

  // UNAVAILABLE naming the address and why if nothing there accepts by the
  // deadline.
  static absl::StatusOr<DataSocket> Connect(const std::string& host, int port,
                                            absl::Time deadline);

  bool valid() const { return fd_ >= 0; }
  // All of `pieces` (advanced in place as they go). UNAVAILABLE if the peer
  // closed or reset the connection, or after Shutdown; DEADLINE_EXCEEDED.
  absl::Status Send(std::span<iovec> pieces, absl::Time deadline);
  absl::Status Receive(std::span<iovec> pieces, absl::Time deadline);
  // Whether bytes (or the peer's close) wait to be received.
  bool Readable() const;
  // Ends every send and receive now and later, from any thread.
  void Shutdown();

 private:
  absl::Status Move(std::span<iovec> pieces, absl::Time deadline, bool sending);

  int fd_ = -1;
};

// One transfer's page bytes over a data socket: the chunks, and the
// target's verdict.
class SlotStream {
 public:
  static constexpr size_t kTicketBytes = 16;
  SlotStream(DataSocket* socket, absl::Time deadline)
      : socket_(socket), deadline_(deadline) {}

  // Sender. The hello that names the transfer, and the target's welcome
  // that says it was the right store and ticket (an error otherwise).
  absl::Status SendHello(absl::string_view ticket);
  absl::Status AwaitWelcome(absl::Time deadline);
  // One chunk, whose bytes must not change until it returns. The checksum
  // is computed a piece at a time just after the piece is sent, so the
  // bytes are read from memory once; chunk.crc32c, if set, is sent instead.
  absl::Status SendChunk(const Chunk& chunk);
  // The target's verdict if it has come already (a failure cuts the send
  // short), nullopt if not.
  std::optional<absl::Status> EarlyVerdict();
  // Waits for the verdict: OK when the target has every slot; its failure;
  // or why it did not come.
  absl::Status AwaitVerdict();

  // Target. The ticket of the hello (INVALID_ARGUMENT if it is not one).
  static absl::StatusOr<std::string> ReceiveHello(DataSocket& socket,
                                                  absl::Time deadline);
  // A chunk's layer, first slot and slot count (no bytes yet).
  absl::StatusOr<Chunk> ReceiveChunkHeader();
  // The chunk's bytes into `into` (exactly its keys and values), then its
  // checksum: DATA_LOSS if it does not match what arrived.
  absl::Status ReceiveChunk(const Chunk& header, const SlotSpans& into);
  // Sends `status` as the verdict. After a failure, the sender may still be
  // sending: Drain reads and drops its bytes until it closes (or the
  // deadline), so the verdict is not lost to a reset connection.
  absl::Status SendVerdict(const absl::Status& status);
  void Drain();

 private:
  DataSocket* const socket_;
  const absl::Time deadline_;
};

// The target's side: a listening socket whose connections are handed to
// the transfers they name. A transfer Expects a ticket (given to the sender
// in READY) and Awaits the connection that presents it; a connection
// presenting anything else is closed. Connections are read for their
// hello concurrently (one thread polls them all), each within
// kHelloPatience (2 s); at most kMaxPendingHellos wait for theirs at once, and
// a new connection beyond that closes the oldest waiting one. So silent or slow
// connections (a port scanner, a stranger) cost a sender nothing: its hello
// follows its connect at once and is read as soon as it arrives.
class TcpTransport {
 public:
  // How long a new connection has to present its whole hello.
  static constexpr absl::Duration kHelloPatience = absl::Seconds(2);
  // Connections waiting for their hello, at most.
  static constexpr size_t kMaxPendingHellos = 64;

  // Listens on `address` ("host:port"; port 0 picks one). Tests give a
  // longer `hello_patience`, to see the order of events without timing.
  static absl::StatusOr<std::unique_ptr<TcpTransport>> Listen(
      const std::string& address,
      absl::Duration hello_patience = kHelloPatience);
  ~TcpTransport();
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  int port() const { return port_; }
  // A new ticket for a transfer (16 random bytes).
  std::string Expect() ABSL_LOCKS_EXCLUDED(mu_);
  // The connection that presents `ticket`: DEADLINE_EXCEEDED if none comes
  // by the deadline, CANCELLED if the ticket is withdrawn or the transport
  // closes. The ticket is spent either way.
  absl::StatusOr<DataSocket> Await(const std::string& ticket,
                                   absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `ticket`: true if it was still waiting for its connection (a
  // waiting Await then returns CANCELLED), false if its Await has returned.
  bool Withdraw(const std::string& ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // Cleanup after an abandoned receive, off gRPC's threads; waited for by
  // the destructor.
  void RunAside(std::function<void()> fn) { aside_.Run(std::move(fn)); }

 private:
  struct Pending;  // a connection whose hello is not all in
  TcpTransport(int listener, int port, int wake, absl::Duration patience);
  void AcceptLoop();
  // Accepts every connection waiting on the listener into `pending`.
  void AcceptAll(std::deque<Pending>& pending);
  // A connection whose hello is all in: welcomed and kept for its Await if
  // its ticket is one waited for, otherwise closed.
  void Hand(Pending& connection) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<DataSocket> AwaitLocked(const std::string& ticket,
                                         absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int listener_;  // non-blocking
  const int port_;
  const int wake_;  // an eventfd: written when closing
  const absl::Duration hello_patience_;
  absl::Mutex mu_;
  struct Expected {
    std::optional<DataSocket> socket;  // once presented, until Await
  };
  absl::flat_hash_map<std::string, Expected> expected_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  int awaiting_ ABSL_GUARDED_BY(mu_) = 0;  // threads inside Await
  std::thread acceptor_;
  AsideThreads aside_;  // last: its threads use the rest
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_TCP_TRANSPORT_H_
