#include "services/kvkeepd/allocator.h"

#include <malloc.h>

namespace kvkeep {

void ConfigureMalloc() {
  // Above glibc's default mmap threshold each large buffer is a fresh
  // mapping; with it fixed high, large buffers come from the heap.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  // Nor is the top of a heap trimmed (returned) until 1 GiB of it is free.
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Two arenas, not glibc's 8 per core: with one per thread that touches
  // malloc, gRPC's many threads spread a step's buffers over arenas whose
  // heaps keep growing into fresh pages (page faults every step, measured
  // by grpc_e2e_bench; none with two).
  mallopt(M_ARENA_MAX, 2);
}

}  // namespace kvkeep
