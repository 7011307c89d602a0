// KvKeepService: the kvkeep.v1.KvKeep gRPC service over a CacheStore. An
// adapter only: it authenticates the caller, checks the session's tenant,
// translates messages to and from the domain, and maps statuses; the store
// does the work, and session transfers are the transfer module's
// (services/transfer/transfer_coordinator.h). Built on gRPC's callback API: one
// session's messages on a stream are handled in order, different sessions in
// parallel.
//
// Thread-safe.
#ifndef KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVICE_H_
#define KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/security/credentials.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/events/event_bus.h"
#include "services/kvkeepd/moved_sessions.h"
#include "services/transfer/page_transport.h"
#include "services/transfer/session_state.h"
#include "services/transfer/tcp_transport.h"
#include "services/transfer/transfer_coordinator.h"

namespace kvkeep {

struct ServiceOptions {
  // token -> tenant; empty: no authentication, every caller is tenant "".
  absl::flat_hash_map<std::string, std::string> tenants_by_token;
  PolicySpec default_policy{"h2o", {}};
  int64_t max_sessions = 0;              // reported in ServerInfo
  int64_t max_message_bytes = 64 << 20;  // in ServerInfo; bounds ReadKv chunks
  std::string backend = "host";
  bool log_events = false;  // a line on stderr per create/close and error
  // Told about every transfer sent or received (metrics); may be empty.
  TransferObserver on_transfer;
  // The data socket incoming transfers may use (the tcp transport); null:
  // they come in chunk messages. Must outlive the service.
  TcpTransport* tcp = nullptr;
  // Wraps each outgoing transfer's page sender (TransferOptions::
  // wrap_sender: tests and kvkeepd_testing inject faulty transports).
  PageSenderWrapper wrap_transfer_sender;
  // Who may call ReceiveSession (docs/security.md): a caller sending this
  // token as 'kvkeep-peer-token', or presenting a verified client
  // certificate that names one of `peer_identities`. Neither set: nobody.
  // This store also sends the token on the transfers it makes.
  // `accepted_peer_tokens` (peer_token and the others of peers.also_accept)
  // are taken; empty: `peer_token` alone.
  std::string peer_token;
  std::vector<std::string> accepted_peer_tokens;
  std::vector<std::string> peer_identities;
  // How this store calls other stores' ReceiveSession: TLS with its own
  // certificate on a store with TLS; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // Whether outgoing transfers may use the plaintext data socket (not from
  // a store with TLS).
  bool plaintext_data = true;
  // Outgoing transfers (TransferOptions): the time limit when the caller
  // gives no earlier deadline, HTTP/2 keepalive to targets, and how a
  // commit in doubt is asked about.
  absl::Duration transfer_time_limit = absl::Minutes(5);
  absl::Duration peer_keepalive = absl::Seconds(10);
  int transfer_resolve_attempts = 12;
  absl::Duration transfer_resolve_wait = absl::Seconds(1);
  // This store in a fleet (docs/fleet.md): its replica name (a DNS label;
  // session ids begin with it; empty: bare 16-hex-digit ids, as a single
  // server), the address it tells others to reach it at (ServerInfo), and
  // how many sessions it sent away it remembers, to redirect calls on them.
  std::string replica_name;
  std::string advertise_address;
  int64_t remembered_moves = kRememberedMoves;
  // WatchEvents (docs/events.md): the ring, the summary interval, the
  // metrics observer. The service fills pool_use from the store if unset.
  EventBusOptions events;
};

// options.events, with the store's pools as the pressure sampler unless
// it has one. `store` must outlive the bus.
EventBusOptions EventOptionsFor(const ServiceOptions& options,
                                const CacheStore* store);

// The trailing metadata that names a TransferSession's transfer id, on
// success and on every error once the id is known.
inline constexpr char kTransferIdMetadata[] = "kvkeep-transfer-id";

// Marks a status whose message names a session by the id its caller sent
// (KvKeepService::WithSessionIds leaves it alone). Never sent to clients.
inline constexpr char kNamedAsCalledPayload[] = "kvkeep-named-as-called";

class KvKeepService final : public v1::KvKeep::CallbackService {
 public:
  // `store` must outlive the service.
  KvKeepService(CacheStore* store, ServiceOptions options);

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* req,
                                          v1::ServerInfo* resp) override;
  grpc::ServerUnaryReactor* CreateSession(
      grpc::CallbackServerContext* ctx, const v1::CreateSessionRequest* req,
      v1::CreateSessionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(
      grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
      v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx,
                                        const v1::ForkSessionRequest* req,
                                        v1::ForkSessionResponse* resp) override;
  grpc::ServerUnaryReactor* GetSessionStats(
      grpc::CallbackServerContext* ctx, const v1::GetSessionStatsRequest* req,
      v1::SessionStats* resp) override;
  grpc::ServerUnaryReactor* ListSessions(
      grpc::CallbackServerContext* ctx, const v1::ListSessionsRequest* req,
      v1::ListSessionsResponse* resp) override;
  // Named prefixes (prefix_service.cc, docs/prefixes.md).
  grpc::ServerUnaryReactor* PublishPrefix(grpc::CallbackServerContext* ctx,
                                          const v1::PublishPrefixRequest* req,
                                          v1::PrefixInfo* resp) override;
  grpc::ServerUnaryReactor* UnpublishPrefix(
      grpc::CallbackServerContext* ctx, const v1::UnpublishPrefixRequest* req,
      v1::UnpublishPrefixResponse* resp) override;
  grpc::ServerUnaryReactor* ListPrefixes(
      grpc::CallbackServerContext* ctx, const v1::ListPrefixesRequest* req,
      v1::ListPrefixesResponse* resp) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx,
                                      const v1::KeepAliveRequest* req,
                                      v1::KeepAliveResponse* resp) override;
  grpc::ServerReadReactor<v1::AppendRequest>* AppendPrefill(
      grpc::CallbackServerContext* ctx,
      v1::AppendPrefillResponse* resp) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* ctx,
                                   const v1::AppendRequest* req,
                                   v1::StepResult* resp) override;
  grpc::ServerBidiReactor<v1::DecodeStep, v1::DecodeStepResult>* Decode(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* CompressPrompt(grpc::CallbackServerContext* ctx,
                                           const v1::CompressPromptRequest* req,
                                           v1::StepResult* resp) override;
  grpc::ServerUnaryReactor* GetBlockTables(
      grpc::CallbackServerContext* ctx, const v1::GetBlockTablesRequest* req,
      v1::GetBlockTablesResponse* resp) override;
  grpc::ServerUnaryReactor* MapPool(grpc::CallbackServerContext* ctx,
                                    const v1::MapPoolRequest* req,
                                    v1::MapPoolResponse* resp) override;
  grpc::ServerWriteReactor<v1::KvChunk>* ReadKv(
      grpc::CallbackServerContext* ctx, const v1::ReadKvRequest* req) override;
  grpc::ServerUnaryReactor* TransferSession(
      grpc::CallbackServerContext* ctx, const v1::TransferSessionRequest* req,
      v1::TransferSessionResponse* resp) override;
  grpc::ServerWriteReactor<v1::WatchEventsResponse>* WatchEvents(
      grpc::CallbackServerContext* ctx,
      const v1::WatchEventsRequest* req) override;

  // The drain's part for transfers (TransferCoordinator::Drain): those still
  // sending at `deadline` are cancelled, before the gRPC server's own
  // deadline cancels their calls, so their callers hear how they ended.
  // Returns once every TransferSession call is answered: the server may
  // then go (a call finished after it would use its freed queue).
  void DrainTransfers(absl::Time deadline) { transfers_.Drain(deadline); }
  // Sends session `transfer.id` (of `tenant`) away, and once it committed
  // remembers the move (MovedSessions), publishes and logs it; then calls
  // `done` with the outcome (its status naming the transfer) and the
  // session's new id (empty on failure), on the transfer's thread.
  void Send(
      OutgoingTransfer transfer, std::string tenant,
      std::function<void(const TransferOutcome&, const std::string& new_id)>
          done);

  // The drain (fleet_drain.h): from StartDraining on, CreateSession and
  // ForkSession (and PublishPrefix) are refused UNAVAILABLE with the
  // trailing metadata kvkeep-draining, and ServerInfo says `draining`.
  void StartDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // The UNAVAILABLE a draining replica answers `method` with.
  absl::Status DrainingRefusal(absl::string_view method) const;
  // A failed operation on session `id` as its caller should hear it: the
  // move's NOT_FOUND (MovedSessions::NotFound) if the session left while
  // the caller held it (a Decode stream), else `status` unchanged.
  absl::Status WhereItWent(SessionId id, const absl::Status& status) const;

  // ReceiveSession is registered raw in the constructor (the transfer
  // module's receiver reads chunks in place): the typed override is unused.

  // Waits for transfers still sending (their calls have been answered, or
  // the server is shutting down).
  ~KvKeepService() override = default;

  // The caller's tenant: UNAUTHENTICATED without a valid bearer token when
  // tokens are configured.
  absl::StatusOr<std::string> Authenticate(
      const grpc::CallbackServerContext& ctx) const;
  // The session `session_id` names, if `tenant` may use it:
  // INVALID_ARGUMENT (malformed id), NOT_FOUND (also another tenant's
  // session; "expired" only to the expired session's own tenant).
  absl::StatusOr<SessionId> Authorize(const std::string& tenant,
                                      const std::string& session_id) const;
  // That the caller of ReceiveSession is a configured peer (the peer token,
  // or a client certificate's name): UNAUTHENTICATED without valid peer
  // credentials, PERMISSION_DENIED where no peer is configured.
  absl::Status AuthenticatePeer(const grpc::CallbackServerContext& ctx) const;
  // Authenticate, then Authorize: the session a unary call names.
  absl::StatusOr<SessionId> CallerSession(
      const grpc::CallbackServerContext& ctx,
      const std::string& session_id) const;
  // Logs a failed call (when log_events) and maps its status.
  grpc::Status Finish(absl::string_view method, const absl::Status& status);
  // The same, and puts a moved session's new place (MovedSessions::NotFound)
  // in the call's trailing metadata.
  grpc::Status Finish(grpc::CallbackServerContext* ctx,
                      absl::string_view method, const absl::Status& status);
  // A session's id as clients see it: "<replica>.<key>" (fleet_names.h).
  std::string SessionIdOf(SessionId key) const;
  // `status` with a leading "session <key>" (the store's way to name a
  // session) naming it by SessionIdOf; payloads kept. A status that carries
  // kNamedAsCalledPayload (Authorize's: it names the id the caller sent)
  // stays as it is.
  absl::Status WithSessionIds(const absl::Status& status) const;
  void LogEvent(absl::string_view event, absl::string_view fields) const;
  // Publishes that session `id` arrived by a transfer (its stats, now).
  void PublishMovedIn(SessionId id);
  // The line for a session whose lease ran out, written whether or not
  // log_events is on.
  void LogExpired(const ExpiredSession& session) const;

  // The address ServerInfo reports when options().advertise_address is
  // empty (KvKeepServer sets the bound one, once it listens).
  void set_address(std::string address) ABSL_LOCKS_EXCLUDED(address_mu_) {
    absl::MutexLock lock(&address_mu_);
    address_ = std::move(address);
  }

  CacheStore& store() { return *store_; }
  // The events WatchEvents serves (the lease reaper and the drain use it).
  EventBus& events() { return events_; }
  const ServiceOptions& options() const { return options_; }

 private:
  // One logfmt line on stderr: ts=... event=EVENT FIELDS.
  static void WriteEvent(absl::string_view event, absl::string_view fields);
  // Runs fn for a unary call and finishes it with fn's status.
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx,
                                  absl::string_view method,
                                  const std::function<absl::Status()>& fn);

  CacheStore* const store_;
  const ServiceOptions options_;
  MovedSessions moved_;
  std::atomic<bool> draining_{false};
  mutable absl::Mutex address_mu_;
  std::string address_ ABSL_GUARDED_BY(address_mu_);
  // Before transfers_: their callbacks publish.
  EventBus events_;
  // Last: its destructor waits for sends whose callbacks use the rest.
  TransferCoordinator transfers_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_KVKEEP_SERVICE_H_
