// kTcp: chunks over the target's data socket (page_transport.h,
// tcp_transport.h).
#include <optional>
#include <utility>

#include "services/transfer/page_transport.h"

namespace kvkeep {
namespace {

class TcpSender final : public PageSender {
 public:
  TcpSender(DataSocket socket, absl::Time deadline, int64_t chunk_slots)
      : socket_(std::move(socket)),
        stream_(&socket_, deadline),
        chunk_slots_(chunk_slots) {}

  Transport transport() const override { return Transport::kTcp; }
  int64_t chunk_slots() const override { return chunk_slots_; }
  bool needs_bytes() const override { return true; }

  absl::Status Send(const Chunk& chunk) override {
    if (verdict_.has_value()) {  // an OK verdict, and yet a chunk to send
      return absl::InternalError(
          "the target's verdict came before the last chunk");
    }
    absl::Status s = stream_.SendChunk(chunk);
    // A target that failed says why before it stops reading.
    verdict_ = stream_.EarlyVerdict();
    if (verdict_.has_value() && !verdict_->ok()) return *verdict_;
    return s;
  }
  absl::Status Finish() override {
    return verdict_.has_value() ? *verdict_ : stream_.AwaitVerdict();
  }
  void Abort() override { socket_.Shutdown(); }

 private:
  DataSocket socket_;
  SlotStream stream_;  // over socket_
  const int64_t chunk_slots_;
  std::optional<absl::Status> verdict_;  // once the target has sent it
};

}  // namespace

std::unique_ptr<PageSender> NewTcpSender(DataSocket socket, absl::Time deadline,
                                         int64_t chunk_slots) {
  return std::make_unique<TcpSender>(std::move(socket), deadline, chunk_slots);
}

}  // namespace kvkeep
