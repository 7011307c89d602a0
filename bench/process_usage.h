// What grpc_e2e_bench reads about its own process: CPU time, minor page
// faults (getrusage) and allocations (malloc, calloc and realloc calls,
// counted by wrappers in process_usage.cc that pass each call on to the next
// definition, glibc's or an LD_PRELOADed allocator's; operator new calls
// malloc). Process-wide: clients, servers and gRPC's threads together.
#ifndef KVKEEP_BENCH_PROCESS_USAGE_H_
#define KVKEEP_BENCH_PROCESS_USAGE_H_

namespace kvkeep::bench {

// The process's CPU time, minor page faults and allocations so far.
struct Usage {
  double cpu_s = 0;
  double minor_faults = 0;
  double allocations = 0;

  Usage operator-(const Usage& o) const {
    return Usage{cpu_s - o.cpu_s, minor_faults - o.minor_faults,
                 allocations - o.allocations};
  }
};

Usage ProcessUsage();

// CLOCK_MONOTONIC seconds, the clock `perf record -k CLOCK_MONOTONIC` stamps
// samples with.
double MonotonicSeconds();

}  // namespace kvkeep::bench

#endif  // KVKEEP_BENCH_PROCESS_USAGE_H_
