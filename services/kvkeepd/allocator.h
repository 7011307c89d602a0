// How kvkeepd sets up malloc, in one place: the daemon's main calls it first
// thing, and so do the benchmarks that run servers in-process, so that their
// numbers are the daemon's.
#ifndef KVKEEP_SERVICES_KVKEEPD_ALLOCATOR_H_
#define KVKEEP_SERVICES_KVKEEPD_ALLOCATOR_H_

namespace kvkeep {

// Keeps freed memory in the process: a decode step's buffers (gRPC's receive
// slices, the parsed messages, up to a few MiB each) are then reused by the
// next step instead of being returned to the kernel and faulted in, zeroed,
// again. Call before any threads start.
void ConfigureMalloc();

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_ALLOCATOR_H_
