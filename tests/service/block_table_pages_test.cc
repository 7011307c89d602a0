// GetBlockTables answers larger than a message come in pages
// (kvkeep.proto, GetBlockTablesRequest): each page within the limit, a
// layer's table split at a page boundary when it alone does not fit, the
// pages together equal to the store's tables; a layer that changes between
// pages is ABORTED; the C++ client joins the pages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/grpc_status_matchers.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int64_t kMessageLimit = 16 << 10;
constexpr int64_t kTokens = 5000;  // about 22 KB of table per layer

class BlockTablePagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerConfig config =
        testing::TestServerConfig({PoolSpec{testing::SmallLayout("m"), 4096}});
    config.max_message_bytes = kMessageLimit;
    absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
        testing::TestServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    SessionSpec spec;
    // "m", spelled so that GCC 12's -Wrestrict does not misfire under ASan.
    spec.layout = std::string(1, 'm');
    spec.policy = {"full", {}};
    absl::StatusOr<SessionId> id = store().CreateSession(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    id_ = *id;
    ASSERT_NO_FATAL_FAILURE(Append(0, kTokens));
  }

  CacheStore& store() { return server_->store(); }

  // Tokens at positions [from, from + n) of every layer.
  void Append(int64_t from, int64_t n) {
    std::vector<int64_t> positions(n);
    for (int64_t i = 0; i < n; ++i) positions[i] = from + i;
    std::vector<float> kv(n * 2 * 8, 0.5f);
    const LayerKv layer{std::as_bytes(std::span(kv)),
                        std::as_bytes(std::span(kv))};
    const std::vector<LayerKv> layers(2, layer);
    ASSERT_TRUE(store().Append(id_, AppendRequest{positions, layers}).ok());
  }

  grpc::Status Page(const std::string& token, int64_t max_page_bytes,
                    v1::GetBlockTablesResponse* out) {
    grpc::ClientContext ctx;
    v1::GetBlockTablesRequest request;
    request.set_session_id(SessionName(id_));
    request.set_page_token(token);
    request.set_max_page_bytes(max_page_bytes);
    return server_->stub().GetBlockTables(&ctx, request, out);
  }

  // The store's own tables, to compare with.
  void ExpectTablesOfTheStore(const v1::GetBlockTablesResponse& tables) {
    ASSERT_EQ(tables.tables_size(), 2);
    for (int32_t layer = 0; layer < 2; ++layer) {
      SCOPED_TRACE(layer);
      absl::StatusOr<BlockTable> want = store().GetBlockTable(id_, layer);
      ASSERT_TRUE(want.ok()) << want.status();
      const v1::BlockTable& got = tables.tables(layer);
      EXPECT_EQ(got.layer(), layer);
      EXPECT_EQ(got.version(), want->version);
      EXPECT_EQ(got.first_slot(), 0);
      EXPECT_THAT(got.pages(), ElementsAreArray(want->pages));
      EXPECT_THAT(got.positions(), ElementsAreArray(want->positions));
      EXPECT_THAT(got.cache_positions(),
                  ElementsAreArray(want->cache_positions));
    }
  }

  std::unique_ptr<testing::TestServer> server_;
  SessionId id_{};
};

// Pages fill up to the limit asked for (or the server's), and split a layer
// at a page boundary; joined, they are the store's tables.
TEST_F(BlockTablePagesTest, PagesStayUnderTheLimitAndJoinToTheTables) {
  for (int64_t limit : {int64_t{0}, int64_t{4096}}) {
    SCOPED_TRACE(limit);
    const int64_t bound = limit > 0 ? limit : kMessageLimit;
    v1::GetBlockTablesResponse whole;
    std::string token;
    int pages = 0;
    bool split = false;
    do {
      v1::GetBlockTablesResponse page;
      ASSERT_GRPC_OK(Page(token, limit, &page));
      EXPECT_LE(static_cast<int64_t>(page.ByteSizeLong()), bound);
      ASSERT_GT(page.tables_size(), 0);
      ++pages;
      for (const v1::BlockTable& part : page.tables()) {
        if (part.first_slot() == 0) {
          *whole.add_tables() = part;
          continue;
        }
        split = true;
        ASSERT_GT(whole.tables_size(), 0);
        v1::BlockTable& last = *whole.mutable_tables(whole.tables_size() - 1);
        ASSERT_EQ(last.layer(), part.layer());
        ASSERT_EQ(last.positions_size(), part.first_slot());
        EXPECT_EQ(part.first_slot() % part.page_tokens(), 0);
        last.mutable_pages()->MergeFrom(part.pages());
        last.mutable_positions()->MergeFrom(part.positions());
        last.mutable_cache_positions()->MergeFrom(part.cache_positions());
      }
      token = page.next_page_token();
    } while (!token.empty());
    EXPECT_GE(pages, limit > 0 ? 6 : 2);
    EXPECT_TRUE(split);
    ExpectTablesOfTheStore(whole);
  }
}

TEST_F(BlockTablePagesTest, TheClientJoinsThePages) {
  client::ClientOptions options;
  options.address = server_->address();
  absl::StatusOr<client::KvKeepClient> c =
      client::KvKeepClient::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<client::Session> session = c->OpenSession(SessionName(id_));
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<v1::GetBlockTablesResponse> tables = session->GetBlockTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ExpectTablesOfTheStore(*tables);
  EXPECT_TRUE(tables->next_page_token().empty());
}

TEST_F(BlockTablePagesTest, ALayerThatChangesBetweenPagesIsAborted) {
  v1::GetBlockTablesResponse first;
  ASSERT_GRPC_OK(Page("", 4096, &first));
  ASSERT_FALSE(first.next_page_token().empty());
  ASSERT_NO_FATAL_FAILURE(Append(kTokens, 1));  // a new version of each layer
  v1::GetBlockTablesResponse next;
  const grpc::Status s = Page(first.next_page_token(), 4096, &next);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(s.error_message(), HasSubstr("changed between pages"));
  // Asked again from the start, the answer is whole and current.
  ASSERT_NO_FATAL_FAILURE(ExpectTablesOfTheStore([&] {
    client::ClientOptions options;
    options.address = server_->address();
    client::KvKeepClient c = *client::KvKeepClient::Connect(options);
    return *c.OpenSession(SessionName(id_))->GetBlockTables();
  }()));
}

TEST_F(BlockTablePagesTest, BadTokensAndTinyPagesAreRefused) {
  v1::GetBlockTablesResponse page;
  for (const std::string& token :
       {std::string("bt1:9:0:0"), std::string("bt1:0:-4:0"),
        std::string("nonsense"), std::string(5000, 'x')}) {
    SCOPED_TRACE(token.substr(0, 20));
    const grpc::Status s = Page(token, 0, &page);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("page_token"));
    EXPECT_LT(s.error_message().size(), 400u);
  }
  const grpc::Status s = Page("", 100, &page);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("max_page_bytes"));
}

}  // namespace
}  // namespace kvkeep
