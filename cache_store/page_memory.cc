// The host PageMemory (private or POSIX shared memory), device names, and the
// stand-ins for the CUDA memory when this build has no CUDA backend.
#include "cache_store/page_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/slot_copy.h"

namespace kvkeep {
namespace {

class HostMemory final : public PageMemory {
 public:
  // `mapping` is null for private memory (owned by `owned`), else an mmap of
  // the shared-memory object `shm_name`, unmapped and unlinked on destruction.
  HostMemory(int64_t bytes, std::unique_ptr<std::byte[]> owned,
             std::byte* mapping, std::string shm_name)
      : bytes_(bytes),
        owned_(std::move(owned)),
        mapping_(mapping),
        shm_name_(std::move(shm_name)) {}
  ~HostMemory() override {
    if (mapping_ != nullptr) {
      munmap(mapping_, static_cast<size_t>(bytes_));
      shm_unlink(shm_name_.c_str());
    }
  }

  Device device() const override { return Device{}; }
  int64_t bytes() const override { return bytes_; }
  std::byte* host_data() override { return arena(); }

  absl::Status WriteSlots(const PageLayout& layout,
                          std::span<const PageId> pages, int64_t first,
                          int64_t n, const std::byte* keys,
                          const std::byte* values) override {
    WriteSlotBytes(arena(), layout, pages.data(), first, n, keys, values);
    return absl::OkStatus();
  }
  absl::Status ReadSlots(const PageLayout& layout,
                         std::span<const PageId> pages, int64_t first,
                         int64_t n, std::byte* keys,
                         std::byte* values) override {
    ReadSlotBytes(arena(), layout, pages.data(), first, n, keys, values);
    return absl::OkStatus();
  }
  absl::Status ReadKeyBlocks(const PageLayout& layout,
                             std::span<const PageId> pages,
                             std::byte* blocks) override {
    ReadKeyBlockBytes(arena(), layout, pages.data(),
                      static_cast<int64_t>(pages.size()), blocks);
    return absl::OkStatus();
  }
  absl::StatusOr<SharedPool> Share() const override {
    if (mapping_ == nullptr) {
      return absl::FailedPreconditionError(
          "this pool is in private host memory: start kvkeepd with pool "
          "sharing on (share_pools) to map it from another process");
    }
    return SharedPool{shm_name_, ""};
  }

 protected:
  absl::Status DoRunStep(const StepBatch& batch) override {
    RunStepOnHost(arena(), batch);
    return absl::OkStatus();
  }

 private:
  std::byte* arena() { return mapping_ != nullptr ? mapping_ : owned_.get(); }

  const int64_t bytes_;
  const std::unique_ptr<std::byte[]> owned_;
  std::byte* const mapping_;
  const std::string shm_name_;
};

absl::StatusOr<std::unique_ptr<PageMemory>> NewSharedHostMemory(int64_t bytes) {
  static std::atomic<int> next{0};
  // The pid names the owner for people; the random tag keeps a new process
  // clear of a segment left by an earlier one with the same pid (a kvkeepd
  // killed with SIGKILL cannot unlink its own), which used to stop it
  // starting with EEXIST.
  static const uint32_t tag = absl::Uniform<uint32_t>(absl::BitGen());
  const std::string name =
      absl::StrCat("/kvkeep-", getpid(), "-", absl::Hex(tag, absl::kZeroPad8),
                   "-", next.fetch_add(1));
  // Owner-only: another user's process cannot open the pool.
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm_open(", name, ") for a shared host pool: ", std::strerror(errno)));
  }
  if (ftruncate(fd, bytes) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size the shared host pool ", name, " to ", bytes,
                     " bytes: ", std::strerror(err)));
  }
  void* mapping = mmap(nullptr, static_cast<size_t>(bytes),
                       PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (mapping == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map the shared host pool ", name, ": ", std::strerror(err)));
  }
  return std::unique_ptr<PageMemory>(
      new HostMemory(bytes, nullptr, static_cast<std::byte*>(mapping), name));
}

}  // namespace

std::string Device::name() const {
  return is_cuda() ? absl::StrCat("cuda:", ordinal) : "host";
}

absl::StatusOr<Device> ResolveDevice(absl::string_view spec) {
  if (spec == "host") return Device{};
  if (spec == "auto") {
    return CudaDeviceCount() > 0 ? Device{Device::Kind::kCuda, 0} : Device{};
  }
  int32_t ordinal = 0;
  if (spec != "cuda" && !(absl::ConsumePrefix(&spec, "cuda:") &&
                          absl::SimpleAtoi(spec, &ordinal) && ordinal >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device '", std::string(spec),
                     "' is not one of host, auto, cuda, cuda:N"));
  }
#if !defined(KVKEEP_HAVE_CUDA)
  return absl::FailedPreconditionError(absl::StrCat(
      "device cuda:", ordinal,
      ": this kvkeepd was built without the CUDA backend (no nvcc at build "
      "time); use --device=host"));
#else
  const int count = CudaDeviceCount();
  if (ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device cuda:", ordinal, ": this machine has ", count,
        " usable CUDA device(s)",
        count == 0 ? " (no GPU, or no driver); use --device=host or auto"
                   : ""));
  }
  return Device{Device::Kind::kCuda, ordinal};
#endif
}

absl::StatusOr<std::unique_ptr<PageMemory>> NewHostMemory(int64_t bytes,
                                                          bool shareable) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page memory of ", bytes, " bytes"));
  }
  if (shareable) return NewSharedHostMemory(bytes);
  // Default-initialised: the kernel backs the memory lazily as pages are
  // first written, so a large, mostly idle pool costs little.
  std::unique_ptr<std::byte[]> arena(new (std::nothrow) std::byte[bytes]);
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve ", bytes, " bytes of host memory"));
  }
  return std::unique_ptr<PageMemory>(
      new HostMemory(bytes, std::move(arena), nullptr, ""));
}

absl::StatusOr<std::unique_ptr<PageMemory>> NewPageMemory(const Device& device,
                                                          int64_t bytes,
                                                          bool shareable) {
  if (device.is_cuda()) return NewCudaMemory(device.ordinal, bytes);
  return NewHostMemory(bytes, shareable);
}

#if !defined(KVKEEP_HAVE_CUDA)
int CudaDeviceCount() { return 0; }

absl::StatusOr<std::unique_ptr<PageMemory>> NewCudaMemory(int32_t ordinal,
                                                          int64_t) {
  return absl::FailedPreconditionError(
      absl::StrCat("device cuda:", ordinal,
                   ": this kvkeepd was built without the CUDA backend"));
}
#endif

}  // namespace kvkeep
