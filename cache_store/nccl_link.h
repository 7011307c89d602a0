// NcclLink: a two-rank NCCL communicator between a GPU of this store and a
// GPU of a peer store, with a stream and device staging of its own, that
// moves a session's slots from one pool to the other (the NCCL transport of
// session transfer, docs/transfer.md). Rank 0 sends, rank 1 receives; both
// move the same slot ranges in the same order.
//
// NCCL is loaded at run time (dlopen of libnccl.so.2), so kvkeepd runs where
// it is not installed; Available() says whether it is. Every NCCL and CUDA
// result becomes a status once (NcclStatus below, CudaStatus); an
// asynchronous NCCL error, or a deadline passing, aborts the communicator:
// the link is then broken() and the transfer fails cleanly.
//
// Built with the CUDA backend only. Not thread-safe: one transfer uses a
// link at a time (the transport's cache hands it out exclusively).
#ifndef KVKEEP_CACHE_STORE_NCCL_LINK_H_
#define KVKEEP_CACHE_STORE_NCCL_LINK_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_store/page_memory.h"

namespace kvkeep {

class NcclLink {
 public:
  // True when libnccl.so.2 loads and has every function the link needs.
  static bool Available();
  // A fresh ncclUniqueId (its bytes), to hand to the peer over gRPC.
  static absl::StatusOr<std::string> NewUniqueId();
  // Joins the communicator named by `unique_id` as `rank` (0 or 1) on CUDA
  // device `ordinal`. Blocks until the peer joins too; DEADLINE_EXCEEDED
  // (and nothing held) if it has not by `deadline`.
  static absl::StatusOr<std::unique_ptr<NcclLink>> Connect(
      const std::string& unique_id, int rank, int32_t ordinal,
      absl::Time deadline);
  ~NcclLink();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  // Rank 0: sends slots [first, first + n) of a layer whose pages are in
  // `memory` (a CUDA memory on this link's device): gathered into staging,
  // keys then values, one ncclSend. Rank 1: the matching Recv writes them
  // into its own pages. Both wait until their side is done.
  absl::Status Send(PageMemory& memory, const PageLayout& layout,
                    std::span<const PageId> pages, int64_t first, int64_t n,
                    absl::Time deadline);
  absl::Status Recv(PageMemory& memory, const PageLayout& layout,
                    std::span<const PageId> pages, int64_t first, int64_t n,
                    absl::Time deadline);

  // True once an error aborted the communicator: the link cannot be used
  // again.
  bool broken() const { return broken_; }
  int rank() const { return rank_; }
  int32_t ordinal() const { return ordinal_; }

 private:
  struct State;
  NcclLink(int rank, int32_t ordinal, std::unique_ptr<State> state);
  absl::Status Move(bool send, PageMemory& memory, const PageLayout& layout,
                    std::span<const PageId> pages, int64_t first, int64_t n,
                    absl::Time deadline);
  // Settles an NCCL call's result on a non-blocking communicator (polling
  // ncclInProgress away); marks the link broken on an error.
  absl::Status Enqueued(int result, absl::string_view what,
                        absl::Time deadline);
  // Waits for the stream, watching the communicator's asynchronous error
  // and the deadline; aborts the communicator on either.
  absl::Status Wait(absl::string_view what, absl::Time deadline);
  absl::Status Reserve(size_t bytes);

  const int rank_;
  const int32_t ordinal_;
  std::unique_ptr<State> state_;
  bool broken_ = false;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_NCCL_LINK_H_
