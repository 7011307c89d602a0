// KvKeepService's part in a drain (fleet_drain.h, docs/fleet.md): the
// refusal of new sessions, and where a session went for a call that held it.
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "services/common/fleet_names.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

absl::Status KvKeepService::DrainingRefusal(absl::string_view method) const {
  const std::string name =
      options_.replica_name.empty() ? "(unnamed)" : options_.replica_name;
  absl::Status status = absl::UnavailableError(
      absl::StrCat("replica ", name,
                   " is draining (it is stopping and moving its sessions "
                   "to its peers): ",
                   method,
                   " is refused here; send it to another "
                   "replica (trailing metadata ",
                   kDrainingMetadata, ")"));
  status.SetPayload(kDrainingMetadata, absl::Cord(name));
  return status;
}

absl::Status KvKeepService::WhereItWent(SessionId id,
                                        const absl::Status& status) const {
  if (status.code() != absl::StatusCode::kNotFound) return status;
  std::optional<MovedSessions::Move> move = moved_.Find(id);
  if (!move.has_value()) return status;
  return MovedSessions::NotFound(SessionIdOf(id), *move);
}

}  // namespace kvkeep
