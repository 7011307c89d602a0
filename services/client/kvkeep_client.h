// The kvkeep C++ client: a thin layer over the generated kvkeep.v1 stubs for
// workers, tools and tests. It adds what every caller would otherwise write
// again: a bearer token and a deadline on every call, retries of idempotent
// calls when the server is unavailable, prompt chunking under the server's
// message limit, reassembly of streamed KV, and a local mirror of a session's
// block tables. Messages are the documented proto types
// (proto/kvkeep/v1/kvkeep.proto); every error is an absl::Status carrying
// the server's gRPC code and message; nothing throws.
//
// Retries. A call that fails with UNAVAILABLE (no server, connection lost)
// is sent again after a backoff only when sending it twice cannot change the
// outcome:
//   retried:     GetServerInfo, GetSessionStats, ListSessions,
//                GetBlockTables, ReadKv (reads); KeepAlive (a renewal
//                twice is a renewal);
//                CreateSession and Session::Fork only with an
//                idempotency_key (the server returns the first attempt's
//                session to a retry);
//                TransferSession (always with a transfer id: the target
//                commits one transfer once);
//                CloseSession: the session ends up closed however many
//                attempts reach the server. When a retry finds it gone
//                (NOT_FOUND after an UNAVAILABLE attempt), the lost attempt
//                closed it: Close reports success, freed pages unknown.
//   not retried: Append, AppendPrefill, Decode, CompressPrompt (each changes
//                the session; a lost reply leaves the caller unable to know
//                whether it applied, so the caller resyncs with
//                GetBlockTables and decides).
// Every attempt has its own deadline (ClientOptions::deadline);
// DEADLINE_EXCEEDED and every other code are returned at once.
//
// Thread-safety: KvKeepClient and Session are thread-safe (each call is an
// independent RPC; the server orders calls on one session as they arrive, so
// callers that need an order keep one thread per session). DecodeStream and
// BlockTableMirror are not: one thread drives each.
#ifndef KVKEEP_SERVICES_CLIENT_KVKEEP_CLIENT_H_
#define KVKEEP_SERVICES_CLIENT_KVKEEP_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/client/event_watch.h"

namespace kvkeep::client {

struct ClientOptions {
  std::string address = "127.0.0.1:50051";  // host:port, or any gRPC target
  // Bearer token for servers with tenants configured; empty: none sent.
  std::string token;
  // TLS: set use_tls, and tls_root_certs_pem to trust a private CA (empty:
  // the system roots). tls_root_certs_pem alone also enables TLS.
  bool use_tls = false;
  std::string tls_root_certs_pem;
  // Deadline of each attempt of a unary or server-streaming call.
  absl::Duration deadline = absl::Seconds(30);
  // Deadline of a whole Decode or AppendPrefill stream: a decode loop lives
  // as long as its sequence, so none by default.
  absl::Duration stream_deadline = absl::InfiniteDuration();
  // UNAVAILABLE on an idempotent call: up to `retries` more attempts, the
  // first after `backoff`, each later one after twice the previous wait (at
  // most max_backoff), each wait jittered by up to +-20%. The channel's own
  // reconnect backoff follows the same bounds, so a server that comes back
  // is found within about one backoff.
  int retries = 4;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // Fleet clients (docs/fleet.md): a call refused because its session is
  // being moved (trailing metadata kvkeep-moving: nothing was applied) is
  // sent again every `backoff` until the move ends (then it is served, or
  // follows the session) or `move_wait` has passed since the first refusal.
  absl::Duration move_wait = absl::Seconds(30);
  // Largest reply accepted; -1: no limit (the client trusts its server).
  int max_receive_message_bytes = -1;
  // Called before each retry's wait: the method, the attempt that failed (1
  // for the first), its status. For logs and tests; runs on the caller's
  // thread and must be thread-safe if the client is shared.
  std::function<void(absl::string_view method, int attempt,
                     const absl::Status& status)>
      on_retry;
};

// One layer's keys and values of n tokens, in the layout's dtype,
// little-endian: keys and values are [n][kv_heads][head_dim] each.
struct LayerBytes {
  std::string keys;
  std::string values;
};

// n tokens for every layer: a prompt, a prefill chunk or one decode token.
struct KvTokens {
  // Original positions: strictly increasing, greater than any appended to
  // the session before.
  std::vector<int64_t> positions;
  std::vector<LayerBytes> layers;  // one per layer, in layer order
};

// A layer's resident tokens as ReadKv returns them, reassembled from the
// stream's chunks, in slot order.
struct LayerKvData {
  int32_t layer = 0;
  uint64_t version = 0;
  std::vector<int64_t> positions;  // per slot
  // [resident][kv_heads][head_dim] of the layout's append dtype (for a
  // quantised layout: dequantised by the server).
  std::string keys;
  std::string values;
};

// What an AppendPrefill did: one result per chunk the client sent, and each
// chunk's token count (what BlockTableMirror::ApplyPrefill needs).
struct PrefillResult {
  std::vector<v1::StepResult> chunks;
  std::vector<int64_t> chunk_tokens;
};

// Scores of one layer for one step, in the three forms the API takes (see
// LayerScores in the proto): values are copied.
//   per_head: [query_heads][rows][resident]
//   reduced:  [rows][resident] (summed over query heads)
//   queries:  [rows][query_heads][head_dim]
v1::LayerScores PerHeadScores(int32_t layer, uint64_t version,
                              absl::Span<const float> values, int32_t rows = 1);
v1::LayerScores ReducedScores(int32_t layer, uint64_t version,
                              absl::Span<const float> values, int32_t rows = 1);
v1::LayerScores QueryScores(int32_t layer, uint64_t version,
                            absl::Span<const float> values, int32_t rows = 1);

// Fills `out` with tokens.
void TokensToProto(const KvTokens& tokens, v1::AppendRequest* out);

// A worker's copy of a session's block tables, kept in step by applying what
// each call reports (LayerChange, in the documented order: moves; keep
// resident - k slots and drop the freed pages; add pages and place the k
// kept new tokens; first of all, replace the pages a fork's copy-on-write
// copied). Equal to GetBlockTables after every call it was given,
// so a worker always knows which position each slot holds and at which
// version to compute attention. Not thread-safe.
class BlockTableMirror {
 public:
  // An empty session: every layer empty at its starting version
  // (CreateSessionResponse.layer_versions). Session::Mirror() builds one
  // for any session in one call.
  BlockTableMirror(int32_t page_tokens, absl::Span<const uint64_t> versions);
  // The store's tables, every layer in layer order (attaching to a session
  // that already holds tokens). INVALID_ARGUMENT if a layer is missing.
  static absl::StatusOr<BlockTableMirror> FromTables(
      const v1::GetBlockTablesResponse& tables);

