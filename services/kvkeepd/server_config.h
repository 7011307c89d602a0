// ServerConfig: everything kvkeepd is configured with, from its embedded
// default, a JSON config file (docs/config.md) and flags, in that order of
// precedence. A plain value; thread-safe to share once built.
#ifndef KVKEEP_SERVICES_KVKEEPD_SERVER_CONFIG_H_
#define KVKEEP_SERVICES_KVKEEPD_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_store/cache_store.h"

namespace kvkeep {

struct TenantToken {
  std::string tenant;
  std::string token;
  // The longest idle timeout this tenant's sessions may have (a create
  // asking for more is refused; the server's default is clamped to it);
  // 0: the store's cap (kMaxIdleTimeout, 30 days).
  double max_idle_timeout_seconds = 0;
};

struct TlsConfig {
  std::string cert_file;       // PEM server certificate chain; empty: no TLS
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // PEM CA; set: clients must present a cert
};

// The other stores that may send sessions here (ReceiveSession), and how
// this store proves itself when it sends (docs/security.md). A store with
// neither a token nor identities takes no transfers.
struct PeerConfig {
  // The fleet's shared secret: sent as the metadata 'kvkeep-peer-token' on
  // every ReceiveSession this store calls, and required on those it serves
  // (at least 16 characters).
  std::string token;
  // A file holding it (e.g. a mounted Kubernetes Secret; surrounding
  // whitespace is dropped); when set, it replaces `token` and
  // `also_accept`. One token per line: the first is sent, every one is
  // accepted (a rolling change of the token, docs/security.md).
  std::string token_file;
  // Further tokens accepted on ReceiveSession, never sent: the old (or the
  // next) token while a fleet changes its token one store at a time.
  std::vector<std::string> also_accept;
  // With tls.client_ca_file: callers whose verified client certificate
  // names one of these (a subject alternative name, or the common name)
  // may call ReceiveSession without the token.
  std::vector<std::string> identities;
  // PEM CA that signed the other stores' server certificates, which this
  // store checks when it sends to them (it has TLS); empty: the CA in
  // tls.client_ca_file, else the system's roots.
  std::string ca_file;
};

// The tenant of kvkeepd's start-up self-check session: the per-tenant
// limits do not apply to it (StoreOptions::unlimited_tenant), and no
// configured tenant may be called so.
inline constexpr char kSelfCheckTenant[] = "kvkeepd-self-check";

// A replica's drain by migration (docs/fleet.md): on SIGTERM it moves
// its sessions to `peers` before it stops.
struct FleetConfig {
  // The fleet's replicas: one gRPC target that resolves to all of them
  // ("dns:///kvkeepd-fleet:50051", the headless Service), or each one's
  // host:port. This replica, found among them by name, is skipped. Empty:
  // no drain by migration (sessions end with the process).
  std::vector<std::string> peers;
  // How long a drain may move sessions (each move's deadline), and how
  // many it moves at once (at least 1).
  double move_seconds = 30;
  int64_t move_parallelism = 4;
  // After the moves, how long the replica still answers (calls on moved
  // sessions are redirected) before the gRPC drain (drain_seconds) starts.
  double linger_seconds = 2;
};

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";
  // The /metrics HTTP endpoint, "host:port"; "off": none (the registry and
  // the RPC metrics still exist; tests that do not scrape use this).
  std::string metrics_listen = "127.0.0.1:9464";
  std::vector<PoolSpec> pools;  // layouts and their pool sizes
  PolicySpec default_policy{"h2o", {}};
  int64_t max_sessions = 65536;
  int64_t max_message_bytes = 64 << 20;
  int64_t max_sessions_per_tenant = 0;  // 0: no limit
  int64_t max_bytes_per_tenant = 0;     // 0: no limit
  // Session leases (docs/sessions.md): the idle timeout of a session whose
  // create names none, 0: such sessions never expire; else between 1 s and
  // 30 days (kMinIdleTimeout, kMaxIdleTimeout).
  double session_idle_timeout_seconds = 3600;
  std::vector<TenantToken> tenants;  // empty: no authentication
  // A JSON file holding the tenants ([{"name", "token"}], e.g. mounted from a
  // Kubernetes Secret); when set, its tenants replace `tenants`.
  std::string tenants_file;
  // Sessions that get per-session metric series, at most (the first ones
  // opened; the rest are counted in the totals).
  int64_t metrics_session_series = 1000;
  // A file holding "USER:PASSWORD" (e.g. a mounted Secret; surrounding
  // whitespace dropped): /metrics then asks for HTTP basic authentication.
  std::string metrics_auth_file;
  TlsConfig tls;
  PeerConfig peers;
  // Graceful shutdown deadline: in-flight calls may finish within it;
  // transfers still sending at three quarters of it are cancelled, so their
  // callers hear how they ended before the rest are cancelled.
  double drain_seconds = 10;
  // Outgoing session transfers (docs/transfer.md): the time limit of one
  // when its caller gives no earlier deadline; the HTTP/2 keepalive ping
  // interval (and answer timeout) on the channel to a target, 0: off,
  // else at least 1; and, for a commit in doubt, how many times the target
  // is asked and the wait before the first question (doubling after).
  double transfer_timeout_seconds = 300;
  double peer_keepalive_seconds = 10;
  int64_t transfer_resolve_attempts = 12;
  double transfer_resolve_seconds = 1;
  bool log_events = false;  // one line per session create/close and error
  // Where the pools live: "host", "auto" (the first GPU if there is one),
  // "cuda" or "cuda:N" (ResolveDevice).
  std::string device = "host";
  // Lets workers on this machine map the pools (the MapPool RPC); host pools
  // then live in POSIX shared memory. Off by default: a mapped pool shows
  // every session of its layout, whatever its tenant.
  bool share_pools = false;
  // Lets a tenant publish a prefix every tenant can start from
  // (PublishPrefix with is_public, docs/prefixes.md). Off by default.
  bool allow_public_prefixes = false;
  // The data socket incoming session transfers may send their pages over
  // (the tcp transport, docs/transfer.md): "host:port"; empty: listen's
  // host, any free port, or none on a store with TLS (the socket is
  // plaintext); "off": none (pages then come in chunk messages).
  std::string transfer_listen;
  // This store in a fleet of replicas (docs/fleet.md): its name, a DNS label
  // unique in the fleet (the StatefulSet pod's name, from the downward API)
  // that begins every session id it gives out; empty: kvkeepd takes the host
  // name (a server built in-process stays unnamed: bare 16-hex-digit ids).
  // And the host:port other replicas and clients reach it at, reported in
  // ServerInfo (e.g. "$(POD_NAME).kvkeep-fleet:50051"); empty: none.
  std::string replica_name;
  std::string advertise_address;
  FleetConfig fleet;
};

