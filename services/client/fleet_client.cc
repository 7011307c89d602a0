// FleetClient (see fleet_client.h): discovery, placement and routing.
#include "services/client/fleet_client.h"

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "services/client/connection.h"
#include "services/common/fleet_discovery.h"
#include "services/common/fleet_names.h"

namespace kvkeep::client {

// One replica: where it is and what it last said about itself.
struct ReplicaState {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::optional<v1::ServerInfo> info;  // nullopt: unreachable at last read
  absl::Time read_at = absl::InfinitePast();
};

struct FleetClient::State {
  explicit State(FleetOptions o) : options(std::move(o)) {}
  const FleetOptions options;
  mutable absl::Mutex mu;
  std::map<std::string, ReplicaState> replicas ABSL_GUARDED_BY(mu);  // by name
};

namespace {

// A connection to `address` over `channel` for one purpose: reading
// ServerInfo (`retries` 0 keeps a placement from waiting on a dead
// replica), or a session's calls (with `redirect`).
std::shared_ptr<Connection> ConnectionTo(const FleetOptions& options,
                                         const std::string& address,
                                         std::shared_ptr<grpc::Channel> channel,
                                         Redirect redirect = nullptr,
                                         std::optional<int> retries = {}) {
  ClientOptions o = options.client;
  o.address = address;
  if (retries.has_value()) o.retries = *retries;
  return std::make_shared<Connection>(o, std::move(channel),
                                      std::move(redirect));
}

absl::Status AddReplica(std::map<std::string, ReplicaState>& replicas,
                        const std::string& target, ReplicaState replica) {
  const std::string& name = replica.info->replica();
  if (name.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the kvkeepd at ", target,
                     " has no replica name: every replica of a fleet needs one "
                     "(replica_name)"));
  }
  auto [it, added] = replicas.emplace(name, replica);
  if (!added && it->second.address != replica.address) {
    return absl::InvalidArgumentError(
        absl::StrCat("two replicas call themselves '", name, "': at ",
                     it->second.address, " and ", replica.address));
  }
  return absl::OkStatus();
}

// Asks a resolved target for ServerInfo over round_robin until
// discovery_calls answers in a row bring no new replica.
absl::Status Discover(const FleetOptions& options, const std::string& target,
                      std::map<std::string, ReplicaState>& replicas) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(options.client, target, /*round_robin=*/true);
  if (!channel.ok()) return channel.status();
  const std::shared_ptr<Connection> all =
      ConnectionTo(options, target, *channel);
  return DiscoverReplicas(
      options.discovery_calls, [&] { return all->GetServerInfo(); },
      [&](const std::string& name) { return replicas.contains(name); },
      [&](const v1::ServerInfo& info) -> absl::Status {
        if (info.address().empty()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "replica '", info.replica(), "' (found through ", target,
              ") reports no address: set its advertise_address"));
        }
        absl::StatusOr<std::shared_ptr<grpc::Channel>> own =
            MakeChannel(options.client, info.address());
        if (!own.ok()) return own.status();
        return AddReplica(
            replicas, target,
            ReplicaState{info.address(), *own, info, absl::Now()});
      });
}

// The free pages of `layout` on a replica, or nullopt if it does not serve
// it (or did not answer).
std::optional<int64_t> FreePages(const ReplicaState& r,
                                 const std::string& layout) {
  if (!r.info.has_value() || r.info->draining()) return std::nullopt;
  for (const v1::Pool& pool : r.info->pools()) {
    if (pool.layout() == layout) return pool.free_pages();
  }
  return std::nullopt;
}

int64_t Sessions(const ReplicaState& r) {
  int64_t n = 0;
  for (const v1::Pool& pool : r.info->pools()) n += pool.sessions();
  return n;
}

// Reads the ServerInfo of every replica read longer than `staleness` ago
// (an unreachable one is skipped by placement until it answers again).
void RefreshStale(FleetClient::State& state, absl::Duration staleness) {
  std::vector<std::pair<std::string, ReplicaState>> stale;
  {
    absl::MutexLock lock(&state.mu);
    for (const auto& [name, r] : state.replicas) {
      if (absl::Now() - r.read_at >= staleness) stale.emplace_back(name, r);
    }
  }
  for (auto& [name, r] : stale) {  // outside the lock: these are RPCs
    absl::StatusOr<v1::ServerInfo> info =
        ConnectionTo(state.options, r.address, r.channel, nullptr, 0)
            ->GetServerInfo();
    absl::MutexLock lock(&state.mu);
    ReplicaState& now = state.replicas[name];
    now.info = info.ok() ? std::optional(*std::move(info)) : std::nullopt;
    now.read_at = absl::Now();
  }
}

}  // namespace

absl::StatusOr<FleetClient> FleetClient::Connect(const FleetOptions& options) {
  if (options.targets.empty()) {
    return absl::InvalidArgumentError("FleetOptions.targets is empty");
  }
  if (absl::Status s = CheckClientOptions(options.client); !s.ok()) return s;
  std::map<std::string, ReplicaState> replicas;
  for (const std::string& target : options.targets) {
    if (IsResolvedTarget(target)) {
      if (absl::Status s = Discover(options, target, replicas); !s.ok()) {
        return s;
      }
      continue;
    }
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(options.client, target);
    if (!channel.ok()) return channel.status();
    absl::StatusOr<v1::ServerInfo> info =
        ConnectionTo(options, target, *channel)->GetServerInfo();
    if (!info.ok()) return info.status();
    ReplicaState r{target, *channel, *std::move(info), absl::Now()};
    if (absl::Status s = AddReplica(replicas, target, std::move(r)); !s.ok()) {
      return s;
    }
  }
  auto state = std::make_shared<State>(options);
  {
    absl::MutexLock lock(&state->mu);
    state->replicas = std::move(replicas);
  }
  return FleetClient(std::move(state));
}

