// SendSession: the sending side of a session transfer. It runs the protocol
// on the target's ReceiveSession stream (header with the state and the
// transports offered; READY naming the one the target took; the chunks;
// commit), and moves the pages through the PageSender of that transport
// (page_transport.h). The two-phase semantics live in the store
// (CacheStore::FreezeForTransfer / PrepareImport); the coordinator
// (transfer_coordinator.h) decides what to offer and what to do after.
//
// SendSession serves one transfer on the calling thread; thread-compatible.
#ifndef KVKEEP_SERVICES_TRANSFER_SESSION_SENDER_H_
#define KVKEEP_SERVICES_TRANSFER_SESSION_SENDER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_store/session_snapshot.h"
#include "cache_store/slot_spans.h"
#include "grpcpp/security/credentials.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/transfer/nccl_transport.h"
#include "services/transfer/page_transport.h"
#include "services/transfer/transfer_cancel.h"
#include "services/transfer/transport.h"

namespace kvkeep {

// The metadata that carries a store's peer token on ReceiveSession
// (docs/security.md).
inline constexpr char kPeerTokenMetadata[] = "kvkeep-peer-token";

struct SendOptions {
  int64_t token_bytes = 0;  // one token's keys (or values) in one layer
  // Chunks start on multiples of this many slots: kivi_int4's page_tokens
  // (its keys move as whole key blocks, SessionState.format 2), else 1.
  int64_t chunk_slot_multiple = 1;
  // kivi_int4: one page's key block, the keys of chunk_slot_multiple slots
  // as they move; 0: keys move as token records of token_bytes.
  int64_t key_block_bytes = 0;
  std::string target;        // host:port
  std::string target_token;  // bearer token, or empty
  std::string peer_token;    // this store's peer token, or empty
  // How to reach the target (TLS on a store with TLS); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string transfer_id;
  absl::Time deadline = absl::InfiniteFuture();
  // HTTP/2 keepalive on the channel to the target: a ping after this long
  // without a frame, and the connection is dropped if the ping is not
  // answered within as long again (a frozen target is noticed). Zero: none.
  absl::Duration keepalive = absl::ZeroDuration();
  // Stops the send from another thread (may be null); its reason becomes
  // the send's status.
  TransferCancel* cancel = nullptr;
  int64_t chunk_bytes = 4 << 20;  // keys + values per chunk, at most
  int64_t max_message_bytes = 64 << 20;
  // NCCL: offered with the header when set. If the target takes it, the
  // channel comes from `nccl_connect` and each slot run goes with
  // `nccl_move`, in runs of the offer's chunk_slots.
  std::optional<v1::NcclOffer> nccl_offer;
  std::function<absl::StatusOr<std::unique_ptr<NcclChannel>>()> nccl_connect;
  NcclMove nccl_move;
  // The data socket: offered with the header when set (`tcp_required`: the
  // target must take it and the socket must connect; otherwise the chunks
  // go as messages).
  bool tcp_offer = false;
  bool tcp_required = false;
  // Wraps the sender of the transport the target chose (tests).
  PageSenderWrapper wrap;
};

// Where the frozen session's slot bytes come from: `spans`, when set, says
// where they lie (a host pool's pages: sent without a copy); otherwise
// `read` copies them into a buffer ([n][kv_heads][head_dim] each).
struct SlotSource {
  std::function<absl::StatusOr<SlotSpans>(int32_t layer, int64_t first,
                                          int64_t n)>
      spans;
  std::function<absl::Status(int32_t layer, int64_t first, int64_t n,
                             std::span<std::byte> keys,
                             std::span<std::byte> values)>
      read;
};

// How a send ended. A failure `in_doubt` may have been committed by the
// target (the commit was sent and the stream then broke, with no answer);
// any other failure was not (the target answers every refusal with its own
// status, and commits only on the commit message).
struct SendResult {
  absl::Status status;
  bool in_doubt = false;
  int64_t bytes = 0;
  Transport transport = Transport::kHost;  // how the pages went
  std::string target_replica;              // TransferReply.replica, from READY
};

// Sends `state` (a snapshot without its bytes) and then its pages.
SendResult SendSession(const SessionSnapshot& state, const SlotSource& source,
                       const SendOptions& options);

// Asks the target (ReceiveSession's resolve) whether it committed
// options.transfer_id: true or false (and then it never will), or why it
// could not be asked by options.deadline.
absl::StatusOr<bool> AskCommitted(const SendOptions& options);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_SESSION_SENDER_H_
