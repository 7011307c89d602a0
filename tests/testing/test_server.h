// Configs for in-process test servers (KvKeepServer): what every service
// test and benchmark starts from, so each builds its server as kvkeepd does
// and states only what it changes. Plain functions; thread-safe.
#ifndef KVKEEP_TESTS_TESTING_TEST_SERVER_H_
#define KVKEEP_TESTS_TESTING_TEST_SERVER_H_

#include <vector>

#include "cache_store/cache_store.h"
#include "services/kvkeepd/server_config.h"

namespace kvkeep::testing {

// `pools` served on 127.0.0.1 (any free port) with no authentication, a
// 5 s drain, and neither a /metrics endpoint nor a data socket (set
// metrics_listen or transfer_listen to "127.0.0.1:0" for one).
ServerConfig TestServerConfig(std::vector<PoolSpec> pools);

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_TESTING_TEST_SERVER_H_
