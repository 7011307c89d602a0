#include "cache_store/shared_pool_reaper.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace kvkeep {
namespace {

// The pid in "kvkeep-<pid>-..." (the names page_memory.cc gives); 0 for
// any other name.
pid_t OwnerOf(const std::string& name) {
  if (!absl::StartsWith(name, "kvkeep-")) return 0;
  const std::vector<absl::string_view> parts = absl::StrSplit(name, '-');
  int64_t pid = 0;
  if (parts.size() < 3 || !absl::SimpleAtoi(parts[1], &pid) || pid <= 0) {
    return 0;
  }
  return static_cast<pid_t>(pid);
}

}  // namespace

ReapedPools ReapAbandonedSharedPools(const std::string& dir) {
  ReapedPools reaped;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    const pid_t pid = OwnerOf(name);
    if (pid == 0) continue;
    struct stat st;
    if (lstat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid()) {
      continue;
    }
    // ESRCH: no such process. (EPERM means it exists, as another user's.)
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (unlink(entry.path().c_str()) == 0) {
      ++reaped.objects;
      reaped.bytes += st.st_size;
    }
  }
  return reaped;
}

}  // namespace kvkeep
