// kvkeepd_testing's AddDaemonHooks (services/kvkeepd/daemon_hooks.h): the
// daemon built from the same main.cc with test-only flags that make its
// outgoing transfers slow or corrupt (tests/service/
// transfer_process_test.cc kills or freezes a peer mid-transfer with them).
// Never linked into kvkeepd.
#include <signal.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "services/kvkeepd/daemon_hooks.h"
#include "tests/testing/faulty_page_sender.h"

ABSL_FLAG(int64_t, test_transfer_chunk_delay_ms, 0,
          "test only: pause before sending each transfer chunk");
ABSL_FLAG(int64_t, test_corrupt_transfer_chunk, -1,
          "test only: flip a bit of this transfer chunk after its checksum");
ABSL_FLAG(int64_t, test_stop_pid, 0,
          "test only: SIGSTOP this process (a target) before sending "
          "--test_stop_at_chunk");
ABSL_FLAG(int64_t, test_stop_at_chunk, -1,
          "test only: the chunk before which --test_stop_pid is stopped");

namespace kvkeep {
namespace {

// Stops process `pid` and waits until every thread of it has stopped: kill
// returns before a running thread stops, and one that goes on for a moment
// could still take a chunk (at most 10 s).
void StopProcess(pid_t pid) {
  kill(pid, SIGSTOP);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  for (bool all = false; !all && absl::Now() < until;) {
    all = true;
    std::error_code error;
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      std::ifstream stat(task.path() / "stat");
      const std::string text((std::istreambuf_iterator<char>(stat)),
                             std::istreambuf_iterator<char>());
      const size_t paren = text.rfind(')');
      if (paren == std::string::npos || paren + 2 >= text.size() ||
          text[paren + 2] != 'T') {
        all = false;
      }
    }
    if (!all) absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace

void AddDaemonHooks(ServiceOptions* options) {
  const int64_t delay_ms = absl::GetFlag(FLAGS_test_transfer_chunk_delay_ms);
  const int64_t corrupt = absl::GetFlag(FLAGS_test_corrupt_transfer_chunk);
  const pid_t stop_pid = static_cast<pid_t>(absl::GetFlag(FLAGS_test_stop_pid));
  const int64_t stop_at = absl::GetFlag(FLAGS_test_stop_at_chunk);
  if (delay_ms <= 0 && corrupt < 0 && (stop_pid <= 0 || stop_at < 0)) return;
  options->wrap_transfer_sender = testing::FaultyTransport(
      [delay_ms, corrupt, stop_pid, stop_at](int64_t chunk) {
        if (stop_pid > 0 && chunk == stop_at) StopProcess(stop_pid);
        absl::SleepFor(absl::Milliseconds(delay_ms));
        testing::ChunkFault fault;
        fault.corrupt = chunk == corrupt;
        return fault;
      });
}

}  // namespace kvkeep