std::vector<std::string> FleetClient::Replicas() const {
  absl::MutexLock lock(&state_->mu);
  std::vector<std::string> names;
  for (const auto& [name, r] : state_->replicas) names.push_back(name);
  return names;
}

absl::Status FleetClient::Refresh() const {
  RefreshStale(*state_, absl::ZeroDuration());
  return absl::OkStatus();
}

absl::StatusOr<std::string> FleetClient::Route(
    const std::string& session_id) const {
  absl::StatusOr<FleetSessionRef> ref = ParseFleetSessionId(session_id);
  if (!ref.ok()) return ref.status();
  absl::MutexLock lock(&state_->mu);
  if (ref->replica.empty()) {
    if (state_->replicas.size() == 1) return state_->replicas.begin()->first;
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id,
        " names no replica (a server without replica_name made it), and "
        "this fleet has ",
        state_->replicas.size(), " replicas"));
  }
  if (!state_->replicas.contains(ref->replica)) {
    return absl::NotFoundError(
        absl::StrCat("session ", session_id, " lives on replica ", ref->replica,
                     ", which is not in the fleet (it is gone, or never was)"));
  }
  return ref->replica;
}

absl::StatusOr<KvKeepClient> FleetClient::Replica(
    const std::string& name) const {
  return SessionClient(name);
}

absl::StatusOr<KvKeepClient> FleetClient::SessionClient(
    const std::string& name) const {
  ReplicaState replica;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->replicas.find(name);
    if (it == state_->replicas.end()) {
      return absl::NotFoundError(
          absl::StrCat("replica ", name, " is not in the fleet (",
                       state_->replicas.size(), " replicas)"));
    }
    replica = it->second;
  }
  // A moved session's handle follows it to its new replica: a known one by
  // name, else (a replica that joined since) by the address it was sent to.
  Redirect redirect = [state = state_](const std::string& to,
                                       const std::string& address)
      -> absl::StatusOr<std::shared_ptr<grpc::Channel>> {
    {
      absl::MutexLock lock(&state->mu);
      auto it = state->replicas.find(to);
      if (it != state->replicas.end()) return it->second.channel;
    }
    if (address.empty()) {
      return absl::NotFoundError(absl::StrCat("replica ", to, " is unknown"));
    }
    return MakeChannel(state->options.client, address);
  };
  ClientOptions o = state_->options.client;
  o.address = replica.address;
  auto connection = std::make_shared<Connection>(o, replica.channel,
                                                 std::move(redirect), name);
  if (replica.info.has_value()) connection->SeedServerInfo(*replica.info);
  return KvKeepClient(std::move(connection));
}

namespace {

// The replica with the most free pages for `layout` (ties: fewer sessions,
// then the first name), or empty.
std::string Emptiest(const std::map<std::string, ReplicaState>& replicas,
                     const std::string& layout) {
  std::string chosen;
  std::optional<int64_t> best_free;
  int64_t best_sessions = 0;
  for (const auto& [name, r] : replicas) {
    const std::optional<int64_t> free = FreePages(r, layout);
    if (!free.has_value()) continue;
    const int64_t sessions = Sessions(r);
    if (!best_free.has_value() || *free > *best_free ||
        (*free == *best_free && sessions < best_sessions)) {
      chosen = name;
      best_free = free;
      best_sessions = sessions;
    }
  }
  return chosen;
}

}  // namespace

absl::StatusOr<Session> FleetClient::CreateSession(
    const v1::CreateSessionRequest& request, const std::string& replica) const {
  if (!replica.empty()) {
    absl::StatusOr<KvKeepClient> client = SessionClient(replica);
    if (!client.ok()) return client.status();
    return client->CreateSession(request);
  }
  RefreshStale(*state_, state_->options.placement_staleness);
  // A replica that refuses because it is draining is marked so (until its
  // next reading) and the session placed again: at most once per replica.
  for (;;) {
    std::string chosen;
    {
      absl::MutexLock lock(&state_->mu);
      chosen = Emptiest(state_->replicas, request.layout());
    }
    if (chosen.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "no reachable replica of the fleet that is not draining serves "
          "layout '",
          request.layout(), "'"));
    }
    absl::StatusOr<KvKeepClient> client = SessionClient(chosen);
    if (!client.ok()) return client.status();
    absl::StatusOr<Session> session = client->CreateSession(request);
    if (session.ok() || !session.status().GetPayload(kDrainingMetadata)) {
      return session;
    }
    absl::MutexLock lock(&state_->mu);
    ReplicaState& r = state_->replicas[chosen];
    if (r.info.has_value()) r.info->set_draining(true);
  }
}

absl::StatusOr<Session> FleetClient::OpenSession(
    const std::string& session_id) const {
  absl::StatusOr<std::string> replica = Route(session_id);
  if (!replica.ok()) return replica.status();
  absl::StatusOr<KvKeepClient> client = SessionClient(*replica);
  if (!client.ok()) return client.status();
  return client->OpenSession(session_id);
}

}  // namespace kvkeep::client
