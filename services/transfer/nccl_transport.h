// NcclTransport: the NCCL side of session transfer for one kvkeepd. It
// decides whether a transfer can move its pages pool to pool (both pools on
// GPUs, NCCL loadable), makes and answers offers (v1::NcclOffer), and keeps
// the two-rank communicators (cache_store/nccl_link.h) for reuse by later
// transfers between the same two stores: by target address on the sending
// side, by link id on the receiving side. A link is handed out to one
// transfer at a time; one that failed is dropped (and aborted), never
// reused. Without the CUDA backend or NCCL every answer is "not here".
//
// Thread-safe.
#ifndef KVKEEP_SERVICES_TRANSFER_NCCL_TRANSPORT_H_
#define KVKEEP_SERVICES_TRANSFER_NCCL_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/page_memory.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/transfer/aside_threads.h"

namespace kvkeep {

class NcclLink;

// One side of one transfer's link: moves slot runs; Done() gives the link
// back (kept for reuse when the transfer committed). Not thread-safe.
class NcclChannel {
 public:
  virtual ~NcclChannel() = default;
  // Rank 0 sends / rank 1 receives slots [first, first + n) of a layer.
  virtual absl::Status Move(PageMemory& memory, const PageLayout& layout,
                            std::span<const PageId> pages, int64_t first,
                            int64_t n) = 0;
  // The transfer ended; `committed` keeps the link for the next one.
  virtual void Done(bool committed) = 0;
};

class NcclTransport {
 public:
  NcclTransport();
  ~NcclTransport();
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // Why a pool in `memory` cannot move over NCCL (OK if it can).
  static absl::Status Usable(const PageMemory& memory);

  // Sender: the offer for a transfer to `target` of a session in `memory`,
  // reusing an idle link to that target when there is one (taken out of the
  // cache until Connect's channel is Done). Its runs of slots start on
  // whole pages for kivi_int4 (`layout`'s keys move as page blocks).
  // FAILED_PRECONDITION when NCCL cannot be used here.
  absl::StatusOr<v1::NcclOffer> Offer(const std::string& target,
                                      const PageMemory& memory,
                                      const PageLayout& layout, bool required);
  // Sender, once the target took `offer`: the channel (joining a new
  // communicator as rank 0, which waits for the target to join).
  absl::StatusOr<std::unique_ptr<NcclChannel>> Connect(
      const std::string& target, const v1::NcclOffer& offer, int32_t ordinal,
      absl::Time deadline);
  // Sender: the target did not take `offer` (or the transfer failed before
  // Connect): a reused link it named is dropped.
  void Withdraw(const v1::NcclOffer& offer);

  // Target: OK if it takes `offer` for a pool in `memory` (a link it reuses
  // is then reserved for this transfer); why not otherwise.
  absl::Status Accept(const v1::NcclOffer& offer, const PageMemory& memory);
  // Target, after Accept: the channel (joining a new communicator as rank
  // 1, which waits for the sender).
  absl::StatusOr<std::unique_ptr<NcclChannel>> Join(const v1::NcclOffer& offer,
                                                    int32_t ordinal,
                                                    absl::Time deadline);

  // Runs `fn` on a thread of its own (cleaning up after an abandoned
  // receive, which may wait for the link); the destructor waits for every
  // one, so they never outlive the service and its store.
  void RunAside(std::function<void()> fn);

 private:
  class Channel;
  // The link of a taken offer: the reserved one it names, or a new
  // communicator joined as `rank`. `target` is empty on the receiving side.
  absl::StatusOr<std::unique_ptr<NcclChannel>> Open(const std::string& target,
                                                    const v1::NcclOffer& offer,
                                                    int rank, int32_t ordinal,
                                                    absl::Time deadline);
  void Keep(const std::string& link_id, const std::string& target,
            std::unique_ptr<NcclLink> link);

  absl::Mutex mu_;
  // Idle links by link id, and the sender's link id per target.
  absl::flat_hash_map<std::string, std::unique_ptr<NcclLink>> idle_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> link_of_target_
      ABSL_GUARDED_BY(mu_);
  // Links reserved by an offer or an acceptance, until connected.
  absl::flat_hash_map<std::string, std::unique_ptr<NcclLink>> reserved_
      ABSL_GUARDED_BY(mu_);
  // Last: its threads may still give links back as it waits for them.
  AsideThreads aside_;
};

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_NCCL_TRANSPORT_H_
