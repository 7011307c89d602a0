// Child processes for tests: spawn a binary with its stdout and stderr
// collected line by line, wait for a line, signal it, reap it. A child is
// SIGKILLed and reaped when its handle is destroyed (and gets SIGKILL if the
// test process dies first), so a failing test leaves nothing running.
// Header-only.
#ifndef KVKEEP_TESTS_TESTING_CHILD_PROCESS_H_
#define KVKEEP_TESTS_TESTING_CHILD_PROCESS_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvkeep::child_process {

// Collects the lines one pipe delivers, on its own thread, until EOF.
// Thread-safe.
class LineCollector {
 public:
  // Takes ownership of `fd`, the read end of the pipe.
  explicit LineCollector(int fd) : fd_(fd), thread_([this] { Run(); }) {}
  // Joins the reader: every writer of the pipe must have exited by then.
  ~LineCollector() {
    thread_.join();
    close(fd_);
  }
  LineCollector(const LineCollector&) = delete;
  LineCollector& operator=(const LineCollector&) = delete;

  // The first line starting with `prefix`, waiting for it up to `timeout`;
  // nullopt if the pipe closed (the process exited) or time ran out.
  std::optional<std::string> WaitFor(absl::string_view prefix,
                                     absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    std::optional<std::string> found;
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      for (const std::string& line : lines_) {
        if (absl::StartsWith(line, prefix)) {
          found = line;
          return true;
        }
      }
      return eof_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    return found;
  }

  // Waits for EOF (up to `timeout`) and returns every line.
  std::vector<std::string> AllLines(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&eof_), timeout);
    return lines_;
  }

  // What arrived so far, for failure messages.
  std::string Text() const {
    absl::MutexLock lock(&mu_);
    return absl::StrJoin(lines_, "\n");
  }

 private:
  void Run() {
    std::string partial;
    char buffer[4096];
    while (true) {
      const ssize_t n = read(fd_, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      partial.append(buffer, static_cast<size_t>(n));
      size_t newline;
      while ((newline = partial.find('\n')) != std::string::npos) {
        absl::MutexLock lock(&mu_);
        lines_.push_back(partial.substr(0, newline));
        partial.erase(0, newline + 1);
      }
    }
    absl::MutexLock lock(&mu_);
    if (!partial.empty()) lines_.push_back(partial);
    eof_ = true;
  }

  const int fd_;
  mutable absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

// A child process with its stdout and stderr collected. Destruction SIGKILLs
// it if it still runs and reaps it. Not thread-safe.
class Child {
 public:
  // Starts argv[0] (a path) with `argv`; stdin is /dev/null. The child
  // starts with default SIGINT/SIGTERM handling and no blocked signals,
  // whatever this process has, and gets SIGKILL if this thread dies.
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(
      const std::vector<std::string>& argv) {
    int out[2];
    int err[2];
    if (pipe2(out, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
    if (pipe2(err, O_CLOEXEC) != 0) {
      const int e = errno;
      close(out[0]);
      close(out[1]);
      return absl::ErrnoToStatus(e, "pipe");
    }
    // Everything the child needs is built before fork: between fork and
    // exec only async-signal-safe calls (this process has gRPC threads).
    std::vector<char*> args;
    for (const std::string& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      const int e = errno;
      for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
      return absl::ErrnoToStatus(e, "fork");
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      const int devnull = open("/dev/null", O_RDONLY);
      if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(out[1], 1) < 0 ||
          dup2(err[1], 2) < 0) {
        _exit(126);
      }
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    return std::unique_ptr<Child>(new Child(pid, out[0], err[0]));
  }

  ~Child() {
    if (!reaped_) {
      kill(pid_, SIGKILL);
      int status;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  void Signal(int sig) { ASSERT_EQ(kill(pid_, sig), 0) << strerror(errno); }
  pid_t pid() const { return pid_; }

  // The wait status once the child exits, or DEADLINE_EXCEEDED after
  // `timeout` (the child is left running).
  absl::StatusOr<int> Wait(absl::Duration timeout) {
    if (reaped_) return status_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const pid_t r = waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        return status_;
      }
      if (r < 0 && errno != EINTR) return absl::ErrnoToStatus(errno, "waitpid");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("pid ", pid_, " still running"));
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  const LineCollector& out() const { return out_; }
  const LineCollector& err() const { return err_; }
  std::string Output() const {
    return absl::StrCat("--- stdout:\n", out_.Text(), "\n--- stderr:\n",
                        err_.Text());
  }

 private:
  Child(pid_t pid, int out_fd, int err_fd)
      : pid_(pid), out_(out_fd), err_(err_fd) {}

  const pid_t pid_;
  bool reaped_ = false;
  int status_ = 0;
  // Destroyed (joined) after ~Child's body has killed and reaped the child,
  // so that their pipes are at EOF.
  LineCollector out_;
  LineCollector err_;
};

// A kvkeepd child and where it serves.
struct ServingChild {
  std::unique_ptr<Child> child;
  std::string address;  // host:port of its gRPC server
  std::string metrics;  // host:port of /metrics; empty without one
};

// Spawns a kvkeepd command line (with --listen and --metrics_listen, each
// "127.0.0.1:0" or an address) and waits up to `patience` for the lines
// naming its gRPC and /metrics addresses.
inline absl::StatusOr<ServingChild> StartServing(
    const std::vector<std::string>& argv, absl::Duration patience) {
  constexpr absl::string_view kListen = "kvkeepd: grpc listening on ";
  constexpr absl::string_view kMetrics = "kvkeepd: metrics on http://";
  ServingChild d;
  absl::StatusOr<std::unique_ptr<Child>> child = Child::Spawn(argv);
  if (!child.ok()) return child.status();
  d.child = *std::move(child);
  std::optional<std::string> line = d.child->out().WaitFor(kListen, patience);
  if (!line.has_value()) {
    return absl::UnavailableError(absl::StrCat(
        "kvkeepd printed no listening line:\n", d.child->Output()));
  }
  d.address = line->substr(kListen.size());
  if (std::optional<std::string> m = d.child->out().WaitFor(kMetrics, patience);
      m.has_value()) {
    d.metrics =
        std::string(absl::StripSuffix(m->substr(kMetrics.size()), "/metrics"));
  }
  return d;
}

// Writes `text` to a file named `name` (and this process's id) in the
// test's temporary directory, for a child's --config and the like; returns
// its path.
inline std::string WriteTempFile(const std::string& name,
                                 const std::string& text) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", name, "_", getpid());
  std::ofstream(path) << text;
  return path;
}

// A free loopback port (bound, read and released: another process could
// take it in between, which a test would report as a start-up failure).
// For a server that must come back on the same port, or whose address its
// peers need before it starts.
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

inline std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

}  // namespace kvkeep::child_process

#endif  // KVKEEP_TESTS_TESTING_CHILD_PROCESS_H_
