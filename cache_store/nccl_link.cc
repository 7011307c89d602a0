#include "cache_store/nccl_link.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cache_store/cuda_status.h"
#include "kernels/cuda/slot_copy.h"

namespace kvkeep {
namespace {

// The NCCL functions the link uses, from libnccl.so.2 loaded at run time.
struct NcclApi {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string load_error;  // empty when every function was found

  static const NcclApi& Get() {
    static const NcclApi* api = Load();
    return *api;
  }

 private:
  static NcclApi* Load() {
    auto* api = new NcclApi;
    // KVKEEP_NCCL_LIBRARY names another copy (e.g. the one a Python wheel
    // ships); else the loader's search path.
    const char* path = std::getenv("KVKEEP_NCCL_LIBRARY");
    if (path == nullptr || *path == '\0') path = "libnccl.so.2";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      api->load_error = why != nullptr ? why : "dlopen of NCCL failed";
      return api;
    }
    auto find = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
          dlsym(lib, name));
      if (fn == nullptr && api->load_error.empty()) {
        api->load_error = absl::StrCat("libnccl.so.2 has no ", name);
      }
    };
    find(api->get_unique_id, "ncclGetUniqueId");
    find(api->init_rank_config, "ncclCommInitRankConfig");
    find(api->get_async_error, "ncclCommGetAsyncError");
    find(api->abort, "ncclCommAbort");
    find(api->send, "ncclSend");
    find(api->recv, "ncclRecv");
    find(api->error_string, "ncclGetErrorString");
    return api;
  }
};

// The one conversion of an ncclResult_t into a status.
absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(std::string(what), ": NCCL error ", static_cast<int>(result),
                   " (", NcclApi::Get().error_string(result), ")");
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclSystemError:
    case ncclRemoteError:
      return absl::UnavailableError(message);  // the peer or the link
    default:
      return absl::InternalError(message);
  }
}

absl::Status Unavailable() {
  return absl::FailedPreconditionError(absl::StrCat(
      "NCCL is not available here: ", NcclApi::Get().load_error.empty()
                                          ? "no CUDA device"
                                          : NcclApi::Get().load_error));
}

}  // namespace

struct NcclLink::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::byte* device_staging = nullptr;  // keys then values, then pages
  std::byte* pinned_staging = nullptr;  // the pages on their way up
  size_t staging_bytes = 0;
};

bool NcclLink::Available() {
  return NcclApi::Get().load_error.empty() && CudaDeviceCount() > 0;
}