  // Applies one call's result. `new_positions`: the positions the call
  // appended (empty for calls that append nothing). Checks the result fits
  // the mirror before changing anything: INVALID_ARGUMENT (wrong layer
  // count, a slot or page out of range, freed pages that are not the tail),
  // the mirror unchanged.
  absl::Status Apply(const v1::StepResult& result,
                     absl::Span<const int64_t> new_positions = {});
  // A decode step: its append (with `new_positions`), then its scores.
  // Each part is checked and applied as Apply does; a failure in the second
  // leaves the first applied (resync with FromTables).
  absl::Status ApplyDecode(const v1::DecodeStepResult& result,
                           absl::Span<const int64_t> new_positions = {});
  // An AppendPrefill of `positions`, chunk by chunk (a failure leaves the
  // earlier chunks applied).
  absl::Status ApplyPrefill(const PrefillResult& result,
                            absl::Span<const int64_t> positions);

  int32_t num_layers() const { return static_cast<int32_t>(layers_.size()); }
  int32_t page_tokens() const { return page_tokens_; }
  uint64_t version(int32_t layer) const { return layers_[layer].version; }
  int64_t resident(int32_t layer) const {
    return static_cast<int64_t>(layers_[layer].positions.size());
  }
  // Per slot, the original position.
  const std::vector<int64_t>& positions(int32_t layer) const {
    return layers_[layer].positions;
  }
  const std::vector<int32_t>& pages(int32_t layer) const {
    return layers_[layer].pages;
  }
  // Per slot, the rank of its position among the layer's resident tokens.
  std::vector<int64_t> CachePositions(int32_t layer) const;
  // The layer's table in GetBlockTables' form (for comparison).
  v1::BlockTable Table(int32_t layer) const;

 private:
  struct Layer {
    uint64_t version = 0;
    std::vector<int32_t> pages;
    std::vector<int64_t> positions;  // per slot
  };
  explicit BlockTableMirror(int32_t page_tokens) : page_tokens_(page_tokens) {}
  absl::Status Check(const v1::StepResult& result,
                     absl::Span<const int64_t> new_positions) const;

  int32_t page_tokens_ = 0;
  std::vector<Layer> layers_;
};

// The channel, stub and options every handle of one client shares.
class Connection;

// A Decode stream of one session: one write and one read per Step, in
// order. The first failing step ends the stream (the server changed nothing
// for it); Step then returns that status, and later Steps return
// FAILED_PRECONDITION. Destroying an unfinished stream cancels it. Not
// thread-safe; movable.
class DecodeStream {
 public:
  DecodeStream(DecodeStream&&) noexcept;
  DecodeStream& operator=(DecodeStream&&) noexcept;
  ~DecodeStream();

