// Session ids as they travel, and the names a fleet of kvkeepd replicas
// shares with its clients (docs/fleet.md). Plain functions and constants,
// no domain dependency: the server, the C++ client and the CLI use the same
// ones. Thread-safe (stateless).
//
// A session id is "<replica>.<key>": the name of the replica that serves
// the session (a DNS label: the StatefulSet pod's name) and a 64-bit key as
// 16 lowercase hex digits, unique among the sessions that replica holds.
// Replica names are unique in a fleet (pod names; FleetClient checks its
// list), so two sessions held by different replicas never share an id, and
// one replica never holds two sessions with one key (the store draws keys at
// random and skips live ones; an incoming transfer whose key is live here
// is refused). A moved session keeps its key and takes its new replica's
// name; the old id keeps working through the old replica's redirect.
// A bare key (16 hex digits, what servers without a replica name give out)
// is still a valid id: it names no replica, and a client routes it to the
// one server it knows.
#ifndef KVKEEP_SERVICES_COMMON_FLEET_NAMES_H_
#define KVKEEP_SERVICES_COMMON_FLEET_NAMES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvkeep {

// Longest replica name: a DNS label.
inline constexpr size_t kMaxReplicaNameBytes = 63;

// Trailing metadata on the NOT_FOUND a replica answers for a session that
// moved away from it (TransferSession): the replica that holds it now (its
// name; the address the transfer was sent to when that store has no name),
// and that address. docs/fleet.md.
inline constexpr char kMovedToMetadata[] = "kvkeep-moved-to";
inline constexpr char kMovedToAddressMetadata[] = "kvkeep-moved-to-address";
// Trailing metadata on the UNAVAILABLE of a call that changed nothing
// because its session is being moved (a TransferSession or a drain froze
// it): "1". The call may be sent again; it is then served here
// (the move failed) or redirected (kvkeep-moved-to).
inline constexpr char kMovingMetadata[] = "kvkeep-moving";
// Trailing metadata on the UNAVAILABLE of a CreateSession, ForkSession or
// PublishPrefix refused by a draining replica: its name. Place elsewhere.
inline constexpr char kDrainingMetadata[] = "kvkeep-draining";

// What a session id names.
struct FleetSessionRef {
  std::string replica;  // empty for a bare key
  uint64_t key = 0;
};

// OK for a DNS label (RFC 1123: 1-63 of [a-z0-9-], no leading or trailing
// '-'); INVALID_ARGUMENT saying what is wrong otherwise.
absl::Status CheckReplicaName(absl::string_view name);

// "<replica>.<key as 16 hex digits>", or the bare key when replica is empty.
std::string FleetSessionId(absl::string_view replica, uint64_t key);

// The inverse. INVALID_ARGUMENT naming the id (quoted, bounded) and what is
// wrong with it: not 16 lowercase hex digits after the last '.', or a
// replica part that is not a DNS label.
absl::StatusOr<FleetSessionRef> ParseFleetSessionId(absl::string_view id);

// The id of the same session held by `replica`: its key under that name.
std::string RenameSessionId(const FleetSessionRef& ref,
                            absl::string_view replica);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_COMMON_FLEET_NAMES_H_
