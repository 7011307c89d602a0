// Requests whose bytes are not a valid message, and the log lines they make.
//
// gRPC's callback server parses a unary or server-streaming request before
// any kvkeep code runs; when the bytes do not parse as the method's request
// type (malformed protobuf, or a string field that is not UTF-8) it answers
// UNIMPLEMENTED with no message, which reads as "this server lacks the
// method". ParseErrorInterceptorFactory turns exactly that answer into
// INVALID_ARGUMENT naming the request type. The protobuf parser also writes
// one "libprotobuf ERROR" line per string field that is not UTF-8; with
// RateLimitProtobufLog a client sending such requests cannot flood the log.
#ifndef KVKEEP_SERVICES_KVKEEPD_PARSE_ERRORS_H_
#define KVKEEP_SERVICES_KVKEEPD_PARSE_ERRORS_H_

#include <grpcpp/support/server_interceptor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvkeep {

// For every method of `services` (full names, e.g. "kvkeep.v1.KvKeep")
// whose request is one message: an UNIMPLEMENTED status with an empty
// message (what gRPC sends when that message did not parse; kvkeep's own
// errors always have a message) becomes INVALID_ARGUMENT "the request does
// not parse as <type>: ...". Methods not listed, and every other status,
// pass unchanged. Register it before the metrics interceptor, so the
// metrics count the code the client receives.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewParseErrorInterceptorFactory(const std::vector<std::string>& services);

// At most one line per `interval`; the next line written says how many were
// left out in between. FATAL lines are always written. Thread-safe.
class LogRateLimiter {
 public:
  using Clock = std::function<absl::Time()>;
  using Writer = std::function<void(const std::string&)>;

  LogRateLimiter(absl::Duration interval, Clock clock, Writer write);

  void Log(bool fatal, const std::string& line);
  int64_t suppressed_total() const;

 private:
  const absl::Duration interval_;
  const Clock clock_;
  const Writer write_;
  mutable absl::Mutex mu_;
  absl::Time last_written_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t suppressed_since_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t suppressed_total_ ABSL_GUARDED_BY(mu_) = 0;
};

// Routes protobuf's log lines (the parser's "String field ... contains
// invalid UTF-8 data" among them) through a LogRateLimiter writing to
// stderr: at most one line every 10 s. For kvkeepd's main.
void RateLimitProtobufLog();

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_PARSE_ERRORS_H_
