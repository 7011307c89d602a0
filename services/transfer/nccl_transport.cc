#include "services/transfer/nccl_transport.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if defined(KVKEEP_HAVE_NCCL)
#include "cache_store/nccl_link.h"
#else
namespace kvkeep {
class NcclLink {};  // never made: nothing here can use NCCL
}  // namespace kvkeep
#endif

namespace kvkeep {

#if defined(KVKEEP_HAVE_NCCL)

namespace {

// Slots per NCCL send: whole runs of about this many bytes (keys + values).
constexpr int64_t kChunkBytes = int64_t{64} << 20;

}  // namespace

class NcclTransport::Channel final : public NcclChannel {
 public:
  Channel(NcclTransport* transport, std::string link_id, std::string target,
          std::unique_ptr<NcclLink> link, absl::Time deadline)
      : transport_(transport),
        link_id_(std::move(link_id)),
        target_(std::move(target)),
        link_(std::move(link)),
        deadline_(deadline) {}
  ~Channel() override {
    if (link_ != nullptr) Done(false);
  }

  absl::Status Move(PageMemory& memory, const PageLayout& layout,
                    std::span<const PageId> pages, int64_t first,
                    int64_t n) override {
    return link_->rank() == 0
               ? link_->Send(memory, layout, pages, first, n, deadline_)
               : link_->Recv(memory, layout, pages, first, n, deadline_);
  }

  void Done(bool committed) override {
    // A failed transfer leaves the peer's side in an unknown state: drop
    // the link (its destructor destroys or aborts the communicator).
    if (committed && !link_->broken()) {
      transport_->Keep(link_id_, target_, std::move(link_));
    }
    link_.reset();
  }

