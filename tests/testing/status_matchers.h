// Assertions on absl::Status and absl::StatusOr for GoogleTest: what every
// test of the domain and the services uses instead of its own copy.
// Header-only.
#ifndef KVKEEP_TESTS_TESTING_STATUS_MATCHERS_H_
#define KVKEEP_TESTS_TESTING_STATUS_MATCHERS_H_

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep::testing {

inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// Expects `s` (a Status or StatusOr) to fail with `code` and a message
// containing every fragment.
template <typename S>
void ExpectError(const S& s, absl::StatusCode code,
                 std::initializer_list<const char*> fragments) {
  const absl::Status status = StatusOf(s);
  EXPECT_EQ(status.code(), code) << status;
  for (const char* f : fragments) {
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(f))
        << status;
  }
}

}  // namespace kvkeep::testing

#define KV_CONCAT_INNER(a, b) a##b
#define KV_CONCAT(a, b) KV_CONCAT_INNER(a, b)
// Asserts that a Status or StatusOr is OK, printing the status otherwise.
#define KV_ASSERT_OK(expr)                                                   \
  do {                                                                       \
    const auto& kv_status_ = (expr);                                         \
    ASSERT_TRUE(kv_status_.ok()) << ::kvkeep::testing::StatusOf(kv_status_); \
  } while (false)
// lhs = *expr, or fails the test with the status.
#define KV_ASSIGN_OR_FAIL(lhs, expr)            \
  auto KV_CONCAT(kv_or_, __LINE__) = (expr);    \
  ASSERT_TRUE(KV_CONCAT(kv_or_, __LINE__).ok()) \
      << KV_CONCAT(kv_or_, __LINE__).status();  \
  lhs = *std::move(KV_CONCAT(kv_or_, __LINE__))

#endif  // KVKEEP_TESTS_TESTING_STATUS_MATCHERS_H_
