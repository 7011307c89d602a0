// KvKeepService's named-prefix RPCs (docs/prefixes.md): PublishPrefix,
// UnpublishPrefix and ListPrefixes. Starting a session from a prefix is
// CreateSession's (CreateSessionRequest.prefix).
#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"
#include "services/common/convert.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

grpc::ServerUnaryReactor* KvKeepService::PublishPrefix(
    grpc::CallbackServerContext* ctx, const v1::PublishPrefixRequest* req,
    v1::PrefixInfo* resp) {
  return Unary(ctx, "PublishPrefix", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    if (draining()) return DrainingRefusal("PublishPrefix");
    absl::StatusOr<std::string> tenant = Authenticate(*ctx);
    if (!tenant.ok()) return tenant.status();
    absl::StatusOr<PrefixInfo> info = store_->PublishPrefix(
        *id, PrefixSpec{req->name(), *tenant, req->is_public()});
    if (!info.ok()) return info.status();
    PrefixToProto(*info, resp);
    resp->set_source_session_id(SessionIdOf(info->source));
    LogEvent("prefix_publish",
             absl::StrCat("prefix=", Quote(info->name), " session=",
                          req->session_id(), " tenant=", Quote(info->tenant),
                          " public=", info->is_public ? "true" : "false",
                          " tokens=", info->tokens, " pages=", info->pages));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::UnpublishPrefix(
    grpc::CallbackServerContext* ctx, const v1::UnpublishPrefixRequest* req,
    v1::UnpublishPrefixResponse* resp) {
  return Unary(ctx, "UnpublishPrefix", [&]() -> absl::Status {
    absl::StatusOr<std::string> tenant = Authenticate(*ctx);
    if (!tenant.ok()) return tenant.status();
    absl::StatusOr<PrefixInfo> info =
        store_->UnpublishPrefix(*tenant, req->name(), req->is_public());
    if (!info.ok()) return info.status();
    resp->set_holders(info->holders);
    LogEvent("prefix_unpublish", absl::StrCat("prefix=", Quote(info->name),
                                              " tenant=", Quote(info->tenant),
                                              " holders=", info->holders));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::ListPrefixes(
    grpc::CallbackServerContext* ctx, const v1::ListPrefixesRequest*,
    v1::ListPrefixesResponse* resp) {
  return Unary(ctx, "ListPrefixes", [&]() -> absl::Status {
    absl::StatusOr<std::string> tenant = Authenticate(*ctx);
    if (!tenant.ok()) return tenant.status();
    for (const PrefixInfo& info : store_->Prefixes(*tenant)) {
      v1::PrefixInfo* out = resp->add_prefixes();
      PrefixToProto(info, out);
      out->set_source_session_id(SessionIdOf(info.source));  // fleet form
    }
    return absl::OkStatus();
  });
}

}  // namespace kvkeep
