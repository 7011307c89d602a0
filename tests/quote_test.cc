// Tests of Quote (cache_store/quote.h): client values in messages, bounded.
#include "cache_store/quote.h"

#include <string>

#include "gtest/gtest.h"

namespace kvkeep {
namespace {

TEST(QuoteTest, ShortPrintableValuesAppearAsSent) {
  EXPECT_EQ(Quote(""), "''");
  EXPECT_EQ(Quote("tiny-f32"), "'tiny-f32'");
  EXPECT_EQ(Quote(std::string("h2o policy")), "'h2o policy'");
}

TEST(QuoteTest, QuotesBackslashesAndOtherBytesAreEscaped) {
  EXPECT_EQ(Quote("it's"), "'it\\'s'");
  EXPECT_EQ(Quote("a\\b"), "'a\\\\b'");
  EXPECT_EQ(Quote(std::string("a\nb\0c\xff", 6)), "'a\\x0ab\\x00c\\xff'");
}

TEST(QuoteTest, LongValuesShowTheirFirstBytesAndTheirSize) {
  const std::string at_limit(kQuotedBytes, 'x');
  EXPECT_EQ(Quote(at_limit), "'" + at_limit + "'");
  EXPECT_EQ(Quote(at_limit + "y"), "'" + at_limit + "...' (65 bytes)");
  EXPECT_EQ(Quote(std::string(10000, 'a')),
            "'" + std::string(kQuotedBytes, 'a') + "...' (10000 bytes)");
}

TEST(QuoteTest, TheResultIsBoundedWhateverTheBytes) {
  for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64},
                         size_t{65}, size_t{4096}, size_t{1} << 20}) {
    const std::string worst(n, '\x01');  // every byte escaped: 4 bytes each
    EXPECT_LE(Quote(worst).size(), 4 * kQuotedBytes + 32) << n;
  }
}

}  // namespace
}  // namespace kvkeep