// A replica name from a host name: its first label, lowercased; an error
// saying to set replica_name when that is not a DNS label.
absl::StatusOr<std::string> ReplicaNameFromHost(absl::string_view host);

// The contents of a file the config names (the config itself, tenants, TLS
// PEM files): NOT_FOUND naming the path when it cannot be read.
absl::StatusOr<std::string> ReadConfigFile(const std::string& path);

// Where the data socket listens for `config` ("" for none).
std::string TransferListenAddress(const ServerConfig& config);

// What no single key's parse can see, checked before a server is built:
// counts below one, a max_bytes_per_tenant that cannot hold one token of a
// layout (one page per layer), an idle timeout out of range, a data socket
// on a TLS store, peer identities without a client CA, a short peer token.
// INVALID_ARGUMENT naming the key.
absl::Status ValidateConfig(const ServerConfig& config);

// The peer tokens `config` gives: from peers.token_file (one per line, the
// first sent), else peers.token and peers.also_accept. NOT_FOUND naming an
// unreadable file; INVALID_ARGUMENT for a token under 16 characters.
struct PeerTokens {
  std::string send;                 // empty: none configured
  std::vector<std::string> accept;  // `send` first, then the others
};
absl::StatusOr<PeerTokens> ReadPeerTokens(const ServerConfig& config);

// The user and password metrics_auth_file holds ({"", ""} when unset):
// NOT_FOUND naming an unreadable file, INVALID_ARGUMENT for one that is not
// "USER:PASSWORD" with both non-empty.
absl::StatusOr<std::pair<std::string, std::string>> ReadMetricsAuth(
    const ServerConfig& config);

// The embedded default: one small Llama-like "demo" layout (8 layers, 8 kv /
// 32 query heads, head_dim 128, bf16, 16-token pages) on a 4096-page host
// pool, loopback addresses, no authentication.
ServerConfig DefaultConfig();

// Overlays a JSON config document onto `config`. Unknown keys, wrong types
// and bad values are INVALID_ARGUMENT naming the key. A document with
// "layouts" replaces the default layouts.
absl::Status ApplyConfigJson(absl::string_view json, ServerConfig& config);

// Replaces config.tenants with a tenants file's list. INVALID_ARGUMENT for
// bad JSON, a tenant without a name or token, or a token used twice.
absl::Status ApplyTenantsJson(absl::string_view json, ServerConfig& config);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_SERVER_CONFIG_H_
