// Shared host pools left behind. A kvkeepd with share_pools keeps each
// host pool in a POSIX shared-memory object named /kvkeep-<pid>-<tag>-<n>
// (page_memory.cc) and unlinks it when it stops; one killed with SIGKILL
// (or that crashed) cannot, and its pool stays in /dev/shm, holding memory,
// until the machine restarts. ReapAbandonedSharedPools removes those whose
// process is gone.
#ifndef KVKEEP_CACHE_STORE_SHARED_POOL_REAPER_H_
#define KVKEEP_CACHE_STORE_SHARED_POOL_REAPER_H_

#include <cstdint>
#include <string>

namespace kvkeep {

struct ReapedPools {
  int64_t objects = 0;
  int64_t bytes = 0;
};

// Removes every kvkeep shared pool in `dir` (where the system keeps POSIX
// shared memory) that this user owns and whose process (the pid in its
// name) no longer exists. A pool of a live process is left alone, whatever
// that process is: a pid reused by another program only delays the reaping.
// Best effort: a file that cannot be examined or removed is skipped.
ReapedPools ReapAbandonedSharedPools(const std::string& dir = "/dev/shm");

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SHARED_POOL_REAPER_H_
