// MovedSessions: the sessions this replica sent away with TransferSession,
// remembered so that a call naming one by its old id hears where it went
// (NOT_FOUND "... moved to replica ..." and the trailing metadata
// kvkeep-moved-to, docs/fleet.md) instead of a bare "not found". Bounded
// like the store's expired ids (cache_store/lease.h): the oldest move is
// forgotten first. A drain that moves every session away records its moves
// here the same way.
//
// Thread-safe.
#ifndef KVKEEP_SERVICES_KVKEEPD_MOVED_SESSIONS_H_
#define KVKEEP_SERVICES_KVKEEPD_MOVED_SESSIONS_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/session_types.h"

namespace kvkeep {

// Moves remembered by default.
inline constexpr int64_t kRememberedMoves = 4096;

class MovedSessions {
 public:
  struct Move {
    std::string tenant;   // the session's, who alone hears where it went
    std::string replica;  // the target's replica name, or empty
    std::string address;  // the target as the transfer named it (host:port)
  };
  explicit MovedSessions(int64_t capacity = kRememberedMoves)
      : capacity_(capacity) {}

  // Remembers that session `key` now lives at `move`. A key moved before
  // (it came back and left again) keeps only its latest move.
  void Add(SessionId key, Move move) ABSL_LOCKS_EXCLUDED(mu_);
  // A session that comes back is found in the store before this is asked.
  std::optional<Move> Find(SessionId key) const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  // The NOT_FOUND a call on `id` (the id the caller sent) gets, with the
  // move in its payload (kMovedToMetadata, kMovedToAddressMetadata) for
  // MovedMetadata to copy into the call's trailing metadata.
  static absl::Status NotFound(const std::string& id, const Move& move);
  // The (key, value) trailing metadata `status` asks for: NotFound's move,
  // a draining replica's refusal (kvkeep-draining), a call refused because
  // its session is frozen for a transfer (kvkeep-moving); else none.
  static std::vector<std::pair<std::string, std::string>> MovedMetadata(
      const absl::Status& status);

 private:
  const int64_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, Move> moves_ ABSL_GUARDED_BY(mu_);
  std::deque<SessionId> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_MOVED_SESSIONS_H_
