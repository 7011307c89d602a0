// Tests of kvkeepd's configuration: the embedded default, the JSON file
// (every key of docs/config.md, the shipped example) and its errors.
#include "services/kvkeepd/server_config.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::Status Apply(const std::string& json, ServerConfig& config) {
  return ApplyConfigJson(json, config);
}

TEST(ServerConfigTest, DefaultServesTheDemoLayoutOnLoopback) {
  const ServerConfig c = DefaultConfig();
  EXPECT_EQ(c.listen, "127.0.0.1:50051");
  EXPECT_EQ(c.metrics_listen, "127.0.0.1:9464");
  ASSERT_EQ(c.pools.size(), 1u);
  EXPECT_EQ(c.pools[0].layout.name, "demo");
  EXPECT_EQ(c.pools[0].capacity_pages, 4096);
  EXPECT_TRUE(ValidateLayout(c.pools[0].layout).ok());
  EXPECT_TRUE(c.tenants.empty());
  EXPECT_TRUE(c.tls.cert_file.empty());
}

TEST(ServerConfigTest, TheShippedExampleParsesAndSetsEveryKey) {
  std::ifstream in(std::string(KVKEEP_SOURCE_DIR) +
                   "/config/kvkeepd.example.json");
  ASSERT_TRUE(in) << "config/kvkeepd.example.json is missing";
  std::stringstream text;
  text << in.rdbuf();
  ServerConfig c = DefaultConfig();
  ASSERT_TRUE(Apply(text.str(), c).ok());
  ASSERT_EQ(c.pools.size(), 2u);
  EXPECT_EQ(c.pools[0].layout.name, "llama3-8b");
  EXPECT_EQ(c.pools[0].layout.num_layers, 32);
  EXPECT_EQ(c.pools[0].layout.dtype, DType::kBF16);
  EXPECT_EQ(c.pools[0].capacity_pages, 65536);
  EXPECT_EQ(c.pools[0].tiers.host_bytes, int64_t{16} << 30);
  EXPECT_EQ(c.pools[0].tiers.disk_dir, "/var/lib/kvkeep/tiers/llama3-8b");
  EXPECT_EQ(c.pools[0].tiers.idle_after, absl::Seconds(300));
  EXPECT_TRUE(c.pools[0].tiers.demote_when_full);
  EXPECT_FALSE(c.pools[1].tiers.enabled());
  EXPECT_EQ(c.pools[1].layout.dtype, DType::kF32);
  EXPECT_EQ(c.pools[1].layout.page_tokens, 4);
  EXPECT_EQ(c.default_policy.name, "h2o");
  EXPECT_EQ(c.default_policy.params.at("recent"), "64");
  EXPECT_EQ(c.max_sessions, 4096);
  EXPECT_EQ(c.max_sessions_per_tenant, 1024);
  EXPECT_EQ(c.max_bytes_per_tenant, int64_t{32} << 30);
  ASSERT_EQ(c.tenants.size(), 2u);
  EXPECT_EQ(c.tenants[1].tenant, "team-b");
  EXPECT_EQ(c.tenants[0].max_idle_timeout_seconds, 0);
  EXPECT_EQ(c.tenants[1].max_idle_timeout_seconds, 86400);
  EXPECT_EQ(c.session_idle_timeout_seconds, 1800);
  EXPECT_TRUE(c.log_events);
  EXPECT_EQ(c.peers.token_file, "/etc/kvkeep-secrets/peer-token");
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  // Every layout in the example is one the store accepts.
  StoreOptions options;
  options.pools = {c.pools[1]};
  EXPECT_TRUE(CacheStore::Create(options).ok());
}

TEST(ServerConfigTest, BadTiersAreRefusedNamingTheKey) {
  const std::string layout =
      R"("name": "m", "num_layers": 1, "kv_heads": 1, "query_heads": 1,
         "head_dim": 8, "dtype": "f32", "pool_pages": 8)";
  for (const auto& [tiers, says] :
       std::vector<std::pair<std::string, std::string>>{
           {R"({"idle_seconds": 5})", "needs host_bytes or disk_dir"},
           {R"({"disk_dir": "/d", "idle_seconds": -1})", "idle_seconds"},
           {R"({"disk_dir": "/d", "idle_seconds": 1e12})", "idle_seconds"},
           {R"({"host_bytes": -5})", "host_bytes"},
           {R"({"disk_dir": "/d", "colour": 1})", "unknown key 'colour'"},
           {R"({"disk_dir": 3})", "wrong type"}}) {
    ServerConfig c = DefaultConfig();
    const absl::Status s = Apply(absl::StrCat(R"({"layouts": [{)", layout,
                                              R"(, "tiers": )", tiers, "}]}"),
                                 c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << tiers;
    EXPECT_THAT(s.message(), ::testing::HasSubstr(says)) << tiers;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("layouts[0].tiers")) << tiers;
  }
}