absl::StatusOr<std::string> NcclLink::NewUniqueId() {
  if (!Available()) return Unavailable();
  ncclUniqueId id;
  if (absl::Status s =
          NcclStatus(NcclApi::Get().get_unique_id(&id), "ncclGetUniqueId");
      !s.ok()) {
    return s;
  }
  return std::string(id.internal, sizeof id.internal);
}

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Connect(
    const std::string& unique_id, int rank, int32_t ordinal,
    absl::Time deadline) {
  if (!Available()) return Unavailable();
  ncclUniqueId id;
  if (unique_id.size() != sizeof id.internal || (rank != 0 && rank != 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has ", sizeof id.internal,
                     " bytes and a link ranks 0 and 1; got ", unique_id.size(),
                     " bytes and rank ", rank));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
  if (absl::Status s = CudaStatus(cudaSetDevice(ordinal), "selecting a GPU");
      !s.ok()) {
    return s;
  }
  auto state = std::make_unique<State>();
  if (absl::Status s = CudaStatus(
          cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking),
          "creating the link's stream");
      !s.ok()) {
    return s;
  }
  // Non-blocking, so a peer that never joins costs a deadline, not a hang.
  std::unique_ptr<NcclLink> link(new NcclLink(rank, ordinal, std::move(state)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const NcclApi& nccl = NcclApi::Get();
  ncclResult_t r =
      nccl.init_rank_config(&link->state_->comm, 2, id, rank, &config);
  while (r == ncclInProgress) {
    if (absl::Now() > deadline) {
      link->broken_ = true;  // the destructor aborts
      return absl::DeadlineExceededError(
          absl::StrCat("the peer did not join the NCCL communicator (rank ",
                       1 - rank, ") in time"));
    }
    absl::SleepFor(absl::Microseconds(200));
    if (absl::Status s = NcclStatus(
            nccl.get_async_error(link->state_->comm, &r), "joining NCCL");
        !s.ok()) {
      link->broken_ = true;
      return s;
    }
  }
  if (r != ncclSuccess) link->broken_ = true;
  if (absl::Status s = NcclStatus(r, "joining NCCL"); !s.ok()) return s;
  return link;
}

NcclLink::NcclLink(int rank, int32_t ordinal, std::unique_ptr<State> state)
    : rank_(rank), ordinal_(ordinal), state_(std::move(state)) {}

NcclLink::~NcclLink() {
  // Nothing can be reported from here; every call before reported its own.
  // Abort, not destroy, even for a healthy link: it needs nothing from the
  // peer, which may be gone.
  cudaSetDevice(ordinal_);
  if (state_->comm != nullptr) NcclApi::Get().abort(state_->comm);
  if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
  cudaFree(state_->device_staging);
  cudaFreeHost(state_->pinned_staging);
}

absl::Status NcclLink::Send(PageMemory& memory, const PageLayout& layout,
                            std::span<const PageId> pages, int64_t first,
                            int64_t n, absl::Time deadline) {
  return Move(/*send=*/true, memory, layout, pages, first, n, deadline);
}

absl::Status NcclLink::Recv(PageMemory& memory, const PageLayout& layout,
                            std::span<const PageId> pages, int64_t first,
                            int64_t n, absl::Time deadline) {
  return Move(/*send=*/false, memory, layout, pages, first, n, deadline);
}

absl::Status NcclLink::Move(bool send, PageMemory& memory,
                            const PageLayout& layout,
                            std::span<const PageId> pages, int64_t first,
                            int64_t n, absl::Time deadline) {
  if (broken_) {
    return absl::FailedPreconditionError("this NCCL link was aborted");
  }
  if (send != (rank_ == 0)) {
    return absl::InvalidArgumentError("rank 0 sends and rank 1 receives");
  }
  std::byte* arena = memory.device_arena();
  if (arena == nullptr || memory.device().ordinal != ordinal_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the NCCL link is on cuda:", ordinal_, "; the pool is on ",
                     memory.device().name()));
  }
  if (n <= 0) return absl::OkStatus();
  // kivi_int4's keys travel as the whole key blocks of the pages touched.
  const size_t key_bytes = static_cast<size_t>(layout.key_run_bytes(first, n));
  const size_t kv_bytes =
      key_bytes + static_cast<size_t>(n * layout.token_bytes());
  const size_t pages_at = kv_bytes;
  if (absl::Status s = Reserve(pages_at + pages.size_bytes()); !s.ok()) {
    return s;
  }
  State& st = *state_;
  std::memcpy(st.pinned_staging, pages.data(), pages.size_bytes());
  auto* device_pages = reinterpret_cast<PageId*>(st.device_staging + pages_at);
  if (absl::Status s = CudaStatus(
          cudaMemcpyAsync(device_pages, st.pinned_staging, pages.size_bytes(),
                          cudaMemcpyHostToDevice, st.stream),
          "uploading a block table");
      !s.ok()) {
    return s;
  }
  std::byte* keys = st.device_staging;
  std::byte* values = st.device_staging + key_bytes;
  const NcclApi& nccl = NcclApi::Get();
  if (send) {
    if (absl::Status s =
            CudaStatus(cuda::LaunchReadSlots(arena, layout, device_pages, first,
                                             n, keys, values, st.stream),
                       "gathering slots to send");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Enqueued(
            nccl.send(keys, kv_bytes, ncclUint8, 1, st.comm, st.stream),
            "ncclSend", deadline);
        !s.ok()) {
      return s;
    }
  } else {
    // The scatter must follow the receive on the stream: wait until NCCL
    // has enqueued it.
    if (absl::Status s = Enqueued(
            nccl.recv(keys, kv_bytes, ncclUint8, 0, st.comm, st.stream),
            "ncclRecv", deadline);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(
            cuda::LaunchWriteSlots(arena, layout, device_pages, first, n, keys,
                                   values, st.stream),
            "scattering received slots");
        !s.ok()) {
      return s;
    }
  }
  return Wait(send ? "sending slots" : "receiving slots", deadline);
}

