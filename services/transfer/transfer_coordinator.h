// TransferCoordinator: session transfer for one store, both ways. Outgoing,
// it owns the transfers this store sends: it picks the transports to offer
// (the caller's Transport; NCCL when both pools can use it, the target's
// data socket, chunk messages), freezes the session, runs SendSession on a
// thread of its own within a time limit (the caller's deadline, at most
// TransferOptions::time_limit), and finishes the store's side (closes the
// session once the target committed; thaws it when nothing was committed).
// A send that its caller cancels, or the drain, stops before the commit and
// thaws the session. When the commit is in doubt the session stays frozen
// while the same thread asks the target (AskCommitted) whether it
// committed, with growing waits, until it can tell; a caller's retry with
// the same transfer id settles it too. Incoming, it makes the
// ReceiveSession reactors, and keeps the log of commits and the NCCL links.
//
// The service (KvKeepService) authenticates and authorizes calls, parses
// the request and maps statuses; the rest is here.
//
// Thread-safe. The destructor waits for sends still running.
#ifndef KVKEEP_SERVICES_TRANSFER_TRANSFER_COORDINATOR_H_
#define KVKEEP_SERVICES_TRANSFER_TRANSFER_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/transfer/nccl_transport.h"
#include "services/transfer/page_transport.h"
#include "services/transfer/session_sender.h"
#include "services/transfer/session_state.h"
#include "services/transfer/tcp_transport.h"
#include "services/transfer/transfer_cancel.h"
#include "services/transfer/transport.h"

namespace kvkeep {

struct TransferOptions {
  int64_t max_message_bytes = 64 << 20;  // on the stream, each way
  // This store's replica name, told to senders (TransferReply.replica).
  std::string replica;
  bool tenants_configured = false;  // a target checks the session's tenant
  // Told about every transfer sent or received (metrics); may be empty.
  TransferObserver on_transfer;
  // The data socket incoming transfers may use; null: they come in chunk
  // messages. Must outlive the coordinator.
  TcpTransport* tcp = nullptr;
  // Wraps each outgoing transfer's page sender (tests inject a failing,
  // slow or corrupting transport here); unset in kvkeepd.
  PageSenderWrapper wrap_sender;
  // Sent on every ReceiveSession this store calls (kPeerTokenMetadata);
  // may be empty.
  std::string peer_token;
  // How to reach targets (TLS on a store with TLS); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // Whether outgoing transfers may send pages over a target's plaintext
  // data socket (false on a store with TLS: they go on the stream).
  bool plaintext_data = true;
  // How long a transfer may take when its caller gives no earlier deadline.
  absl::Duration time_limit = absl::Minutes(5);
  // HTTP/2 keepalive to targets (SendOptions::keepalive); zero: none.
  absl::Duration keepalive = absl::Seconds(10);
  // A commit in doubt: how many times the target is asked, the wait before
  // the first question (it doubles, up to a minute, between the others).
  int resolve_attempts = 12;
  absl::Duration resolve_wait = absl::Seconds(1);
  // Told how each commit in doubt was resolved (a log line); may be empty.
  std::function<void(SessionId, const std::string& transfer_id, bool committed)>
      on_resolved;
};

// One TransferSession, as the service parsed it.
struct OutgoingTransfer {
  SessionId id = 0;
  std::string target;        // host:port
  std::string target_token;  // bearer token for the target, or empty
  std::string transfer_id;   // empty: one is made
  Transport transport = Transport::kAuto;
  absl::Time deadline = absl::InfiniteFuture();
  // The caller's cancel (may be null).
  std::shared_ptr<TransferCancel> cancel;
  // Told once the target committed, before the session is closed here, so
  // that a call which then finds it gone can already say where it went;
  // with the target's replica name (empty when a commit in doubt was
  // settled by asking). May be empty.
  std::function<void(const std::string& target_replica)> on_commit;
};

struct TransferOutcome {
  absl::Status status;  // the session's id and fate in its message
  std::string transfer_id;
  int64_t doubt = 0;  // > 0: the commit is in doubt (Resolve's)
  Transport transport = Transport::kHost;
  int64_t bytes = 0;
  absl::Duration duration;
  // The target's replica name (TransferReply.replica); empty when it has
  // none, or when a commit in doubt was settled by asking.
  std::string target_replica;
};

class TransferCoordinator {
 public:
  // `store` must outlive the coordinator.
  TransferCoordinator(CacheStore* store, TransferOptions options);
  ~TransferCoordinator();
  TransferCoordinator(const TransferCoordinator&) = delete;
  TransferCoordinator& operator=(const TransferCoordinator&) = delete;