TEST(ServerConfigTest, KeysOverlayTheDefault) {
  ServerConfig c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"listen": "0.0.0.0:7000", "drain_seconds": 2.5,
                        "tls": {"cert_file": "c.pem", "key_file": "k.pem"}})",
                    c)
                  .ok());
  EXPECT_EQ(c.listen, "0.0.0.0:7000");
  EXPECT_EQ(c.drain_seconds, 2.5);
  EXPECT_EQ(c.tls.cert_file, "c.pem");
  EXPECT_EQ(c.pools.size(), 1u) << "layouts untouched when absent";
}

TEST(ServerConfigTest, ErrorsNameTheKey) {
  struct Case {
    std::string json;
    std::string fragment;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {R"({"listne": "x"})", "unknown key 'listne'"},
      {R"({"limits": {"max_session": 1}})", "unknown key 'max_session'"},
      {R"({"listen": 5})", "config.listen"},
      {R"({"layouts": []})", "non-empty array"},
      {R"({"layouts": [{"name": "a", "num_layers": 1, "kv_heads": 1,
           "query_heads": 1, "head_dim": 4, "dtype": "f64",
           "pool_pages": 1}]})",
       "unknown dtype 'f64'"},
      {R"({"layouts": [{"name": "a", "num_layers": 1, "kv_heads": 2,
           "query_heads": 3, "head_dim": 4, "pool_pages": 1}]})",
       "multiple of kv_heads"},
      {R"({"layouts": [{"name": "a", "num_layers": 1, "kv_heads": 1,
           "query_heads": 1, "head_dim": 4, "pool_pages": 0}]})",
       "pool_pages must be positive"},
      {R"({"layouts": [{"name": "a", "heads": 1}]})", "unknown key 'heads'"},
      {R"({"tenants": [{"name": "a"}]})", "needs a name and a token"},
      {R"({"tenants": {"name": "a"}})", "tenants must be an array"},
      {R"({"default_policy": {"name": "h2o", "parms": {}}})",
       "unknown key 'parms'"},
      {R"({"metrics_session_series": -1})", "metrics_session_series"},
      {R"({"tenants_file": 3})", "config.tenants_file"},
      {R"({"tenants": [{"name": "a", "token": "t"},
                       {"name": "b", "token": "t"}]})",
       "reuses the token of tenant 'a'"},
  };
  for (const Case& c : cases) {
    ServerConfig config = DefaultConfig();
    const absl::Status s = Apply(c.json, config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.fragment)) << c.json;
  }
}

