#include "tests/testing/faulty_page_sender.h"

#include <cstring>
#include <utility>
#include <vector>

namespace kvkeep::testing {
namespace {

class FaultyPageSender final : public PageSender {
 public:
  FaultyPageSender(std::unique_ptr<PageSender> inner, ChunkFaultHook hook)
      : inner_(std::move(inner)), hook_(std::move(hook)) {}

  Transport transport() const override { return inner_->transport(); }
  int64_t chunk_slots() const override { return inner_->chunk_slots(); }
  bool needs_bytes() const override { return inner_->needs_bytes(); }
  absl::Status Finish() override { return inner_->Finish(); }
  void Done(bool committed) override { inner_->Done(committed); }
  void Abort() override { inner_->Abort(); }

  absl::Status Send(const Chunk& chunk) override {
    const ChunkFault fault = hook_(index_++);
    if (!fault.fail.ok()) return fault.fail;
    if (!fault.corrupt) return inner_->Send(chunk);
    // The copy is changed, never the frozen session's pages.
    Chunk changed = chunk;
    changed.crc32c = chunk.crc32c.value_or(ChunkCrc32c(chunk));
    keys_ = Gather(chunk.keys);
    values_ = Gather(chunk.values);
    std::vector<std::byte>& side = fault.in_values ? values_ : keys_;
    if (fault.byte < static_cast<int64_t>(side.size())) {
      side[fault.byte] ^= std::byte{fault.mask};
    }
    changed.keys = {std::span<const std::byte>(keys_)};
    changed.values = {std::span<const std::byte>(values_)};
    return inner_->Send(changed);
  }

 private:
  static std::vector<std::byte> Gather(
      const std::vector<std::span<const std::byte>>& pieces) {
    std::vector<std::byte> out;
    for (const auto& p : pieces) out.insert(out.end(), p.begin(), p.end());
    return out;
  }

  const std::unique_ptr<PageSender> inner_;
  const ChunkFaultHook hook_;
  int64_t index_ = 0;
  std::vector<std::byte> keys_, values_;  // a corrupted chunk's bytes
};

}  // namespace

std::unique_ptr<PageSender> NewFaultyPageSender(
    std::unique_ptr<PageSender> inner, ChunkFaultHook hook) {
  return std::make_unique<FaultyPageSender>(std::move(inner), std::move(hook));
}

PageSenderWrapper FaultyTransport(ChunkFaultHook hook) {
  return [hook = std::move(hook)](std::unique_ptr<PageSender> inner) {
    return NewFaultyPageSender(std::move(inner), hook);
  };
}

}  // namespace kvkeep::testing
