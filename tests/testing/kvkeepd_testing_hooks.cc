// kvkeepd_testing's AddDaemonHooks (services/kvkeepd/daemon_hooks.h): the
// daemon built from the same main.cc with test-only flags that make its
// outgoing transfers slow or corrupt (tests/service/
// transfer_process_test.cc kills a peer mid-transfer with them). Never
// linked into kvkeepd.
#include <cstdint>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "services/kvkeepd/daemon_hooks.h"
#include "tests/testing/faulty_page_sender.h"

ABSL_FLAG(int64_t, test_transfer_chunk_delay_ms, 0,
          "test only: pause before sending each transfer chunk");
ABSL_FLAG(int64_t, test_corrupt_transfer_chunk, -1,
          "test only: flip a bit of this transfer chunk after its checksum");

namespace kvkeep {

void AddDaemonHooks(ServiceOptions* options) {
  const int64_t delay_ms = absl::GetFlag(FLAGS_test_transfer_chunk_delay_ms);
  const int64_t corrupt = absl::GetFlag(FLAGS_test_corrupt_transfer_chunk);
  if (delay_ms <= 0 && corrupt < 0) return;
  options->wrap_transfer_sender =
      testing::FaultyTransport([delay_ms, corrupt](int64_t chunk) {
        absl::SleepFor(absl::Milliseconds(delay_ms));
        testing::ChunkFault fault;
        fault.corrupt = chunk == corrupt;
        return fault;
      });
}

}  // namespace kvkeep