TEST(ServerConfigTest, QuantisedLayoutsParseAndBadOnesNameTheLayout) {
  ServerConfig c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"layouts": [{"name": "q", "num_layers": 2,
      "kv_heads": 2, "query_heads": 4, "head_dim": 64, "dtype": "int4",
      "group_size": 16, "append_dtype": "f16", "pool_pages": 8}]})",
                    c)
                  .ok());
  ASSERT_EQ(c.pools.size(), 1u);
  EXPECT_EQ(c.pools[0].layout.dtype, DType::kInt4);
  EXPECT_EQ(c.pools[0].layout.group_size, 16);
  EXPECT_EQ(c.pools[0].layout.input_dtype(), DType::kF16);
  c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"layouts": [{"name": "q", "num_layers": 2,
      "kv_heads": 2, "query_heads": 4, "head_dim": 64, "dtype": "fp8_e4m3",
      "pool_pages": 8}]})",
                    c)
                  .ok());
  EXPECT_EQ(c.pools[0].layout.group_size, 32) << "the documented default";
  EXPECT_EQ(c.pools[0].layout.input_dtype(), DType::kBF16);
  c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"layouts": [{"name": "q", "num_layers": 2,
      "kv_heads": 2, "query_heads": 4, "head_dim": 64, "dtype": "kivi_int4",
      "pool_pages": 8}]})",
                    c)
                  .ok());
  EXPECT_EQ(c.pools[0].layout.dtype, DType::kKiviInt4);
  EXPECT_EQ(c.pools[0].layout.input_dtype(), DType::kBF16);

  struct Case {
    std::string layout_keys;
    std::string fragment;
  };
  const Case cases[] = {
      {R"("head_dim": 64, "dtype": "int8", "group_size": 48)",
       "layout 'bad': group_size 48 does not divide head_dim 64"},
      {R"("head_dim": 80, "dtype": "int8")",
       "layout 'bad': group_size 32 does not divide head_dim 80"},
      {R"("head_dim": 63, "dtype": "int4", "group_size": 63)",
       "layout 'bad': int4 needs an even head_dim (got 63)"},
      {R"("head_dim": 66, "dtype": "int4", "group_size": 33)",
       "layout 'bad': int4 needs an even group_size (got 33)"},
      {R"("head_dim": 63, "dtype": "kivi_int4", "group_size": 63)",
       "layout 'bad': kivi_int4 needs an even head_dim (got 63)"},
      {R"("head_dim": 64, "dtype": "kivi_int4", "group_size": 48)",
       "layout 'bad': group_size 48 does not divide head_dim 64"},
      {R"("head_dim": 64, "dtype": "int3")",
       "layout 'bad'): unknown dtype 'int3'"},
      {R"("head_dim": 64, "dtype": "int8", "append_dtype": "int4")",
       "layout 'bad': append_dtype must be f32, f16 or bf16"},
  };
  for (const Case& k : cases) {
    c = DefaultConfig();
    const absl::Status s = Apply(
        R"({"layouts": [{"name": "bad", "num_layers": 1, "kv_heads": 1,
            "query_heads": 1, "pool_pages": 1, )" +
            k.layout_keys + "}]}",
        c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.layout_keys;
    EXPECT_THAT(std::string(s.message()), HasSubstr(k.fragment));
  }
}

TEST(ServerConfigTest, MetricsAndTenantsFileKeys) {
  ServerConfig c = DefaultConfig();
  EXPECT_EQ(c.metrics_session_series, 1000);
  ASSERT_TRUE(Apply(R"({"metrics_session_series": 5,
                        "tenants_file": "/etc/kvkeep-secrets/tenants.json"})",
                    c)
                  .ok());
  EXPECT_EQ(c.metrics_session_series, 5);
  EXPECT_EQ(c.tenants_file, "/etc/kvkeep-secrets/tenants.json");
}

TEST(ServerConfigTest, ATenantsFileReplacesTheTenants) {
  ServerConfig c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"tenants": [{"name": "old", "token": "x"}]})", c).ok());
  ASSERT_TRUE(ApplyTenantsJson(R"([{"name": "team-a", "token": "ta"},
                                   {"name": "team-b", "token": "tb"}])",
                               c)
                  .ok());
  ASSERT_EQ(c.tenants.size(), 2u);
  EXPECT_EQ(c.tenants[0].tenant, "team-a");
  EXPECT_EQ(c.tenants[1].token, "tb");

  // A bad file changes nothing and says what is wrong.
  for (const auto& [json, fragment] :
       std::vector<std::pair<std::string, std::string>>{
           {"[{", "tenants file: not valid JSON"},
           {R"({"name": "a"})", "tenants must be an array"},
           {R"([{"name": "a", "token": ""}])", "needs a name and a token"}}) {
    const absl::Status s = ApplyTenantsJson(json, c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(std::string(s.message()), HasSubstr(fragment)) << json;
    EXPECT_EQ(c.tenants.size(), 2u);
  }
}

TEST(ServerConfigTest, PeersKeys) {
  ServerConfig c = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"peers": {"token": "0123456789abcdef",
                                  "token_file": "/run/peer-token",
                                  "identities": ["kvkeepd-0", "kvkeepd-1"],
                                  "ca_file": "/etc/ca.pem"}})",
                    c)
                  .ok());
  EXPECT_EQ(c.peers.token, "0123456789abcdef");
  EXPECT_EQ(c.peers.token_file, "/run/peer-token");
  EXPECT_EQ(c.peers.identities.size(), 2u);
  EXPECT_EQ(c.peers.ca_file, "/etc/ca.pem");
  const absl::Status s = Apply(R"({"peers": {"tokn": "x"}})", c);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown key 'tokn'"));
}