 private:
  NcclTransport* const transport_;
  const std::string link_id_;
  const std::string target_;  // empty on the receiving side
  std::unique_ptr<NcclLink> link_;
  const absl::Time deadline_;
};

absl::Status NcclTransport::Usable(const PageMemory& memory) {
  if (!memory.device().is_cuda()) {
    return absl::FailedPreconditionError(
        "this store's pool is in host memory (NCCL moves GPU pools)");
  }
  if (!NcclLink::Available()) {
    return absl::FailedPreconditionError(
        "NCCL (libnccl.so.2) cannot be loaded here");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::NcclOffer> NcclTransport::Offer(const std::string& target,
                                                   const PageMemory& memory,
                                                   const PageLayout& layout,
                                                   bool required) {
  if (absl::Status s = Usable(memory); !s.ok()) return s;
  v1::NcclOffer offer;
  // kivi_int4: runs of whole pages, a page's key block and value records.
  const int64_t run = IsKivi(layout.dtype) ? layout.page_tokens : 1;
  const int64_t run_bytes =
      IsKivi(layout.dtype)
          ? layout.key_run_bytes(0, run) + run * layout.token_bytes()
          : 2 * layout.token_bytes();
  offer.set_chunk_slots(
      run *
      std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, run_bytes)));
  offer.set_required(required);
  {
    absl::MutexLock lock(&mu_);
    auto known = link_of_target_.find(target);
    if (known != link_of_target_.end()) {
      auto idle = idle_.find(known->second);
      if (idle != idle_.end() &&
          idle->second->ordinal() == memory.device().ordinal) {
        offer.set_link_id(known->second);
        reserved_[known->second] = std::move(idle->second);
        idle_.erase(idle);
        return offer;
      }
    }
  }
  absl::StatusOr<std::string> unique_id = NcclLink::NewUniqueId();
  if (!unique_id.ok()) return unique_id.status();
  absl::BitGen rng;
  offer.set_link_id(absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(rng),
                                    absl::Uniform<uint64_t>(rng)));
  offer.set_unique_id(*std::move(unique_id));
  return offer;
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclTransport::Open(
    const std::string& target, const v1::NcclOffer& offer, int rank,
    int32_t ordinal, absl::Time deadline) {
  std::unique_ptr<NcclLink> link;
  if (offer.unique_id().empty()) {  // reserved by Offer or Accept
    absl::MutexLock lock(&mu_);
    auto it = reserved_.find(offer.link_id());
    if (it == reserved_.end()) {
      return absl::InternalError(
          absl::StrCat("NCCL link ", offer.link_id(), " is gone"));
    }
    link = std::move(it->second);
    reserved_.erase(it);
  } else {
    absl::StatusOr<std::unique_ptr<NcclLink>> joined =
        NcclLink::Connect(offer.unique_id(), rank, ordinal, deadline);
    if (!joined.ok()) return joined.status();
    link = *std::move(joined);
  }
  return std::unique_ptr<NcclChannel>(
      new Channel(this, offer.link_id(), target, std::move(link), deadline));
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclTransport::Connect(
    const std::string& target, const v1::NcclOffer& offer, int32_t ordinal,
    absl::Time deadline) {
  return Open(target, offer, /*rank=*/0, ordinal, deadline);
}

void NcclTransport::Withdraw(const v1::NcclOffer& offer) {
  absl::MutexLock lock(&mu_);
  reserved_.erase(offer.link_id());
}

absl::Status NcclTransport::Accept(const v1::NcclOffer& offer,
                                   const PageMemory& memory) {
  if (absl::Status s = Usable(memory); !s.ok()) return s;
  if (offer.link_id().empty() || offer.chunk_slots() <= 0) {
    return absl::InvalidArgumentError(
        "an NCCL offer needs a link_id and chunk_slots");
  }
  if (!offer.unique_id().empty()) return absl::OkStatus();  // a new link
  absl::MutexLock lock(&mu_);
  auto it = idle_.find(offer.link_id());
  if (it == idle_.end() || it->second->ordinal() != memory.device().ordinal) {
    return absl::FailedPreconditionError(
        absl::StrCat("this store no longer holds NCCL link ", offer.link_id()));
  }
  reserved_[offer.link_id()] = std::move(it->second);
  idle_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclTransport::Join(
    const v1::NcclOffer& offer, int32_t ordinal, absl::Time deadline) {
  return Open(/*target=*/"", offer, /*rank=*/1, ordinal, deadline);
}

void NcclTransport::Keep(const std::string& link_id, const std::string& target,
                         std::unique_ptr<NcclLink> link) {
  absl::MutexLock lock(&mu_);
  if (!target.empty()) link_of_target_[target] = link_id;
  idle_[link_id] = std::move(link);
}

#else  // !KVKEEP_HAVE_NCCL

absl::Status NcclTransport::Usable(const PageMemory&) {
  return absl::FailedPreconditionError(
      "this kvkeepd was built without the CUDA backend and NCCL");
}

absl::StatusOr<v1::NcclOffer> NcclTransport::Offer(const std::string&,
                                                   const PageMemory& memory,
                                                   const PageLayout&, bool) {
  return Usable(memory);
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclTransport::Connect(
    const std::string&, const v1::NcclOffer&, int32_t, absl::Time) {
  return absl::FailedPreconditionError("no NCCL in this build");
}

void NcclTransport::Withdraw(const v1::NcclOffer&) {}

absl::Status NcclTransport::Accept(const v1::NcclOffer&,
                                   const PageMemory& memory) {
  return Usable(memory);
}

absl::StatusOr<std::unique_ptr<NcclChannel>> NcclTransport::Join(
    const v1::NcclOffer&, int32_t, absl::Time) {
  return absl::FailedPreconditionError("no NCCL in this build");
}

void NcclTransport::Keep(const std::string&, const std::string&,
                         std::unique_ptr<NcclLink>) {}

#endif  // KVKEEP_HAVE_NCCL

NcclTransport::NcclTransport() = default;

NcclTransport::~NcclTransport() = default;

void NcclTransport::RunAside(std::function<void()> fn) {
  aside_.Run(std::move(fn));
}

}  // namespace kvkeep
