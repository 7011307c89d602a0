// Shared pools left by processes that are gone are removed; those of live
// processes, other users' and other files stay.
#include "cache_store/shared_pool_reaper.h"

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

// A pid no process has now: a child that has exited and been reaped.
pid_t DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

TEST(SharedPoolReaperTest, RemovesOnlyPoolsOfProcessesThatAreGone) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("reaper_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto make = [&](const std::string& name, size_t bytes) {
    std::ofstream(dir / name) << std::string(bytes, 'x');
  };
  const pid_t dead = DeadPid();
  make(absl::StrCat("kvkeep-", dead, "-0badf00d-0"), 1000);
  make(absl::StrCat("kvkeep-", dead, "-1"), 24);  // the older name form
  make(absl::StrCat("kvkeep-", getpid(), "-0badf00d-0"), 10);  // alive
  make("kvkeep-1-0badf00d-0", 10);                             // init: alive
  make("kvkeep-notapid-0", 10);
  make("something-else", 10);

  const ReapedPools reaped = ReapAbandonedSharedPools(dir.string());
  EXPECT_EQ(reaped.objects, 2);
  EXPECT_EQ(reaped.bytes, 1024);
  EXPECT_FALSE(std::filesystem::exists(
      dir / absl::StrCat("kvkeep-", dead, "-0badf00d-0")));
  EXPECT_FALSE(
      std::filesystem::exists(dir / absl::StrCat("kvkeep-", dead, "-1")));
  for (const std::string& kept :
       {absl::StrCat("kvkeep-", getpid(), "-0badf00d-0"),
        std::string("kvkeep-1-0badf00d-0"), std::string("kvkeep-notapid-0"),
        std::string("something-else")}) {
    EXPECT_TRUE(std::filesystem::exists(dir / kept)) << kept;
  }
  // Nothing left to reap; a missing directory is no error.
  EXPECT_EQ(ReapAbandonedSharedPools(dir.string()).objects, 0);
  EXPECT_EQ(ReapAbandonedSharedPools((dir / "missing").string()).objects, 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvkeep
