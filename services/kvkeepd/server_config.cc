#include "services/kvkeepd/server_config.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "services/common/fleet_names.h"

namespace kvkeep {
namespace {

using Json = nlohmann::json;

ModelLayout DemoLayout() {
  ModelLayout l;
  l.name = "demo";
  l.num_layers = 8;
  l.kv_heads = 8;
  l.query_heads = 32;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  l.page_tokens = 16;
  return l;
}

// Rejects keys of `object` outside `known`, naming where they were.
absl::Status CheckKeys(const Json& object, absl::string_view where,
                       const std::set<std::string>& known) {
  if (!object.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", where, " must be an object"));
  }
  for (const auto& [key, value] : object.items()) {
    if (!known.contains(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: unknown key '", key, "' in ", where,
                       " (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Read(const Json& object, const char* key, absl::string_view where,
                  T& out) {
  auto it = object.find(key);
  if (it == object.end()) return absl::OkStatus();
  try {
    out = it->get<T>();
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: ", where, ".", key, " has the wrong type: ", e.what()));
  }
  return absl::OkStatus();
}

#define KVKEEP_RETURN_IF_ERROR(expr)          \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)

// A layout's "tiers" object (docs/tiers.md); the directory and the
// options' consistency are checked when the store starts (PrepareTiers).
absl::Status ParseTiers(const Json& j, const std::string& layout_where,
                        TierOptions& tiers) {
  const std::string where = layout_where + ".tiers";
  KVKEEP_RETURN_IF_ERROR(CheckKeys(
      j, where,
      {"host_bytes", "disk_dir", "idle_seconds", "demote_when_full"}));
  double idle_seconds = 0;
  KVKEEP_RETURN_IF_ERROR(Read(j, "host_bytes", where, tiers.host_bytes));
  KVKEEP_RETURN_IF_ERROR(Read(j, "disk_dir", where, tiers.disk_dir));
  KVKEEP_RETURN_IF_ERROR(Read(j, "idle_seconds", where, idle_seconds));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "demote_when_full", where, tiers.demote_when_full));
  // A month is the longest lease (lease.h); idling longer than any lease
  // can last would never move anything.
  constexpr double kMaxIdleSeconds = 30.0 * 24 * 3600;
  if (!std::isfinite(idle_seconds) || idle_seconds < 0 ||
      idle_seconds > kMaxIdleSeconds) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", where, ".idle_seconds must be in [0, ",
                     kMaxIdleSeconds, "] (0: only a full pool moves one)"));
  }
  if (tiers.host_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", where, ".host_bytes must not be negative"));
  }
  if (!tiers.enabled()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", where,
                     " needs host_bytes or disk_dir (a tier to move to)"));
  }
  tiers.idle_after = absl::Seconds(idle_seconds);
  return absl::OkStatus();
}

absl::StatusOr<PoolSpec> ParseLayout(const Json& j, int index) {
  const std::string where = absl::StrCat("layouts[", index, "]");
  KVKEEP_RETURN_IF_ERROR(
      CheckKeys(j, where,
                {"name", "num_layers", "kv_heads", "query_heads", "head_dim",
                 "dtype", "group_size", "append_dtype", "page_tokens",
                 "keys_pre_rope", "pool_pages", "tiers"}));
  PoolSpec spec;
  ModelLayout& l = spec.layout;
  std::string dtype = "bf16";
  std::string append_dtype = "bf16";
  KVKEEP_RETURN_IF_ERROR(Read(j, "name", where, l.name));
  KVKEEP_RETURN_IF_ERROR(Read(j, "num_layers", where, l.num_layers));
  KVKEEP_RETURN_IF_ERROR(Read(j, "kv_heads", where, l.kv_heads));
  KVKEEP_RETURN_IF_ERROR(Read(j, "query_heads", where, l.query_heads));
  KVKEEP_RETURN_IF_ERROR(Read(j, "head_dim", where, l.head_dim));
  KVKEEP_RETURN_IF_ERROR(Read(j, "dtype", where, dtype));
  KVKEEP_RETURN_IF_ERROR(Read(j, "group_size", where, l.group_size));
  KVKEEP_RETURN_IF_ERROR(Read(j, "append_dtype", where, append_dtype));
  KVKEEP_RETURN_IF_ERROR(Read(j, "page_tokens", where, l.page_tokens));
  KVKEEP_RETURN_IF_ERROR(Read(j, "keys_pre_rope", where, l.keys_pre_rope));
  KVKEEP_RETURN_IF_ERROR(Read(j, "pool_pages", where, spec.capacity_pages));
  if (auto it = j.find("tiers"); it != j.end()) {
    KVKEEP_RETURN_IF_ERROR(ParseTiers(*it, where, spec.tiers));
  }
  auto parse = [&](const std::string& name, DType& out) {
    absl::StatusOr<DType> parsed = ParseDType(name);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", where, " (layout '", l.name,
                       "'): ", parsed.status().message()));
    }
    out = *parsed;
    return absl::OkStatus();
  };
  KVKEEP_RETURN_IF_ERROR(parse(dtype, l.dtype));
  KVKEEP_RETURN_IF_ERROR(parse(append_dtype, l.append_dtype));
  KVKEEP_RETURN_IF_ERROR(ValidateLayout(l));
  if (spec.capacity_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", where, ".pool_pages must be positive"));
  }
  return spec;
}

absl::StatusOr<std::vector<TenantToken>> ParseTenants(const Json& j) {
  if (!j.is_array()) {
    return absl::InvalidArgumentError("config: tenants must be an array");
  }
  std::vector<TenantToken> tenants;
  int index = 0;
  for (const Json& t : j) {
    const std::string where = absl::StrCat("tenants[", index++, "]");
    KVKEEP_RETURN_IF_ERROR(
        CheckKeys(t, where, {"name", "token", "max_idle_timeout_seconds"}));
    TenantToken tenant;
    KVKEEP_RETURN_IF_ERROR(Read(t, "name", where, tenant.tenant));
    KVKEEP_RETURN_IF_ERROR(Read(t, "token", where, tenant.token));
    KVKEEP_RETURN_IF_ERROR(Read(t, "max_idle_timeout_seconds", where,
                                tenant.max_idle_timeout_seconds));
    if (tenant.tenant.empty() || tenant.token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", where, " needs a name and a token"));
    }
    if (tenant.tenant == kSelfCheckTenant) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", where, ": the name '", kSelfCheckTenant,
                       "' is kvkeepd's own (its start-up self-check)"));
    }
    for (const TenantToken& other : tenants) {
      if (other.token == tenant.token) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: ", where, " reuses the token of tenant '",
                         other.tenant, "'"));
      }
    }
    tenants.push_back(std::move(tenant));
  }
  return tenants;
}

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not valid JSON: ", e.what()));
  }
}

// Idle timeouts in seconds: 0 where allowed, else within the store's range
// (lease.h); NaN and infinities fail both tests.
bool IdleTimeoutInRange(double seconds) {
  return seconds >= absl::ToDoubleSeconds(kMinIdleTimeout) &&
         seconds <= absl::ToDoubleSeconds(kMaxIdleTimeout);
}

