// kNccl: slot runs pool to pool over an NCCL link (page_transport.h,
// nccl_transport.h).
#include <utility>

#include "services/transfer/page_transport.h"

namespace kvkeep {
namespace {

class NcclSender final : public PageSender {
 public:
  NcclSender(std::unique_ptr<NcclChannel> channel, NcclMove move,
             int64_t chunk_slots)
      : channel_(std::move(channel)),
        move_(std::move(move)),
        chunk_slots_(chunk_slots) {}
  ~NcclSender() override {
    if (!done_) channel_->Done(false);
  }

  Transport transport() const override { return Transport::kNccl; }
  int64_t chunk_slots() const override { return chunk_slots_; }
  bool needs_bytes() const override { return false; }

  absl::Status Send(const Chunk& chunk) override {
    return move_(*channel_, chunk.layer, chunk.first_slot, chunk.slots);
  }
  absl::Status Finish() override { return absl::OkStatus(); }
  void Done(bool committed) override {
    if (done_) return;
    done_ = true;
    channel_->Done(committed);
  }

 private:
  const std::unique_ptr<NcclChannel> channel_;
  const NcclMove move_;
  const int64_t chunk_slots_;
  bool done_ = false;
};

}  // namespace

std::unique_ptr<PageSender> NewNcclSender(std::unique_ptr<NcclChannel> channel,
                                          NcclMove move, int64_t chunk_slots) {
  return std::make_unique<NcclSender>(std::move(channel), std::move(move),
                                      chunk_slots);
}

}  // namespace kvkeep
