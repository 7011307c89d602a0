// DrainByMigration (see fleet_drain.h): peers, placement and the moves.
#include "services/kvkeepd/fleet_drain.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/common/fleet_discovery.h"
#include "services/common/grpc_status.h"
#include "services/transfer/session_sender.h"

namespace kvkeep {
namespace {

// The longest one GetServerInfo of a peer may take.
constexpr absl::Duration kAskTime = absl::Seconds(5);

struct Peer {
  std::string name;
  std::string address;                  // where its sessions are sent
  std::map<std::string, int64_t> free;  // layout -> free pages, as read
};

std::shared_ptr<grpc::Channel> PeerChannel(const DrainOptions& options,
                                           const std::string& target,
                                           bool round_robin) {
  grpc::ChannelArguments args;
  if (round_robin) args.SetLoadBalancingPolicyName("round_robin");
  return grpc::CreateCustomChannel(target,
                                   options.peer_credentials != nullptr
                                       ? options.peer_credentials
                                       : grpc::InsecureChannelCredentials(),
                                   args);
}

absl::StatusOr<v1::ServerInfo> AskInfo(v1::KvKeep::Stub& stub,
                                       const DrainOptions& options,
                                       absl::Time deadline) {
  grpc::ClientContext context;
  if (!options.peer_token.empty()) {
    context.AddMetadata(kPeerTokenMetadata, options.peer_token);
  }
  context.set_deadline(
      absl::ToChronoTime(std::min(deadline, absl::Now() + kAskTime)));
  v1::ServerInfo info;
  absl::Status s = FromGrpcStatus(stub.GetServerInfo(&context, {}, &info));
  if (!s.ok()) return s;
  return info;
}

void LogLine(const std::string& line) {
  std::fprintf(stderr, "kvkeepd: drain: %s\n", line.c_str());
  std::fflush(stderr);
}

// The replicas `options.peers` names, but this one (by name, or by
// address) and draining ones. A target that does not answer is logged
// and skipped.
std::vector<Peer> FindPeers(const DrainOptions& options,
                            const std::string& self, absl::Time deadline) {
  std::map<std::string, Peer> found;  // by name (address when unnamed)
  auto add = [&](const v1::ServerInfo& info, const std::string& address) {
    const std::string key = info.replica().empty() ? address : info.replica();
    if (key == self || info.draining() || found.contains(key)) return;
    Peer& peer = found[key];
    peer.name = key;
    peer.address = address;
    for (const v1::Pool& pool : info.pools()) {
      peer.free[pool.layout()] = pool.free_pages();
    }
  };
  for (const std::string& target : options.peers) {
    const bool resolved = IsResolvedTarget(target);
    std::unique_ptr<v1::KvKeep::Stub> stub =
        v1::KvKeep::NewStub(PeerChannel(options, target, resolved));
    absl::Status s;
    if (resolved) {
      absl::flat_hash_set<std::string> seen;
      s = DiscoverReplicas(
          options.discovery_calls,
          [&] { return AskInfo(*stub, options, deadline); },
          [&](const std::string& name) { return seen.contains(name); },
          [&](const v1::ServerInfo& info) {
            seen.insert(info.replica());
            if (!info.address().empty()) add(info, info.address());
            return absl::OkStatus();
          });
    } else {
      absl::StatusOr<v1::ServerInfo> info = AskInfo(*stub, options, deadline);
      if (info.ok()) add(*info, target);
      s = info.status();
    }
    if (!s.ok()) LogLine(absl::StrCat("peer ", target, ": ", s.ToString()));
  }
  std::vector<Peer> peers;
  for (auto& [key, peer] : found) peers.push_back(std::move(peer));
  return peers;
}

struct Item {
  SessionId id = 0;
  std::string tenant;
  std::string layout;
  int64_t pages = 0;
};

// The moves: workers take the next session, plan it on the peer with the
// most free pages of its layout left, and send it.
class Mover {
 public:
  Mover(KvKeepService& service, std::vector<Peer> peers, absl::Time deadline)
      : service_(service), peers_(std::move(peers)), deadline_(deadline) {
    for (const Peer& peer : peers_) free_.push_back(peer.free);
  }

  void Run(std::vector<Item> items, int parallelism) {
    items_ = std::move(items);
    std::vector<std::thread> workers;
    const int n = std::max(1, std::min<int>(parallelism, items_.size()));
    for (int i = 0; i < n; ++i) workers.emplace_back([this] { Work(); });
    for (std::thread& t : workers) t.join();
  }
  int64_t moved() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return moved_;
  }
  int64_t unmoved() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return unmoved_;
  }

