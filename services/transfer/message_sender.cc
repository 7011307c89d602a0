// kHost: chunk messages on the gRPC stream (page_transport.h).
#include "absl/strings/str_cat.h"
#include "services/transfer/chunk_wire.h"
#include "services/transfer/page_transport.h"

namespace kvkeep {
namespace {

class MessageSender final : public PageSender {
 public:
  MessageSender(TransferCall* call, int64_t chunk_slots)
      : call_(call), chunk_slots_(chunk_slots) {}

  Transport transport() const override { return Transport::kHost; }
  int64_t chunk_slots() const override { return chunk_slots_; }
  bool needs_bytes() const override { return true; }

  // Queued behind the message on the wire: building the next chunk and
  // writing this one to the socket overlap (TransferCall::Write).
  absl::Status Send(const Chunk& chunk) override {
    if (!call_->Write(EncodeChunk(chunk))) {
      return absl::UnavailableError("the target stopped taking chunks");
    }
    return absl::OkStatus();
  }
  absl::Status Finish() override {
    if (call_->Broken()) {
      return absl::UnavailableError("the target stopped taking chunks");
    }
    return absl::OkStatus();
  }

 private:
  TransferCall* const call_;
  const int64_t chunk_slots_;
};

}  // namespace

std::unique_ptr<PageSender> NewMessageSender(TransferCall* call,
                                             int64_t chunk_slots) {
  return std::make_unique<MessageSender>(call, chunk_slots);
}

}  // namespace kvkeep
