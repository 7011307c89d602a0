// Assertions on grpc::Status for GoogleTest, for tests that call kvkeepd
// through the generated stubs. Header-only.
#ifndef KVKEEP_TESTS_TESTING_GRPC_STATUS_MATCHERS_H_
#define KVKEEP_TESTS_TESTING_GRPC_STATUS_MATCHERS_H_

#include <initializer_list>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

namespace kvkeep::testing {

// Expects `s` to fail with `code` and a message containing every fragment.
inline void ExpectStatus(const grpc::Status& s, grpc::StatusCode code,
                         std::initializer_list<std::string> fragments) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  for (const std::string& f : fragments) {
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(f));
  }
}

}  // namespace kvkeep::testing

#define KV_GRPC_CHECK_OK_(check, expr)                                        \
  do {                                                                        \
    const grpc::Status kv_s_ = (expr);                                        \
    check(kv_s_.ok()) << kv_s_.error_code() << ": " << kv_s_.error_message(); \
  } while (false)
#define EXPECT_GRPC_OK(expr) KV_GRPC_CHECK_OK_(EXPECT_TRUE, expr)
#define ASSERT_GRPC_OK(expr) KV_GRPC_CHECK_OK_(ASSERT_TRUE, expr)

#endif  // KVKEEP_TESTS_TESTING_GRPC_STATUS_MATCHERS_H_
