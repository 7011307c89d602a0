// What a session transfer carries beside the pages, and what it leaves
// behind: the proto form of a session's state (the header), the log of
// transfers a target committed (for retries whose answer was lost), and the
// report of each transfer for monitoring.
//
// Thread-safe: TransferLog is; the rest are plain values and pure functions.
#ifndef KVKEEP_SERVICES_TRANSFER_SESSION_STATE_H_
#define KVKEEP_SERVICES_TRANSFER_SESSION_STATE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/session_snapshot.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/transfer/transport.h"

namespace kvkeep {

// What one transfer did, for monitoring: sent from this store (outgoing)
// or received, how it ended, the key and value bytes moved, how long, and
// (a received transfer that committed) the session's id here.
struct TransferReport {
  Transport transport = Transport::kHost;
  bool outgoing = true;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t bytes = 0;
  absl::Duration duration;
  SessionId session = 0;
};
using TransferObserver = std::function<void(const TransferReport&)>;

// A snapshot's state without its bytes, and back (INVALID_ARGUMENT for a
// malformed one; the store checks the rest).
void StateToProto(const SessionSnapshot& snapshot, v1::SessionState* out);
absl::StatusOr<SessionSnapshot> StateFromProto(const v1::SessionState& state);

// The transfers a store committed as a target, by transfer id (the newest
// `capacity`): a retried transfer whose commit answer was lost is answered
// COMMITTED instead of making a second copy. It also settles a commit in
// doubt for good: a source asking about a transfer (Resolve) is told whether
// it committed, and one that has not is fenced: a commit of it that is
// still on its way (from a stream that froze) is refused.
class TransferLog {
 public:
  explicit TransferLog(size_t capacity = 4096) : capacity_(capacity) {}
  // A receive of `transfer_id` starts (after its header): its fence, for
  // Commit. Each Begin is paired with an End.
  uint64_t Begin(const std::string& transfer_id) ABSL_LOCKS_EXCLUDED(mu_);
  void End(const std::string& transfer_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Commits the receive that Begin gave `fence` with `commit` and logs it,
  // unless Resolve aborted the transfer since (ABORTED, nothing run).
  absl::StatusOr<SessionId> Commit(
      const std::string& transfer_id, uint64_t fence, const std::string& tenant,
      const std::function<absl::StatusOr<SessionId>()>& commit)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `transfer_id` was committed here (for `tenant`: PERMISSION_DENIED
  // if another tenant's); if not, receives of it under way can no longer
  // commit.
  absl::StatusOr<bool> Resolve(const std::string& transfer_id,
                               const std::string& tenant)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(const std::string& transfer_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Committed {
    SessionId id = 0;
    std::string tenant;
  };
  struct Receiving {
    int64_t count = 0;   // receives under way
    uint64_t fence = 0;  // raised by Resolve
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Committed> ids_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Receiving> receiving_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_SESSION_STATE_H_