absl::Status NcclLink::Enqueued(int result_code, absl::string_view what,
                                absl::Time deadline) {
  // A non-blocking communicator may answer ncclInProgress: the operation is
  // on the stream only once its asynchronous error says ncclSuccess.
  ncclResult_t result = static_cast<ncclResult_t>(result_code);
  while (result == ncclInProgress) {
    if (absl::Now() > deadline) {
      broken_ = true;
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the deadline passed; the NCCL link is aborted"));
    }
    absl::SleepFor(absl::Microseconds(50));
    if (absl::Status s = NcclStatus(
            NcclApi::Get().get_async_error(state_->comm, &result), what);
        !s.ok()) {
      broken_ = true;
      return s;
    }
  }
  if (result != ncclSuccess) broken_ = true;
  return NcclStatus(result, what);
}

absl::Status NcclLink::Wait(absl::string_view what, absl::Time deadline) {
  State& st = *state_;
  const NcclApi& nccl = NcclApi::Get();
  while (true) {
    const cudaError_t done = cudaStreamQuery(st.stream);
    if (done != cudaSuccess && done != cudaErrorNotReady) {
      broken_ = true;
      return CudaStatus(done, what);
    }
    ncclResult_t async = ncclSuccess;
    if (absl::Status s =
            NcclStatus(nccl.get_async_error(st.comm, &async), what);
        !s.ok()) {
      broken_ = true;
      return s;
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      broken_ = true;  // the destructor aborts the communicator
      return NcclStatus(async, what);
    }
    if (done == cudaSuccess) return absl::OkStatus();
    if (absl::Now() > deadline) {
      broken_ = true;
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the deadline passed; the NCCL link is aborted"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

absl::Status NcclLink::Reserve(size_t bytes) {
  State& st = *state_;
  if (absl::Status s = CudaStatus(cudaSetDevice(ordinal_), "selecting a GPU");
      !s.ok()) {
    return s;
  }
  if (bytes <= st.staging_bytes) return absl::OkStatus();
  const size_t want = std::max(bytes, 2 * st.staging_bytes);
  const cudaError_t freed_device = cudaFree(st.device_staging);
  const cudaError_t freed_pinned = cudaFreeHost(st.pinned_staging);
  st.device_staging = nullptr;
  st.pinned_staging = nullptr;
  st.staging_bytes = 0;
  if (absl::Status s = CudaStatus(freed_device, "freeing link staging");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(freed_pinned, "freeing link staging");
      !s.ok()) {
    return s;
  }
  void* device = nullptr;
  void* pinned = nullptr;
  if (absl::Status s =
          CudaStatus(cudaMalloc(&device, want), "reserving link staging");
      !s.ok()) {
    return s;
  }
  st.device_staging = static_cast<std::byte*>(device);
  if (absl::Status s = CudaStatus(cudaMallocHost(&pinned, want),
                                  "reserving pinned link staging");
      !s.ok()) {
    return s;
  }
  st.pinned_staging = static_cast<std::byte*>(pinned);
  st.staging_bytes = want;
  return absl::OkStatus();
}

}  // namespace kvkeep
