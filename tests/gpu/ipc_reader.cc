// A second process for the CUDA IPC test (pool_ipc_test): opens a pool's
// cudaIpcMemHandle_t, copies byte ranges of it to the host and writes them,
// concatenated, to a file. Exit status 0 on success, 1 with a message on
// stderr otherwise.
//   usage: gpu_ipc_reader DEVICE HANDLE_HEX OUT_FILE OFFSET:LENGTH...
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

int Fail(const char* what, cudaError_t e) {
  std::fprintf(stderr, "gpu_ipc_reader: %s: %s\n", what, cudaGetErrorString(e));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: %s DEVICE HANDLE_HEX OUT_FILE OFFSET:LENGTH...\n",
                 argv[0]);
    return 2;
  }
  const int device = std::atoi(argv[1]);
  const std::string hex = argv[2];
  cudaIpcMemHandle_t handle;
  if (hex.size() != 2 * sizeof handle) {
    std::fprintf(stderr, "gpu_ipc_reader: handle must be %zu hex digits\n",
                 2 * sizeof handle);
    return 2;
  }
  for (size_t i = 0; i < sizeof handle; ++i) {
    handle.reserved[i] =
        static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return Fail("cudaSetDevice", e);
  }
  void* arena = nullptr;
  if (cudaError_t e =
          cudaIpcOpenMemHandle(&arena, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return Fail("cudaIpcOpenMemHandle", e);
  }
  std::vector<char> bytes;
  for (int i = 4; i < argc; ++i) {
    const std::string range = argv[i];
    const size_t colon = range.find(':');
    const long long offset = std::stoll(range.substr(0, colon));
    const long long length = std::stoll(range.substr(colon + 1));
    const size_t at = bytes.size();
    bytes.resize(at + static_cast<size_t>(length));
    if (cudaError_t e =
            cudaMemcpy(bytes.data() + at, static_cast<char*>(arena) + offset,
                       static_cast<size_t>(length), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return Fail("cudaMemcpy", e);
    }
  }
  if (cudaError_t e = cudaIpcCloseMemHandle(arena); e != cudaSuccess) {
    return Fail("cudaIpcCloseMemHandle", e);
  }
  FILE* out = std::fopen(argv[3], "wb");
  if (out == nullptr ||
      std::fwrite(bytes.data(), 1, bytes.size(), out) != bytes.size() ||
      std::fclose(out) != 0) {
    std::fprintf(stderr, "gpu_ipc_reader: cannot write %s\n", argv[3]);
    return 1;
  }
  return 0;
}
