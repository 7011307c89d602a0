// Helpers for GPU tests: skip without a device, and own device memory.
// Not thread-safe; one test at a time.
#ifndef KVKEEP_TESTS_GPU_GPU_TESTING_H_
#define KVKEEP_TESTS_GPU_GPU_TESTING_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace kvkeep::testing {

// True when a CUDA device can be used (false on machines without a GPU or
// driver: cudaGetDeviceCount then fails).
inline bool HaveCudaDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define KVKEEP_REQUIRE_GPU()                                            \
  do {                                                                  \
    if (!::kvkeep::testing::HaveCudaDevice()) {                         \
      GTEST_SKIP() << "no CUDA device: GPU tests run on a GPU machine"; \
    }                                                                   \
  } while (0)

#define KVKEEP_ASSERT_CUDA(expr)                            \
  do {                                                      \
    const cudaError_t kvkeep_err = (expr);                  \
    ASSERT_EQ(kvkeep_err, cudaSuccess)                      \
        << #expr << ": " << cudaGetErrorString(kvkeep_err); \
  } while (0)

// Device memory for `n` elements of T, freed on destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n > 0 && cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)) !=
                     cudaSuccess) {
      ptr_ = nullptr;
    }
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (ptr_ != nullptr) {
      cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
    }
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  bool ok() const { return n_ == 0 || ptr_ != nullptr; }
  std::vector<T> ToHost() const {
    std::vector<T> out(n_);
    if (n_ > 0) {
      cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    }
    return out;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// A non-blocking stream of its own, so a launcher is checked with the
// stream it is given (not the default one). get() is null if creation
// failed.
class Stream {
 public:
  Stream() {
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) !=
        cudaSuccess) {
      stream_ = nullptr;
    }
  }
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_GPU_GPU_TESTING_H_
