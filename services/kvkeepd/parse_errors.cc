#include "services/kvkeepd/parse_errors.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/stubs/logging.h>

#include <cstdio>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvkeep {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::Interceptor;
using grpc::experimental::InterceptorBatchMethods;
using grpc::experimental::ServerRpcInfo;

// One per call of a method whose request may fail to parse.
class ParseErrorInterceptor : public Interceptor {
 public:
  explicit ParseErrorInterceptor(const std::string* request_type)
      : request_type_(request_type) {}

  void Intercept(InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
          status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("the request does not parse as ", *request_type_,
                         ": the bytes are not a valid protobuf message of "
                         "that type, or a string field is not UTF-8")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string* const request_type_;
};

class ParseErrorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ParseErrorFactory(
      absl::flat_hash_map<std::string, std::string> request_types)
      : request_types_(std::move(request_types)) {}

  Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    if (info->method() == nullptr) return nullptr;
    auto it = request_types_.find(info->method());
    if (it == request_types_.end()) return nullptr;
    return new ParseErrorInterceptor(&it->second);
  }

 private:
  // "/kvkeep.v1.KvKeep/CreateSession" -> "kvkeep.v1.CreateSessionRequest"
  const absl::flat_hash_map<std::string, std::string> request_types_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewParseErrorInterceptorFactory(const std::vector<std::string>& services) {
  absl::flat_hash_map<std::string, std::string> request_types;
  const google::protobuf::DescriptorPool* pool =
      google::protobuf::DescriptorPool::generated_pool();
  for (const std::string& name : services) {
    const google::protobuf::ServiceDescriptor* service =
        pool->FindServiceByName(name);
    if (service == nullptr) continue;
    for (int i = 0; i < service->method_count(); ++i) {
      const google::protobuf::MethodDescriptor* method = service->method(i);
      // A streamed request that does not parse ends the stream on the
      // server's side as if the client had finished; gRPC gives the
      // service no way to tell the two apart (docs/security.md).
      if (method->client_streaming()) continue;
      request_types.emplace(absl::StrCat("/", name, "/", method->name()),
                            method->input_type()->full_name());
    }
  }
  return std::make_unique<ParseErrorFactory>(std::move(request_types));
}

LogRateLimiter::LogRateLimiter(absl::Duration interval, Clock clock,
                               Writer write)
    : interval_(interval), clock_(std::move(clock)), write_(std::move(write)) {}

void LogRateLimiter::Log(bool fatal, const std::string& line) {
  std::string out;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    if (!fatal && now - last_written_ < interval_) {
      ++suppressed_since_;
      ++suppressed_total_;
      return;
    }
    last_written_ = now;
    out = line;
    if (suppressed_since_ > 0) {
      absl::StrAppend(&out, " (", suppressed_since_,
                      " similar lines left out before this one)");
      suppressed_since_ = 0;
    }
  }
  write_(out);
}

int64_t LogRateLimiter::suppressed_total() const {
  absl::MutexLock lock(&mu_);
  return suppressed_total_;
}

namespace {

LogRateLimiter& ProtobufLogLimiter() {
  static LogRateLimiter* limiter = new LogRateLimiter(
      absl::Seconds(10), [] { return absl::Now(); },
      [](const std::string& line) {
        std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      });
  return *limiter;
}

void ProtobufLogHandler(google::protobuf::LogLevel level, const char* filename,
                        int line, const std::string& message) {
  static constexpr const char* kLevels[] = {"INFO", "WARNING", "ERROR",
                                            "FATAL"};
  const int index = static_cast<int>(level);
  ProtobufLogLimiter().Log(
      level == google::protobuf::LOGLEVEL_FATAL,
      absl::StrCat("[libprotobuf ",
                   index >= 0 && index < 4 ? kLevels[index] : "?", " ",
                   filename, ":", line, "] ", message));
}

}  // namespace

void RateLimitProtobufLog() {
  google::protobuf::SetLogHandler(&ProtobufLogHandler);
}

}  // namespace kvkeep
