// TransferSession of a kivi_int4 session between real kvkeepd gRPC servers on
// loopback, over chunk messages ("host") and the data socket ("tcp"): the
// header carries format 2 and each layer's staging, the chunks the pages'
// key blocks as stored and the value records; the moved session then
// answers every call exactly as a twin that never moved (the same
// evictions and slot moves under h2o_page, the same ReadLayerAs bytes, key
// blocks, records and staging), and the response counts the bytes that went
// (key blocks and records, fewer than bf16's). A corrupted chunk fails the
// transfer with DATA_LOSS: the session stays on the source, unchanged and
// serving, and the target holds no page. A peer's hand-made header of an
// unknown format or with a short staging, and a kivi chunk that is not
// whole pages, are refused with INVALID_ARGUMENT, nothing held.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "services/transfer/session_state.h"
#include "tests/testing/faulty_page_sender.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_server.h"
#include "tests/testing/transfer_store.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

using ::kvkeep::test_data::AppendBuffers;
using ::testing::HasSubstr;

const ModelLayout kKivi = test_data::SmallLayout(DType::kKiviInt4, "kivi");

// A kvkeepd with a kivi_int4 pool and a data socket.
class Store : public testing::TransferStore {
 public:
  explicit Store(ServiceOptions options = {})
      : TransferStore(PoolSpec{kKivi, 256}, std::move(options)) {}

  grpc::Status Transfer(SessionId id, const std::string& target,
                        const std::string& transport,
                        v1::TransferSessionResponse* out) {
    return testing::TransferSession(*this, SessionName(id), target, out, "",
                                    absl::Seconds(60), transport);
  }
};

SessionId Open(CacheStore& store, const PolicySpec& policy) {
  SessionSpec spec{kKivi.name, policy};
  spec.budget.tokens = 12;
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  EXPECT_TRUE(id.ok()) << id.status();
  return id.ok() ? *id : 0;
}

// Position `pos` appended to `id` and, unless the policy is full, the same
// rows of attention (from a generator seeded with `pos`) folded in; the
// changes.
std::vector<LayerChange> Step(CacheStore& store, SessionId id, int64_t pos) {
  AppendBuffers data(kKivi, pos, 1);
  absl::StatusOr<StepResult> appended = store.Append(id, data.request());
  EXPECT_TRUE(appended.ok()) << appended.status();
  if (store.GetStats(id)->policy == "full") return appended->layers;
  std::mt19937 rng(static_cast<uint32_t>(pos));
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<std::vector<float>> rows(kKivi.num_layers);
  std::vector<LayerScores> scores;
  for (int32_t layer = 0; layer < kKivi.num_layers; ++layer) {
    absl::StatusOr<BlockTable> t = store.GetBlockTable(id, layer);
    EXPECT_TRUE(t.ok()) << t.status();
    for (size_t i = 0; i < t->positions.size(); ++i) {
      rows[layer].push_back(uniform(rng) / t->positions.size());
    }
    scores.push_back(
        LayerScores{layer, t->version, ScoreSource::kReduced, 1, rows[layer]});
  }
  absl::StatusOr<StepResult> r = store.UpdateScores(id, scores);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<LayerChange> out = appended->layers;
  out.insert(out.end(), r->layers.begin(), r->layers.end());
  return out;
}

void ExpectSame(CacheStore& a, SessionId a_id, CacheStore& b, SessionId b_id) {
  for (int32_t layer = 0; layer < kKivi.num_layers; ++layer) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      absl::StatusOr<LayerKvCopy> x = a.ReadLayerAs(a_id, layer, dtype);
      absl::StatusOr<LayerKvCopy> y = b.ReadLayerAs(b_id, layer, dtype);
      ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
      EXPECT_EQ(x->positions, y->positions);
      EXPECT_TRUE(x->keys == y->keys && x->values == y->values);
    }
  }
  absl::StatusOr<SessionSnapshot> x = a.ExportSession(a_id);
  absl::StatusOr<SessionSnapshot> y = b.ExportSession(b_id);
  ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
  for (size_t l = 0; l < x->layers.size(); ++l) {
    EXPECT_TRUE(x->layers[l].keys == y->layers[l].keys) << "layer " << l;
    EXPECT_TRUE(x->layers[l].values == y->layers[l].values) << "layer " << l;
    EXPECT_EQ(x->layers[l].kivi_staging, y->layers[l].kivi_staging);
    EXPECT_EQ(x->layers[l].score, y->layers[l].score);
  }
  EXPECT_EQ(a.GetStats(a_id)->bytes, b.GetStats(b_id)->bytes);
}

// Whether `store` gave back every page (a refused receive is cleaned up
// just after its answer), waiting up to a limit only a leak reaches.
bool Emptied(Store& store) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (store.used_pages() != 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return store.used_pages() == 0;
}

class EachTransport : public ::testing::TestWithParam<std::string> {};

