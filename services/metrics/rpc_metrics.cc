#include "services/metrics/rpc_metrics.h"

#include <chrono>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/interceptor.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "services/metrics/store_metrics.h"

namespace kvkeep {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::Interceptor;
using grpc::experimental::InterceptorBatchMethods;
using grpc::experimental::ServerRpcInfo;

constexpr int kCodes = 17;  // grpc::StatusCode: OK .. UNAUTHENTICATED

// The histograms, one per (method, code), made on first use.
class RpcSeries {
 public:
  RpcSeries(prometheus::Registry& registry, std::vector<std::string> methods)
      : family_(prometheus::BuildHistogram()
                    .Name("kvkeep_rpc_duration_seconds")
                    .Help("gRPC calls by method and status code: latency from "
                          "arrival to status (a stream's lifetime)")
                    .Register(registry)),
        methods_(methods.begin(), methods.end()) {}

  void Observe(const std::string& method, int code, double seconds) {
    if (code < 0 || code >= kCodes) code = 2;  // UNKNOWN
    const std::string& label = methods_.contains(method) ? method : kOther;
    prometheus::Histogram* h;
    {
      absl::MutexLock lock(&mu_);
      prometheus::Histogram*& slot = series_[std::pair(label, code)];
      if (slot == nullptr) {
        slot = &family_.Add({{"method", label}, {"code", StatusCodeName(code)}},
                            RpcLatencyBuckets());
      }
      h = slot;
    }
    h->Observe(seconds);
  }

 private:
  static inline const std::string kOther = "other";
  prometheus::Family<prometheus::Histogram>& family_;
  const absl::flat_hash_set<std::string> methods_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::pair<std::string, int>, prometheus::Histogram*>
      series_ ABSL_GUARDED_BY(mu_);
};

// One per call: gRPC creates it when the call arrives and deletes it when
// the call is done.
class RpcInterceptor : public Interceptor {
 public:
  RpcInterceptor(RpcSeries& series, const char* method)
      : series_(series),
        method_(method == nullptr ? "" : method),
        start_(std::chrono::steady_clock::now()) {}

  // A call that ends without sending a status (the client went away first)
  // counts as CANCELLED.
  ~RpcInterceptor() override {
    if (!recorded_) Record(static_cast<int>(grpc::StatusCode::CANCELLED));
  }

  void Intercept(InterceptorBatchMethods* methods) override {
    if (!recorded_ && methods->QueryInterceptionHookPoint(
                          InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  void Record(int code) {
    recorded_ = true;
    const std::chrono::duration<double> elapsed =
        std::chrono::steady_clock::now() - start_;
    series_.Observe(method_, code, elapsed.count());
  }

  RpcSeries& series_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  bool recorded_ = false;
};

class RpcMetricsFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RpcMetricsFactory(prometheus::Registry& registry,
                    std::vector<std::string> methods)
      : series_(registry, std::move(methods)) {}

  Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    return new RpcInterceptor(series_, info->method());
  }

 private:
  RpcSeries series_;
};

}  // namespace

std::vector<std::string> MethodsOf(const std::vector<std::string>& services) {
  std::vector<std::string> out;
  const google::protobuf::DescriptorPool* pool =
      google::protobuf::DescriptorPool::generated_pool();
  for (const std::string& name : services) {
    const google::protobuf::ServiceDescriptor* service =
        pool->FindServiceByName(name);
    if (service == nullptr) continue;
    for (int i = 0; i < service->method_count(); ++i) {
      out.push_back("/" + name + "/" + service->method(i)->name());
    }
  }
  return out;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRpcMetricsFactory(prometheus::Registry& registry,
                     std::vector<std::string> methods) {
  return std::make_unique<RpcMetricsFactory>(registry, std::move(methods));
}

const char* StatusCodeName(int code) {
  static constexpr const char* kNames[kCodes] = {"OK",
                                                 "CANCELLED",
                                                 "UNKNOWN",
                                                 "INVALID_ARGUMENT",
                                                 "DEADLINE_EXCEEDED",
                                                 "NOT_FOUND",
                                                 "ALREADY_EXISTS",
                                                 "PERMISSION_DENIED",
                                                 "RESOURCE_EXHAUSTED",
                                                 "FAILED_PRECONDITION",
                                                 "ABORTED",
                                                 "OUT_OF_RANGE",
                                                 "UNIMPLEMENTED",
                                                 "INTERNAL",
                                                 "UNAVAILABLE",
                                                 "DATA_LOSS",
                                                 "UNAUTHENTICATED"};
  return code >= 0 && code < kCodes ? kNames[code] : "UNKNOWN";
}

}  // namespace kvkeep