TEST(ServerConfigTest, FleetPeersAndDrainKeys) {
  ServerConfig c = DefaultConfig();
  EXPECT_TRUE(c.fleet.peers.empty());
  ASSERT_TRUE(Apply(R"({"fleet": {"peers": ["dns:///kvkeepd-fleet:50051"],
                                  "move_seconds": 20, "move_parallelism": 8,
                                  "linger_seconds": 1.5}})",
                    c)
                  .ok());
  EXPECT_THAT(c.fleet.peers,
              ::testing::ElementsAre("dns:///kvkeepd-fleet:50051"));
  EXPECT_EQ(c.fleet.move_seconds, 20);
  EXPECT_EQ(c.fleet.move_parallelism, 8);
  EXPECT_EQ(c.fleet.linger_seconds, 1.5);
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.fleet.move_parallelism = 0;
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("fleet: move_parallelism must be >= 1"));
  const absl::Status s = Apply(R"({"fleet": {"peer": []}})", c);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown key 'peer'"));
}

TEST(ServerConfigTest, APeerTokenFileIsReadAndTrimmed) {
  const std::string path = ::testing::TempDir() + "/server_config_peer_token";
  std::ofstream(path) << "  a-long-enough-peer-token\n";
  ServerConfig c = DefaultConfig();
  c.peers.token = "replaced-by-the-file";
  c.peers.also_accept = {"also-replaced-by-the-file"};
  c.peers.token_file = path;
  absl::StatusOr<PeerTokens> tokens = ReadPeerTokens(c);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->send, "a-long-enough-peer-token");
  EXPECT_THAT(tokens->accept, ElementsAre("a-long-enough-peer-token"));
  std::ofstream(path) << "short\n";
  EXPECT_EQ(ReadPeerTokens(c).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::ofstream(path) << "\n  \n";
  EXPECT_THAT(std::string(ReadPeerTokens(c).status().message()),
              HasSubstr("holds no token"));
  c.peers.token_file = path + ".missing";
  EXPECT_EQ(ReadPeerTokens(c).status().code(), absl::StatusCode::kNotFound);
}

// A rolling change of the fleet's token: the file's first line is sent,
// every line is accepted; in the config, peers.also_accept.
TEST(ServerConfigTest, SeveralPeerTokensAreAcceptedAndTheFirstIsSent) {
  const std::string path = ::testing::TempDir() + "/server_config_peer_tokens";
  std::ofstream(path) << "the-new-fleet-token-2\n\nthe-old-fleet-token-1\n";
  ServerConfig c = DefaultConfig();
  c.peers.token_file = path;
  absl::StatusOr<PeerTokens> tokens = ReadPeerTokens(c);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->send, "the-new-fleet-token-2");
  EXPECT_THAT(tokens->accept,
              ElementsAre("the-new-fleet-token-2", "the-old-fleet-token-1"));

  ServerConfig j = DefaultConfig();
  ASSERT_TRUE(Apply(R"({"peers": {"token": "the-new-fleet-token-2",
                        "also_accept": ["the-old-fleet-token-1"]}})",
                    j)
                  .ok());
  tokens = ReadPeerTokens(j);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->send, "the-new-fleet-token-2");
  EXPECT_THAT(tokens->accept,
              ElementsAre("the-new-fleet-token-2", "the-old-fleet-token-1"));
  j.peers.also_accept = {"short"};
  EXPECT_THAT(std::string(ValidateConfig(j).message()),
              HasSubstr("peers.also_accept"));
  j.peers.also_accept = {"the-old-fleet-token-1"};
  j.peers.token.clear();
  EXPECT_THAT(std::string(ValidateConfig(j).message()),
              HasSubstr("needs peers.token"));
}

