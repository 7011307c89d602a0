// FaultyPageSender: a PageSender (services/transfer/page_transport.h) that
// wraps the real one a transfer chose and, before each chunk, calls a test's
// hook, which may stall (a slow transport), fail the send (a failing one),
// or ask for the chunk to be corrupted after its checksum is taken (one
// bit of the chunk's bytes flipped in a copy, the original bytes' CRC32C
// claimed): the target must catch it. Test-only: linked into tests and
// kvkeepd_testing, never into kvkeepd.
//
// Not thread-safe: one per transfer, on its sending thread; the hook may be
// called from several transfers' threads at once.
#ifndef KVKEEP_TESTS_TESTING_FAULTY_PAGE_SENDER_H_
#define KVKEEP_TESTS_TESTING_FAULTY_PAGE_SENDER_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "services/transfer/page_transport.h"

namespace kvkeep::testing {

// What to do with chunk `index` (0 for a transfer's first).
struct ChunkFault {
  absl::Status fail;     // not OK: Send returns it, nothing is sent
  bool corrupt = false;  // flip a bit (`byte` of the keys, or values)
  bool in_values = false;
  int64_t byte = 0;
  uint8_t mask = 0x01;
};
using ChunkFaultHook = std::function<ChunkFault(int64_t index)>;

std::unique_ptr<PageSender> NewFaultyPageSender(
    std::unique_ptr<PageSender> inner, ChunkFaultHook hook);

// The wrapper for ServiceOptions::wrap_transfer_sender.
PageSenderWrapper FaultyTransport(ChunkFaultHook hook);

}  // namespace kvkeep::testing

#endif  // KVKEEP_TESTS_TESTING_FAULTY_PAGE_SENDER_H_
