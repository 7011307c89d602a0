// The CUDA PageMemory: one cudaMalloc arena per pool on one device, a stream
// of its own, and pinned host staging through which every host buffer goes
// in and out in one copy each way. Built only with the CUDA backend.
//
// Each call stages its inputs (block table, moves, token bytes, queries) in
// one pinned buffer, uploads it with one copy, runs one kernel, downloads
// what it produced and waits for its stream: the session's state on the
// host and the bytes on the device never disagree when a call returns. The
// calls are serialised by a mutex (one stream, one pair of staging buffers).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/cuda_status.h"
#include "cache_store/page_memory.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/compaction.h"
#include "kernels/cuda/slot_copy.h"

namespace kvkeep {
namespace {

constexpr size_t kAlign = 256;
// Query scoring's logits per launch, at most (one row may need more).
constexpr int64_t kWorkspaceBytes = int64_t{256} << 20;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where each array of one call sits in the staging buffers (the same offset
// in the pinned and the device buffer).
class StagingPlan {
 public:
  size_t Add(size_t bytes) {
    const size_t offset = total_;
    total_ = AlignUp(total_ + bytes);
    return offset;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

class CudaMemory final : public PageMemory {
 public:
  static absl::StatusOr<std::unique_ptr<PageMemory>> Create(int32_t ordinal,
                                                            int64_t bytes) {
    const std::string where = absl::StrCat("cuda:", ordinal);
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal),
                                    absl::StrCat("selecting ", where));
        !s.ok()) {
      return s;
    }
    std::unique_ptr<CudaMemory> memory(new CudaMemory(ordinal, bytes));
    void* arena = nullptr;
    if (absl::Status s = CudaStatus(
            cudaMalloc(&arena, static_cast<size_t>(bytes)),
            absl::StrCat("reserving a pool of ", bytes, " bytes on ", where));
        !s.ok()) {
      return s;
    }
    memory->arena_ = static_cast<std::byte*>(arena);
    if (absl::Status s = CudaStatus(
            cudaStreamCreateWithFlags(&memory->stream_, cudaStreamNonBlocking),
            absl::StrCat("creating a stream on ", where));
        !s.ok()) {
      return s;
    }
    return std::unique_ptr<PageMemory>(std::move(memory));
  }

  ~CudaMemory() override {
    // Errors here have no one to go to (a destructor cannot fail, and the
    // process is letting the device go); the calls before it reported any
    // error the device had.
    cudaSetDevice(ordinal_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    cudaFree(arena_);
    cudaFree(device_staging_);
    cudaFreeHost(pinned_staging_);
  }

  Device device() const override {
    return Device{Device::Kind::kCuda, ordinal_};
  }
  absl::Status CheckLayout(const PageLayout& layout) const override {
    if (!cuda::QueryAttentionSupportsHeadDim(layout.head_dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head_dim ", layout.head_dim,
          " has no CUDA query-scoring kernel (built for 64, 80, 96, 128 and "
          "256)"));
    }
    return absl::OkStatus();
  }
  int64_t bytes() const override { return bytes_; }
  std::byte* device_arena() override { return arena_; }

  absl::Status WriteSlots(const PageLayout& layout,
                          std::span<const PageId> pages, int64_t first,
                          int64_t n, const std::byte* keys,
                          const std::byte* values) override {
    if (n <= 0) return absl::OkStatus();
    const size_t token_bytes = static_cast<size_t>(n * layout.token_bytes());
    absl::MutexLock lock(&mu_);
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t keys_at = plan.Add(token_bytes);
    const size_t values_at = plan.Add(token_bytes);
    if (absl::Status s = Reserve(plan.total()); !s.ok()) return s;
    std::memcpy(pinned_staging_ + pages_at, pages.data(), pages.size_bytes());
    std::memcpy(pinned_staging_ + keys_at, keys, token_bytes);
    std::memcpy(pinned_staging_ + values_at, values, token_bytes);
    if (absl::Status s = Upload(0, plan.total()); !s.ok()) return s;
    return Finish(
        cuda::LaunchWriteSlots(arena_, layout, DevicePtr<PageId>(pages_at),
                               first, n, device_staging_ + keys_at,
                               device_staging_ + values_at, stream_),
        "writing slots", 0, 0);
  }

  absl::Status ReadSlots(const PageLayout& layout,
                         std::span<const PageId> pages, int64_t first,
                         int64_t n, std::byte* keys,
                         std::byte* values) override {
    if (n <= 0) return absl::OkStatus();
    const size_t token_bytes = static_cast<size_t>(n * layout.token_bytes());
    absl::MutexLock lock(&mu_);
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t keys_at = plan.Add(token_bytes);
    const size_t values_at = plan.Add(token_bytes);
    if (absl::Status s = Reserve(plan.total()); !s.ok()) return s;
    std::memcpy(pinned_staging_ + pages_at, pages.data(), pages.size_bytes());
    if (absl::Status s = Upload(0, keys_at); !s.ok()) return s;
    // keys and values are adjacent in staging: one download brings both.
    if (absl::Status s = Finish(
            cuda::LaunchReadSlots(arena_, layout, DevicePtr<PageId>(pages_at),
                                  first, n, device_staging_ + keys_at,
                                  device_staging_ + values_at, stream_),
            "reading slots", keys_at, plan.total() - keys_at);
        !s.ok()) {
      return s;
    }
    std::memcpy(keys, pinned_staging_ + keys_at, token_bytes);
    std::memcpy(values, pinned_staging_ + values_at, token_bytes);
    return absl::OkStatus();
  }

  absl::Status MoveSlots(const PageLayout& layout,
                         std::span<const PageId> pages,
                         std::span<const SlotMove> moves) override {
    if (moves.empty()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t moves_at = plan.Add(moves.size_bytes());
    if (absl::Status s = Reserve(plan.total()); !s.ok()) return s;
    std::memcpy(pinned_staging_ + pages_at, pages.data(), pages.size_bytes());
    std::memcpy(pinned_staging_ + moves_at, moves.data(), moves.size_bytes());
    if (absl::Status s = Upload(0, plan.total()); !s.ok()) return s;
    return Finish(
        cuda::LaunchMoveSlotBytes(arena_, layout, DevicePtr<PageId>(pages_at),
                                  DevicePtr<SlotMove>(moves_at),
                                  static_cast<int32_t>(moves.size()), stream_),
        "moving slots", 0, 0);
  }

  absl::Status ScoreQueries(const PageLayout& layout,
                            std::span<const PageId> pages,
                            std::span<const int64_t> order,
                            const float* queries, const int64_t* row_order,
                            int32_t rows, int32_t query_heads,
                            float* out) override {
    const int64_t slots = static_cast<int64_t>(order.size());
    if (rows <= 0 || slots == 0) return absl::OkStatus();
    // The kernel keeps every logit of its rows in the workspace: a prefill
    // chunk goes in groups of rows that keep it near kWorkspaceBytes.
    const int64_t row_bytes = int64_t{query_heads} * slots * sizeof(float);
    const int32_t group = static_cast<int32_t>(std::clamp<int64_t>(
        kWorkspaceBytes / std::max<int64_t>(row_bytes, 1), 1, rows));
    const size_t query_row_bytes =
        sizeof(float) * query_heads * static_cast<size_t>(layout.head_dim);
    absl::MutexLock lock(&mu_);
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t order_at = plan.Add(order.size_bytes());
    const size_t queries_at = plan.Add(query_row_bytes * group);
    const size_t row_order_at = plan.Add(sizeof(int64_t) * group);
    const size_t out_at = plan.Add(sizeof(float) * group * slots);
    const size_t workspace_at =
        plan.Add(cuda::QueryAttentionWorkspaceBytes(group, query_heads, slots));
    if (absl::Status s = Reserve(plan.total()); !s.ok()) return s;
    std::memcpy(pinned_staging_ + pages_at, pages.data(), pages.size_bytes());
    std::memcpy(pinned_staging_ + order_at, order.data(), order.size_bytes());
    for (int32_t first = 0; first < rows; first += group) {
      const int32_t n = std::min(group, rows - first);
      std::memcpy(pinned_staging_ + queries_at,
                  queries + static_cast<size_t>(first) * query_row_bytes /
                                sizeof(float),
                  query_row_bytes * n);
      std::memcpy(pinned_staging_ + row_order_at, row_order + first,
                  sizeof(int64_t) * n);
      // The block table and order go up once, with the first group.
      const size_t from = first == 0 ? 0 : queries_at;
      if (absl::Status s = Upload(from, out_at - from); !s.ok()) return s;
      const cuda::DevicePagedKeys keys{arena_, layout,
                                       DevicePtr<PageId>(pages_at),
                                       DevicePtr<int64_t>(order_at), slots};
      const size_t out_bytes = sizeof(float) * n * static_cast<size_t>(slots);
      if (absl::Status s = Finish(cuda::LaunchQueryAttention(
                                      keys, DevicePtr<float>(queries_at),
                                      DevicePtr<int64_t>(row_order_at), n,
                                      query_heads, DevicePtr<float>(out_at),
                                      device_staging_ + workspace_at, stream_),
                                  "scoring queries", out_at, out_bytes);
          !s.ok()) {
        return s;
      }
      std::memcpy(out + static_cast<size_t>(first) * slots,
                  pinned_staging_ + out_at, out_bytes);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<SharedPool> Share() const override {
    cudaIpcMemHandle_t handle;
    if (absl::Status s =
            CudaStatus(cudaSetDevice(ordinal_), "selecting the pool's device");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaIpcGetMemHandle(&handle, arena_),
                                    "taking the pool's IPC handle");
        !s.ok()) {
      return s;
    }
    return SharedPool{
        "", std::string(reinterpret_cast<const char*>(&handle), sizeof handle)};
  }

 private:
  CudaMemory(int32_t ordinal, int64_t bytes)
      : ordinal_(ordinal), bytes_(bytes) {}

  template <typename T>
  T* DevicePtr(size_t offset) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reinterpret_cast<T*>(device_staging_ + offset);
  }

  // Grows both staging buffers to at least `bytes` (doubling, so a
  // session's steady state allocates nothing).
  absl::Status Reserve(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal_), "selecting");
        !s.ok()) {
      return s;
    }
    if (bytes <= staging_bytes_) return absl::OkStatus();
    const size_t want = std::max(bytes, 2 * staging_bytes_);
    const cudaError_t freed_device = cudaFree(device_staging_);
    const cudaError_t freed_pinned = cudaFreeHost(pinned_staging_);
    device_staging_ = nullptr;
    pinned_staging_ = nullptr;
    staging_bytes_ = 0;
    if (absl::Status s = CudaStatus(freed_device, "freeing staging"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(freed_pinned, "freeing pinned staging");
        !s.ok()) {
      return s;
    }
    void* device = nullptr;
    void* pinned = nullptr;
    if (absl::Status s =
            CudaStatus(cudaMalloc(&device, want),
                       absl::StrCat("reserving ", want, " bytes of staging"));
        !s.ok()) {
      return s;
    }
    device_staging_ = static_cast<std::byte*>(device);
    if (absl::Status s = CudaStatus(
            cudaMallocHost(&pinned, want),
            absl::StrCat("reserving ", want, " bytes of pinned staging"));
        !s.ok()) {
      return s;
    }
    pinned_staging_ = static_cast<std::byte*>(pinned);
    staging_bytes_ = want;
    return absl::OkStatus();
  }