 private:
  void Work() {
    for (;;) {
      std::optional<Item> item;
      {
        absl::MutexLock lock(&mu_);
        if (next_ >= items_.size()) return;
        item = items_[next_++];
      }
      Move(*item);
    }
  }

  // The peer with the most room for `item` not in `tried`, its pages
  // reserved; -1 if none has room.
  int Reserve(const Item& item, const std::vector<int>& tried) {
    absl::MutexLock lock(&mu_);
    int best = -1;
    for (int p = 0; p < static_cast<int>(free_.size()); ++p) {
      if (std::find(tried.begin(), tried.end(), p) != tried.end()) continue;
      auto it = free_[p].find(item.layout);
      if (it == free_[p].end() || it->second < item.pages) continue;
      if (best < 0 || it->second > free_[best][item.layout]) best = p;
    }
    if (best >= 0) free_[best][item.layout] -= item.pages;
    return best;
  }

  void Move(const Item& item) {
    std::vector<int> tried;
    std::string why = "no peer has room for its pages";
    for (int attempt = 0; attempt < 2 && absl::Now() < deadline_; ++attempt) {
      const int p = Reserve(item, tried);
      if (p < 0) break;
      tried.push_back(p);
      absl::StatusOr<std::string> sent = Send(item, peers_[p].address);
      if (sent.ok()) {
        absl::MutexLock lock(&mu_);
        ++moved_;
        return;
      }
      why = absl::StrCat("to ", peers_[p].name, ": ", sent.status().ToString());
      absl::MutexLock lock(&mu_);
      free_[p][item.layout] += item.pages;  // not used after all
    }
    LogLine(absl::StrCat("could not move session ",
                         service_.SessionIdOf(item.id), " (layout ",
                         item.layout, ", ", item.pages, " pages): ", why,
                         "; it ends with this replica"));
    absl::MutexLock lock(&mu_);
    ++unmoved_;
  }

  // Sends one session; its new id, or why it stayed.
  absl::StatusOr<std::string> Send(const Item& item,
                                   const std::string& target) {
    OutgoingTransfer transfer;
    transfer.id = item.id;
    transfer.target = target;
    transfer.deadline = deadline_;
    absl::Notification done;
    absl::StatusOr<std::string> result;
    service_.Send(std::move(transfer), item.tenant,
                  [&](const TransferOutcome& outcome, const std::string& id) {
                    result = outcome.status.ok()
                                 ? absl::StatusOr<std::string>(id)
                                 : outcome.status;
                    done.Notify();
                  });
    done.WaitForNotification();
    return result;
  }

  KvKeepService& service_;
  const std::vector<Peer> peers_;  // names and addresses
  absl::Mutex mu_;
  // Per peer, layout -> free pages less the moves planned there.
  std::vector<std::map<std::string, int64_t>> free_ ABSL_GUARDED_BY(mu_);
  std::vector<Item> items_;  // fixed before the workers start
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t moved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t unmoved_ ABSL_GUARDED_BY(mu_) = 0;
  const absl::Time deadline_;
};

}  // namespace

DrainReport DrainByMigration(KvKeepService& service,
                             const DrainOptions& options) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options.move_time;
  service.StartDraining();
  DrainReport report;
  std::vector<Item> items;
  for (const SessionInfo& s : service.store().Sessions()) {
    absl::StatusOr<SessionStats> stats = service.store().GetStats(s.id, false);
    if (!stats.ok()) continue;  // closed meanwhile
    items.push_back(Item{s.id, s.tenant, s.layout, stats->pages});
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.pages > b.pages; });
  report.sessions = static_cast<int64_t>(items.size());
  std::vector<Peer> peers =
      FindPeers(options, service.options().replica_name, deadline);
  report.peers = static_cast<int64_t>(peers.size());
  Mover mover(service, std::move(peers), deadline);
  mover.Run(std::move(items), options.parallelism);
  report.moved = mover.moved();
  report.unmoved = mover.unmoved();
  report.duration = absl::Now() - start;
  LogLine(absl::StrCat(report.sessions, " sessions: ", report.moved,
                       " moved to ", report.peers, " peers, ", report.unmoved,
                       " not moved, in ",
                       absl::FormatDuration(report.duration)));
  return report;
}

}  // namespace kvkeep
