// PageMemory: where one pool's page bytes live (host memory, or one GPU) and
// the work that touches those bytes: writing and reading slots, and a
// session call's batch of compaction moves, new tokens' writes and query
// scoring (step_batch.h), run at once. The pool
// owns the allocation of pages; the memory knows nothing of owners. Per-token
// state (positions, scores) stays with the session on the host.
//
// The host memory runs the CPU twins of the kernels (kernels/); the CUDA
// memory runs the CUDA kernels on its device through pinned staging buffers,
// so a session behaves identically on both, byte for byte.
//
// Thread-safe: calls touching disjoint pages may run concurrently (the CUDA
// memory serialises them on its one stream). A page freed to the pool must
// not be named by a call still running (the session frees its pages after
// the batch that last touched them has run).
#ifndef KVKEEP_CACHE_STORE_PAGE_MEMORY_H_
#define KVKEEP_CACHE_STORE_PAGE_MEMORY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_store/step_batch.h"
#include "kernels/page_layout.h"

namespace kvkeep {

// Where a pool lives: host memory or CUDA device `ordinal`.
struct Device {
  enum class Kind : uint8_t { kHost, kCuda };
  Kind kind = Kind::kHost;
  int32_t ordinal = 0;

  bool is_cuda() const { return kind == Kind::kCuda; }
  std::string name() const;  // "host" | "cuda:N"
  friend bool operator==(const Device&, const Device&) = default;
};

// "host" | "cuda" (= cuda:0) | "cuda:N" | "auto" (cuda:0 when a CUDA device
// is usable, host otherwise). INVALID_ARGUMENT for anything else;
// FAILED_PRECONDITION for CUDA when this build has no CUDA backend or the
// machine has no such device (the message says which and why).
absl::StatusOr<Device> ResolveDevice(absl::string_view spec);

// CUDA devices this process can use (0 without the CUDA backend, a driver,
// or a device).
int CudaDeviceCount();

// How another process on this machine maps a pool (see MapPool in the
// proto): exactly one of the handles is set.
struct SharedPool {
  std::string shm_name;         // host: a POSIX shared-memory object
  std::string cuda_ipc_handle;  // CUDA: cudaIpcMemHandle_t's bytes
};

class PageMemory {
 public:
  virtual ~PageMemory() = default;

  virtual Device device() const = 0;
  virtual int64_t bytes() const = 0;
  // The arena when it is in host memory; null for device memory.
  virtual std::byte* host_data() { return nullptr; }
  // The arena when it is in device memory (device().ordinal); null for host
  // memory. For moving pages device to device (cache_store/nccl_link.h).
  virtual std::byte* device_arena() { return nullptr; }
  // INVALID_ARGUMENT naming what is missing unless every kernel this memory
  // runs supports pages of `layout` (checked once, when the pool is made).
  virtual absl::Status CheckLayout(const PageLayout& layout) const {
    return absl::OkStatus();
  }

  // Dense buffers `keys` and `values` are host memory, [n][kv_heads]
  // [head_dim] of layout.dtype; `pages` is the layer's block table, covering
  // every slot named. kivi_int4's `keys` is null (values only) or the whole
  // key blocks of the pages the slots touch (kernels/slot_copy.h). Callers
  // validate ranges; these only fail on a device error (the status says
  // which).
  virtual absl::Status WriteSlots(const PageLayout& layout,
                                  std::span<const PageId> pages, int64_t first,
                                  int64_t n, const std::byte* keys,
                                  const std::byte* values) = 0;
  virtual absl::Status ReadSlots(const PageLayout& layout,
                                 std::span<const PageId> pages, int64_t first,
                                 int64_t n, std::byte* keys,
                                 std::byte* values) = 0;
  // kivi_int4: the key blocks of `pages` (layout.key_block_bytes() each, in
  // order) into host `blocks`. Only fails on a device error.
  virtual absl::Status ReadKeyBlocks(const PageLayout& layout,
                                     std::span<const PageId> pages,
                                     std::byte* blocks) = 0;
  // Runs a session call's page work (step_batch.h) over this memory and
  // returns when all of it is done: moves and writes applied, scoring outputs
  // in their host buffers. The CUDA memory waits on its device once per
  // batch (more only when a batch's scoring outputs exceed its staging
  // bound). Callers validate ranges; this only fails on a device error (the
  // status says which), after which the bytes the batch touches are unknown.
  absl::Status RunStep(const StepBatch& batch) {
    if (batch.empty()) return absl::OkStatus();
    batches_run_.fetch_add(1, std::memory_order_relaxed);
    return DoRunStep(batch);
  }
  // Non-empty batches run so far (for tests and monitoring).
  int64_t batches_run() const {
    return batches_run_.load(std::memory_order_relaxed);
  }
  // A handle another process can map, if this memory was made shareable
  // (FAILED_PRECONDITION otherwise).
  virtual absl::StatusOr<SharedPool> Share() const = 0;

 protected:
  // RunStep's work, for a non-empty batch.
  virtual absl::Status DoRunStep(const StepBatch& batch) = 0;

 private:
  std::atomic<int64_t> batches_run_{0};
};

// `bytes` of host memory; with `shareable`, in a POSIX shared-memory object
// (readable by other processes of this user, removed when the memory is
// destroyed) instead of private memory. Pages are backed lazily.
absl::StatusOr<std::unique_ptr<PageMemory>> NewHostMemory(int64_t bytes,
                                                          bool shareable);

// `bytes` of device memory on CUDA device `ordinal` (one cudaMalloc), with
// its own stream and pinned staging. Its IPC handle is always available.
// FAILED_PRECONDITION without the CUDA backend or the device;
// RESOURCE_EXHAUSTED when the device cannot hold `bytes`.
absl::StatusOr<std::unique_ptr<PageMemory>> NewCudaMemory(int32_t ordinal,
                                                          int64_t bytes);

// Either of the above, for `device`.
absl::StatusOr<std::unique_ptr<PageMemory>> NewPageMemory(const Device& device,
                                                          int64_t bytes,
                                                          bool shareable);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_PAGE_MEMORY_H_
