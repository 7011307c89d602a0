// DrainByMigration: what a replica of a fleet does on SIGTERM before it
// stops (docs/fleet.md). It stops taking new sessions (the service refuses
// CreateSession, ForkSession and PublishPrefix UNAVAILABLE with the
// trailing metadata kvkeep-draining, and ServerInfo says `draining`), finds
// its peers (fleet.peers: the headless Service's DNS name, resolved by
// gRPC, or a static list; services/common/fleet_discovery.h), and moves
// every session to them with the two-phase transfer (TransferSession's
// path: each move is remembered in MovedSessions, so calls on the old id
// are redirected).
//
// Placement: sessions largest first, each to the peer with the most free
// pages of its layout left after the moves already planned (so a drain
// spreads its sessions and never plans more than a peer has room for), at
// most `parallelism` moves at once, each with the drain's deadline. A move
// that fails is tried once more on the next peer with room. A session a
// call is using moves between two of its steps (the freeze waits for the
// step in progress); calls that find it frozen get UNAVAILABLE with
// kvkeep-moving, and a fleet client sends them again. What cannot be moved
// (no peer has room, or every try failed) stays here, serving, until the
// replica stops; it is counted (kvkeep_drain_sessions_total{outcome=
// "unmoved"}) and logged with its reason.
//
// A forked session moves as a whole copy: its pages shared with its parent
// or siblings are copied, not shared, on the peer. Published prefixes are
// not moved (a prefix lives on the replica that published it): they end
// with the replica, and sessions started from them move with their pages.
#ifndef KVKEEP_SERVICES_KVKEEPD_FLEET_DRAIN_H_
#define KVKEEP_SERVICES_KVKEEPD_FLEET_DRAIN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

struct DrainOptions {
  // FleetConfig::peers: one resolved target, or host:port each.
  std::vector<std::string> peers;
  absl::Duration move_time = absl::Seconds(30);
  int parallelism = 4;
  // How this replica calls its peers' GetServerInfo: its peer token and
  // credentials (null: plaintext), as its transfers do.
  std::string peer_token;
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // Answers in a row that name no new replica before discovery stops.
  int discovery_calls = 8;
};

struct DrainReport {
  int64_t sessions = 0;  // held when the drain began
  int64_t moved = 0;
  int64_t unmoved = 0;
  int64_t peers = 0;  // peers found that were not draining
  absl::Duration duration;
};

// Runs the drain on `service` (see above) and returns once every move has
// ended, by options.move_time at the latest. Logs one line per session it
// could not move and one summary line, on stderr.
DrainReport DrainByMigration(KvKeepService& service,
                             const DrainOptions& options);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_FLEET_DRAIN_H_