absl::Status ValidateIdleTimeouts(const ServerConfig& config) {
  const std::string range =
      absl::StrCat(absl::ToInt64Seconds(kMinIdleTimeout), " and ",
                   absl::ToInt64Seconds(kMaxIdleTimeout), " (30 days)");
  if (config.session_idle_timeout_seconds != 0 &&
      !IdleTimeoutInRange(config.session_idle_timeout_seconds)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_idle_timeout_seconds (", config.session_idle_timeout_seconds,
        ") must be 0 (sessions never expire) or between ", range));
  }
  for (const TenantToken& t : config.tenants) {
    if (t.max_idle_timeout_seconds != 0 &&
        !IdleTimeoutInRange(t.max_idle_timeout_seconds)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant '", t.tenant, "': max_idle_timeout_seconds (",
                       t.max_idle_timeout_seconds,
                       ") must be 0 (the cap) or between ", range));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyTenantsJson(absl::string_view text, ServerConfig& config) {
  absl::StatusOr<Json> j = ParseJson(text, "tenants file");
  if (!j.ok()) return j.status();
  absl::StatusOr<std::vector<TenantToken>> tenants = ParseTenants(*j);
  if (!tenants.ok()) return tenants.status();
  config.tenants = *std::move(tenants);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReplicaNameFromHost(absl::string_view host) {
  std::string name = absl::AsciiStrToLower(host.substr(0, host.find('.')));
  if (absl::Status s = CheckReplicaName(name); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the host name does not make a replica name (",
                     s.message(), "): set replica_name (--replica_name)"));
  }
  return name;
}

absl::StatusOr<std::string> ReadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

ServerConfig DefaultConfig() {
  ServerConfig config;
  config.pools.push_back(PoolSpec{DemoLayout(), 4096});
  return config;
}

std::string TransferListenAddress(const ServerConfig& config) {
  if (config.transfer_listen == "off") return "";
  if (!config.transfer_listen.empty()) return config.transfer_listen;
  if (!config.tls.cert_file.empty()) return "";  // plaintext: not with TLS
  const size_t colon = config.listen.rfind(':');
  if (absl::StartsWith(config.listen, "unix:") || colon == std::string::npos) {
    return "";
  }
  return config.listen.substr(0, colon) + ":0";
}

absl::Status ValidateConfig(const ServerConfig& config) {
  if (config.max_sessions < 1) {
    return absl::InvalidArgumentError("limits.max_sessions must be >= 1");
  }
  if (!(config.transfer_timeout_seconds > 0)) {
    return absl::InvalidArgumentError(
        "transfer_timeout_seconds must be > 0 (a transfer's time limit)");
  }
  if (!(config.peer_keepalive_seconds == 0 ||
        config.peer_keepalive_seconds >= 1)) {
    return absl::InvalidArgumentError(
        "peer_keepalive_seconds must be 0 (off) or >= 1 (stores accept a "
        "ping a second at most)");
  }
  if (config.transfer_resolve_attempts < 0 ||
      !(config.transfer_resolve_seconds > 0)) {
    return absl::InvalidArgumentError(
        "transfer_resolve_attempts must be >= 0 and transfer_resolve_seconds "
        "> 0");
  }
  if (config.max_sessions_per_tenant < 0) {
    return absl::InvalidArgumentError(
        "limits.max_sessions_per_tenant must be >= 0 (0: no limit)");
  }
  if (config.max_bytes_per_tenant < 0) {
    return absl::InvalidArgumentError(
        "limits.max_bytes_per_tenant must be >= 0 (0: no limit)");
  }
  if (absl::Status s = ValidateIdleTimeouts(config); !s.ok()) return s;
  for (const PoolSpec& pool : config.pools) {
    const ModelLayout& l = pool.layout;
    const int64_t one_token = l.num_layers * l.page_layout().page_bytes();
    if (config.max_bytes_per_tenant > 0 &&
        config.max_bytes_per_tenant < one_token) {
      return absl::InvalidArgumentError(absl::StrCat(
          "limits.max_bytes_per_tenant (", config.max_bytes_per_tenant,
          " bytes) cannot hold one token of layout '", l.name, "' (",
          l.num_layers, " layers x one ", l.page_layout().page_bytes(),
          "-byte page = ", one_token, " bytes): no session could be used"));
    }
  }
  if (config.fleet.move_parallelism < 1 || !(config.fleet.move_seconds >= 0) ||
      !(config.fleet.linger_seconds >= 0)) {
    return absl::InvalidArgumentError(
        "fleet: move_parallelism must be >= 1, move_seconds and "
        "linger_seconds >= 0");
  }
  if (!config.replica_name.empty()) {
    if (absl::Status s = CheckReplicaName(config.replica_name); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("replica_name: ", s.message()));
    }
  }
  if (!config.tls.cert_file.empty() && !config.transfer_listen.empty() &&
      config.transfer_listen != "off") {
    return absl::InvalidArgumentError(
        "transfer_listen: the data socket is plaintext, and this store has "
        "TLS: its transfers move their pages encrypted on the gRPC stream "
        "(leave transfer_listen unset, or \"off\")");
  }
  if (!config.peers.identities.empty() && config.tls.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "peers.identities needs tls.client_ca_file (the CA that verifies the "
        "peers' client certificates)");
  }
  if (!config.peers.token.empty() && config.peers.token.size() < 16) {
    return absl::InvalidArgumentError(
        "peers.token must be at least 16 characters");
  }
  for (const std::string& t : config.peers.also_accept) {
    if (t.size() < 16) {
      return absl::InvalidArgumentError(
          "peers.also_accept: every token must be at least 16 characters");
    }
  }
  if (!config.peers.also_accept.empty() && config.peers.token.empty() &&
      config.peers.token_file.empty()) {
    return absl::InvalidArgumentError(
        "peers.also_accept needs peers.token (the token this store sends)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::string, std::string>> ReadMetricsAuth(
    const ServerConfig& config) {
  if (config.metrics_auth_file.empty())
    return std::pair<std::string, std::string>();
  absl::StatusOr<std::string> text = ReadConfigFile(config.metrics_auth_file);
  if (!text.ok()) {
    return absl::NotFoundError(
        absl::StrCat("metrics_auth_file: ", text.status().message()));
  }
  const absl::string_view line = absl::StripAsciiWhitespace(*text);
  const size_t colon = line.find(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == line.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_auth_file: '", config.metrics_auth_file,
                     "' must hold USER:PASSWORD, both non-empty"));
  }
  return std::pair(std::string(line.substr(0, colon)),
                   std::string(line.substr(colon + 1)));
}

