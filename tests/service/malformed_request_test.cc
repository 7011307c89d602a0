// Requests whose bytes do not parse: every one-message method answers
// INVALID_ARGUMENT naming the request type (gRPC alone answers UNIMPLEMENTED
// with no message), the metrics count that code, and the server goes on
// serving. Also the rate limit on protobuf's own log lines.
#include <gmock/gmock.h>
#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/kvkeepd/parse_errors.h"
#include "tests/testing/grpc_status_matchers.h"
#include "tests/testing/metrics_testing.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

// Sends `bytes` as the one request message of `method` (any kind of
// method: the wire is the same) and returns the call's status.
grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel,
                  const std::string& method, const std::string& bytes) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::internal::RpcMethod rpc(
      method.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream(grpc::internal::ClientReaderWriterFactory<
             grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), rpc,
                                                         &ctx));
  stream->Write(Buffer(bytes));
  stream->WritesDone();
  grpc::ByteBuffer reply;
  while (stream->Read(&reply)) {
  }
  return stream->Finish();
}

class MalformedRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerConfig config =
        testing::TestServerConfig({PoolSpec{testing::SmallLayout("m"), 64}});
    config.metrics_listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
        testing::TestServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::unique_ptr<testing::TestServer> server_;
};

// Bytes that are no protobuf message at all: a field with wire type 7.
constexpr char kNotProtobuf[] = "\x0f\xff\xff\xff";

TEST_F(MalformedRequestTest, EveryOneMessageMethodSaysTheRequestDoesNotParse) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "kvkeep.v1.KvKeep");
  ASSERT_NE(service, nullptr);
  int checked = 0;
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = service->method(i);
    if (m->client_streaming()) continue;
    SCOPED_TRACE(m->name());
    const grpc::Status status =
        Call(server_->channel(), absl::StrCat("/kvkeep.v1.KvKeep/", m->name()),
             kNotProtobuf);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(),
                HasSubstr(absl::StrCat("does not parse as ",
                                       m->input_type()->full_name())));
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

TEST_F(MalformedRequestTest, AStringThatIsNotUtf8IsInvalidArgument) {
  v1::CreateSessionRequest request;
  request.set_layout("m");
  request.set_policy("@@@@");
  std::string bytes = request.SerializeAsString();
  bytes = absl::StrReplaceAll(bytes, {{"@@@@", "\xff\xfe\xfd\xfc"}});
  const grpc::Status status =
      Call(server_->channel(), "/kvkeep.v1.KvKeep/CreateSession", bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("kvkeep.v1.CreateSessionRequest"));
  EXPECT_THAT(status.error_message(), HasSubstr("UTF-8"));
  // Nothing was created, and the same request with a valid string works.
  EXPECT_TRUE(server_->store().ListSessions().empty());
  request.set_policy("window");
  request.mutable_budget()->set_tokens(8);
  const grpc::Status valid =
      Call(server_->channel(), "/kvkeep.v1.KvKeep/CreateSession",
           request.SerializeAsString());
  EXPECT_TRUE(valid.ok()) << valid.error_message();
  EXPECT_EQ(server_->store().ListSessions().size(), 1u);
}

TEST_F(MalformedRequestTest, AMethodTheServerLacksStaysUnimplemented) {
  const grpc::Status status =
      Call(server_->channel(), "/kvkeep.v1.KvKeep/NoSuchMethod", kNotProtobuf);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(MalformedRequestTest, MetricsCountTheCodeTheClientReceived) {
  for (int i = 0; i < 3; ++i) {
    Call(server_->channel(), "/kvkeep.v1.KvKeep/GetSessionStats", kNotProtobuf);
  }
  absl::StatusOr<std::string> text =
      metrics_testing::HttpGet(server_->server().metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<metrics_testing::Sample> scrape =
      metrics_testing::ParseExposition(*text);
  EXPECT_THAT(
      metrics_testing::Value(scrape, "kvkeep_rpc_duration_seconds_count",
                             {{"method", "/kvkeep.v1.KvKeep/GetSessionStats"},
                              {"code", "INVALID_ARGUMENT"}}),
      Optional(3.0));
  EXPECT_EQ(
      metrics_testing::Value(scrape, "kvkeep_rpc_duration_seconds_count",
                             {{"method", "/kvkeep.v1.KvKeep/GetSessionStats"},
                              {"code", "UNIMPLEMENTED"}}),
      std::nullopt);
}

TEST(LogRateLimiterTest, WritesOneLinePerIntervalAndCountsTheRest) {
  absl::Time now = absl::UnixEpoch();
  std::vector<std::string> written;
  LogRateLimiter limiter(
      absl::Seconds(10), [&] { return now; },
      [&](const std::string& line) { written.push_back(line); });
  for (int i = 0; i < 1000; ++i) limiter.Log(false, absl::StrCat("e", i));
  now += absl::Seconds(9);
  limiter.Log(false, "still quiet");
  now += absl::Seconds(1);
  limiter.Log(false, "after ten seconds");
  limiter.Log(true, "fatal passes");
  EXPECT_THAT(written,
              ElementsAre("e0",
                          "after ten seconds (1000 similar lines left out "
                          "before this one)",
                          "fatal passes"));
  EXPECT_EQ(limiter.suppressed_total(), 1000);
}

}  // namespace
}  // namespace kvkeep