  // Copies staging [from, from + bytes) to the device.
  absl::Status Upload(size_t from, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (bytes == 0) return absl::OkStatus();
    return CudaStatus(
        cudaMemcpyAsync(device_staging_ + from, pinned_staging_ + from, bytes,
                        cudaMemcpyHostToDevice, stream_),
        "uploading to staging");
  }

  // Checks the launch, downloads staging [from, from + bytes) and waits for
  // the stream.
  absl::Status Finish(cudaError_t launch, absl::string_view what, size_t from,
                      size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string where = absl::StrCat(what, " on cuda:", ordinal_);
    if (absl::Status s = CudaStatus(launch, where); !s.ok()) return s;
    if (bytes > 0) {
      if (absl::Status s = CudaStatus(
              cudaMemcpyAsync(pinned_staging_ + from, device_staging_ + from,
                              bytes, cudaMemcpyDeviceToHost, stream_),
              where);
          !s.ok()) {
        return s;
      }
    }
    return CudaStatus(cudaStreamSynchronize(stream_), where);
  }

  const int32_t ordinal_;
  const int64_t bytes_;
  std::byte* arena_ = nullptr;
  cudaStream_t stream_ = nullptr;

  absl::Mutex mu_;
  std::byte* device_staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::byte* pinned_staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  // Any error (no driver, no device) means: nothing usable.
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

absl::StatusOr<std::unique_ptr<PageMemory>> NewCudaMemory(int32_t ordinal,
                                                          int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page memory of ", bytes, " bytes"));
  }
  if (ordinal < 0 || ordinal >= CudaDeviceCount()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda:", ordinal, ": this machine has ",
                     CudaDeviceCount(), " usable CUDA device(s)"));
  }
  return CudaMemory::Create(ordinal, bytes);
}

}  // namespace kvkeep
