// Tests of the status mapping (services/common/grpc_status.h).
#include "services/common/grpc_status.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

TEST(GrpcStatusTest, CodesAndMessagesMapBothWays) {
  for (const absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kResourceExhausted,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kDataLoss,
        absl::StatusCode::kUnauthenticated}) {
    const absl::Status s(code, "what was wrong");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), static_cast<int>(code));
    EXPECT_EQ(g.error_message(), "what was wrong");
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

// The message goes in a trailer a client bounds (8 KiB of metadata by
// default): a longer one is cut, and says how much was cut.
TEST(GrpcStatusTest, LongMessagesAreCutAndSaySo) {
  const std::string at_limit(kMaxStatusMessageBytes, 'm');
  EXPECT_EQ(ToGrpcStatus(absl::InternalError(at_limit)).error_message(),
            at_limit);
  const grpc::Status cut =
      ToGrpcStatus(absl::InvalidArgumentError(std::string(100000, 'm')));
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(cut.error_message(),
            at_limit + "... (" +
                std::to_string(100000 - kMaxStatusMessageBytes) +
                " more bytes)");
}

}  // namespace
}  // namespace kvkeep
