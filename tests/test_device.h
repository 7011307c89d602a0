// The device the store tests put their pools on: host memory, unless the
// environment names another with KVKEEP_TEST_DEVICE (e.g. "cuda:0"). That is
// how the GPU device check (tests/gpu/device_check.sh) runs the whole store
// suite on the CUDA backend. Header-only; thread-safe.
#ifndef KVKEEP_TESTS_TEST_DEVICE_H_
#define KVKEEP_TESTS_TEST_DEVICE_H_

#include <cstdio>
#include <cstdlib>

#include "cache_store/page_memory.h"

namespace kvkeep::test_support {

inline Device TestDevice() {
  const char* spec = std::getenv("KVKEEP_TEST_DEVICE");
  if (spec == nullptr || *spec == '\0') return Device{};
  absl::StatusOr<Device> device = ResolveDevice(spec);
  if (!device.ok()) {
    // A test run asked for a device it cannot have: fail loudly rather
    // than test the host backend under the device's name.
    std::fprintf(stderr, "KVKEEP_TEST_DEVICE=%s: %s\n", spec,
                 device.status().ToString().c_str());
    std::abort();
  }
  return *device;
}

}  // namespace kvkeep::test_support

#endif  // KVKEEP_TESTS_TEST_DEVICE_H_
