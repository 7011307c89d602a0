// KvKeepService's part of WatchEvents (docs/events.md): the bus's options,
// the call (the caller's tenant is its scope), and the event of a session
// that arrived by a transfer. The bus itself is services/events/.
#include <string>
#include <utility>
#include <vector>

#include "services/common/fleet_names.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

EventBusOptions EventOptionsFor(const ServiceOptions& options,
                                const CacheStore* store) {
  EventBusOptions events = options.events;
  if (!events.pool_use) {
    events.pool_use = [store] {
      std::vector<PoolUse> pools;
      for (const LayoutStats& s : store->Layouts()) {
        pools.push_back({s.layout.name, s.pool.capacity_pages,
                         s.pool.capacity_pages - s.pool.used_pages});
      }
      return pools;
    };
  }
  // Sessions are named as this replica's calls name them (docs/fleet.md).
  if (!events.session_name) {
    events.session_name = [replica = options.replica_name](SessionId id) {
      return FleetSessionId(replica, id);
    };
  }
  return events;
}

grpc::ServerWriteReactor<v1::WatchEventsResponse>* KvKeepService::WatchEvents(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest* req) {
  absl::StatusOr<std::string> tenant = Authenticate(*ctx);
  if (!tenant.ok()) return events_.Watch(ctx, *req, tenant.status());
  return events_.Watch(
      ctx, *req,
      WatchScope{*std::move(tenant), options_.tenants_by_token.empty()});
}

void KvKeepService::PublishMovedIn(SessionId id) {
  absl::StatusOr<SessionStats> stats = store_->GetStats(id, false);
  if (!stats.ok()) return;  // closed already: it never served here
  events_.SessionStarted(v1::EVENT_SESSION_MOVED_IN, id,
                         SessionEventOf(*stats));
}

}  // namespace kvkeep
