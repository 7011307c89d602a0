#include "services/kvkeepd/daemon_hooks.h"

namespace kvkeep {

// The shipped daemon: nothing to add.
void AddDaemonHooks(ServiceOptions*) {}

}  // namespace kvkeep
