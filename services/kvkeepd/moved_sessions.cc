#include "services/kvkeepd/moved_sessions.h"

#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/fleet_names.h"

namespace kvkeep {

// The status payloads that carry a move are keyed by the metadata names.

void MovedSessions::Add(SessionId key, Move move) {
  if (capacity_ <= 0) return;
  absl::MutexLock lock(&mu_);
  if (auto it = moves_.find(key); it != moves_.end()) {
    it->second = std::move(move);  // moved again: keeps its place in order_
    return;
  }
  // order_ holds each key of moves_ once, so neither outgrows capacity_.
  if (static_cast<int64_t>(order_.size()) >= capacity_) {
    moves_.erase(order_.front());
    order_.pop_front();
  }
  moves_.emplace(key, std::move(move));
  order_.push_back(key);
}

std::optional<MovedSessions::Move> MovedSessions::Find(SessionId key) const {
  absl::MutexLock lock(&mu_);
  auto it = moves_.find(key);
  if (it == moves_.end()) return std::nullopt;
  return it->second;
}

int64_t MovedSessions::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(moves_.size());
}

absl::Status MovedSessions::NotFound(const std::string& id, const Move& move) {
  const std::string& to = move.replica.empty() ? move.address : move.replica;
  absl::Status status = absl::NotFoundError(absl::StrCat(
      "session ", id, " not found here: it moved to ",
      move.replica.empty() ? ""
                           : absl::StrCat("replica ", move.replica, " at "),
      move.address, " (trailing metadata ", kMovedToMetadata, ")"));
  status.SetPayload(kMovedToMetadata, absl::Cord(to));
  status.SetPayload(kMovedToAddressMetadata, absl::Cord(move.address));
  return status;
}

std::vector<std::pair<std::string, std::string>> MovedSessions::MovedMetadata(
    const absl::Status& status) {
  std::vector<std::pair<std::string, std::string>> metadata;
  for (const char* key :
       {kMovedToMetadata, kMovedToAddressMetadata, kDrainingMetadata}) {
    if (absl::optional<absl::Cord> value = status.GetPayload(key)) {
      metadata.emplace_back(key, std::string(*value));
    }
  }
  // A call the store refused because its session is frozen for a transfer
  // (CacheStore's "... is being transferred to another store"): it changed
  // nothing and may be sent again (a fleet client waits for the move).
  if (status.code() == absl::StatusCode::kUnavailable &&
      absl::StrContains(status.message(),
                        " is being transferred to another store")) {
    metadata.emplace_back(kMovingMetadata, "1");
  }
  return metadata;
}

}  // namespace kvkeep
