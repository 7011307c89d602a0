// session_holder: a client process that opens sessions and holds them until
// it is killed, for lease_process_test (which SIGKILLs it and waits for the
// store to take every page back).
//
//   session_holder ADDRESS TOKEN LAYOUT SESSIONS STREAMS
//
// Creates SESSIONS sessions of LAYOUT (policy "full", so nothing is evicted
// and every page stays held), prefills 6 tokens into each, and opens a
// Decode stream on the first STREAMS of them (one step each, then left
// open). A second thread renews every session made so far with KeepAlive
// every 100 ms, from the first create on, forever. Prints "holding N
// sessions" once all are made, then "renewed for Ns" after each whole
// second of renewing them all. A renewal that fails prints "lost SESSION:
// STATUS" and exits 1; a failure before that exits 2.
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/metrics_testing.h"

namespace {

using kvkeep::client::DecodeStream;
using kvkeep::client::Session;

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int Fail(const std::string& what, const absl::Status& status) {
  Say("failed: " + what + ": " + status.ToString());
  return 2;
}

// The sessions made so far, and when the last was made.
class Held {
 public:
  void Add(const Session& s) {
    absl::MutexLock lock(&mu_);
    sessions_.push_back(s);
  }
  void AllMade() {
    absl::MutexLock lock(&mu_);
    all_made_ = absl::Now();
  }

  // Renews every session every 100 ms, forever; exits 1 on a failure.
  [[noreturn]] void Renew() {
    int64_t reported = 0;
    while (true) {
      std::vector<Session> sessions;
      absl::Time since;
      {
        absl::MutexLock lock(&mu_);
        sessions = sessions_;
        since = all_made_;
      }
      for (const Session& s : sessions) {
        if (absl::Status st = s.KeepAlive().status(); !st.ok()) {
          Say("lost " + s.id() + ": " + st.ToString());
          _exit(1);
        }
      }
      if (since != absl::InfiniteFuture()) {
        const int64_t seconds = absl::ToInt64Seconds(absl::Now() - since);
        if (seconds > reported) {
          reported = seconds;
          Say("renewed for " + std::to_string(seconds) + "s");
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }

 private:
  absl::Mutex mu_;
  std::vector<Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::Time all_made_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace

int main(int argc, char** argv) {
  int sessions_wanted = 0;
  int streams_wanted = 0;
  if (argc != 6 || !absl::SimpleAtoi(argv[4], &sessions_wanted) ||
      !absl::SimpleAtoi(argv[5], &streams_wanted)) {
    std::fprintf(stderr,
                 "usage: session_holder ADDRESS TOKEN LAYOUT SESSIONS "
                 "STREAMS\n");
    return 2;
  }
  kvkeep::client::ClientOptions options;
  options.address = argv[1];
  options.token = argv[2];
  absl::StatusOr<kvkeep::client::KvKeepClient> client =
      kvkeep::client::KvKeepClient::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());
  Held held;
  std::thread renewer([&held] { held.Renew(); });
  renewer.detach();
  std::mt19937 rng(11);
  std::vector<DecodeStream> streams;  // open until the process dies
  for (int i = 0; i < sessions_wanted; ++i) {
    absl::StatusOr<Session> session =
        kvkeep::metrics_testing::OpenSession(*client, argv[3], "full", 64);
    if (!session.ok()) return Fail("create", session.status());
    held.Add(*session);
    const kvkeep::client::KvTokens prompt =
        kvkeep::metrics_testing::RandomTokens(session->layout(),
                                              {0, 1, 2, 3, 4, 5}, rng);
    if (absl::Status s = session->AppendPrefill(prompt).status(); !s.ok()) {
      return Fail("prefill", s);
    }
    if (i < streams_wanted) {
      streams.push_back(session->Decode());
      const kvkeep::client::KvTokens token =
          kvkeep::metrics_testing::RandomTokens(session->layout(), {6}, rng);
      if (absl::Status s = streams.back().Step(token, {}).status(); !s.ok()) {
        return Fail("decode", s);
      }
    }
  }
  held.AllMade();
  Say("holding " + std::to_string(sessions_wanted) + " sessions");
  while (true) pause();  // until killed
}
