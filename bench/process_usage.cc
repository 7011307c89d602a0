#include "bench/process_usage.h"

#include <dlfcn.h>
#include <sys/resource.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ctime>

// Counts the process's allocations: malloc, calloc and realloc (operator new
// calls malloc) are wrapped here and passed to the next definition, glibc's
// or an LD_PRELOADed allocator's. Relaxed counter: an estimate's precision.
namespace {
std::atomic<uint64_t> g_allocations{0};
template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}
}  // namespace

extern "C" {
void* malloc(size_t n) {
  static auto* next = Next<void* (*)(size_t)>("malloc");
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(n);
}
void* realloc(void* p, size_t n) {
  static auto* next = Next<void* (*)(void*, size_t)>("realloc");
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(p, n);
}
// dlsym may calloc while it resolves calloc itself: those few come from a
// static buffer (never freed: they live as long as the process).
void* calloc(size_t count, size_t size) {
  alignas(16) static char bootstrap[4096];
  static size_t used = 0;
  static thread_local bool resolving = false;
  static void* (*next)(size_t, size_t) = nullptr;
  if (next == nullptr) {
    if (resolving) {
      const size_t n = (count * size + 15) & ~size_t{15};
      if (used + n > sizeof(bootstrap)) return nullptr;
      used += n;
      return bootstrap + used - n;  // static storage: zeroed
    }
    resolving = true;
    next = Next<void* (*)(size_t, size_t)>("calloc");
    resolving = false;
  }
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return next(count, size);
}
}

namespace kvkeep::bench {

Usage ProcessUsage() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return Usage{
      ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
          1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec),
      static_cast<double>(ru.ru_minflt),
      static_cast<double>(g_allocations.load(std::memory_order_relaxed))};
}

double MonotonicSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

}  // namespace kvkeep::bench
