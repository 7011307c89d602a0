#include "cache_store/tiers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvkeep {
namespace {

constexpr absl::string_view kSuffix = ".kvt";
constexpr absl::string_view kTempSuffix = ".kvt.tmp";

// A failed system call on `path`, with errno: a full disk is
// RESOURCE_EXHAUSTED, anything else FAILED_PRECONDITION (the directory is
// not usable as configured).
absl::Status FileError(absl::string_view what, const std::string& path,
                       int err) {
  const std::string message =
      absl::StrCat("disk tier: ", what, " ", path, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::FailedPreconditionError(message);
}

// Writes all of `bytes` to `fd`, retrying short writes.
int WriteAll(int fd, std::span<const std::byte> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    done += static_cast<size_t>(n);
  }
  return 0;
}

int SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  const int err = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

}  // namespace

absl::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kPool:
      return "pool";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "unknown";
}

absl::Status PrepareTiers(const TierOptions& options,
                          absl::string_view layout) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout '", layout, "' tiers: ", what));
  };
  if (options.host_bytes < 0) return bad("host_bytes is negative");
  if (options.idle_after < absl::ZeroDuration()) {
    return bad("idle_after is negative");
  }
  if (options.idle_after > absl::ZeroDuration() && !options.enabled()) {
    return bad("idle_after needs a host or disk tier to move sessions to");
  }
  if (options.disk_dir.empty()) return absl::OkStatus();
  std::error_code ec;
  const std::filesystem::path dir(options.disk_dir);
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout '", layout, "' disk tier: cannot make directory ",
        options.disk_dir, ": ", ec ? ec.message() : "not a directory"));
  }
  for (const auto& file : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = file.path().filename().string();
    if (absl::EndsWith(name, kSuffix) || absl::EndsWith(name, kTempSuffix)) {
      std::filesystem::remove(file.path(), ec);
    }
  }
  return absl::OkStatus();
}

TierStats TierCounters::Snapshot() const {
  TierStats s;
  for (int t = 0; t < kTierCount; ++t) {
    s.sessions[t] = sessions_[t].load(std::memory_order_relaxed);
    s.bytes[t] = bytes_[t].load(std::memory_order_relaxed);
  }
  s.moves_down = moves_down_.load(std::memory_order_relaxed);
  s.restores = restores_.load(std::memory_order_relaxed);
  s.failed_moves = failed_.load(std::memory_order_relaxed);
  s.corrupt = corrupt_.load(std::memory_order_relaxed);
  return s;
}

TierCopy::TierCopy(Tier tier, int64_t bytes, TierCounters* counters)
    : tier_(tier), bytes_(bytes), counters_(counters) {
  const int t = static_cast<int>(tier_);
  counters_->sessions_[t].fetch_add(1, std::memory_order_relaxed);
  // kHost's bytes were reserved by InHost.
  if (tier_ != Tier::kHost) {
    counters_->bytes_[t].fetch_add(bytes_, std::memory_order_relaxed);
  }
}

TierCopy::~TierCopy() {
  const int t = static_cast<int>(tier_);
  counters_->sessions_[t].fetch_sub(1, std::memory_order_relaxed);
  counters_->bytes_[t].fetch_sub(bytes_, std::memory_order_relaxed);
  if (tier_ == Tier::kDisk) ::unlink(path_.c_str());
}

absl::StatusOr<std::unique_ptr<TierCopy>> TierCopy::InHost(
    std::vector<std::byte> bytes, int64_t budget_bytes,
    TierCounters* counters) {
  const int64_t size = static_cast<int64_t>(bytes.size());
  std::atomic<int64_t>& used = counters->bytes_[static_cast<int>(Tier::kHost)];
  int64_t now = used.load(std::memory_order_relaxed);
  do {
    if (now + size > budget_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host tier full: ", now, " of ", budget_bytes,
                       " bytes used; the session needs ", size));
    }
  } while (
      !used.compare_exchange_weak(now, now + size, std::memory_order_relaxed));
  std::unique_ptr<TierCopy> copy(new TierCopy(Tier::kHost, size, counters));
  copy->host_ = std::move(bytes);
  return copy;
}

absl::StatusOr<std::unique_ptr<TierCopy>> TierCopy::OnDisk(
    const std::string& dir, SessionId id, std::span<const std::byte> bytes,
    TierCounters* counters) {
  const std::string path = absl::StrCat(dir, "/", SessionName(id), kSuffix);
  const std::string temp = absl::StrCat(dir, "/", SessionName(id), kTempSuffix);
  const int fd =
      ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return FileError("cannot create", temp, errno);
  int err = WriteAll(fd, bytes);
  absl::string_view step = "cannot write";
  if (err == 0 && ::fsync(fd) != 0) {
    err = errno;
    step = "cannot fsync";
  }
  if (::close(fd) != 0 && err == 0) {
    err = errno;
    step = "cannot close";
  }
  if (err == 0 && ::rename(temp.c_str(), path.c_str()) != 0) {
    err = errno;
    step = "cannot rename into place";
  }
  if (err != 0) {
    ::unlink(temp.c_str());
    return FileError(step, temp, err);
  }
  if (err = SyncDirectory(dir); err != 0) {
    ::unlink(path.c_str());
    return FileError("cannot fsync directory of", path, err);
  }
  std::unique_ptr<TierCopy> copy(
      new TierCopy(Tier::kDisk, static_cast<int64_t>(bytes.size()), counters));
  copy->path_ = path;
  return copy;
}

absl::StatusOr<std::vector<std::byte>> TierCopy::Read() const {
  if (tier_ == Tier::kHost) return host_;
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::DataLossError(
          absl::StrCat("disk tier file ", path_, " is gone"));
    }
    return absl::UnavailableError(absl::StrCat("disk tier: cannot open ", path_,
                                               ": ", std::strerror(err)));
  }
  std::vector<std::byte> out(static_cast<size_t>(bytes_));
  size_t done = 0;
  int err = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat("disk tier: cannot read ", path_,
                                               ": ", std::strerror(err)));
  }
  // A shorter file decodes as damage: its header's length disagrees.
  out.resize(done);
  return out;
}

}  // namespace kvkeep
