// KvKeepService::GetServerInfo: what this store serves, how full each pool
// is, and who it is in a fleet (docs/fleet.md).
#include "absl/time/time.h"
#include "cache_store/policy_registry.h"
#include "services/common/convert.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

grpc::ServerUnaryReactor* KvKeepService::GetServerInfo(
    grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest*,
    v1::ServerInfo* resp) {
  return Unary(ctx, "GetServerInfo", [&]() -> absl::Status {
    // Tenants, and peers (a draining replica chooses where its sessions
    // go by what its peers say: fleet_drain.h).
    absl::StatusOr<std::string> t = Authenticate(*ctx);
    if (!t.ok() && AuthenticatePeer(*ctx).ok()) t = std::string();
    if (!t.ok()) return t.status();
    resp->set_version(KVKEEP_VERSION);
    resp->set_backend(options_.backend);
    for (const LayoutStats& s : store_->Layouts()) {
      LayoutToProto(s.layout, resp->add_layouts());
      v1::Pool* pool = resp->add_pools();
      pool->set_layout(s.layout.name);
      pool->set_capacity_pages(s.pool.capacity_pages);
      pool->set_used_pages(s.pool.used_pages);
      pool->set_page_bytes(s.pool.page_bytes);
      pool->set_sessions(s.sessions);
      pool->set_allocation_failures(s.pool.allocation_failures);
      pool->set_shared_pages(s.pool.shared_pages);
      pool->set_page_references(s.pool.page_references);
      pool->set_free_pages(s.pool.capacity_pages - s.pool.used_pages);
    }
    resp->set_replica(options_.replica_name);
    if (!options_.advertise_address.empty()) {
      resp->set_address(options_.advertise_address);
    } else {
      absl::MutexLock lock(&address_mu_);
      resp->set_address(address_);
    }
    for (const PolicyInfo& policy : Policies()) {
      resp->add_policies(std::string(policy.name));
      PolicyInfoToProto(policy, resp->add_policy_info());
    }
    resp->set_max_sessions(options_.max_sessions);
    resp->set_max_message_bytes(options_.max_message_bytes);
    const LeaseOptions& lease = store_->lease_options();
    resp->set_default_idle_timeout_seconds(absl::ToDoubleSeconds(
        ResolveIdleTimeout(lease, *t, absl::ZeroDuration())
            .value_or(absl::ZeroDuration())));
    resp->set_max_idle_timeout_seconds(
        absl::ToDoubleSeconds(MaxIdleTimeout(lease, *t)));
    resp->set_public_prefixes(store_->allow_public_prefixes());
    resp->set_draining(draining());
    return absl::OkStatus();
  });
}
}  // namespace kvkeep