absl::StatusOr<PeerTokens> ReadPeerTokens(const ServerConfig& config) {
  PeerTokens tokens;
  if (config.peers.token_file.empty()) {
    tokens.send = config.peers.token;
    if (!tokens.send.empty()) tokens.accept.push_back(tokens.send);
    for (const std::string& t : config.peers.also_accept) {
      tokens.accept.push_back(t);
    }
    return tokens;
  }
  absl::StatusOr<std::string> text = ReadConfigFile(config.peers.token_file);
  if (!text.ok()) {
    return absl::NotFoundError(
        absl::StrCat("peers.token_file: ", text.status().message()));
  }
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    if (line.size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peers.token_file: the token on line ", line_number, " of '",
          config.peers.token_file, "' must be at least 16 characters"));
    }
    tokens.accept.emplace_back(line);
  }
  if (tokens.accept.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peers.token_file: '", config.peers.token_file, "' holds no token"));
  }
  tokens.send = tokens.accept.front();
  return tokens;
}

namespace {

// The config's top-level strings, numbers and booleans (ApplyConfigJson).
absl::Status ReadScalars(const Json& j, ServerConfig& config) {
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "tenants_file", "config", config.tenants_file));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "metrics_auth_file", "config", config.metrics_auth_file));
  KVKEEP_RETURN_IF_ERROR(Read(j, "listen", "config", config.listen));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "metrics_listen", "config", config.metrics_listen));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "drain_seconds", "config", config.drain_seconds));
  KVKEEP_RETURN_IF_ERROR(Read(j, "transfer_timeout_seconds", "config",
                              config.transfer_timeout_seconds));
  KVKEEP_RETURN_IF_ERROR(Read(j, "peer_keepalive_seconds", "config",
                              config.peer_keepalive_seconds));
  KVKEEP_RETURN_IF_ERROR(Read(j, "transfer_resolve_attempts", "config",
                              config.transfer_resolve_attempts));
  KVKEEP_RETURN_IF_ERROR(Read(j, "transfer_resolve_seconds", "config",
                              config.transfer_resolve_seconds));
  KVKEEP_RETURN_IF_ERROR(Read(j, "log_events", "config", config.log_events));
  KVKEEP_RETURN_IF_ERROR(Read(j, "session_idle_timeout_seconds", "config",
                              config.session_idle_timeout_seconds));
  KVKEEP_RETURN_IF_ERROR(Read(j, "device", "config", config.device));
  KVKEEP_RETURN_IF_ERROR(Read(j, "share_pools", "config", config.share_pools));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "allow_public_prefixes", "config", config.allow_public_prefixes));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "transfer_listen", "config", config.transfer_listen));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "replica_name", "config", config.replica_name));
  KVKEEP_RETURN_IF_ERROR(
      Read(j, "advertise_address", "config", config.advertise_address));
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyConfigJson(absl::string_view text, ServerConfig& config) {
  absl::StatusOr<Json> parsed = ParseJson(text, "config");
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  KVKEEP_RETURN_IF_ERROR(CheckKeys(j, "the config",
                                   {"listen",
                                    "metrics_listen",
                                    "metrics_session_series",
                                    "metrics_auth_file",
                                    "layouts",
                                    "default_policy",
                                    "limits",
                                    "tenants",
                                    "tenants_file",
                                    "tls",
                                    "peers",
                                    "drain_seconds",
                                    "log_events",
                                    "device",
                                    "share_pools",
                                    "allow_public_prefixes",
                                    "transfer_listen",
                                    "transfer_timeout_seconds",
                                    "peer_keepalive_seconds",
                                    "transfer_resolve_attempts",
                                    "transfer_resolve_seconds",
                                    "session_idle_timeout_seconds",
                                    "replica_name",
                                    "advertise_address",
                                    "fleet"}));
  KVKEEP_RETURN_IF_ERROR(Read(j, "metrics_session_series", "config",
                              config.metrics_session_series));
  if (config.metrics_session_series < 0) {
    return absl::InvalidArgumentError(
        "config: metrics_session_series must be >= 0");
  }
  KVKEEP_RETURN_IF_ERROR(ReadScalars(j, config));
  if (auto it = j.find("layouts"); it != j.end()) {
    if (!it->is_array() || it->empty()) {
      return absl::InvalidArgumentError(
          "config: layouts must be a non-empty array");
    }
    config.pools.clear();
    int index = 0;
    for (const Json& layout : *it) {
      absl::StatusOr<PoolSpec> spec = ParseLayout(layout, index++);
      if (!spec.ok()) return spec.status();
      config.pools.push_back(*std::move(spec));
    }
  }
  if (auto it = j.find("default_policy"); it != j.end()) {
    KVKEEP_RETURN_IF_ERROR(
        CheckKeys(*it, "default_policy", {"name", "params"}));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "name", "default_policy", config.default_policy.name));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "params", "default_policy", config.default_policy.params));
  }
  if (auto it = j.find("limits"); it != j.end()) {
    KVKEEP_RETURN_IF_ERROR(
        CheckKeys(*it, "limits",
                  {"max_sessions", "max_message_bytes",
                   "max_sessions_per_tenant", "max_bytes_per_tenant"}));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "max_sessions", "limits", config.max_sessions));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "max_message_bytes", "limits", config.max_message_bytes));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "max_sessions_per_tenant", "limits",
                                config.max_sessions_per_tenant));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "max_bytes_per_tenant", "limits",
                                config.max_bytes_per_tenant));
  }
  if (auto it = j.find("tenants"); it != j.end()) {
    absl::StatusOr<std::vector<TenantToken>> tenants = ParseTenants(*it);
    if (!tenants.ok()) return tenants.status();
    config.tenants = *std::move(tenants);
  }
  if (auto it = j.find("peers"); it != j.end()) {
    KVKEEP_RETURN_IF_ERROR(CheckKeys(
        *it, "peers",
        {"token", "token_file", "also_accept", "identities", "ca_file"}));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "token", "peers", config.peers.token));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "also_accept", "peers", config.peers.also_accept));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "token_file", "peers", config.peers.token_file));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "identities", "peers", config.peers.identities));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "ca_file", "peers", config.peers.ca_file));
  }
  if (auto it = j.find("fleet"); it != j.end()) {
    FleetConfig& fleet = config.fleet;
    KVKEEP_RETURN_IF_ERROR(CheckKeys(
        *it, "fleet",
        {"peers", "move_seconds", "move_parallelism", "linger_seconds"}));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "peers", "fleet", fleet.peers));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "move_seconds", "fleet", fleet.move_seconds));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "move_parallelism", "fleet", fleet.move_parallelism));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "linger_seconds", "fleet", fleet.linger_seconds));
  }
  if (auto it = j.find("tls"); it != j.end()) {
    KVKEEP_RETURN_IF_ERROR(
        CheckKeys(*it, "tls", {"cert_file", "key_file", "client_ca_file"}));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "cert_file", "tls", config.tls.cert_file));
    KVKEEP_RETURN_IF_ERROR(Read(*it, "key_file", "tls", config.tls.key_file));
    KVKEEP_RETURN_IF_ERROR(
        Read(*it, "client_ca_file", "tls", config.tls.client_ca_file));
  }
  return absl::OkStatus();
}

}  // namespace kvkeep