  // One step: scores only (a score update), or a new token first and then
  // the step's scores, whose versions are the layer versions BEFORE that
  // append.
  absl::StatusOr<v1::DecodeStepResult> Step(
      absl::Span<const v1::LayerScores> scores);
  absl::StatusOr<v1::DecodeStepResult> Step(
      const KvTokens& append, absl::Span<const v1::LayerScores> scores);
  // Any step; its session_id is filled in if empty.
  absl::StatusOr<v1::DecodeStepResult> Step(v1::DecodeStep step);

  // Half-closes the stream and returns how it ended: OK, or the status of
  // the step that ended it. Idempotent.
  absl::Status Finish();

 private:
  friend class Session;
  using Stream = grpc::ClientReaderWriter<v1::DecodeStep, v1::DecodeStepResult>;
  DecodeStream(std::shared_ptr<const Connection> connection,
               std::string session_id);
  absl::Status End();  // collects the final status once

  std::shared_ptr<const Connection> connection_;
  std::string session_id_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<Stream> stream_;
  bool sent_first_ = false;
  bool ended_ = false;
  absl::Status final_status_;
};

// A handle on one open session. Holds no server state of its own: copying
// it, or destroying it, does not touch the session; Close does. Usable after
// the KvKeepClient that made it is gone. Thread-safe.
class Session {
 public:
  const std::string& id() const { return id_; }
  const v1::Layout& layout() const { return layout_; }
  // Per layer, the budget in force (tokens).
  const std::vector<int64_t>& layer_budgets() const { return layer_budgets_; }
  // The largest message the server takes (from ServerInfo).
  int64_t max_message_bytes() const { return max_message_bytes_; }

  // Appends tokens in one message (typically one decode token).
  absl::StatusOr<v1::StepResult> Append(const KvTokens& tokens) const;
  // Appends a prompt of any length on one AppendPrefill stream, cut into
  // chunks of at most max_chunk_tokens tokens (0: no limit) whose messages
  // fit the server's max_message_bytes. INVALID_ARGUMENT (nothing sent) if
  // the layers' byte sizes do not match the positions; RESOURCE_EXHAUSTED if
  // one token does not fit a message. On a failure the server's status says
  // how many chunks it appended; a caller keeping a mirror resyncs with
  // GetBlockTables.
  absl::StatusOr<PrefillResult> AppendPrefill(
      const KvTokens& prompt, int64_t max_chunk_tokens = 0) const;
  // A mirror of the session's block tables as they are now (one
  // GetBlockTables call): the starting point for a worker that then applies
  // every result it gets.
  absl::StatusOr<BlockTableMirror> Mirror() const;
  // SnapKV compression with the observation window's scores.
  absl::StatusOr<v1::StepResult> CompressPrompt(
      absl::Span<const v1::LayerScores> window) const;
  // Opens a Decode stream. Errors (a closed session, a wrong tenant) come
  // back from its first Step.
  DecodeStream Decode() const;

  // The block tables of `layers` (empty: every layer).
  absl::StatusOr<v1::GetBlockTablesResponse> GetBlockTables(
      absl::Span<const int32_t> layers = {}) const;
  // The handle, geometry and this session's block tables of the pool its
  // layout lives in, for a worker on the same machine to map (docs/gpu.md).
  // FAILED_PRECONDITION unless kvkeepd shares its pools (--share_pools).
  absl::StatusOr<v1::MapPoolResponse> MapPool() const;
  // The resident keys and values of `layers` (empty: every layer), one
  // entry per requested layer in request order.
  absl::StatusOr<std::vector<LayerKvData>> ReadKv(
      absl::Span<const int32_t> layers = {}) const;
  absl::StatusOr<v1::SessionStats> Stats() const;
  // Renews the session's lease (any call does; this one does nothing else):
  // for a caller that holds the session between turns without calling it.
  // The response says how long the lease now runs. NOT_FOUND, with
  // "expired" in the message, once the lease has run out.
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive() const;

