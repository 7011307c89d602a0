// Session transfer between kvkeepd processes over the host transport: the
// sending side (SendSession, run by TransferSession on the store holding
// the session) and the receiving side (the ReceiveSession reactor), plus
// the proto form of a session's state. The two-phase semantics live in the
// store (CacheStore::FreezeForTransfer / PrepareImport); this file moves
// the bytes: a header with the state, chunks of page bytes each with a
// CRC32C, a commit.
//
// Thread-safe: TransferLog is; SendSession and a reactor each serve one
// transfer.
#ifndef KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_
#define KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"

namespace kvkeep {

// What one transfer did, for monitoring: sent from this store (outgoing)
// or received, how it ended, the key and value bytes moved, how long.
struct TransferReport {
  std::string transport = "host";
  bool outgoing = true;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t bytes = 0;
  absl::Duration duration;
};
using TransferObserver = std::function<void(const TransferReport&)>;

// A snapshot's state without its bytes, and back (INVALID_ARGUMENT for a
// malformed one; the store checks the rest).
void StateToProto(const SessionSnapshot& snapshot, v1::SessionState* out);
absl::StatusOr<SessionSnapshot> StateFromProto(const v1::SessionState& state);

// The transfers a store committed as a target, by transfer id (the newest
// `capacity`): a retried transfer whose commit answer was lost is answered
// COMMITTED instead of making a second copy.
class TransferLog {
 public:
  explicit TransferLog(size_t capacity = 4096) : capacity_(capacity) {}
  void Add(const std::string& transfer_id, SessionId id);
  bool Contains(const std::string& transfer_id) const;

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, SessionId> ids_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
};

struct SendOptions {
  int64_t token_bytes = 0;   // one token's keys (or values) in one layer
  std::string target;        // host:port
  std::string target_token;  // bearer token, or empty
  std::string transfer_id;
  absl::Time deadline = absl::InfiniteFuture();
  int64_t chunk_bytes = 4 << 20;  // keys + values per chunk, at most
  int64_t max_message_bytes = 64 << 20;
  // Test-only: may change a chunk after its checksum is computed.
  std::function<void(int64_t chunk, v1::TransferChunk&)> fault;
};

// How a send ended. A failure `in_doubt` may have been committed by the
// target (the commit was sent and the stream then broke, with no answer);
// any other failure was not (the target answers every refusal with its own
// status, and commits only on the commit message).
struct SendResult {
  absl::Status status;
  bool in_doubt = false;
  int64_t bytes = 0;
};

// Reads slots [first, first + n) of a layer's keys and values into the
// buffers ([n][kv_heads][head_dim] each).
using SlotReader = std::function<absl::Status(
    int32_t layer, int64_t first, int64_t n, std::span<std::byte> keys,
    std::span<std::byte> values)>;

// Sends `state` (a snapshot without its bytes) to the target's
// ReceiveSession, reading each chunk's bytes with `read` straight into the
// message (no copy of the whole session is made).
SendResult SendSession(const SessionSnapshot& state, const SlotReader& read,
                       const SendOptions& options);

// The ReceiveSession reactor: `authenticate` gives the caller's tenant (or
// an error); the log records commits.
using Authenticator = std::function<absl::StatusOr<std::string>(
    const grpc::CallbackServerContext&)>;
grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply>*
NewReceiveReactor(CacheStore* store, TransferLog* log,
                  grpc::CallbackServerContext* ctx, Authenticator authenticate,
                  bool tenants_configured, TransferObserver observer);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_
