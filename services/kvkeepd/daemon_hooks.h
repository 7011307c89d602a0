// What a build of the daemon adds to its service options after the flags
// are parsed. The shipped kvkeepd adds nothing (daemon_hooks.cc);
// kvkeepd_testing, built under tests/ from the same main.cc, links its own
// definition instead, which registers test-only flags and wraps transfers'
// page senders with faulty transports (tests/service/kvkeepd_testing_hooks.cc),
// so kvkeepd itself carries no test flag and no fault hook.
//
// Called once, before the service is built: main passes it to KvKeepServer
// as ServerHooks::edit_service_options.
#ifndef KVKEEP_SERVICES_KVKEEPD_DAEMON_HOOKS_H_
#define KVKEEP_SERVICES_KVKEEPD_DAEMON_HOOKS_H_

#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {

void AddDaemonHooks(ServiceOptions* options);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_DAEMON_HOOKS_H_