TEST_P(EachTransport, AKiviSessionMovesAndContinuesAsItWouldHave) {
  Store source, target;
  for (const PolicySpec& policy :
       {PolicySpec{"full", {}},
        PolicySpec{"h2o_page", {{"sinks", "1"}, {"recent", "2"}}}}) {
    SCOPED_TRACE(policy.name);
    const SessionId twin = Open(source.store(), policy);
    const SessionId moved = Open(source.store(), policy);
    for (int64_t pos = 0; pos < 22; ++pos) {  // the open pages hold 2
      Step(source.store(), twin, pos);
      Step(source.store(), moved, pos);
    }
    absl::StatusOr<SessionSnapshot> state =
        source.store().ExportSession(moved, /*with_bytes=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    int64_t kivi_bytes = 0;
    for (const LayerSnapshot& l : state->layers) {
      kivi_bytes += static_cast<int64_t>(l.keys.size() + l.values.size());
    }
    v1::TransferSessionResponse response;
    const grpc::Status status =
        source.Transfer(moved, target.address(), GetParam(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.transport(), GetParam());
    // The pages' key blocks and value records, as stored.
    EXPECT_EQ(response.bytes(), kivi_bytes);
    EXPECT_EQ(source.store().GetStats(moved).status().code(),
              absl::StatusCode::kNotFound);
    ExpectSame(target.store(), moved, source.store(), twin);
    for (int64_t pos = 22; pos < 50; ++pos) {
      SCOPED_TRACE(pos);
      const std::vector<LayerChange> x = Step(target.store(), moved, pos);
      const std::vector<LayerChange> y = Step(source.store(), twin, pos);
      ASSERT_EQ(x.size(), y.size());
      for (size_t i = 0; i < x.size(); ++i) {
        EXPECT_EQ(x[i].evicted_positions, y[i].evicted_positions);
        EXPECT_EQ(x[i].moves, y[i].moves);
      }
      ExpectSame(target.store(), moved, source.store(), twin);
    }
    KV_ASSERT_OK(target.store().CloseSession(moved));
    KV_ASSERT_OK(source.store().CloseSession(twin));
  }
  EXPECT_EQ(source.used_pages(), 0);
  EXPECT_EQ(target.used_pages(), 0);
}

// A bit of a key block (first chunk) or of a value record flipped on the
// way, the original bytes' CRC32C claimed: the target refuses the chunk.
TEST_P(EachTransport, ACorruptedKiviChunkLeavesTheSessionWhereItWas) {
  for (const bool in_values : {false, true}) {
    SCOPED_TRACE(in_values ? "values" : "key blocks");
    ServiceOptions options;
    options.wrap_transfer_sender =
        testing::FaultyTransport([in_values](int64_t index) {
          testing::ChunkFault fault;
          fault.corrupt = index == 0;
          fault.in_values = in_values;
          fault.byte = 200;
          return fault;
        });
    Store source(options), target;
    const SessionId id = Open(source.store(), {"full", {}});
    for (int64_t pos = 0; pos < 9; ++pos) Step(source.store(), id, pos);
    absl::StatusOr<SessionSnapshot> before = source.store().ExportSession(id);
    ASSERT_TRUE(before.ok()) << before.status();
    v1::TransferSessionResponse response;
    const grpc::Status status =
        source.Transfer(id, target.address(), GetParam(), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS)
        << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("CRC32C"));
    EXPECT_TRUE(Emptied(target));
    absl::StatusOr<SessionSnapshot> after = source.store().ExportSession(id);
    ASSERT_TRUE(after.ok()) << after.status();
    for (size_t l = 0; l < after->layers.size(); ++l) {
      EXPECT_TRUE(after->layers[l].keys == before->layers[l].keys);
      EXPECT_EQ(after->layers[l].kivi_staging, before->layers[l].kivi_staging);
    }
    Step(source.store(), id, 9);  // still serving
  }
}

// A peer's ReceiveSession stream: `state` as the header, then `chunks`
// (if READY came) and the commit.
grpc::Status Receive(Store& target, const std::string& transfer_id,
                     const v1::SessionState& state,
                     const std::vector<v1::TransferMessage>& chunks) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("kvkeep-peer-token", testing::kTestPeerToken);
  auto stream = target.client().stub().ReceiveSession(&ctx);
  v1::TransferMessage header;
  header.set_transfer_id(transfer_id);
  *header.mutable_header() = state;
  v1::TransferReply reply;
  if (stream->Write(header) && stream->Read(&reply) &&
      reply.phase() == v1::TransferReply::READY) {
    for (const v1::TransferMessage& chunk : chunks) {
      if (!stream->Write(chunk)) break;
    }
    v1::TransferMessage commit;
    commit.set_commit(true);
    if (stream->Write(commit)) stream->Read(&reply);
  }
  stream->WritesDone();
  return stream->Finish();
}

TEST(KiviTransferTest, MalformedKiviHeadersAndChunksAreRefused) {
  Store source, target;
  const SessionId id = Open(source.store(), {"full", {}});
  for (int64_t pos = 0; pos < 6; ++pos) Step(source.store(), id, pos);
  absl::StatusOr<SessionSnapshot> snapshot =
      source.store().ExportSession(id, /*with_bytes=*/false);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  v1::SessionState good;
  StateToProto(*snapshot, &good);
  ASSERT_EQ(good.format(), 2u);
  ASSERT_EQ(good.layers(0).kivi_staging_size(), 2 * 128);

  v1::SessionState newer = good;
  newer.set_format(3);
  grpc::Status status = Receive(target, "newer", newer, {});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("format 3 is newer"));

  v1::SessionState short_staging = good;
  short_staging.mutable_layers(1)->mutable_kivi_staging()->RemoveLast();
  status = Receive(target, "short", short_staging, {});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("staging must hold the open page's 2 tokens"));

  // A chunk of one token's record and 10 key bytes, not a key block.
  v1::TransferMessage chunk;
  v1::TransferChunk* c = chunk.mutable_chunk();
  c->set_layer(0);
  c->set_first_slot(0);
  c->set_keys(std::string(10, 'k'));
  c->set_values(std::string(kKivi.page_layout().token_bytes(), 'v'));
  status = Receive(target, "split", good, {chunk});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("not whole kivi_int4 pages"));
  EXPECT_TRUE(Emptied(target));
  for (const TenantStats& t : target.store().Tenants()) EXPECT_EQ(t.bytes, 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, EachTransport,
                         ::testing::Values("host", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvkeep
