// kvkeepd: the kvkeep store daemon. Reads its configuration (embedded
// default, then --config, then flags), has KvKeepServer (kvkeep_server.h)
// build and serve kvkeep.v1.KvKeep, grpc.health.v1.Health and server
// reflection from it, and drains on SIGTERM/SIGINT. This file keeps the
// flags, the signals and the start-up lines; the assembly is the class's.
//
// It also serves Prometheus metrics over HTTP (docs/metrics.md). At startup
// it prints the bound gRPC address on one line and the bound metrics URL on
// the next, so scripts can find ephemeral ports (--listen ...:0).
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "cache_store/shared_pool_reaper.h"
#include "services/kvkeepd/allocator.h"
#include "services/kvkeepd/daemon_hooks.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/parse_errors.h"
#include "services/kvkeepd/server_config.h"

// Flags override the config file; each one's "unset" value (empty, -1)
// leaves the file's (or the embedded default's) setting alone.
ABSL_FLAG(std::string, config, "", "JSON config file (docs/config.md)");
ABSL_FLAG(std::string, listen, "",
          "gRPC address (default 127.0.0.1:50051); port 0 picks a free one");
ABSL_FLAG(std::string, metrics_listen, "",
          "Prometheus metrics address (default 127.0.0.1:9464)");
ABSL_FLAG(int64_t, metrics_session_series, -1,
          "sessions with per-session metric series, at most (1000)");
ABSL_FLAG(std::string, metrics_auth_file, "",
          "file holding USER:PASSWORD: /metrics asks for basic auth");
ABSL_FLAG(std::string, tenants_file, "",
          "JSON file of tenants and their tokens, [{\"name\", \"token\"}] "
          "(e.g. mounted from a Kubernetes Secret); replaces config tenants");
ABSL_FLAG(int64_t, pool_pages, -1,
          "pages in the pool of each layout (default: from the config; 4096 "
          "for the embedded demo layout)");
ABSL_FLAG(std::string, default_policy, "",
          "policy for sessions that name none (default h2o)");
ABSL_FLAG(int64_t, max_sessions, -1, "sessions the store holds (65536)");
ABSL_FLAG(int64_t, max_message_bytes, -1,
          "largest gRPC message accepted, in bytes (64 MiB)");
ABSL_FLAG(int64_t, max_sessions_per_tenant, -1, "0: no limit (default)");
ABSL_FLAG(int64_t, max_bytes_per_tenant, -1,
          "KV bytes a tenant's sessions may hold; 0: no limit (default)");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA: clients must present a certificate it signed");
ABSL_FLAG(double, drain_seconds, -1,
          "on SIGTERM, how long in-flight calls may take to finish (10)");
ABSL_FLAG(double, transfer_timeout_seconds, -1,
          "an outgoing transfer's time limit when its caller gives no earlier "
          "deadline (300)");
ABSL_FLAG(double, peer_keepalive_seconds, -1,
          "HTTP/2 keepalive to a transfer's target, 0: off (10)");
ABSL_FLAG(double, transfer_resolve_seconds, -1,
          "a commit in doubt: the wait before asking the target (1)");
ABSL_FLAG(int64_t, transfer_resolve_attempts, -1,
          "a commit in doubt: how many times the target is asked (12)");
ABSL_FLAG(double, session_idle_timeout_seconds, -1,
          "a session's lease when its create names none, 0: never expires "
          "(3600)");
ABSL_FLAG(bool, log_events, false,
          "log one line per session create/close and per error (stderr)");
ABSL_FLAG(bool, self_check, true,
          "decode a short demo session through the store before serving");
ABSL_FLAG(std::string, device, "",
          "where the pools live: host (default), auto, cuda or cuda:N");
ABSL_FLAG(bool, share_pools, false,
          "let workers on this machine map the pools (MapPool); host pools "
          "then live in POSIX shared memory");
ABSL_FLAG(bool, allow_public_prefixes, false,
          "let tenants publish prefixes every tenant can start from");
ABSL_FLAG(std::string, transfer_listen, "",
          "data socket for incoming session transfers' pages, host:port "
          "(default: --listen's host, any free port); off: none");
ABSL_FLAG(std::string, peer_token_file, "",
          "file holding the peer token other stores send this one's "
          "ReceiveSession and this one sends them (docs/security.md)");
ABSL_FLAG(std::string, peer_ca, "",
          "PEM CA of the other stores' server certificates (with TLS)");
ABSL_FLAG(std::string, replica_name, "",
          "this replica's name in a fleet, which begins its session ids "
          "(default: the host name; docs/fleet.md)");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port other replicas and clients reach this one at "
          "(ServerInfo.address)");
ABSL_FLAG(std::string, fleet_peers, "",
          "the fleet's replicas a SIGTERM moves sessions to: one gRPC target "
          "(dns:///kvkeepd-fleet:50051) or host:port,host:port "
          "(fleet.peers; docs/fleet.md)");
ABSL_FLAG(bool, exit_after_start, false,
          "exit 0 once serving has started (a smoke test of the start-up)");

namespace kvkeep {
namespace {

absl::StatusOr<ServerConfig> LoadConfig() {
  ServerConfig config = DefaultConfig();
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    absl::StatusOr<std::string> text = ReadConfigFile(path);
    if (!text.ok()) return text.status();
    if (absl::Status s = ApplyConfigJson(*text, config); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
    }
  }
  // Flags given on the command line win over the file.
  auto set_string = [](const absl::Flag<std::string>& flag, std::string& out) {
    if (std::string v = absl::GetFlag(flag); !v.empty()) out = v;
  };
  auto set_int = [](const absl::Flag<int64_t>& flag, int64_t& out) {
    if (int64_t v = absl::GetFlag(flag); v >= 0) out = v;
  };
  set_string(FLAGS_listen, config.listen);
  set_string(FLAGS_metrics_listen, config.metrics_listen);
  set_int(FLAGS_metrics_session_series, config.metrics_session_series);
  set_string(FLAGS_tenants_file, config.tenants_file);
  set_string(FLAGS_metrics_auth_file, config.metrics_auth_file);
  if (int64_t pages = absl::GetFlag(FLAGS_pool_pages); pages >= 0) {
    for (PoolSpec& p : config.pools) p.capacity_pages = pages;
  }
  if (std::string p = absl::GetFlag(FLAGS_default_policy); !p.empty()) {
    config.default_policy = PolicySpec{p, {}};
  }
  set_int(FLAGS_max_sessions, config.max_sessions);
  set_int(FLAGS_max_message_bytes, config.max_message_bytes);
  set_int(FLAGS_max_sessions_per_tenant, config.max_sessions_per_tenant);
  set_int(FLAGS_max_bytes_per_tenant, config.max_bytes_per_tenant);
  set_string(FLAGS_tls_cert, config.tls.cert_file);
  set_string(FLAGS_tls_key, config.tls.key_file);
  set_string(FLAGS_tls_client_ca, config.tls.client_ca_file);
  if (double d = absl::GetFlag(FLAGS_drain_seconds); d >= 0) {
    config.drain_seconds = d;
  }
  for (auto [flag, value] : {std::pair{&FLAGS_transfer_timeout_seconds,
                                       &config.transfer_timeout_seconds},
                             std::pair{&FLAGS_peer_keepalive_seconds,
                                       &config.peer_keepalive_seconds},
                             std::pair{&FLAGS_transfer_resolve_seconds,
                                       &config.transfer_resolve_seconds},
                             std::pair{&FLAGS_session_idle_timeout_seconds,
                                       &config.session_idle_timeout_seconds}}) {
    if (double d = absl::GetFlag(*flag); d >= 0) *value = d;
  }
  set_int(FLAGS_transfer_resolve_attempts, config.transfer_resolve_attempts);
  if (absl::GetFlag(FLAGS_log_events)) config.log_events = true;
  set_string(FLAGS_device, config.device);
  if (absl::GetFlag(FLAGS_share_pools)) config.share_pools = true;
  if (absl::GetFlag(FLAGS_allow_public_prefixes)) {
    config.allow_public_prefixes = true;
  }
  set_string(FLAGS_transfer_listen, config.transfer_listen);
  set_string(FLAGS_peer_token_file, config.peers.token_file);
  set_string(FLAGS_peer_ca, config.peers.ca_file);
  set_string(FLAGS_replica_name, config.replica_name);
  set_string(FLAGS_advertise_address, config.advertise_address);
  if (std::string p = absl::GetFlag(FLAGS_fleet_peers); !p.empty()) {
    config.fleet.peers = absl::StrSplit(p, ',', absl::SkipEmpty());
  }
  if (config.replica_name.empty()) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0) {
      return absl::InternalError(
          "gethostname failed: set replica_name (--replica_name)");
    }
    absl::StatusOr<std::string> name = ReplicaNameFromHost(host);
    if (!name.ok()) return name.status();
    config.replica_name = *std::move(name);
  }
  if (!config.tenants_file.empty()) {
    absl::StatusOr<std::string> text = ReadConfigFile(config.tenants_file);
    if (!text.ok()) return text.status();
    if (absl::Status s = ApplyTenantsJson(*text, config); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(config.tenants_file, ": ", s.message()));
    }
  }
  // A typo in the default policy fails start-up, not the first session.
  if (absl::StatusOr<PolicyPtr> p = NewPolicy(config.default_policy); !p.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_policy: ", p.status().message()));
  }
  if (config.max_message_bytes < 4096 || config.max_message_bytes > (1 << 30)) {
    return absl::InvalidArgumentError(
        "max_message_bytes must be in [4096, 2^30]");
  }
  return config;
}

// Decodes 512 tokens of random KV through an h2o session of the first
// layout and prints what the store kept: proof the store works before it
// takes traffic.
absl::Status SelfCheck(CacheStore& store) {
  const ModelLayout layout = store.Layouts().front().layout;
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = {"h2o", {{"sinks", "4"}, {"recent", "32"}, {"slack", "16"}}};
  spec.budget.tokens = 128;
  spec.tenant = kSelfCheckTenant;  // outside the per-tenant limits
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  if (!id.ok()) return id.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const int64_t token_elems = int64_t{layout.kv_heads} * layout.head_dim;
  const DType input = layout.input_dtype();  // the store quantises if asked
  std::vector<std::byte> k(token_elems * DTypeBytes(input));
  std::vector<std::byte> v(k.size());
  std::vector<float> q(int64_t{layout.query_heads} * layout.head_dim);
  std::vector<LayerKv> kv(layout.num_layers);
  std::vector<LayerScores> scores(layout.num_layers);
  int64_t evicted = 0;
  absl::Status status;
  for (int64_t pos = 0; pos < 512 && status.ok(); ++pos) {
    for (int64_t i = 0; i < token_elems; ++i) {
      StoreFromFloat(input, k.data(), i, normal(rng));
      StoreFromFloat(input, v.data(), i, normal(rng));
    }
    for (LayerKv& layer : kv) layer = LayerKv{k, v};
    absl::StatusOr<SessionStats> before = store.GetStats(*id);
    if (!before.ok()) return before.status();
    for (float& x : q) x = normal(rng);
    std::vector<float> uniform;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      scores[l] =
          LayerScores{l, before->layer_version[l], ScoreSource::kQueries, 1, q};
      if (layout.keys_pre_rope) {  // the store cannot score queries then
        const int64_t n = before->layer_resident[l] + 1;
        uniform.assign(n, static_cast<float>(layout.query_heads) / n);
        scores[l] = LayerScores{l, before->layer_version[l],
                                ScoreSource::kReduced, 1, uniform};
      }
    }
    absl::StatusOr<StepOutcome> step =
        store.Step(*id, AppendRequest{std::span(&pos, 1), kv}, scores);
    if (!step.ok()) {
      status = step.status();
      break;
    }
    for (const LayerChange& c : step->scores.layers) {
      evicted += static_cast<int64_t>(c.evicted_positions.size());
    }
  }
  absl::StatusOr<SessionStats> stats = store.GetStats(*id);
  if (status.ok() && stats.ok()) {
    std::printf(
        "kvkeepd: self-check: h2o (sinks 4, recent 32, budget 128, slack 16) "
        "decoded 512 tokens x %d layers of '%s': %lld resident, %lld "
        "evicted, %lld pages held\n",
        layout.num_layers, layout.name.c_str(),
        static_cast<long long>(stats->resident_tokens),
        static_cast<long long>(evicted), static_cast<long long>(stats->pages));
  }
  if (absl::Status s = store.CloseSession(*id); status.ok()) status = s;
  return status.ok() ? stats.status() : status;
}

// Prints each layout and its pool, then (with --self_check) decodes through
// the store: kvkeepd's check before it serves.
absl::Status BeforeServing(CacheStore& store, const ServerConfig& config) {
  for (const LayoutStats& s : store.Layouts()) {
    const ModelLayout& l = s.layout;
    std::printf(
        "kvkeepd: layout '%s': %d layers, %d kv / %d query heads, head_dim "
        "%d, %s, %d tokens per page; %s pool of %lld pages (%.1f MiB)%s\n",
        l.name.c_str(), l.num_layers, l.kv_heads, l.query_heads, l.head_dim,
        std::string(DTypeName(l.dtype)).c_str(), l.page_tokens,
        store.device().name().c_str(),
        static_cast<long long>(s.pool.capacity_pages),
        s.pool.capacity_pages * s.pool.page_bytes / 1048576.0,
        config.share_pools ? ", shared" : "");
  }
  if (!absl::GetFlag(FLAGS_self_check)) return absl::OkStatus();
  if (absl::Status s = SelfCheck(store); !s.ok()) {
    // The store failing its own check is no usage error (exit 1, not 2).
    return absl::InternalError(
        absl::StrCat("self-check failed: ", s.ToString()));
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvkeepd: the kvkeep KV-cache store daemon.\n"
      "With no flags it serves its embedded default: one demo layout on a "
      "host-memory pool, on 127.0.0.1:50051.");
  // --help lists the flags defined in this file (absl's default looks for a
  // file named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "kvkeepd/main.cc");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);

  // Freed buffers stay in the process (allocator.h; bench/README.md has the
  // numbers).
  ConfigureMalloc();
  // Debian's Abseil checks every lock order at run time; the locking here is
  // checked at compile time (clang -Wthread-safety) instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // A client can make protobuf log a line per request (a string field that
  // is not UTF-8): at most one such line every 10 s (parse_errors.h).
  RateLimitProtobufLog();

  // Signals go to the main thread only: block them before gRPC starts its
  // threads, which inherit the mask, and wait for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<ServerConfig> config = LoadConfig();
  if (!config.ok()) {
    std::fprintf(stderr, "kvkeepd: %s\n", config.status().ToString().c_str());
    return 2;
  }
  if (config->share_pools) {
    // Pools of kvkeepd processes killed before they could remove them.
    const ReapedPools reaped = ReapAbandonedSharedPools();
    if (reaped.objects > 0) {
      std::printf(
          "kvkeepd: removed %lld shared pools of exited processes (%.1f "
          "MiB)\n",
          static_cast<long long>(reaped.objects), reaped.bytes / 1048576.0);
    }
  }
  ServerHooks hooks;
  hooks.before_serving = [&config](CacheStore& store) {
    return BeforeServing(store, *config);
  };
  hooks.edit_service_options = [](ServiceOptions& o) { AddDaemonHooks(&o); };
  absl::StatusOr<std::unique_ptr<KvKeepServer>> server =
      KvKeepServer::Start(*config, std::move(hooks));
  if (!server.ok()) {
    std::fprintf(stderr, "kvkeepd: %s\n", server.status().ToString().c_str());
    // What the config got wrong is a usage error, as a bad flag is.
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("kvkeepd: grpc listening on %s\n", (*server)->address().c_str());
  if (const std::string m = (*server)->metrics_address(); !m.empty()) {
    std::printf("kvkeepd: metrics on http://%s/metrics\n", m.c_str());
  }
  if (const int data = (*server)->data_port(); data != 0) {
    const std::string listen = TransferListenAddress(*config);
    std::printf("kvkeepd: transfer data socket on %s:%d\n",
                listen.substr(0, listen.rfind(':')).c_str(), data);
  }
  std::printf("kvkeepd: ready; SIGTERM or Ctrl-C drains and stops\n");
  std::fflush(stdout);

  int sig = SIGTERM;
  if (!absl::GetFlag(FLAGS_exit_after_start)) sigwait(&signals, &sig);
  if (!config->fleet.peers.empty()) {
    std::printf(
        "kvkeepd: signal %d: moving sessions to peers (up to %.1fs), then "
        "draining (up to %.1fs)\n",
        sig, config->fleet.move_seconds + config->fleet.linger_seconds,
        config->drain_seconds);
  } else {
    std::printf("kvkeepd: signal %d: draining (up to %.1fs)\n", sig,
                config->drain_seconds);
  }
  std::fflush(stdout);
  (*server)->Stop(absl::Seconds(config->drain_seconds));
  server->reset();  // then the rest, in KvKeepServer's order
  std::printf("kvkeepd: stopped\n");
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) { return kvkeep::Main(argc, argv); }