  // Forks the session (ForkSession in the proto): a handle on a child at
  // this session's current state, sharing its pages copy-on-write.
  // `request` may name another policy and budget and an idempotency_key
  // (its session_id is set to this session's). The child's block tables
  // start as this session's: a worker copies its mirror, or calls Mirror()
  // on the child, and then applies the child's results (pages_copied
  // included) to it.
  absl::StatusOr<Session> Fork(v1::ForkSessionRequest request = {}) const;
  // Publishes the session's current state as a named prefix (PublishPrefix
  // in the proto; docs/prefixes.md): CreateSessionRequest.prefix then
  // starts sessions from it. The session lives on. Not retried (a retry
  // would find the name taken).
  absl::StatusOr<v1::PrefixInfo> Publish(const std::string& name,
                                         bool is_public = false) const;
  // The server's description (GetServerInfo), e.g. what the session's
  // policy takes (ServerInfo.policy_info).
  absl::StatusOr<v1::ServerInfo> GetServerInfo() const;
  // Closes the session; returns the pages it freed, or kUnknownFreedPages
  // when a retry found the session already closed by an attempt whose reply
  // was lost.
  absl::StatusOr<int64_t> Close() const;
  static constexpr int64_t kUnknownFreedPages = -1;

 private:
  friend class KvKeepClient;
  Session(std::shared_ptr<const Connection> connection, std::string id,
          v1::Layout layout, std::vector<int64_t> layer_budgets,
          int64_t max_message_bytes);

  std::shared_ptr<const Connection> connection_;
  std::string id_;
  v1::Layout layout_;
  std::vector<int64_t> layer_budgets_;
  int64_t max_message_bytes_ = 0;
};

// The entry point: a channel to one kvkeepd. Thread-safe.
class KvKeepClient {
 public:
  // Builds the channel; connects lazily, so a server that is not up yet is
  // not an error here (calls then get UNAVAILABLE after their retries).
  // INVALID_ARGUMENT for an empty address, negative retries or backoff,
  // max_backoff < backoff, or a deadline that is not positive.
  static absl::StatusOr<KvKeepClient> Connect(const ClientOptions& options);

  absl::StatusOr<v1::ServerInfo> GetServerInfo() const;
  // Creates a session and returns its handle (with its layout, from
  // ServerInfo). Retried on UNAVAILABLE only with an idempotency_key. The
  // session's lease: request.idle_timeout_seconds (0: the server's default).
  // With request.prefix the layout may be empty (the prefix's).
  absl::StatusOr<Session> CreateSession(
      const v1::CreateSessionRequest& request) const;
  // A handle on an existing session (one this tenant may use).
  absl::StatusOr<Session> OpenSession(const std::string& session_id) const;
  absl::StatusOr<v1::SessionStats> GetSessionStats(
      const std::string& session_id) const;
  // See Session::KeepAlive.
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(
      const std::string& session_id) const;
  // Every session of the caller's tenant. Does not renew their leases.
  absl::StatusOr<std::vector<v1::SessionStats>> ListSessions() const;
  // See Session::Close.
  absl::StatusOr<int64_t> CloseSession(const std::string& session_id) const;
  // Named prefixes (docs/prefixes.md; Session::Publish publishes one).
  // UnpublishPrefix returns the sessions still holding it (its pages go back
  // when the last closes); not retried. ListPrefixes: the tenant's own and
  // the public ones.
  absl::StatusOr<int64_t> UnpublishPrefix(const std::string& name,
                                          bool is_public = false) const;
  absl::StatusOr<std::vector<v1::PrefixInfo>> ListPrefixes() const;
  // Moves a session from this server to request.target (TransferSession in
  // the proto). Without a transfer_id the client makes one, so that an
  // attempt lost on the way (UNAVAILABLE) is retried safely: the target
  // never makes a second copy of one transfer. Each attempt has
  // ClientOptions::deadline: raise it for large sessions.
  absl::StatusOr<v1::TransferSessionResponse> TransferSession(
      v1::TransferSessionRequest request) const;
  // The server's events (WatchEvents; request.kinds filters them; a resume
  // point in it is where the first Start resumes). Not started: call
  // EventWatch::Start. Its deadline is ClientOptions::stream_deadline.
  EventWatch WatchEvents(v1::WatchEventsRequest request = {}) const;

  // The generated stub, for what this class does not wrap. The caller sets
  // metadata and deadlines itself.
  v1::KvKeep::Stub& stub() const;
  const ClientOptions& options() const;

 private:
  friend class FleetClient;
  explicit KvKeepClient(std::shared_ptr<const Connection> connection)
      : connection_(std::move(connection)) {}
  absl::StatusOr<Session> MakeSession(std::string id,
                                      const std::string& layout_name,
                                      std::vector<int64_t> budgets) const;

  std::shared_ptr<const Connection> connection_;
};

}  // namespace kvkeep::client

#endif  // KVKEEP_SERVICES_CLIENT_KVKEEP_CLIENT_H_
