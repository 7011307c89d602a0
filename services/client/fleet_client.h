// FleetClient: the C++ client of a fleet of kvkeepd replicas (docs/fleet.md).
// It finds the replicas (a static list of addresses, or one gRPC target
// that resolves to all of them, such as the headless Service's DNS name),
// places each new session on the replica with the most free pages for its
// layout (read at most placement_staleness ago) unless the caller names
// one, and routes every call on a session to the replica its id names
// ("<replica>.<key>", services/common/fleet_names.h). A session that moved
// (TransferSession, a drain) is followed once, transparently: its old
// replica answers NOT_FOUND with the new one in the trailing metadata
// kvkeep-moved-to, and the session's handle sends that call, and every
// later one, to the new replica; a call refused while its session is being
// moved (kvkeep-moving) is sent again until the move ends
// (ClientOptions::move_wait). What a single-server KvKeepClient does
// (retries, deadlines, chunking) every replica's calls do too.
//
// Thread-safe; copies share one view of the fleet.
#ifndef KVKEEP_SERVICES_CLIENT_FLEET_CLIENT_H_
#define KVKEEP_SERVICES_CLIENT_FLEET_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/client/kvkeep_client.h"

namespace kvkeep::client {

struct FleetOptions {
  // Token, TLS, deadlines and retries for every replica (`address` unused).
  ClientOptions client;
  // The replicas: each entry one replica's host:port; or a single gRPC
  // target with a scheme that resolves to every replica
  // ("dns:///kvkeep-fleet.kvkeep.svc.cluster.local:50051", the headless
  // Service; "ipv4:127.0.0.1:5001,127.0.0.1:5002"), asked for ServerInfo
  // over round_robin until `discovery_calls` answers in a row bring no new
  // replica. Every replica must have a name (kvkeepd's replica_name), and,
  // when found through a resolved target, report its address
  // (ServerInfo.address: kvkeepd's advertise_address).
  std::vector<std::string> targets;
  int discovery_calls = 8;
  // Placement reads a replica's free pages again when its last reading is
  // older than this: how stale the numbers a session is placed by may be.
  // Zero: read every replica before every placement.
  absl::Duration placement_staleness = absl::Seconds(1);
};

class FleetClient {
 public:
  // Finds the replicas and reads their ServerInfo. INVALID_ARGUMENT for no
  // targets, bad ClientOptions or two replicas with one name;
  // FAILED_PRECONDITION for a replica without a name (or, found through a
  // resolved target, without an address); UNAVAILABLE naming the target
  // that did not answer.
  static absl::StatusOr<FleetClient> Connect(const FleetOptions& options);

  // The replicas' names, sorted.
  std::vector<std::string> Replicas() const;
  // A client of one replica, for calls this class does not route
  // (GetServerInfo, ListSessions of that replica). NOT_FOUND for an unknown
  // name.
  absl::StatusOr<KvKeepClient> Replica(const std::string& name) const;

  // Creates a session on `replica`, or (empty) on the replica with the most
  // free pages for request.layout (ties: the one holding fewer sessions,
  // then the first name) among those not draining; one that refuses
  // because it drains (kvkeep-draining) is marked draining and the next
  // one tried. NOT_FOUND when no reachable replica that is not draining
  // serves the layout. Retried as KvKeepClient::CreateSession is.
  absl::StatusOr<Session> CreateSession(const v1::CreateSessionRequest& request,
                                        const std::string& replica = "") const;
  // A handle on a session, routed by its id (Route).
  absl::StatusOr<Session> OpenSession(const std::string& session_id) const;
  // The replica a session id names: INVALID_ARGUMENT for a malformed id;
  // NOT_FOUND naming the replica when it is not in the fleet (gone, or
  // never was); a bare key (an unnamed server's id) routes to the fleet's
  // only replica, FAILED_PRECONDITION on a fleet of several.
  absl::StatusOr<std::string> Route(const std::string& session_id) const;
  // Reads every replica's ServerInfo now.
  absl::Status Refresh() const;

  struct State;  // the replicas and their last ServerInfo (fleet_client.cc)

 private:
  // A client of `replica` whose sessions follow their moves.
  absl::StatusOr<KvKeepClient> SessionClient(const std::string& replica) const;

  explicit FleetClient(std::shared_ptr<State> state)
      : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace kvkeep::client

#endif  // KVKEEP_SERVICES_CLIENT_FLEET_CLIENT_H_