// What no one key's parse sees is refused before a server is built, with
// the key in the message.
TEST(ServerConfigTest, ValidateRefusesConfigsNoServerCouldRunWell) {
  EXPECT_TRUE(ValidateConfig(DefaultConfig()).ok());
  // The demo layout: 8 layers of 64 KiB pages hold a token in 512 KiB.
  ServerConfig small_quota = DefaultConfig();
  small_quota.max_bytes_per_tenant = 512 << 10;
  EXPECT_TRUE(ValidateConfig(small_quota).ok());
  struct Case {
    std::function<void(ServerConfig&)> edit;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {[](ServerConfig& c) { c.max_bytes_per_tenant = (512 << 10) - 1; },
       "limits.max_bytes_per_tenant (524287 bytes) cannot hold one token of "
       "layout 'demo'"},
      {[](ServerConfig& c) { c.max_bytes_per_tenant = -1; },
       "limits.max_bytes_per_tenant must be >= 0"},
      {[](ServerConfig& c) { c.max_sessions_per_tenant = -3; },
       "limits.max_sessions_per_tenant must be >= 0"},
      {[](ServerConfig& c) { c.max_sessions = 0; },
       "limits.max_sessions must be >= 1"},
      {[](ServerConfig& c) {
         c.tls.cert_file = "cert.pem";
         c.transfer_listen = "0.0.0.0:50053";
       },
       "transfer_listen: the data socket is plaintext"},
      {[](ServerConfig& c) { c.peers.identities = {"kvkeepd-0"}; },
       "peers.identities needs tls.client_ca_file"},
      {[](ServerConfig& c) { c.peers.token = "short"; },
       "peers.token must be at least 16 characters"},
      {[](ServerConfig& c) { c.session_idle_timeout_seconds = -1; },
       "session_idle_timeout_seconds (-1) must be 0 (sessions never expire) "
       "or between 1 and 2592000"},
      {[](ServerConfig& c) { c.session_idle_timeout_seconds = 0.5; },
       "session_idle_timeout_seconds (0.5)"},
      {[](ServerConfig& c) { c.session_idle_timeout_seconds = 1e9; },
       "session_idle_timeout_seconds (1e+09)"},
      {[](ServerConfig& c) { c.session_idle_timeout_seconds = std::nan(""); },
       "session_idle_timeout_seconds (nan)"},
      {[](ServerConfig& c) {
         c.tenants = {{"a", "token-a", -5}};
       },
       "tenant 'a': max_idle_timeout_seconds (-5) must be 0"},
      {[](ServerConfig& c) {
         c.tenants = {{"a", "token-a", 3e6}};
       },
       "tenant 'a': max_idle_timeout_seconds (3e+06)"},
  };
  for (const Case& k : cases) {
    ServerConfig c = DefaultConfig();
    k.edit(c);
    const absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.fragment;
    EXPECT_THAT(std::string(s.message()), HasSubstr(k.fragment));
  }
  // A TLS store has no data socket unless one is named (which is refused).
  ServerConfig tls = DefaultConfig();
  tls.tls.cert_file = "cert.pem";
  EXPECT_EQ(TransferListenAddress(tls), "");
  tls.transfer_listen = "off";
  EXPECT_TRUE(ValidateConfig(tls).ok());
}

TEST(ServerConfigTest, LeaseKeys) {
  ServerConfig c = DefaultConfig();
  EXPECT_EQ(c.session_idle_timeout_seconds, 3600);
  ASSERT_TRUE(Apply(R"({"session_idle_timeout_seconds": 0})", c).ok());
  EXPECT_EQ(c.session_idle_timeout_seconds, 0);  // never
  EXPECT_TRUE(ValidateConfig(c).ok());
  ASSERT_TRUE(ApplyTenantsJson(R"([{"name": "a", "token": "t",
                                    "max_idle_timeout_seconds": 60}])",
                               c)
                  .ok());
  EXPECT_EQ(c.tenants[0].max_idle_timeout_seconds, 60);
  const absl::Status s = ApplyTenantsJson(
      R"([{"name": "a", "token": "t", "max_idle_timeout_seconds": "1h"}])", c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("max_idle_timeout_seconds has the wrong type"));
}

TEST(ServerConfigTest, FleetKeys) {
  ServerConfig c = DefaultConfig();
  EXPECT_EQ(c.replica_name, "");  // kvkeepd fills in the host name
  ASSERT_TRUE(Apply(R"({"replica_name": "kvkeepd-2",
                        "advertise_address": "kvkeepd-2.kvkeepd-fleet:50051"})",
                    c)
                  .ok());
  EXPECT_EQ(c.replica_name, "kvkeepd-2");
  EXPECT_EQ(c.advertise_address, "kvkeepd-2.kvkeepd-fleet:50051");
  EXPECT_TRUE(ValidateConfig(c).ok());
  for (const std::string bad : {"Kvkeepd-2", "kvkeepd_2", "-a", "a.b"}) {
    c.replica_name = bad;
    const absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), HasSubstr("replica_name")) << bad;
  }
  EXPECT_EQ(*ReplicaNameFromHost("Worker-7.example.com"), "worker-7");
  const absl::StatusOr<std::string> bad = ReplicaNameFromHost("under_score");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("set replica_name"));
}

TEST(ServerConfigTest, TheSelfChecksTenantNameIsReserved) {
  ServerConfig c = DefaultConfig();
  const absl::Status s =
      ApplyTenantsJson(R"([{"name": "kvkeepd-self-check", "token": "t"}])", c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("kvkeepd's own"));
}

}  // namespace
}  // namespace kvkeep