  // Sends a session on a thread of its own (it is a client of the target
  // for as long as the bytes take); `done` gets the outcome on that thread.
  void Send(OutgoingTransfer transfer,
            std::function<void(const TransferOutcome&)> done)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A reactor for one ReceiveSession call by `tenant` (or the error that
  // authenticating the caller gave).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Receive(
      grpc::CallbackServerContext* ctx, absl::StatusOr<std::string> tenant);
  // The drain: waits until no send runs or `deadline`, then cancels the
  // sends still running (UNAVAILABLE: the store is stopping) and stops
  // asking about commits in doubt. Sends started later are refused. Returns
  // once every send has answered its caller (its `done` returned).
  void Drain(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What a send needs to know about the session's pool.
  struct Pool {
    PageMemory* memory = nullptr;
    PageLayout page_layout;
  };
  TransferOutcome Run(const OutgoingTransfer& transfer,
                      const std::string& transfer_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Pool> PoolOf(SessionId id);
  // The NCCL offer to make, if any (an error when NCCL was required and
  // cannot be used).
  absl::StatusOr<std::optional<v1::NcclOffer>> NcclOffer(
      const OutgoingTransfer& transfer, const Pool& pool);
  // Phase 1: freezes the session, or resumes a transfer whose commit was in
  // doubt (same transfer id); the snapshot without its bytes.
  absl::StatusOr<SessionSnapshot> Freeze(SessionId id,
                                         const std::string& transfer_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Phase 2 on this side, from how the send ended (`doubt`: which doubt an
  // in-doubt end is, for Resolve).
  absl::Status Settle(const OutgoingTransfer& transfer,
                      const std::string& transfer_id, const SendResult& sent,
                      int64_t* doubt) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks the target about a commit in doubt until it says, and settles the
  // session accordingly; gives up after resolve_attempts or on the drain.
  void Resolve(const OutgoingTransfer& transfer, const std::string& transfer_id,
               int64_t doubt) ABSL_LOCKS_EXCLUDED(mu_);
  bool InDoubt(SessionId id, const std::string& transfer_id,
               int64_t doubt) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What SendSession needs that is the same for every send to `transfer`.
  SendOptions SendOptionsFor(const OutgoingTransfer& transfer,
                             const std::string& transfer_id) const;

  CacheStore* const store_;
  const TransferOptions options_;
  TransferLog log_;     // transfers committed here as the target
  NcclTransport nccl_;  // links to other stores' GPUs, both ways
  absl::Mutex mu_;
  // Sessions being sent: their transfer id, and whether a send is running
  // (not running: the commit's outcome is unknown; a retry with the same id
  // finishes it).
  struct Outgoing {
    std::string transfer_id;
    bool running = false;
    int64_t doubt = 0;  // counts the sends of it that ended in doubt
  };
  absl::flat_hash_map<SessionId, Outgoing> outgoing_ ABSL_GUARDED_BY(mu_);
  int64_t sending_ ABSL_GUARDED_BY(mu_) = 0;  // threads running
  int64_t sends_ ABSL_GUARDED_BY(mu_) = 0;    // of them, sending or answering
  // The cancels of sends and questions under way (the drain's).
  absl::flat_hash_set<std::shared_ptr<TransferCancel>> cancels_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the drain began
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_TRANSFER_COORDINATOR_H_
