// RpcMetrics: a gRPC server interceptor factory that records every call's
// latency, by method and status code, in
// kvkeep_rpc_duration_seconds{method,code} (its _count is the call count). A
// call's latency runs from its arrival to its status being sent; for a stream
// that is the stream's lifetime. Method labels are limited to the methods
// named at construction (any other is "other"), so a client cannot create
// series by calling made-up methods.
//
// Thread-safe. The registry must outlive the factory and the server.
#ifndef KVKEEP_SERVICES_METRICS_RPC_METRICS_H_
#define KVKEEP_SERVICES_METRICS_RPC_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/support/server_interceptor.h"
#include "prometheus/registry.h"

namespace kvkeep {

// The full method names ("/package.Service/Method") of the services named,
// from the generated descriptor pool.
std::vector<std::string> MethodsOf(const std::vector<std::string>& services);

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRpcMetricsFactory(prometheus::Registry& registry,
                     std::vector<std::string> methods);

// "OK", "NOT_FOUND", ... as gRPC spells the code.
const char* StatusCodeName(int code);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_METRICS_RPC_METRICS_H_
