// KvKeepService's checks of who calls (kvkeep_service.h): tenants by their
// bearer token, peers by their token or certificate, and which session an
// id names for a tenant: here, moved (MovedSessions) or unknown.
#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"
#include "services/common/constant_time.h"
#include "services/common/fleet_names.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "services/transfer/session_sender.h"

namespace kvkeep {

namespace {

constexpr absl::string_view kBearer = "Bearer ";

// `status` (the store's, naming the session by its key: "session <key>
// ...") naming it by the id the caller sent, as the caller knows it, and
// marked so that WithSessionIds leaves it so.
absl::Status AsCalled(const absl::Status& status, SessionId key,
                      const std::string& id) {
  const std::string label = SessionLabel(key);
  absl::Status named = status;
  if (absl::StartsWith(status.message(), label)) {
    named = absl::Status(
        status.code(),
        absl::StrCat("session ", id, status.message().substr(label.size())));
  }
  named.SetPayload(kNamedAsCalledPayload, absl::Cord());
  return named;
}

// What an unknown session, or another tenant's, gets: the same words.
absl::Status UnknownSession(const std::string& id) {
  absl::Status status =
      absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  status.SetPayload(kNamedAsCalledPayload, absl::Cord());
  return status;
}

}  // namespace

absl::Status KvKeepService::AuthenticatePeer(
    const grpc::CallbackServerContext& ctx) const {
  if (options_.peer_token.empty() && options_.accepted_peer_tokens.empty() &&
      options_.peer_identities.empty()) {
    return absl::PermissionDeniedError(
        "this store takes no session transfers: no peers are configured "
        "(peers.token or peers.identities, docs/security.md)");
  }
  if (!options_.peer_identities.empty()) {
    const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) {
      for (const char* property :
           {"x509_subject_alternative_name", "x509_common_name"}) {
        for (const grpc::string_ref& name :
             auth->FindPropertyValues(property)) {
          const absl::string_view n(name.data(), name.size());
          if (std::find(options_.peer_identities.begin(),
                        options_.peer_identities.end(),
                        n) != options_.peer_identities.end()) {
            return absl::OkStatus();
          }
        }
      }
    }
  }
  if (options_.peer_token.empty() && options_.accepted_peer_tokens.empty()) {
    return absl::UnauthenticatedError(
        "ReceiveSession is for other kvkeep stores: this store takes only "
        "peers whose client certificate names one of peers.identities");
  }
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find(kPeerTokenMetadata);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "ReceiveSession is for other kvkeep stores: send the store's peer "
        "token as metadata 'kvkeep-peer-token' (peers.token)");
  }
  const absl::string_view sent(it->second.data(), it->second.size());
  // Every token is compared, so the time taken does not say which matched.
  bool match = !options_.peer_token.empty() &&
               ConstantTimeEquals(sent, options_.peer_token);
  for (const std::string& token : options_.accepted_peer_tokens) {
    match |= ConstantTimeEquals(sent, token);
  }
  if (!match) return absl::UnauthenticatedError("wrong peer token");
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvKeepService::Authenticate(
    const grpc::CallbackServerContext& ctx) const {
  if (options_.tenants_by_token.empty()) return std::string();
  const auto& metadata = ctx.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "this server requires a token: send metadata 'authorization: Bearer "
        "<token>'");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  if (!absl::StartsWith(value, kBearer)) {
    return absl::UnauthenticatedError(
        "the authorization metadata must read 'Bearer <token>'");
  }
  auto tenant =
      options_.tenants_by_token.find(std::string(value.substr(kBearer.size())));
  if (tenant == options_.tenants_by_token.end()) {
    return absl::UnauthenticatedError("unknown token");
  }
  return tenant->second;
}

absl::StatusOr<SessionId> KvKeepService::CallerSession(
    const grpc::CallbackServerContext& ctx,
    const std::string& session_id) const {
  absl::StatusOr<std::string> tenant = Authenticate(ctx);
  if (!tenant.ok()) return tenant.status();
  return Authorize(*tenant, session_id);
}

absl::StatusOr<SessionId> KvKeepService::Authorize(
    const std::string& tenant, const std::string& session_id) const {
  absl::StatusOr<FleetSessionRef> ref = ParseFleetSessionId(session_id);
  if (!ref.ok()) return ref.status();
  const std::optional<SessionId> id = ref->key;
  // The key alone finds the session: it is unique among the sessions held
  // here, whichever replica's name the id carries (a session that moved
  // here keeps answering to its old id).
  absl::StatusOr<std::string> owner = store_->TenantOf(*id);
  if (!owner.ok()) {
    // Only its own tenant hears where a session went.
    if (std::optional<MovedSessions::Move> move = moved_.Find(*id);
        move.has_value() && move->tenant == tenant) {
      return MovedSessions::NotFound(session_id, *move);
    }
    if (!ref->replica.empty() && ref->replica != options_.replica_name) {
      return absl::NotFoundError(absl::StrCat(
          "session ", session_id, " not found on replica ",
          options_.replica_name.empty() ? "(unnamed)" : options_.replica_name,
          ": its id names replica ", ref->replica));
    }
    // Only its own tenant hears that a session expired.
    if (std::optional<std::string> expired = store_->ExpiredTenant(*id);
        expired.has_value() && *expired != tenant) {
      return UnknownSession(session_id);
    }
    return AsCalled(owner.status(), *id, session_id);
  }
  if (*owner != tenant) {
    // The answer a session that does not exist gets, word for word: the
    // code must not tell a tenant which of others' ids exist.
    return UnknownSession(session_id);
  }
  return *id;
}

}  // namespace kvkeep
