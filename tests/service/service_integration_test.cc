// kvkeep.v1 through the wire: a real KvKeepService on a loopback port (the
// way kvkeepd builds it: health service on, message size bounded) and the
// generated stubs over a real channel. Every RPC, every scoring source,
// SnapKV compression, a byte-exact KV round trip per dtype, the health check,
// and bad input: each refused with its status code and a message naming what
// was wrong, changing nothing, while another session keeps stepping.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "tests/testing/grpc_status_matchers.h"
#include "tests/testing/noise.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectStatus;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using ::testing::UnorderedElementsAreArray;

// Bounds a hung call (a bug) so the test fails instead of blocking; never
// reached by a healthy run, even under sanitizers.
constexpr std::chrono::seconds kCallDeadline(120);

// ---------------------------------------------------------------------------
// Test data: layouts, deterministic KV bytes and attention.

ModelLayout MakeLayout(std::string name, DType dtype, bool pre_rope = false) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 8;
  l.dtype = dtype;
  l.page_tokens = 4;
  l.keys_pre_rope = pre_rope;
  return l;
}

using ::kvkeep::testing::Mix;
using ::kvkeep::testing::NoiseF;

// One layer's keys (which = 0) or values (which = 1) for `positions`, in the
// layout's dtype: [n][kv_heads][head_dim]. `raw` fills every byte with noise
// (NaN and subnormal patterns included: the store must copy, not convert);
// otherwise finite values the store can score queries against.
std::string KvBytes(const ModelLayout& l, int32_t layer,
                    const std::vector<int64_t>& positions, int which,
                    bool raw) {
  const int64_t elems = int64_t{l.kv_heads} * l.head_dim;
  std::string out(positions.size() * elems * DTypeBytes(l.dtype), '\0');
  for (size_t t = 0; t < positions.size(); ++t) {
    if (raw) {
      const int64_t bytes = elems * DTypeBytes(l.dtype);
      for (int64_t b = 0; b < bytes; ++b) {
        out[t * bytes + b] =
            static_cast<char>(Mix(layer, positions[t], b, which + 10) & 0xffu);
      }
    } else {
      for (int64_t e = 0; e < elems; ++e) {
        StoreFromFloat(l.dtype, out.data(), t * elems + e,
                       NoiseF(layer, positions[t], e, which));
      }
    }
  }
  return out;
}

// One layer's attention for one step, as the test generates it; turned into
// a proto for the wire and a domain value for a local replica.
struct ScoreSpec {
  int32_t layer = 0;
  uint64_t version = 0;
  ScoreSource source = ScoreSource::kReduced;
  int32_t rows = 1;
  std::vector<float> data;
};

// One Decode step: an optional append (positions and per-layer K/V bytes)
// and scores for some layers.
struct StepSpec {
  std::vector<int64_t> positions;  // empty: no append
  std::vector<std::string> keys, values;
  std::vector<ScoreSpec> scores;
};

// Positive weights over n slots summing to `total`.
std::vector<float> Weights(int64_t n, float total, uint64_t seed,
                           uint64_t salt) {
  std::vector<float> w(n);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = 0.05f + std::abs(NoiseF(seed, salt, j, 77));
    sum += w[j];
  }
  for (float& x : w) x = static_cast<float>(x / sum * total);
  return w;
}

// Attention of `source` over n slots (one row), deterministic in seed.
ScoreSpec MakeScores(const ModelLayout& l, int32_t layer, uint64_t version,
                     ScoreSource source, int64_t n, uint64_t seed) {
  ScoreSpec s{layer, version, source, 1, {}};
  switch (source) {
    case ScoreSource::kReduced:
      s.data = Weights(n, 0.98f * l.query_heads, seed, layer);
      break;
    case ScoreSource::kPerHead:
      for (int32_t h = 0; h < l.query_heads; ++h) {
        std::vector<float> row = Weights(n, 0.98f, seed, layer * 64 + h);
        s.data.insert(s.data.end(), row.begin(), row.end());
      }
      break;
    case ScoreSource::kQueries:
      for (int64_t i = 0; i < int64_t{l.query_heads} * l.head_dim; ++i) {
        s.data.push_back(2.0f * NoiseF(seed, layer, i, 99));
      }
      break;
  }
  return s;
}

v1::LayerScores ScoresToProto(const ScoreSpec& s) {
  v1::LayerScores out;
  out.set_layer(s.layer);
  out.set_version(s.version);
  switch (s.source) {
    case ScoreSource::kPerHead:
      out.mutable_per_head()->set_rows(s.rows);
      out.mutable_per_head()->mutable_values()->Add(s.data.begin(),
                                                    s.data.end());
      break;
    case ScoreSource::kReduced:
      out.mutable_reduced()->set_rows(s.rows);
      out.mutable_reduced()->mutable_values()->Add(s.data.begin(),
                                                   s.data.end());
      break;
    case ScoreSource::kQueries:
      out.mutable_queries()->set_rows(s.rows);
      out.mutable_queries()->mutable_values()->Add(s.data.begin(),
                                                   s.data.end());
      break;
  }
  return out;
}

v1::AppendRequest AppendToProto(const StepSpec& s,
                                const std::string& session_id) {
  v1::AppendRequest out;
  out.set_session_id(session_id);
  out.mutable_positions()->Add(s.positions.begin(), s.positions.end());
  for (size_t l = 0; l < s.keys.size(); ++l) {
    v1::LayerKv* kv = out.add_layers();
    kv->set_keys(s.keys[l]);
    kv->set_values(s.values[l]);
  }
  return out;
}

v1::DecodeStep StepToProto(const StepSpec& s, const std::string& session_id) {
  v1::DecodeStep out;
  out.set_session_id(session_id);
  if (!s.positions.empty()) *out.mutable_append() = AppendToProto(s, "");
  for (const ScoreSpec& score : s.scores) {
    *out.add_scores() = ScoresToProto(score);
  }
  return out;
}

// The same step as domain values, pointing into `s` (which must outlive it).
struct DomainStep {
  std::vector<LayerKv> kv;
  std::vector<LayerScores> scores;
  AppendRequest append;

  explicit DomainStep(const StepSpec& s) {
    for (size_t l = 0; l < s.keys.size(); ++l) {
      kv.push_back(
          LayerKv{{reinterpret_cast<const std::byte*>(s.keys[l].data()),
                   s.keys[l].size()},
                  {reinterpret_cast<const std::byte*>(s.values[l].data()),
                   s.values[l].size()}});
    }
    append = AppendRequest{s.positions, kv};
    for (const ScoreSpec& x : s.scores) {
      scores.push_back(LayerScores{x.layer, x.version, x.source, x.rows,
                                   std::span<const float>(x.data)});
    }
  }
};

// What a worker knows of a session: per layer, the version and resident
// count the last reply reported.
struct View {
  std::vector<uint64_t> version;
  std::vector<int64_t> resident;

  static View FromCreate(const v1::CreateSessionResponse& r) {
    View v;
    v.version.assign(r.layer_versions().begin(), r.layer_versions().end());
    v.resident.assign(v.version.size(), 0);
    return v;
  }
  void Apply(const v1::StepResult& r) {
    for (const v1::LayerChange& c : r.layers()) {
      version[c.layer()] = c.version();
      resident[c.layer()] = c.resident();
    }
  }
};

// A decode step at `position` (if set) with `source` attention for every
// layer (if set), over the slots the view says there will be.
StepSpec MakeStep(const ModelLayout& l, const View& v,
                  std::optional<int64_t> position,
                  std::optional<ScoreSource> source, uint64_t seed,
                  bool raw_kv = false) {
  StepSpec s;
  if (position.has_value()) {
    s.positions = {*position};
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      s.keys.push_back(KvBytes(l, layer, s.positions, 0, raw_kv));
      s.values.push_back(KvBytes(l, layer, s.positions, 1, raw_kv));
    }
  }
  if (source.has_value()) {
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      const int64_t n = v.resident[layer] + (position.has_value() ? 1 : 0);
      s.scores.push_back(
          MakeScores(l, layer, v.version[layer], *source, n, seed));
    }
  }
  return s;
}

// Expects what the wire reported for one call to equal what the domain did
// for the same input. Page ids belong to each store's own pool, so pages are
// compared by count.
void ExpectSameChanges(const v1::StepResult& wire, const StepResult& local,
                       const std::string& what) {
  ASSERT_EQ(wire.layers_size(), static_cast<int>(local.layers.size())) << what;
  for (size_t l = 0; l < local.layers.size(); ++l) {
    const v1::LayerChange& w = wire.layers(static_cast<int>(l));
    const LayerChange& d = local.layers[l];
    SCOPED_TRACE(absl::StrCat(what, ", layer ", l));
    EXPECT_EQ(w.layer(), d.layer);
    EXPECT_EQ(w.version(), d.version);
    EXPECT_EQ(w.resident(), d.resident);
    EXPECT_THAT(w.evicted_positions(), ElementsAreArray(d.evicted_positions));
    ASSERT_EQ(w.moves_size(), static_cast<int>(d.moves.size()));
    for (int m = 0; m < w.moves_size(); ++m) {
      EXPECT_EQ(w.moves(m).from_slot(), d.moves[m].from_slot);
      EXPECT_EQ(w.moves(m).to_slot(), d.moves[m].to_slot);
    }
    EXPECT_EQ(w.pages_freed_size(), static_cast<int>(d.pages_freed.size()));
    EXPECT_EQ(w.pages_added_size(), static_cast<int>(d.pages_added.size()));
  }
}

// ---------------------------------------------------------------------------
// The server and the client calls.

struct TestServerOptions {
  std::vector<PoolSpec> pools;
  int64_t max_sessions = 1 << 16;
  int64_t max_sessions_per_tenant = 0;
  int64_t max_bytes_per_tenant = 0;
  absl::flat_hash_map<std::string, std::string> tenants_by_token;
  int max_message_bytes = 1 << 20;
};

std::vector<PoolSpec> DefaultPools(int64_t pages = 512) {
  return {
      PoolSpec{MakeLayout("tiny-f32", DType::kF32), pages},
      PoolSpec{MakeLayout("tiny-f16", DType::kF16), pages},
      PoolSpec{MakeLayout("tiny-bf16", DType::kBF16), pages},
      PoolSpec{MakeLayout("tiny-prerope", DType::kBF16, true), pages},
  };
}

// A kvkeepd (KvKeepServer) on 127.0.0.1:<ephemeral>, and a channel to it;
// null (after a test failure) if it cannot start.
std::unique_ptr<testing::TestServer> StartTestServer(
    const TestServerOptions& options) {
  ServerConfig config = testing::TestServerConfig(options.pools);
  config.max_sessions = options.max_sessions;
  config.max_sessions_per_tenant = options.max_sessions_per_tenant;
  config.max_bytes_per_tenant = options.max_bytes_per_tenant;
  config.max_message_bytes = options.max_message_bytes;
  for (const auto& [token, tenant] : options.tenants_by_token) {
    config.tenants.push_back(TenantToken{tenant, token});
  }
  absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
      testing::TestServer::Start(config);
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  return *std::move(server);
}

void Prepare(grpc::ClientContext& ctx, const std::string& token) {
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
}

struct CreateArgs {
  std::string layout = "tiny-f32";
  std::string policy = "h2o";
  std::map<std::string, std::string> params;
  int64_t budget = 16;
  std::vector<int64_t> per_layer;
  std::string idempotency_key;
  std::string token;
};

grpc::Status Create(v1::KvKeep::Stub& stub, const CreateArgs& a,
                    v1::CreateSessionResponse* resp) {
  grpc::ClientContext ctx;
  Prepare(ctx, a.token);
  v1::CreateSessionRequest req;
  req.set_layout(a.layout);
  req.set_policy(a.policy);
  for (const auto& [k, v] : a.params) (*req.mutable_policy_params())[k] = v;
  req.mutable_budget()->set_tokens(a.budget);
  req.mutable_budget()->mutable_per_layer()->Add(a.per_layer.begin(),
                                                 a.per_layer.end());
  req.set_idempotency_key(a.idempotency_key);
  return stub.CreateSession(&ctx, req, resp);
}

grpc::Status Stats(v1::KvKeep::Stub& stub, const std::string& id,
                   v1::SessionStats* out, const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  v1::GetSessionStatsRequest req;
  req.set_session_id(id);
  return stub.GetSessionStats(&ctx, req, out);
}

grpc::Status Close(v1::KvKeep::Stub& stub, const std::string& id,
                   v1::CloseSessionResponse* out = nullptr,
                   const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  v1::CloseSessionRequest req;
  req.set_session_id(id);
  v1::CloseSessionResponse unused;
  return stub.CloseSession(&ctx, req, out != nullptr ? out : &unused);
}

grpc::Status List(v1::KvKeep::Stub& stub, v1::ListSessionsResponse* out,
                  const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  return stub.ListSessions(&ctx, v1::ListSessionsRequest(), out);
}

grpc::Status Info(v1::KvKeep::Stub& stub, v1::ServerInfo* out,
                  const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  return stub.GetServerInfo(&ctx, v1::GetServerInfoRequest(), out);
}

grpc::Status Append(v1::KvKeep::Stub& stub, const v1::AppendRequest& req,
                    v1::StepResult* out, const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  return stub.Append(&ctx, req, out);
}

grpc::Status Tables(v1::KvKeep::Stub& stub, const std::string& id,
                    std::vector<int32_t> layers,
                    v1::GetBlockTablesResponse* out,
                    const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  v1::GetBlockTablesRequest req;
  req.set_session_id(id);
  req.mutable_layers()->Add(layers.begin(), layers.end());
  return stub.GetBlockTables(&ctx, req, out);
}

grpc::Status Compress(v1::KvKeep::Stub& stub, const std::string& id,
                      const std::vector<ScoreSpec>& window, v1::StepResult* out,
                      const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  v1::CompressPromptRequest req;
  req.set_session_id(id);
  for (const ScoreSpec& s : window) *req.add_window() = ScoresToProto(s);
  return stub.CompressPrompt(&ctx, req, out);
}

grpc::Status ReadKv(v1::KvKeep::Stub& stub, const std::string& id,
                    std::vector<int32_t> layers, std::vector<v1::KvChunk>* out,
                    const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  v1::ReadKvRequest req;
  req.set_session_id(id);
  req.mutable_layers()->Add(layers.begin(), layers.end());
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
      stub.ReadKv(&ctx, req);
  v1::KvChunk chunk;
  while (reader->Read(&chunk)) out->push_back(chunk);
  return reader->Finish();
}

grpc::Status Prefill(v1::KvKeep::Stub& stub,
                     const std::vector<v1::AppendRequest>& chunks,
                     v1::AppendPrefillResponse* out,
                     const std::string& token = "") {
  grpc::ClientContext ctx;
  Prepare(ctx, token);
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
      stub.AppendPrefill(&ctx, out);
  for (const v1::AppendRequest& c : chunks) {
    if (!writer->Write(c)) break;  // the server ended the call
  }
  writer->WritesDone();
  return writer->Finish();
}

// One Decode stream: one reply per step.
class DecodeStream {
 public:
  explicit DecodeStream(v1::KvKeep::Stub& stub, const std::string& token = "") {
    Prepare(ctx_, token);
    stream_ = stub.Decode(&ctx_);
  }
  ~DecodeStream() {
    if (!finished_) {
      ctx_.TryCancel();
      stream_->Finish();
    }
  }

  // Sends a step and reads its reply; false once the stream has ended
  // (Finish() then says why).
  bool Step(const v1::DecodeStep& step, v1::DecodeStepResult* result) {
    if (!stream_->Write(step)) return false;
    return stream_->Read(result);
  }
  grpc::Status Finish() {
    finished_ = true;
    stream_->WritesDone();
    return stream_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::DecodeStep, v1::DecodeStepResult>>
      stream_;
  bool finished_ = false;
};

// Sends one step on a fresh stream, expecting the stream to end with an
// error, and returns that status.
grpc::Status FailingStep(v1::KvKeep::Stub& stub, const v1::DecodeStep& step,
                         const std::string& token = "") {
  DecodeStream stream(stub, token);
  v1::DecodeStepResult result;
  if (stream.Step(step, &result)) {
    ADD_FAILURE() << "the step was accepted: " << result.DebugString();
  }
  return stream.Finish();
}

// A session that steps on its own long-lived Decode stream: proof that
// whatever happened to other sessions and streams left it unharmed.
class Bystander {
 public:
  void Start(v1::KvKeep::Stub& stub, const std::string& token = "") {
    CreateArgs args;
    args.policy = "h2o";
    args.params = {{"recent", "2"}};
    args.budget = 6;
    args.token = token;
    v1::CreateSessionResponse resp;
    ASSERT_GRPC_OK(Create(stub, args, &resp));
    id_ = resp.session_id();
    view_ = View::FromCreate(resp);
    layout_ = MakeLayout("tiny-f32", DType::kF32);
    stream_ = std::make_unique<DecodeStream>(stub, token);
  }

  // One append + reduced-scores step; expects it to succeed and to keep the
  // layer within budget.
  void Advance() {
    const StepSpec spec = MakeStep(layout_, view_, next_position_,
                                   ScoreSource::kReduced, next_position_);
    v1::DecodeStepResult result;
    ASSERT_TRUE(stream_->Step(StepToProto(spec, first_ ? id_ : ""), &result))
        << "the bystander's stream failed: "
        << stream_->Finish().error_message();
    first_ = false;
    ++next_position_;
    const View before = view_;
    view_.Apply(result.append());
    view_.Apply(result.scores());
    for (size_t l = 0; l < view_.version.size(); ++l) {
      EXPECT_GT(view_.version[l], before.version[l]);
      EXPECT_EQ(view_.resident[l], std::min<int64_t>(next_position_, 6));
    }
  }

  void Finish() { EXPECT_GRPC_OK(stream_->Finish()); }
  const std::string& id() const { return id_; }

 private:
  ModelLayout layout_;
  std::string id_;
  View view_;
  std::unique_ptr<DecodeStream> stream_;
  int64_t next_position_ = 0;
  bool first_ = true;
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(TestServerOptions{DefaultPools()}); }

  void StartServer(const TestServerOptions& options) {
    server_.reset();
    server_ = StartTestServer(options);
    ASSERT_NE(server_, nullptr);
  }

  v1::KvKeep::Stub& stub() { return server_->stub(); }

  // A new session; fails the test (and returns "") if it cannot be made.
  std::string NewSession(const CreateArgs& args, View* view = nullptr) {
    v1::CreateSessionResponse resp;
    const grpc::Status s = Create(stub(), args, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (view != nullptr) *view = View::FromCreate(resp);
    return resp.session_id();
  }

  // Without the lease's time left and hold: a lease is not the session's
  // state but moves with every call (docs/sessions.md).
  v1::SessionStats StatsOf(const std::string& id) {
    v1::SessionStats stats;
    EXPECT_GRPC_OK(Stats(stub(), id, &stats));
    stats.clear_lease_seconds_left();
    stats.clear_lease_held();
    return stats;
  }
  v1::GetBlockTablesResponse TablesOf(const std::string& id) {
    v1::GetBlockTablesResponse tables;
    EXPECT_GRPC_OK(Tables(stub(), id, {}, &tables));
    return tables;
  }

  // Appends positions [first, first + n) to every layer with one Append.
  void AppendTokens(const std::string& id, const ModelLayout& l, int64_t first,
                    int64_t n, View* view = nullptr, bool raw = false) {
    StepSpec s;
    for (int64_t p = first; p < first + n; ++p) s.positions.push_back(p);
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      s.keys.push_back(KvBytes(l, layer, s.positions, 0, raw));
      s.values.push_back(KvBytes(l, layer, s.positions, 1, raw));
    }
    v1::StepResult result;
    EXPECT_GRPC_OK(Append(stub(), AppendToProto(s, id), &result));
    if (view != nullptr) view->Apply(result);
  }

  std::unique_ptr<testing::TestServer> server_;
  const ModelLayout f32_ = MakeLayout("tiny-f32", DType::kF32);
};

// ---------------------------------------------------------------------------
// Every RPC.

TEST_F(ServiceTest, ServerInfoReportsLayoutsPoolsAndPolicies) {
  v1::ServerInfo info;
  ASSERT_GRPC_OK(Info(stub(), &info));
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), "host");
  EXPECT_EQ(info.max_message_bytes(), 1 << 20);
  EXPECT_EQ(info.max_sessions(), 1 << 16);
  EXPECT_THAT(
      info.policies(),
      UnorderedElementsAre("full", "window", "streaming_llm", "h2o", "tova",
                           "scissorhands", "snapkv", "h2o_page"));
  ASSERT_EQ(info.layouts_size(), 4);
  ASSERT_EQ(info.pools_size(), 4);
  const v1::Layout& f16 = info.layouts(1);
  EXPECT_EQ(f16.name(), "tiny-f16");
  EXPECT_EQ(f16.num_layers(), 2);
  EXPECT_EQ(f16.kv_heads(), 2);
  EXPECT_EQ(f16.query_heads(), 4);
  EXPECT_EQ(f16.head_dim(), 8);
  EXPECT_EQ(f16.dtype(), v1::DTYPE_F16);
  EXPECT_EQ(f16.page_tokens(), 4);
  EXPECT_FALSE(f16.keys_pre_rope());
  EXPECT_EQ(f16.page_bytes(), 2 * 4 * 2 * 8 * 2);
  EXPECT_EQ(info.layouts(0).dtype(), v1::DTYPE_F32);
  EXPECT_EQ(info.layouts(0).page_bytes(), 2 * 4 * 2 * 8 * 4);
  EXPECT_EQ(info.layouts(2).dtype(), v1::DTYPE_BF16);
  EXPECT_TRUE(info.layouts(3).keys_pre_rope());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(info.pools(i).layout(), info.layouts(i).name());
    EXPECT_EQ(info.pools(i).capacity_pages(), 512);
    EXPECT_EQ(info.pools(i).used_pages(), 0);
    EXPECT_EQ(info.pools(i).page_bytes(), info.layouts(i).page_bytes());
    EXPECT_EQ(info.pools(i).sessions(), 0);
    EXPECT_EQ(info.pools(i).allocation_failures(), 0);
  }

  // Pool use follows the sessions.
  const std::string id = NewSession({.layout = "tiny-f16", .policy = "full"});
  AppendTokens(id, MakeLayout("tiny-f16", DType::kF16), 0, 9);
  ASSERT_GRPC_OK(Info(stub(), &info));
  EXPECT_EQ(info.pools(1).used_pages(), 2 * 3);  // 2 layers x ceil(9 / 4)
  EXPECT_EQ(info.pools(1).sessions(), 1);
  EXPECT_EQ(info.pools(0).used_pages(), 0);
}

// ServerInfo.policy_info describes every policy, and what it describes is
// what the server does: defaults and lower bounds are taken, values past a
// range and unlisted names are refused, and a step's scores are taken by
// the per-step policies only (probabilities and queries alike).
TEST_F(ServiceTest, ServerInfoDescribesEveryPolicyAsItBehaves) {
  v1::ServerInfo info;
  ASSERT_GRPC_OK(Info(stub(), &info));
  ASSERT_EQ(info.policy_info_size(), info.policies_size());
  std::map<std::string, const v1::PolicyInfo*> by_name;
  for (int i = 0; i < info.policy_info_size(); ++i) {
    EXPECT_EQ(info.policy_info(i).name(), info.policies(i));
    by_name[info.policy_info(i).name()] = &info.policy_info(i);
  }
  const std::map<std::string, v1::PolicyInfo::Input> inputs = {
      {"full", v1::PolicyInfo::INPUT_NONE},
      {"window", v1::PolicyInfo::INPUT_NONE},
      {"streaming_llm", v1::PolicyInfo::INPUT_NONE},
      {"h2o", v1::PolicyInfo::INPUT_PER_STEP},
      {"tova", v1::PolicyInfo::INPUT_PER_STEP},
      {"scissorhands", v1::PolicyInfo::INPUT_PER_STEP},
      {"snapkv", v1::PolicyInfo::INPUT_COMPRESS},
      {"h2o_page", v1::PolicyInfo::INPUT_PER_STEP}};
  ASSERT_EQ(by_name.size(), inputs.size());
  for (const auto& [name, input] : inputs) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(by_name.contains(name));
    const v1::PolicyInfo& p = *by_name[name];
    EXPECT_EQ(p.input(), input);
    EXPECT_EQ(p.accepts_probabilities(), input != v1::PolicyInfo::INPUT_NONE);
    EXPECT_EQ(p.accepts_queries(), input != v1::PolicyInfo::INPUT_NONE);
    EXPECT_FALSE(p.summary().empty());
    EXPECT_FALSE(p.budget_rule().empty());
  }
  EXPECT_TRUE(by_name["full"]->params().empty());
  ASSERT_EQ(by_name["streaming_llm"]->params_size(), 3);
  EXPECT_EQ(by_name["streaming_llm"]->params(0).name(), "sinks");
  EXPECT_EQ(by_name["streaming_llm"]->params(0).default_value(), "4");
  const v1::PolicyInfo& snapkv = *by_name["snapkv"];
  EXPECT_THAT(snapkv.budget_rule(), HasSubstr("window"));
  ASSERT_EQ(snapkv.params_size(), 3);
  const v1::PolicyParam& window = snapkv.params(0);
  EXPECT_EQ(window.name(), "window");
  EXPECT_EQ(window.type(), v1::PolicyParam::TYPE_INT);
  EXPECT_EQ(window.default_value(), "32");
  EXPECT_EQ(window.min(), 1);
  EXPECT_EQ(window.max(), 1 << 20);
  const v1::PolicyParam& kernel = snapkv.params(1);
  EXPECT_EQ(kernel.name(), "kernel");
  EXPECT_EQ(kernel.default_value(), "5");
  EXPECT_EQ(kernel.rule(), "odd");
  const v1::PolicyParam& pooling = snapkv.params(2);
  EXPECT_EQ(pooling.type(), v1::PolicyParam::TYPE_CHOICE);
  EXPECT_EQ(pooling.default_value(), "avgpool");
  EXPECT_THAT(pooling.choices(), ElementsAre("avgpool", "maxpool"));

  for (const v1::PolicyInfo& p : info.policy_info()) {
    SCOPED_TRACE(p.name());
    std::map<std::string, std::string> defaults, lowest;
    for (const v1::PolicyParam& q : p.params()) {
      defaults[q.name()] = q.default_value();
      lowest[q.name()] = q.type() == v1::PolicyParam::TYPE_CHOICE
                             ? q.choices(0)
                             : absl::StrCat(static_cast<int64_t>(q.min()));
    }
    v1::CreateSessionResponse resp;
    EXPECT_GRPC_OK(Create(
        stub(), {.policy = p.name(), .params = defaults, .budget = 64}, &resp));
    EXPECT_GRPC_OK(Create(
        stub(), {.policy = p.name(), .params = lowest, .budget = 64}, &resp));
    for (const v1::PolicyParam& q : p.params()) {
      std::string over = "not one of them";
      if (q.type() == v1::PolicyParam::TYPE_INT) {
        over = absl::StrCat(static_cast<int64_t>(q.max()) + 1);
      } else if (q.type() == v1::PolicyParam::TYPE_DOUBLE) {
        over = absl::StrCat(q.max() * 2);
      }
      ExpectStatus(
          Create(
              stub(),
              {.policy = p.name(), .params = {{q.name(), over}}, .budget = 64},
              &resp),
          grpc::StatusCode::INVALID_ARGUMENT, {q.name(), over});
    }
    ExpectStatus(Create(stub(),
                        {.policy = p.name(),
                         .params = {{"no_such_param", "1"}},
                         .budget = 64},
                        &resp),
                 grpc::StatusCode::INVALID_ARGUMENT, {"no_such_param"});

    for (ScoreSource source : {ScoreSource::kReduced, ScoreSource::kQueries}) {
      View view;
      const std::string id =
          NewSession({.policy = p.name(), .budget = 64}, &view);
      AppendTokens(id, f32_, 0, 3, &view);
      const v1::DecodeStep step =
          StepToProto(MakeStep(f32_, view, std::nullopt, source, 1), id);
      if (p.input() == v1::PolicyInfo::INPUT_PER_STEP) {
        DecodeStream stream(stub());
        v1::DecodeStepResult result;
        EXPECT_TRUE(stream.Step(step, &result))
            << stream.Finish().error_message();
        EXPECT_GRPC_OK(stream.Finish());
      } else {
        ExpectStatus(FailingStep(stub(), step),
                     grpc::StatusCode::FAILED_PRECONDITION,
                     {"per-step attention scores"});
      }
    }
  }
}

TEST_F(ServiceTest, SessionLifecycle) {
  v1::CreateSessionResponse created;
  ASSERT_GRPC_OK(Create(stub(),
                        {.policy = "h2o",
                         .params = {{"recent", "4"}, {"sinks", "1"}},
                         .per_layer = {10, 20}},
                        &created));
  const std::string a = created.session_id();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_THAT(created.layer_budgets(), ElementsAre(10, 20));
  EXPECT_THAT(created.layer_versions(), ElementsAre(1, 1));

  // No policy: the server's default (h2o), refined by the parameters sent.
  const std::string b =
      NewSession({.policy = "", .params = {{"recent", "3"}}, .budget = 8});
  ASSERT_NE(a, b);

  v1::SessionStats stats = StatsOf(a);
  EXPECT_EQ(stats.session_id(), a);
  EXPECT_EQ(stats.layout(), "tiny-f32");
  EXPECT_EQ(stats.policy(), "h2o");
  EXPECT_EQ(stats.tenant(), "");
  EXPECT_EQ(stats.resident_tokens(), 0);
  EXPECT_EQ(stats.pages(), 0);
  EXPECT_THAT(stats.layer_budget(), ElementsAre(10, 20));
  EXPECT_THAT(stats.layer_version(), ElementsAre(1, 1));
  EXPECT_EQ(StatsOf(b).policy(), "h2o");
  EXPECT_THAT(StatsOf(b).layer_budget(), ElementsAre(8, 8));

  AppendTokens(a, f32_, 0, 5);
  stats = StatsOf(a);
  EXPECT_EQ(stats.resident_tokens(), 10);
  EXPECT_EQ(stats.pages(), 4);
  EXPECT_EQ(stats.resident_bytes(), 4 * 2 * 4 * 2 * 8 * 4);
  EXPECT_THAT(stats.layer_resident(), ElementsAre(5, 5));
  EXPECT_THAT(stats.layer_version(), ElementsAre(2, 2));

  v1::ListSessionsResponse list;
  ASSERT_GRPC_OK(List(stub(), &list));
  std::vector<std::string> listed;
  for (const v1::SessionStats& s : list.sessions()) {
    listed.push_back(s.session_id());
    if (s.session_id() == a) {
      EXPECT_EQ(s.resident_tokens(), 10);
    }
  }
  EXPECT_THAT(listed, UnorderedElementsAre(a, b));

  v1::CloseSessionResponse closed;
  ASSERT_GRPC_OK(Close(stub(), a, &closed));
  EXPECT_EQ(closed.freed_pages(), 4);
  ExpectStatus(Stats(stub(), a, &stats), grpc::StatusCode::NOT_FOUND,
               {a, "not found"});
  ExpectStatus(Close(stub(), a), grpc::StatusCode::NOT_FOUND, {a});
  list.Clear();
  ASSERT_GRPC_OK(List(stub(), &list));
  ASSERT_EQ(list.sessions_size(), 1);
  EXPECT_EQ(list.sessions(0).session_id(), b);
  v1::ServerInfo info;
  ASSERT_GRPC_OK(Info(stub(), &info));
  EXPECT_EQ(info.pools(0).used_pages(), 0);
  EXPECT_EQ(info.pools(0).sessions(), 1);
}

TEST_F(ServiceTest, CreateRefusesBadRequests) {
  v1::CreateSessionResponse resp;
  ExpectStatus(Create(stub(), {.layout = "no-such-layout"}, &resp),
               grpc::StatusCode::NOT_FOUND, {"no-such-layout"});
  ExpectStatus(Create(stub(), {.policy = "lru"}, &resp),
               grpc::StatusCode::INVALID_ARGUMENT, {"lru"});
  ExpectStatus(Create(stub(), {.params = {{"recnet", "4"}}}, &resp),
               grpc::StatusCode::INVALID_ARGUMENT, {"recnet"});
  ExpectStatus(
      Create(stub(), {.params = {{"recent", "40"}}, .budget = 16}, &resp),
      grpc::StatusCode::INVALID_ARGUMENT, {"budget"});
  ExpectStatus(Create(stub(), {.per_layer = {4, 4, 4}}, &resp),
               grpc::StatusCode::INVALID_ARGUMENT, {"3"});
  v1::ListSessionsResponse list;
  ASSERT_GRPC_OK(List(stub(), &list));
  EXPECT_THAT(list.sessions(), IsEmpty());
}

TEST_F(ServiceTest, CreateIsIdempotentWithAKey) {
  const std::string a = NewSession({.idempotency_key = "req-1"});
  const std::string again = NewSession({.idempotency_key = "req-1"});
  const std::string other = NewSession({.idempotency_key = "req-2"});
  const std::string plain1 = NewSession({});
  const std::string plain2 = NewSession({});
  EXPECT_EQ(a, again);
  EXPECT_NE(a, other);
  EXPECT_NE(plain1, plain2);
  v1::ListSessionsResponse list;
  ASSERT_GRPC_OK(List(stub(), &list));
  EXPECT_EQ(list.sessions_size(), 4);
  // Once closed, the key makes a new session.
  ASSERT_GRPC_OK(Close(stub(), a));
  const std::string after = NewSession({.idempotency_key = "req-1"});
  EXPECT_NE(after, a);
}

TEST_F(ServiceTest, AppendAndBlockTables) {
  const std::string id = NewSession({.policy = "full"});
  StepSpec s;
  s.positions = {10, 11, 13};
  for (int32_t layer = 0; layer < 2; ++layer) {
    s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, false));
    s.values.push_back(KvBytes(f32_, layer, s.positions, 1, false));
  }
  v1::StepResult result;
  ASSERT_GRPC_OK(Append(stub(), AppendToProto(s, id), &result));
  ASSERT_EQ(result.layers_size(), 2);
  std::vector<int32_t> pages;
  for (int l = 0; l < 2; ++l) {
    const v1::LayerChange& c = result.layers(l);
    EXPECT_EQ(c.layer(), l);
    EXPECT_EQ(c.version(), 2u);
    EXPECT_EQ(c.resident(), 3);
    EXPECT_THAT(c.evicted_positions(), IsEmpty());
    EXPECT_THAT(c.moves(), IsEmpty());
    EXPECT_THAT(c.pages_freed(), IsEmpty());
    ASSERT_EQ(c.pages_added_size(), 1);
    pages.push_back(c.pages_added(0));
  }
  EXPECT_NE(pages[0], pages[1]);
  // Two more tokens: the second page.
  s.positions = {20, 21};
  for (int32_t layer = 0; layer < 2; ++layer) {
    s.keys[layer] = KvBytes(f32_, layer, s.positions, 0, false);
    s.values[layer] = KvBytes(f32_, layer, s.positions, 1, false);
  }
  ASSERT_GRPC_OK(Append(stub(), AppendToProto(s, id), &result));
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(result.layers(l).resident(), 5);
    ASSERT_EQ(result.layers(l).pages_added_size(), 1);
    pages.push_back(result.layers(l).pages_added(0));
  }

  v1::GetBlockTablesResponse tables;
  ASSERT_GRPC_OK(Tables(stub(), id, {}, &tables));
  ASSERT_EQ(tables.tables_size(), 2);
  for (int l = 0; l < 2; ++l) {
    const v1::BlockTable& t = tables.tables(l);
    EXPECT_EQ(t.layer(), l);
    EXPECT_EQ(t.version(), 3u);
    EXPECT_EQ(t.page_tokens(), 4);
    EXPECT_THAT(t.pages(), ElementsAre(pages[l], pages[2 + l]));
    EXPECT_THAT(t.positions(), ElementsAre(10, 11, 13, 20, 21));
    EXPECT_THAT(t.cache_positions(), ElementsAre(0, 1, 2, 3, 4));
  }
  tables.Clear();
  ASSERT_GRPC_OK(Tables(stub(), id, {1}, &tables));
  ASSERT_EQ(tables.tables_size(), 1);
  EXPECT_EQ(tables.tables(0).layer(), 1);
  ExpectStatus(Tables(stub(), id, {2}, &tables),
               grpc::StatusCode::INVALID_ARGUMENT, {id, "layer 2"});
}

TEST_F(ServiceTest, AppendPrefillInChunks) {
  // window keeps the last 12 tokens; chunks of 10, 7 and 1 tokens.
  const std::string id = NewSession({.policy = "window", .budget = 12});
  std::vector<v1::AppendRequest> chunks;
  int64_t next = 0;
  for (int64_t n : {10, 7, 1}) {
    StepSpec s;
    for (int64_t i = 0; i < n; ++i) s.positions.push_back(next++);
    for (int32_t layer = 0; layer < 2; ++layer) {
      s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, true));
      s.values.push_back(KvBytes(f32_, layer, s.positions, 1, true));
    }
    // Only the first chunk names the session.
    chunks.push_back(AppendToProto(s, chunks.empty() ? id : ""));
  }
  v1::AppendPrefillResponse resp;
  ASSERT_GRPC_OK(Prefill(stub(), chunks, &resp));
  ASSERT_EQ(resp.chunks_size(), 3);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(resp.chunks(0).layers(l).resident(), 10);
    EXPECT_THAT(resp.chunks(0).layers(l).evicted_positions(), IsEmpty());
    EXPECT_EQ(resp.chunks(1).layers(l).resident(), 12);
    EXPECT_THAT(resp.chunks(1).layers(l).evicted_positions(),
                ElementsAre(0, 1, 2, 3, 4));
    EXPECT_EQ(resp.chunks(2).layers(l).resident(), 12);
    EXPECT_THAT(resp.chunks(2).layers(l).evicted_positions(), ElementsAre(5));
    // Each evicting append bumps the version twice: the eviction, then the
    // new tokens.
    EXPECT_EQ(resp.chunks(2).layers(l).version(), 6u);
  }
  const v1::GetBlockTablesResponse tables = TablesOf(id);
  for (const v1::BlockTable& t : tables.tables()) {
    EXPECT_THAT(t.positions(), UnorderedElementsAre(6, 7, 8, 9, 10, 11, 12, 13,
                                                    14, 15, 16, 17));
    EXPECT_EQ(t.pages_size(), 3);
  }

  // A chunk naming the session again is fine; one naming another is not.
  const std::string other = NewSession({.policy = "full"});
  StepSpec s;
  s.positions = {100};
  for (int32_t layer = 0; layer < 2; ++layer) {
    s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, true));
    s.values.push_back(KvBytes(f32_, layer, s.positions, 1, true));
  }
  chunks = {AppendToProto(s, id)};
  s.positions = {101};
  chunks.push_back(AppendToProto(s, id));
  s.positions = {102};
  chunks.push_back(AppendToProto(s, other));
  resp.Clear();
  ExpectStatus(Prefill(stub(), chunks, &resp),
               grpc::StatusCode::INVALID_ARGUMENT,
               {"chunk 2", id, other, "2 earlier chunks were appended"});
  EXPECT_EQ(StatsOf(id).layer_version(0), 10u);  // the two good chunks
  EXPECT_EQ(StatsOf(other).resident_tokens(), 0);
}

TEST_F(ServiceTest, AppendPrefillRefusesBadChunks) {
  const std::string id = NewSession({.policy = "full"});
  StepSpec s;
  s.positions = {0, 1};
  for (int32_t layer = 0; layer < 2; ++layer) {
    s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, false));
    s.values.push_back(KvBytes(f32_, layer, s.positions, 1, false));
  }
  v1::AppendPrefillResponse resp;
  // The first message must name the session.
  ExpectStatus(Prefill(stub(), {AppendToProto(s, "")}, &resp),
               grpc::StatusCode::INVALID_ARGUMENT, {"session_id"});
  // A failing chunk: the chunks before it stay, the message says so.
  StepSpec bad = s;
  bad.positions = {1, 2};  // 1 is not after 1
  resp.Clear();
  ExpectStatus(
      Prefill(stub(), {AppendToProto(s, id), AppendToProto(bad, "")}, &resp),
      grpc::StatusCode::INVALID_ARGUMENT,
      {"chunk 1", id, "strictly increase", "1 earlier chunks were appended"});
  EXPECT_EQ(StatsOf(id).resident_tokens(), 4);
  // Unknown and malformed sessions.
  resp.Clear();
  ExpectStatus(Prefill(stub(), {AppendToProto(s, "0123456789abcdef")}, &resp),
               grpc::StatusCode::NOT_FOUND, {"0123456789abcdef"});
  ExpectStatus(Prefill(stub(), {AppendToProto(s, "nope")}, &resp),
               grpc::StatusCode::INVALID_ARGUMENT, {"nope"});
  // An empty stream appends nothing and succeeds.
  resp.Clear();
  ASSERT_GRPC_OK(Prefill(stub(), {}, &resp));
  EXPECT_THAT(resp.chunks(), IsEmpty());
}

// The three scoring sources through a Decode stream, checked step by step
// against a local replica (the domain store, no gRPC) fed the same steps:
// the same evictions, moves, versions and residents for every reply.
class DecodeSourceTest
    : public ServiceTest,
      public ::testing::WithParamInterface<std::tuple<ScoreSource, bool>> {};

TEST_P(DecodeSourceTest, EveryReplyMatchesALocalReplica) {
  const auto [source, pages] = GetParam();
  const std::string policy = pages ? "h2o_page" : "h2o";
  const std::map<std::string, std::string> params = {
      {"sinks", "1"}, {"recent", "3"}, {"slack", pages ? "4" : "0"}};
  View view;
  const std::string id = NewSession(
      {.layout = "tiny-bf16", .policy = policy, .params = params, .budget = 12},
      &view);
  ASSERT_FALSE(id.empty());
  const ModelLayout layout = MakeLayout("tiny-bf16", DType::kBF16);

  StoreOptions replica_options;
  replica_options.pools = {PoolSpec{layout, 64}};
  absl::StatusOr<std::unique_ptr<CacheStore>> replica =
      CacheStore::Create(replica_options);
  ASSERT_TRUE(replica.ok()) << replica.status();
  SessionSpec spec;
  spec.layout = layout.name;
  spec.policy = PolicySpec{policy, params};
  spec.budget.tokens = 12;
  absl::StatusOr<SessionId> local = (*replica)->CreateSession(spec);
  ASSERT_TRUE(local.ok()) << local.status();

  DecodeStream stream(stub());
  int64_t position = 0;
  int64_t evicted = 0;
  for (int step = 0; step < 120; ++step) {
    // Mostly append + scores; every 10th step appends without scores and
    // the next sends scores only (the over-budget layer is settled then).
    const bool append = step % 10 != 6;
    const bool scores = step % 10 != 5;
    const StepSpec spec_step =
        MakeStep(layout, view, append ? std::optional(position) : std::nullopt,
                 scores ? std::optional(source) : std::nullopt, step);
    if (append) position += 1 + step % 3;  // positions may skip
    v1::DecodeStepResult wire;
    ASSERT_TRUE(stream.Step(StepToProto(spec_step, step == 0 ? id : ""), &wire))
        << "step " << step << ": " << stream.Finish().error_message();
    const DomainStep domain(spec_step);
    absl::StatusOr<StepOutcome> expected =
        (*replica)->Step(*local, domain.append, domain.scores);
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(wire.has_append(), append);
    if (append) {
      ExpectSameChanges(wire.append(), expected->append,
                        absl::StrCat("step ", step, " append"));
    }
    ExpectSameChanges(wire.scores(), expected->scores,
                      absl::StrCat("step ", step, " scores"));
    view.Apply(wire.append());
    view.Apply(wire.scores());
    for (const v1::LayerChange& c : wire.scores().layers()) {
      evicted += c.evicted_positions_size();
      if (scores) {
        EXPECT_LE(c.resident(), 12);
      }
    }
  }
  EXPECT_GRPC_OK(stream.Finish());
  EXPECT_GT(evicted, 100);

  // The session as the server and the replica see it.
  const v1::SessionStats stats = StatsOf(id);
  absl::StatusOr<SessionStats> want = (*replica)->GetStats(*local);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(stats.resident_tokens(), want->resident_tokens);
  EXPECT_EQ(stats.pages(), want->pages);
  EXPECT_EQ(stats.evicted_tokens(), want->evicted_tokens);
  EXPECT_EQ(stats.evicted_score(), want->evicted_score);
  EXPECT_EQ(stats.score_updates(), want->score_updates);
  EXPECT_EQ(stats.score_updates(), 2 * 108);
  const v1::GetBlockTablesResponse tables = TablesOf(id);
  for (int32_t l = 0; l < 2; ++l) {
    absl::StatusOr<BlockTable> t = (*replica)->GetBlockTable(*local, l);
    ASSERT_TRUE(t.ok());
    EXPECT_THAT(tables.tables(l).positions(), ElementsAreArray(t->positions));
    EXPECT_THAT(tables.tables(l).cache_positions(),
                ElementsAreArray(t->cache_positions));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sources, DecodeSourceTest,
    ::testing::Combine(::testing::Values(ScoreSource::kPerHead,
                                         ScoreSource::kReduced,
                                         ScoreSource::kQueries),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<DecodeSourceTest::ParamType>& info) {
      const char* source =
          std::get<0>(info.param) == ScoreSource::kPerHead   ? "PerHead"
          : std::get<0>(info.param) == ScoreSource::kReduced ? "Reduced"
                                                             : "Queries";
      return absl::StrCat(source, std::get<1>(info.param) ? "H2OPage" : "H2O");
    });

// Each source, with attention concentrated on one token (position 2): h2o
// keeps it through every step while everything else unprotected cycles out.
class HotTokenTest : public ServiceTest,
                     public ::testing::WithParamInterface<ScoreSource> {};

TEST_P(HotTokenTest, TheAttendedTokenSurvives) {
  const ScoreSource source = GetParam();
  constexpr int64_t kHot = 2;
  View view;
  const std::string id = NewSession(
      {.policy = "h2o", .params = {{"recent", "2"}}, .budget = 6}, &view);
  DecodeStream stream(stub());
  std::set<int64_t> evicted;
  for (int64_t pos = 0; pos < 40; ++pos) {
    StepSpec s;
    s.positions = {pos};
    for (int32_t layer = 0; layer < 2; ++layer) {
      // The hot token's keys point along dimension 0 of every kv head; the
      // others are zero, so the queries below attend (almost) only to it.
      std::string keys(2 * 8 * 4, '\0');
      if (pos == kHot) {
        for (int h = 0; h < 2; ++h)
          StoreFromFloat(DType::kF32, keys.data(), h * 8, 8.0f);
      }
      s.keys.push_back(keys);
      s.values.push_back(KvBytes(f32_, layer, s.positions, 1, false));
    }
    // The slots the attention covers: the resident ones and the new token.
    v1::GetBlockTablesResponse tables = TablesOf(id);
    for (int32_t layer = 0; layer < 2; ++layer) {
      std::vector<int64_t> slots(tables.tables(layer).positions().begin(),
                                 tables.tables(layer).positions().end());
      slots.push_back(pos);
      const int64_t n = static_cast<int64_t>(slots.size());
      ScoreSpec score{layer, view.version[layer], source, 1, {}};
      auto row = [&](float hot_mass) {
        std::vector<float> r(n, 0.0f);
        const bool has_hot = pos >= kHot;
        for (int64_t j = 0; j < n; ++j) {
          r[j] = slots[j] == kHot
                     ? hot_mass
                     : (has_hot ? (1.0f - hot_mass) : 1.0f) /
                           static_cast<float>(n - (has_hot ? 1 : 0));
        }
        return r;
      };
      if (source == ScoreSource::kReduced) {
        score.data = row(0.9f);
        for (float& x : score.data) x *= 4.0f;
      } else if (source == ScoreSource::kPerHead) {
        for (int h = 0; h < 4; ++h) {
          const std::vector<float> r = row(0.9f);
          score.data.insert(score.data.end(), r.begin(), r.end());
        }
      } else {
        score.data.assign(4 * 8, 0.0f);
        for (int h = 0; h < 4; ++h) score.data[h * 8] = 8.0f;
      }
      s.scores.push_back(score);
    }
    v1::DecodeStepResult result;
    ASSERT_TRUE(stream.Step(StepToProto(s, pos == 0 ? id : ""), &result))
        << stream.Finish().error_message();
    view.Apply(result.append());
    view.Apply(result.scores());
    for (const v1::LayerChange& c : result.scores().layers()) {
      evicted.insert(c.evicted_positions().begin(),
                     c.evicted_positions().end());
      EXPECT_EQ(c.resident(), std::min<int64_t>(pos + 1, 6));
    }
  }
  EXPECT_GRPC_OK(stream.Finish());
  EXPECT_FALSE(evicted.contains(kHot));
  EXPECT_EQ(evicted.size(), 40u - 6u);
  const v1::GetBlockTablesResponse final_tables = TablesOf(id);
  for (const v1::BlockTable& t : final_tables.tables()) {
    EXPECT_THAT(t.positions(), ::testing::Contains(kHot));
    EXPECT_THAT(t.positions(), ::testing::Contains(39));
    EXPECT_THAT(t.positions(), ::testing::Contains(38));
  }
}

INSTANTIATE_TEST_SUITE_P(Sources, HotTokenTest,
                         ::testing::Values(ScoreSource::kPerHead,
                                           ScoreSource::kReduced,
                                           ScoreSource::kQueries),
                         [](const ::testing::TestParamInfo<ScoreSource>& info) {
                           return info.param == ScoreSource::kPerHead
                                      ? "PerHead"
                                  : info.param == ScoreSource::kReduced
                                      ? "Reduced"
                                      : "Queries";
                         });

TEST_F(ServiceTest, DecodeStepsWithoutAppendOrScores) {
  // window: appends only. A step without scores evicts on append.
  View view;
  const std::string w = NewSession({.policy = "window", .budget = 4}, &view);
  DecodeStream stream(stub());
  for (int64_t pos = 0; pos < 10; ++pos) {
    v1::DecodeStepResult result;
    ASSERT_TRUE(
        stream.Step(StepToProto(MakeStep(f32_, view, pos, std::nullopt, pos),
                                pos == 0 ? w : ""),
                    &result))
        << stream.Finish().error_message();
    ASSERT_TRUE(result.has_append());
    for (const v1::LayerChange& c : result.append().layers()) {
      EXPECT_EQ(c.resident(), std::min<int64_t>(pos + 1, 4));
      if (pos >= 4) {
        EXPECT_THAT(c.evicted_positions(), ElementsAre(pos - 4));
      }
    }
    view.Apply(result.append());
  }
  EXPECT_GRPC_OK(stream.Finish());

  // h2o: a step with scores only (no append) at the current versions.
  View hv;
  const std::string h = NewSession({.budget = 3}, &hv);
  AppendTokens(h, f32_, 0, 5, &hv);
  DecodeStream scores_only(stub());
  v1::DecodeStepResult result;
  ASSERT_TRUE(scores_only.Step(
      StepToProto(MakeStep(f32_, hv, std::nullopt, ScoreSource::kReduced, 1),
                  h),
      &result))
      << scores_only.Finish().error_message();
  EXPECT_FALSE(result.has_append());
  for (const v1::LayerChange& c : result.scores().layers()) {
    EXPECT_EQ(c.resident(), 3);
    EXPECT_EQ(c.evicted_positions_size(), 2);
  }
  hv.Apply(result.scores());
  // An empty step (nothing to append, no scores) changes nothing.
  ASSERT_TRUE(scores_only.Step(v1::DecodeStep(), &result))
      << scores_only.Finish().error_message();
  for (const v1::LayerChange& c : result.scores().layers()) {
    EXPECT_EQ(c.resident(), 3);
    EXPECT_EQ(c.version(), hv.version[c.layer()]);
    EXPECT_THAT(c.evicted_positions(), IsEmpty());
  }
  EXPECT_GRPC_OK(scores_only.Finish());
}

TEST_F(ServiceTest, CompressPromptSnapKv) {
  // window 4, kernel 1 (no smoothing), budget 10: the window plus the 6
  // prefix tokens the window attends to most.
  const std::map<std::string, std::string> params = {
      {"window", "4"}, {"kernel", "1"}, {"pooling", "maxpool"}};
  const std::string id =
      NewSession({.policy = "snapkv", .params = params, .budget = 10});
  View view;
  view.version = {1, 1};
  view.resident = {0, 0};
  AppendTokens(id, f32_, 0, 40, &view);
  const std::vector<int64_t> hot = {3, 7, 11, 20, 29, 33};
  std::vector<ScoreSpec> window;
  for (int32_t layer = 0; layer < 2; ++layer) {
    // Row r is the query of token 36 + r: causal over positions <= 36 + r.
    ScoreSpec s{layer,
                view.version[layer],
                layer == 0 ? ScoreSource::kReduced : ScoreSource::kPerHead,
                4,
                {}};
    const int heads = layer == 0 ? 1 : 4;
    const float scale = layer == 0 ? 4.0f : 1.0f;
    for (int h = 0; h < heads; ++h) {
      for (int r = 0; r < 4; ++r) {
        std::vector<float> row(40, 0.0f);
        const int64_t visible = 36 + r + 1;
        for (int64_t j = 0; j < visible; ++j) {
          row[j] = 0.2f / static_cast<float>(visible);
        }
        for (int64_t p : hot) row[p] += 0.05f + 0.001f * static_cast<float>(p);
        for (float& x : row) x *= scale;
        s.data.insert(s.data.end(), row.begin(), row.end());
      }
    }
    window.push_back(s);
  }
  v1::StepResult result;
  ASSERT_GRPC_OK(Compress(stub(), id, window, &result));
  std::vector<int64_t> kept = hot;
  for (int64_t p = 36; p < 40; ++p) kept.push_back(p);
  for (const v1::LayerChange& c : result.layers()) {
    EXPECT_EQ(c.resident(), 10);
    EXPECT_EQ(c.evicted_positions_size(), 30);
    EXPECT_EQ(c.version(), 3u);
    for (int64_t p : kept) {
      EXPECT_THAT(c.evicted_positions(),
                  ::testing::Not(::testing::Contains(p)));
    }
  }
  const v1::GetBlockTablesResponse final_tables = TablesOf(id);
  for (const v1::BlockTable& t : final_tables.tables()) {
    EXPECT_THAT(t.positions(), UnorderedElementsAreArray(kept));
    EXPECT_EQ(t.pages_size(), 3);
  }
  const v1::SessionStats stats = StatsOf(id);
  EXPECT_TRUE(stats.compressed());
  EXPECT_EQ(stats.evicted_tokens(), 60);

  // Once only; and only snapkv sessions compress.
  ExpectStatus(Compress(stub(), id, window, &result),
               grpc::StatusCode::FAILED_PRECONDITION,
               {id, "already compressed"});
  const std::string h2o = NewSession({});
  ExpectStatus(Compress(stub(), h2o, window, &result),
               grpc::StatusCode::FAILED_PRECONDITION, {h2o, "snapkv"});

  // Query-vector windows (what SnapKV itself computes), for every layer.
  View qv;
  const std::string q =
      NewSession({.policy = "snapkv", .params = params, .budget = 10}, &qv);
  AppendTokens(q, f32_, 0, 30, &qv);
  std::vector<ScoreSpec> queries;
  for (int32_t layer = 0; layer < 2; ++layer) {
    ScoreSpec s{layer, qv.version[layer], ScoreSource::kQueries, 4, {}};
    for (int i = 0; i < 4 * 4 * 8; ++i)
      s.data.push_back(NoiseF(layer, i, 5, 5));
    queries.push_back(s);
  }
  // Not every layer: refused, nothing changed.
  ExpectStatus(Compress(stub(), q, {queries[0]}, &result),
               grpc::StatusCode::INVALID_ARGUMENT, {q, "every layer"});
  ASSERT_GRPC_OK(Compress(stub(), q, queries, &result));
  for (const v1::LayerChange& c : result.layers()) {
    EXPECT_EQ(c.resident(), 10);
    EXPECT_EQ(c.evicted_positions_size(), 20);
  }
}

// KV bytes go in with Append/AppendPrefill/Decode and come back from ReadKv
// byte for byte, for every resident token, after evictions moved them.
class ReadKvTest : public ServiceTest,
                   public ::testing::WithParamInterface<DType> {};

TEST_P(ReadKvTest, RoundTripIsByteExact) {
  const DType dtype = GetParam();
  const std::string name = absl::StrCat("tiny-", std::string(DTypeName(dtype)));
  const ModelLayout layout = MakeLayout(name, dtype);
  // A small message limit, so a layer comes back in several chunks.
  TestServerOptions options{DefaultPools()};
  options.max_message_bytes = 4096;
  StartServer(options);

  View view;
  const std::string id = NewSession({.layout = name,
                                     .policy = "h2o",
                                     .params = {{"sinks", "2"}, {"slack", "3"}},
                                     .budget = 40},
                                    &view);
  // An empty session: one empty message per layer.
  std::vector<v1::KvChunk> chunks;
  ASSERT_GRPC_OK(ReadKv(stub(), id, {}, &chunks));
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].layer(), 0);
  EXPECT_EQ(chunks[1].layer(), 1);
  EXPECT_THAT(chunks[0].positions(), IsEmpty());

  // A prompt in chunks, then decode steps with evictions; raw bytes
  // throughout (NaN patterns included).
  std::vector<v1::AppendRequest> prefill;
  for (int64_t first = 0; first < 30; first += 10) {
    StepSpec s;
    for (int64_t p = first; p < first + 10; ++p) s.positions.push_back(p);
    for (int32_t layer = 0; layer < 2; ++layer) {
      s.keys.push_back(KvBytes(layout, layer, s.positions, 0, true));
      s.values.push_back(KvBytes(layout, layer, s.positions, 1, true));
    }
    prefill.push_back(AppendToProto(s, id));
  }
  v1::AppendPrefillResponse prefilled;
  ASSERT_GRPC_OK(Prefill(stub(), prefill, &prefilled));
  view.Apply(prefilled.chunks(2));
  DecodeStream stream(stub());
  for (int64_t pos = 30; pos < 90; ++pos) {
    v1::DecodeStepResult result;
    ASSERT_TRUE(stream.Step(
        StepToProto(MakeStep(layout, view, pos, ScoreSource::kReduced, pos,
                             /*raw_kv=*/true),
                    pos == 30 ? id : ""),
        &result))
        << stream.Finish().error_message();
    view.Apply(result.append());
    view.Apply(result.scores());
  }
  ASSERT_GRPC_OK(stream.Finish());
  const v1::GetBlockTablesResponse tables = TablesOf(id);
  EXPECT_EQ(StatsOf(id).evicted_tokens(), 2 * (90 - view.resident[0]));

  for (const std::vector<int32_t>& layers :
       {std::vector<int32_t>{}, std::vector<int32_t>{1}}) {
    chunks.clear();
    ASSERT_GRPC_OK(ReadKv(stub(), id, layers, &chunks));
    std::map<int32_t, int64_t> next_slot;
    std::map<int32_t, int> messages;
    for (const v1::KvChunk& c : chunks) {
      const v1::BlockTable& t = tables.tables(c.layer());
      SCOPED_TRACE(absl::StrCat("layer ", c.layer(), " slot ", c.first_slot()));
      EXPECT_EQ(c.version(), t.version());
      EXPECT_EQ(c.first_slot(), next_slot[c.layer()]);
      ++messages[c.layer()];
      const int64_t n = c.positions_size();
      const int64_t token_bytes = 2 * 8 * DTypeBytes(dtype);
      ASSERT_EQ(static_cast<int64_t>(c.keys().size()), n * token_bytes);
      ASSERT_EQ(static_cast<int64_t>(c.values().size()), n * token_bytes);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = c.first_slot() + i;
        ASSERT_LT(slot, t.positions_size());
        const int64_t pos = c.positions(static_cast<int>(i));
        EXPECT_EQ(pos, t.positions(static_cast<int>(slot)));
        EXPECT_EQ(c.keys().substr(i * token_bytes, token_bytes),
                  KvBytes(layout, c.layer(), {pos}, 0, true))
            << "keys of position " << pos;
        EXPECT_EQ(c.values().substr(i * token_bytes, token_bytes),
                  KvBytes(layout, c.layer(), {pos}, 1, true))
            << "values of position " << pos;
      }
      next_slot[c.layer()] += n;
    }
    const std::vector<int32_t> want =
        layers.empty() ? std::vector<int32_t>{0, 1} : layers;
    ASSERT_EQ(next_slot.size(), want.size());
    for (int32_t l : want) {
      EXPECT_EQ(next_slot[l], tables.tables(l).positions_size());
      EXPECT_GT(messages[l], 1) << "expected several chunks for layer " << l;
    }
  }
  ExpectStatus(ReadKv(stub(), id, {5}, &chunks),
               grpc::StatusCode::INVALID_ARGUMENT, {id, "layer 5"});
}

INSTANTIATE_TEST_SUITE_P(DTypes, ReadKvTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// grpc.health.v1.Health/Check through a generic call (grpc's generated
// health stub is not installed): HealthCheckRequest{service = 1} in,
// HealthCheckResponse{status = 1} out, SERVING = 1.
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& service, std::string* response) {
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1);
  grpc::ByteBuffer resp;
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  Prepare(ctx, "");
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                    &req, &resp,
                    [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status status = done.get_future().get();
  if (status.ok()) {
    std::vector<grpc::Slice> slices;
    if (resp.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        response->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
  }
  return status;
}

TEST_F(ServiceTest, HealthCheckServing) {
  std::string response;
  ASSERT_GRPC_OK(HealthCheck(server_->channel(), "", &response));
  EXPECT_EQ(response, std::string("\x08\x01", 2));  // status: SERVING
  response.clear();
  ExpectStatus(HealthCheck(server_->channel(), "no.such.Service", &response),
               grpc::StatusCode::NOT_FOUND, {});
}

// ---------------------------------------------------------------------------
// Bad input through the wire: each refused with its code and a message that
// names what was wrong; nothing changes; other sessions go on.

TEST_F(ServiceTest, UnknownAndMalformedSessions) {
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  bystander.Advance();
  const std::string unknown = "00000000deadbeef";
  v1::SessionStats stats;
  v1::StepResult result;
  v1::GetBlockTablesResponse tables;
  std::vector<v1::KvChunk> chunks;
  v1::AppendRequest append;
  StepSpec s = MakeStep(f32_, View{{1, 1}, {0, 0}}, 0, std::nullopt, 0);
  for (const std::string& id : {unknown}) {
    ExpectStatus(Stats(stub(), id, &stats), grpc::StatusCode::NOT_FOUND,
                 {id, "not found"});
    ExpectStatus(Close(stub(), id), grpc::StatusCode::NOT_FOUND, {id});
    ExpectStatus(Append(stub(), AppendToProto(s, id), &result),
                 grpc::StatusCode::NOT_FOUND, {id});
    ExpectStatus(Tables(stub(), id, {}, &tables), grpc::StatusCode::NOT_FOUND,
                 {id});
    ExpectStatus(ReadKv(stub(), id, {}, &chunks), grpc::StatusCode::NOT_FOUND,
                 {id});
    ExpectStatus(Compress(stub(), id, {}, &result), grpc::StatusCode::NOT_FOUND,
                 {id});
    ExpectStatus(FailingStep(stub(), StepToProto(s, id)),
                 grpc::StatusCode::NOT_FOUND, {id});
    bystander.Advance();
  }
  for (const std::string& id :
       {std::string("xyz"), std::string("00000000DEADBEEF"),
        std::string("00000000deadbeef0"), std::string("0x000000deadbeef"),
        std::string("")}) {
    SCOPED_TRACE(absl::StrCat("session id '", id, "'"));
    const std::initializer_list<std::string> what = {absl::StrCat("'", id, "'"),
                                                     "16 lowercase hex digits"};
    ExpectStatus(Stats(stub(), id, &stats), grpc::StatusCode::INVALID_ARGUMENT,
                 what);
    ExpectStatus(Close(stub(), id), grpc::StatusCode::INVALID_ARGUMENT, what);
    ExpectStatus(Append(stub(), AppendToProto(s, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT, what);
    ExpectStatus(Tables(stub(), id, {}, &tables),
                 grpc::StatusCode::INVALID_ARGUMENT, what);
    ExpectStatus(ReadKv(stub(), id, {}, &chunks),
                 grpc::StatusCode::INVALID_ARGUMENT, what);
    ExpectStatus(Compress(stub(), id, {}, &result),
                 grpc::StatusCode::INVALID_ARGUMENT, what);
    if (!id.empty()) {
      ExpectStatus(FailingStep(stub(), StepToProto(s, id)),
                   grpc::StatusCode::INVALID_ARGUMENT, what);
    }
    bystander.Advance();
  }
  bystander.Finish();
}

// A value a client sends is echoed bounded (cache_store/quote.h): a
// 10,000-byte value in any of the request fields an error message names
// gives a short message (at most 64 of its bytes and its size), and a
// stream on the same channel goes on. Echoed whole, such a status broke the
// client's 8 KiB metadata limit and with it every stream on the channel.
TEST_F(ServiceTest, HugeValuesAreQuotedBoundedAndTheChannelLives) {
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  bystander.Advance();
  const std::string huge(10000, 'a');
  const auto expect_bounded = [&](const grpc::Status& s, grpc::StatusCode code,
                                  absl::string_view field) {
    SCOPED_TRACE(field);
    ExpectStatus(s, code, {"'aaaaaaaa", "...' (10000 bytes)"});
    EXPECT_LT(s.error_message().size(), 400u) << s.error_message();
    bystander.Advance();
  };
  v1::CreateSessionResponse created;
  v1::SessionStats stats;
  expect_bounded(Close(stub(), huge), grpc::StatusCode::INVALID_ARGUMENT,
                 "CloseSession.session_id");
  expect_bounded(Stats(stub(), huge, &stats),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 "GetSessionStats.session_id");
  expect_bounded(Create(stub(), {.layout = huge}, &created),
                 grpc::StatusCode::NOT_FOUND, "layout");
  expect_bounded(Create(stub(), {.policy = huge}, &created),
                 grpc::StatusCode::INVALID_ARGUMENT, "policy");
  expect_bounded(Create(stub(), {.params = {{huge, "1"}}}, &created),
                 grpc::StatusCode::INVALID_ARGUMENT, "parameter name");
  expect_bounded(Create(stub(), {.params = {{"recent", huge}}}, &created),
                 grpc::StatusCode::INVALID_ARGUMENT, "parameter value");
  {
    grpc::ClientContext ctx;
    Prepare(ctx, "");
    v1::CreateSessionRequest req;
    req.set_layout("tiny-f32");
    req.set_policy("h2o");
    req.mutable_budget()->set_tokens(16);
    req.mutable_budget()->set_schedule(huge);
    expect_bounded(stub().CreateSession(&ctx, req, &created),
                   grpc::StatusCode::INVALID_ARGUMENT, "budget schedule");
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, "");
    v1::MapPoolRequest req;
    req.set_layout(huge);
    req.set_session_id(bystander.id());
    v1::MapPoolResponse resp;
    expect_bounded(stub().MapPool(&ctx, req, &resp),
                   grpc::StatusCode::INVALID_ARGUMENT, "MapPool.layout");
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, "");
    v1::TransferSessionRequest req;
    req.set_session_id(bystander.id());
    req.set_target("127.0.0.1:1");
    req.set_transport(huge);
    v1::TransferSessionResponse resp;
    expect_bounded(stub().TransferSession(&ctx, req, &resp),
                   grpc::StatusCode::INVALID_ARGUMENT, "transport");
  }
  bystander.Finish();
}

TEST_F(ServiceTest, BadAppendsChangeNothing) {
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  View view;
  const std::string id = NewSession({.budget = 8}, &view);
  AppendTokens(id, f32_, 0, 3, &view);
  const v1::SessionStats before = StatsOf(id);
  const v1::GetBlockTablesResponse tables_before = TablesOf(id);
  v1::StepResult result;

  StepSpec good = MakeStep(f32_, view, 3, std::nullopt, 0);
  {
    StepSpec bad = good;  // one layer of two
    bad.keys.pop_back();
    bad.values.pop_back();
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 {id, "1 layers", "tiny-f32", "has 2"});
  }
  {
    StepSpec bad = good;  // three layers of two
    bad.keys.push_back(bad.keys[0]);
    bad.values.push_back(bad.values[0]);
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT, {id, "3 layers"});
  }
  {
    StepSpec bad = good;  // layer 1's keys are 4 bytes short
    bad.keys[1].resize(bad.keys[1].size() - 4);
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 {id, "layer 1", "60/64 bytes", "expected 64"});
  }
  {
    StepSpec bad = good;  // values of two tokens for one
    bad.values[0] += bad.values[0];
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT, {id, "layer 0", "64/128"});
  }
  {
    StepSpec bad = good;  // position 2 is not after 2
    bad.positions = {2};
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 {id, "strictly increase", "position 2"});
  }
  {
    StepSpec bad = good;  // no tokens
    bad.positions.clear();
    ExpectStatus(Append(stub(), AppendToProto(bad, id), &result),
                 grpc::StatusCode::INVALID_ARGUMENT, {id, "zero tokens"});
  }
  // The same through a Decode step.
  {
    StepSpec bad = good;
    bad.keys[1].resize(bad.keys[1].size() - 4);
    ExpectStatus(FailingStep(stub(), StepToProto(bad, id)),
                 grpc::StatusCode::INVALID_ARGUMENT, {id, "layer 1", "60/64"});
  }
  bystander.Advance();
  const v1::SessionStats after = StatsOf(id);
  EXPECT_EQ(after.DebugString(), before.DebugString());
  EXPECT_EQ(TablesOf(id).DebugString(), tables_before.DebugString());
  // The good append still goes through.
  ASSERT_GRPC_OK(Append(stub(), AppendToProto(good, id), &result));
  EXPECT_EQ(result.layers(0).resident(), 4);
  bystander.Advance();
  bystander.Finish();
}

TEST_F(ServiceTest, BadScoresChangeNothing) {
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  View view;
  const std::string id = NewSession({.budget = 4}, &view);
  AppendTokens(id, f32_, 0, 4, &view);
  const v1::SessionStats before = StatsOf(id);
  const v1::GetBlockTablesResponse tables_before = TablesOf(id);
  // Each bad step appends position 4 with scores; the step is refused
  // whole, so the append does not happen either.
  auto step = [&](ScoreSource source) {
    return MakeStep(f32_, view, 4, source, 7);
  };
  struct Case {
    std::string name;
    StepSpec spec;
    grpc::StatusCode code;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases;
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[1].data[2] = std::numeric_limits<float>::quiet_NaN();
    cases.push_back({"NaN reduced",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 1", "NaN"}});
  }
  {
    StepSpec s = step(ScoreSource::kPerHead);
    s.scores[0].data[3] = std::numeric_limits<float>::quiet_NaN();
    cases.push_back({"NaN per head",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 0", "NaN"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[0].data[0] = std::numeric_limits<float>::infinity();
    cases.push_back({"infinite",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 0", "infinity"}});
  }
  {
    StepSpec s = step(ScoreSource::kQueries);
    s.scores[1].data[5] = std::numeric_limits<float>::quiet_NaN();
    cases.push_back({"NaN query",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 1", "non-finite"}});
  }
  {
    StepSpec s = step(ScoreSource::kPerHead);
    s.scores[1].data[1] = -0.25f;
    cases.push_back({"negative",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 1", "negative", "-0.25"}});
  }
  {
    StepSpec s = step(ScoreSource::kPerHead);
    s.scores[0].data[0] += 0.5f;  // head 0's row sums to 1.48
    cases.push_back({"row sum",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 0", "summing to"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[0].data.pop_back();  // 4 floats over 5 slots
    cases.push_back({"short",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 0", "4 floats", "expected 5"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[0].rows = 0;
    cases.push_back(
        {"rows 0", s, grpc::StatusCode::INVALID_ARGUMENT, {"rows = 0"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[1].layer = 0;
    cases.push_back(
        {"twice", s, grpc::StatusCode::INVALID_ARGUMENT, {"layer 0", "twice"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[1].layer = 7;
    cases.push_back({"no layer",
                     s,
                     grpc::StatusCode::INVALID_ARGUMENT,
                     {"layer 7", "outside"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[1].version = view.version[1] - 1;
    cases.push_back({"stale",
                     s,
                     grpc::StatusCode::FAILED_PRECONDITION,
                     {"stale version", "layer 1"}});
  }
  {
    StepSpec s = step(ScoreSource::kReduced);
    s.scores[0].version = view.version[0] + 1;  // from the future
    cases.push_back({"future",
                     s,
                     grpc::StatusCode::FAILED_PRECONDITION,
                     {"stale version", "layer 0"}});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const grpc::Status s = FailingStep(stub(), StepToProto(c.spec, id));
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(id));
    for (const std::string& f : c.fragments) {
      EXPECT_THAT(s.error_message(), HasSubstr(f));
    }
    EXPECT_EQ(StatsOf(id).DebugString(), before.DebugString());
    EXPECT_EQ(TablesOf(id).DebugString(), tables_before.DebugString());
    bystander.Advance();
  }
  {
    // A score entry with no source at all.
    v1::DecodeStep s = StepToProto(step(ScoreSource::kReduced), id);
    s.mutable_scores(1)->clear_reduced();
    ExpectStatus(FailingStep(stub(), s), grpc::StatusCode::INVALID_ARGUMENT,
                 {"layer 1", "no source"});
  }
  {
    // Queries against a pre-RoPE layout.
    View pv;
    const std::string pre = NewSession({.layout = "tiny-prerope"}, &pv);
    const ModelLayout pre_layout =
        MakeLayout("tiny-prerope", DType::kBF16, true);
    ExpectStatus(
        FailingStep(stub(), StepToProto(MakeStep(pre_layout, pv, 0,
                                                 ScoreSource::kQueries, 1),
                                        pre)),
        grpc::StatusCode::FAILED_PRECONDITION, {pre, "before RoPE"});
    EXPECT_EQ(StatsOf(pre).resident_tokens(), 0);
  }
  {
    // Scores for a policy that takes none.
    View wv;
    const std::string w = NewSession({.policy = "window"}, &wv);
    ExpectStatus(
        FailingStep(
            stub(),
            StepToProto(MakeStep(f32_, wv, 0, ScoreSource::kReduced, 1), w)),
        grpc::StatusCode::FAILED_PRECONDITION, {w, "window"});
  }
  EXPECT_EQ(StatsOf(id).DebugString(), before.DebugString());
  // The session itself is fine: the good step goes through.
  DecodeStream stream(stub());
  v1::DecodeStepResult result;
  ASSERT_TRUE(
      stream.Step(StepToProto(step(ScoreSource::kReduced), id), &result))
      << stream.Finish().error_message();
  EXPECT_EQ(result.append().layers(0).resident(), 5);
  EXPECT_EQ(result.scores().layers(0).resident(), 4);
  EXPECT_GRPC_OK(stream.Finish());
  bystander.Advance();
  bystander.Finish();
}

// kvkeep.proto: "Messages name the session and the field." A score entry
// without a source is refused before the store sees it; the message must
// still say which session.
TEST_F(ServiceTest, ScoresWithoutSourceNameTheSession) {
  View view;
  const std::string id = NewSession({}, &view);
  v1::DecodeStep step =
      StepToProto(MakeStep(f32_, view, 0, ScoreSource::kReduced, 1), id);
  step.mutable_scores(0)->clear_reduced();
  ExpectStatus(FailingStep(stub(), step), grpc::StatusCode::INVALID_ARGUMENT,
               {id, "layer 0", "no source"});
  v1::CompressPromptRequest req;
  req.set_session_id(id);
  req.add_window()->set_layer(0);
  grpc::ClientContext ctx;
  Prepare(ctx, "");
  v1::StepResult result;
  ExpectStatus(stub().CompressPrompt(&ctx, req, &result),
               grpc::StatusCode::INVALID_ARGUMENT,
               {id, "layer 0", "no source"});
}

TEST_F(ServiceTest, FailedDecodeStepMidStreamChangesNothing) {
  View view;
  const std::string id = NewSession(
      {.policy = "h2o", .params = {{"recent", "2"}}, .budget = 6}, &view);
  DecodeStream stream(stub());
  v1::DecodeStepResult result;
  int64_t pos = 0;
  for (; pos < 20; ++pos) {
    ASSERT_TRUE(stream.Step(
        StepToProto(MakeStep(f32_, view, pos, ScoreSource::kQueries, pos),
                    pos == 0 ? id : ""),
        &result))
        << stream.Finish().error_message();
    view.Apply(result.append());
    view.Apply(result.scores());
  }
  const v1::SessionStats stats_before = StatsOf(id);
  const v1::GetBlockTablesResponse tables_before = TablesOf(id);
  std::vector<v1::KvChunk> kv_before;
  ASSERT_GRPC_OK(ReadKv(stub(), id, {}, &kv_before));

  // Layer 1's version is one behind: stale.
  View stale = view;
  stale.version[1] -= 1;
  EXPECT_FALSE(stream.Step(
      StepToProto(MakeStep(f32_, stale, pos, ScoreSource::kQueries, pos), ""),
      &result));
  ExpectStatus(stream.Finish(), grpc::StatusCode::FAILED_PRECONDITION,
               {id, "stale version for layer 1", "version"});

  EXPECT_EQ(StatsOf(id).DebugString(), stats_before.DebugString());
  EXPECT_EQ(TablesOf(id).DebugString(), tables_before.DebugString());
  std::vector<v1::KvChunk> kv_after;
  ASSERT_GRPC_OK(ReadKv(stub(), id, {}, &kv_after));
  ASSERT_EQ(kv_after.size(), kv_before.size());
  for (size_t i = 0; i < kv_after.size(); ++i) {
    EXPECT_EQ(kv_after[i].DebugString(), kv_before[i].DebugString());
  }
  // A new stream takes the same step at the right versions.
  DecodeStream again(stub());
  ASSERT_TRUE(again.Step(
      StepToProto(MakeStep(f32_, view, pos, ScoreSource::kQueries, pos), id),
      &result))
      << again.Finish().error_message();
  EXPECT_EQ(result.scores().layers(1).resident(), 6);
  EXPECT_GRPC_OK(again.Finish());
}

TEST_F(ServiceTest, DecodeStreamServesOneNamedSession) {
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  View av, bv;
  const std::string a = NewSession({}, &av);
  const std::string b = NewSession({}, &bv);
  // The first message must name the session.
  ExpectStatus(
      FailingStep(
          stub(),
          StepToProto(MakeStep(f32_, av, 0, ScoreSource::kReduced, 0), "")),
      grpc::StatusCode::INVALID_ARGUMENT, {"first message", "session_id"});
  // A stream that switches sessions ends; what it did before stays.
  DecodeStream stream(stub());
  v1::DecodeStepResult result;
  ASSERT_TRUE(stream.Step(
      StepToProto(MakeStep(f32_, av, 0, ScoreSource::kReduced, 0), a), &result))
      << stream.Finish().error_message();
  av.Apply(result.append());
  av.Apply(result.scores());
  // Naming the same session again is fine.
  ASSERT_TRUE(stream.Step(
      StepToProto(MakeStep(f32_, av, 1, ScoreSource::kReduced, 1), a), &result))
      << stream.Finish().error_message();
  EXPECT_FALSE(stream.Step(
      StepToProto(MakeStep(f32_, bv, 0, ScoreSource::kReduced, 2), b),
      &result));
  ExpectStatus(stream.Finish(), grpc::StatusCode::INVALID_ARGUMENT,
               {"one session", a, b});
  EXPECT_EQ(StatsOf(a).resident_tokens(), 4);
  EXPECT_EQ(StatsOf(b).resident_tokens(), 0);
  EXPECT_EQ(StatsOf(b).score_updates(), 0);
  bystander.Advance();
  bystander.Finish();
}

TEST_F(ServiceTest, OversizedMessagesAreRefusedByGrpc) {
  TestServerOptions options{DefaultPools()};
  options.max_message_bytes = 4096;
  StartServer(options);
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub()));
  const std::string id = NewSession({.policy = "full"});
  // 40 tokens x 2 layers x (keys + values) x 64 bytes = 10 KiB.
  StepSpec big;
  for (int64_t p = 0; p < 40; ++p) big.positions.push_back(p);
  for (int32_t layer = 0; layer < 2; ++layer) {
    big.keys.push_back(KvBytes(f32_, layer, big.positions, 0, true));
    big.values.push_back(KvBytes(f32_, layer, big.positions, 1, true));
  }
  v1::StepResult result;
  const grpc::Status s = Append(stub(), AppendToProto(big, id), &result);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("4096"));
  ExpectStatus(FailingStep(stub(), StepToProto(big, id)),
               grpc::StatusCode::RESOURCE_EXHAUSTED, {"4096"});
  v1::AppendPrefillResponse prefilled;
  ExpectStatus(Prefill(stub(), {AppendToProto(big, id)}, &prefilled),
               grpc::StatusCode::RESOURCE_EXHAUSTED, {"4096"});
  EXPECT_EQ(StatsOf(id).resident_tokens(), 0);
  bystander.Advance();
  // The same tokens in chunks that fit.
  std::vector<v1::AppendRequest> chunks;
  for (int64_t first = 0; first < 40; first += 8) {
    StepSpec s8;
    for (int64_t p = first; p < first + 8; ++p) s8.positions.push_back(p);
    for (int32_t layer = 0; layer < 2; ++layer) {
      s8.keys.push_back(KvBytes(f32_, layer, s8.positions, 0, true));
      s8.values.push_back(KvBytes(f32_, layer, s8.positions, 1, true));
    }
    chunks.push_back(AppendToProto(s8, id));
  }
  ASSERT_GRPC_OK(Prefill(stub(), chunks, &prefilled));
  EXPECT_EQ(StatsOf(id).resident_tokens(), 80);
  bystander.Advance();
  bystander.Finish();
}

TEST_F(ServiceTest, PoolExhaustionAndRecovery) {
  // 12 pages of 4 tokens: 24 tokens for a 2-layer session.
  StartServer(TestServerOptions{DefaultPools(12)});
  const std::string a = NewSession({.policy = "full"});
  const std::string b = NewSession({.policy = "full"});
  AppendTokens(a, f32_, 0, 20);  // 10 pages
  StepSpec more;
  more.positions = {20, 21, 22, 23, 24};  // 2 more pages per layer
  for (int32_t layer = 0; layer < 2; ++layer) {
    more.keys.push_back(KvBytes(f32_, layer, more.positions, 0, false));
    more.values.push_back(KvBytes(f32_, layer, more.positions, 1, false));
  }
  v1::StepResult result;
  ExpectStatus(Append(stub(), AppendToProto(more, b), &result),
               grpc::StatusCode::RESOURCE_EXHAUSTED,
               {b, "page pool exhausted", "need 4 pages", "2 of 12 free"});
  // A decode step that needs a page fails the same way; nothing changed.
  ExpectStatus(FailingStep(stub(), StepToProto(more, a)),
               grpc::StatusCode::RESOURCE_EXHAUSTED, {a, "page pool"});
  EXPECT_EQ(StatsOf(a).resident_tokens(), 40);
  EXPECT_EQ(StatsOf(b).resident_tokens(), 0);
  v1::ServerInfo info;
  ASSERT_GRPC_OK(Info(stub(), &info));
  EXPECT_EQ(info.pools(0).used_pages(), 10);
  EXPECT_EQ(info.pools(0).allocation_failures(), 2);
  // A smaller append still fits.
  more.positions = {20, 21, 22, 23};
  for (int32_t layer = 0; layer < 2; ++layer) {
    more.keys[layer] = KvBytes(f32_, layer, more.positions, 0, false);
    more.values[layer] = KvBytes(f32_, layer, more.positions, 1, false);
  }
  ASSERT_GRPC_OK(Append(stub(), AppendToProto(more, b), &result));
  // Closing a frees its pages for b.
  v1::CloseSessionResponse closed;
  ASSERT_GRPC_OK(Close(stub(), a, &closed));
  EXPECT_EQ(closed.freed_pages(), 10);
  AppendTokens(b, f32_, 24, 16);
  EXPECT_EQ(StatsOf(b).resident_tokens(), 40);
  ASSERT_GRPC_OK(Info(stub(), &info));
  EXPECT_EQ(info.pools(0).used_pages(), 10);
}

// ---------------------------------------------------------------------------
// Tenants.

class TenantTest : public ServiceTest {
 protected:
  void SetUp() override {
    TestServerOptions options{DefaultPools(64)};
    options.tenants_by_token = {{"alice-token", "alice"}, {"bob-token", "bob"}};
    options.max_sessions_per_tenant = 3;
    // 8 pages of tiny-f32 (512 bytes each).
    options.max_bytes_per_tenant = 8 * 512;
    StartServer(options);
  }

  std::string NewSessionOf(const std::string& token, CreateArgs args = {}) {
    args.token = token;
    return NewSession(args);
  }
};

TEST_F(TenantTest, CallsNeedAValidToken) {
  const std::string id = NewSessionOf("alice-token");
  v1::ServerInfo info;
  v1::SessionStats stats;
  v1::ListSessionsResponse list;
  v1::CreateSessionResponse created;
  for (const std::string& token : {std::string(""), std::string("mallory")}) {
    SCOPED_TRACE(absl::StrCat("token '", token, "'"));
    const std::string fragment =
        token.empty() ? "requires a token" : "unknown token";
    ExpectStatus(Info(stub(), &info, token), grpc::StatusCode::UNAUTHENTICATED,
                 {fragment});
    ExpectStatus(Create(stub(), {.token = token}, &created),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
    ExpectStatus(Stats(stub(), id, &stats, token),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
    ExpectStatus(List(stub(), &list, token), grpc::StatusCode::UNAUTHENTICATED,
                 {fragment});
    ExpectStatus(Close(stub(), id, nullptr, token),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
    ExpectStatus(FailingStep(stub(),
                             StepToProto(MakeStep(f32_, View{{1, 1}, {0, 0}}, 0,
                                                  ScoreSource::kReduced, 0),
                                         id),
                             token),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
    std::vector<v1::KvChunk> chunks;
    ExpectStatus(ReadKv(stub(), id, {}, &chunks, token),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
    v1::AppendPrefillResponse prefilled;
    ExpectStatus(Prefill(stub(), {}, &prefilled, token),
                 grpc::StatusCode::UNAUTHENTICATED, {fragment});
  }
  // The metadata must read "Bearer <token>".
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "alice-token");
  ExpectStatus(stub().GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info),
               grpc::StatusCode::UNAUTHENTICATED, {"Bearer"});
  ASSERT_GRPC_OK(Stats(stub(), id, &stats, "alice-token"));
  EXPECT_EQ(stats.tenant(), "alice");
  ASSERT_GRPC_OK(Info(stub(), &info, "bob-token"));
}

TEST_F(TenantTest, SessionsBelongToTheirTenant) {
  const std::string a1 = NewSessionOf("alice-token");
  const std::string a2 = NewSessionOf("alice-token");
  const std::string b1 = NewSessionOf("bob-token");
  Bystander bystander;  // one of bob's, stepping throughout
  ASSERT_NO_FATAL_FAILURE(bystander.Start(stub(), "bob-token"));

  v1::ListSessionsResponse list;
  ASSERT_GRPC_OK(List(stub(), &list, "alice-token"));
  std::vector<std::string> ids;
  for (const v1::SessionStats& s : list.sessions()) {
    ids.push_back(s.session_id());
    EXPECT_EQ(s.tenant(), "alice");
  }
  EXPECT_THAT(ids, UnorderedElementsAre(a1, a2));
  list.Clear();
  ASSERT_GRPC_OK(List(stub(), &list, "bob-token"));
  ids.clear();
  for (const v1::SessionStats& s : list.sessions()) {
    ids.push_back(s.session_id());
  }
  EXPECT_THAT(ids, UnorderedElementsAre(b1, bystander.id()));

  // Bob cannot touch alice's sessions, by any call, and cannot tell them
  // from sessions that do not exist: the same code and message.
  const std::string bob = "bob-token";
  const std::initializer_list<std::string> denied = {a1, "not found"};
  v1::SessionStats stats;
  v1::StepResult result;
  v1::GetBlockTablesResponse tables;
  std::vector<v1::KvChunk> chunks;
  const StepSpec s =
      MakeStep(f32_, View{{1, 1}, {0, 0}}, 0, ScoreSource::kReduced, 0);
  ExpectStatus(Stats(stub(), a1, &stats, bob), grpc::StatusCode::NOT_FOUND,
               denied);
  ExpectStatus(Close(stub(), a1, nullptr, bob), grpc::StatusCode::NOT_FOUND,
               denied);
  ExpectStatus(Append(stub(), AppendToProto(s, a1), &result, bob),
               grpc::StatusCode::NOT_FOUND, denied);
  ExpectStatus(Tables(stub(), a1, {}, &tables, bob),
               grpc::StatusCode::NOT_FOUND, denied);
  ExpectStatus(ReadKv(stub(), a1, {}, &chunks, bob),
               grpc::StatusCode::NOT_FOUND, denied);
  ExpectStatus(Compress(stub(), a1, {}, &result, bob),
               grpc::StatusCode::NOT_FOUND, denied);
  ExpectStatus(FailingStep(stub(), StepToProto(s, a1), bob),
               grpc::StatusCode::NOT_FOUND, denied);
  v1::AppendPrefillResponse prefilled;
  ExpectStatus(Prefill(stub(), {AppendToProto(s, a1)}, &prefilled, bob),
               grpc::StatusCode::NOT_FOUND, denied);
  const std::string nobody = "00000000000000a1";
  const grpc::Status theirs = Stats(stub(), a1, &stats, bob);
  const grpc::Status missing = Stats(stub(), nobody, &stats, bob);
  EXPECT_EQ(theirs.error_code(), missing.error_code());
  EXPECT_EQ(absl::StrReplaceAll(theirs.error_message(), {{a1, "ID"}}),
            absl::StrReplaceAll(missing.error_message(), {{nobody, "ID"}}));
  bystander.Advance();
  // Nothing happened to a1; alice can use it.
  ASSERT_GRPC_OK(Stats(stub(), a1, &stats, "alice-token"));
  EXPECT_EQ(stats.resident_tokens(), 0);
  ASSERT_GRPC_OK(Append(stub(), AppendToProto(s, a1), &result, "alice-token"));
  ASSERT_GRPC_OK(Close(stub(), a1, nullptr, "alice-token"));
  bystander.Advance();
  bystander.Finish();
}

TEST_F(TenantTest, IdempotencyKeysArePerTenant) {
  const std::string a =
      NewSessionOf("alice-token", {.idempotency_key = "retry-me"});
  const std::string a_again =
      NewSessionOf("alice-token", {.idempotency_key = "retry-me"});
  const std::string b =
      NewSessionOf("bob-token", {.idempotency_key = "retry-me"});
  EXPECT_EQ(a, a_again);
  EXPECT_NE(a, b);
}

TEST_F(TenantTest, PerTenantLimits) {
  // Sessions: alice may hold 3.
  std::vector<std::string> alice;
  for (int i = 0; i < 3; ++i) alice.push_back(NewSessionOf("alice-token"));
  v1::CreateSessionResponse created;
  ExpectStatus(Create(stub(), {.token = "alice-token"}, &created),
               grpc::StatusCode::RESOURCE_EXHAUSTED,
               {"tenant 'alice'", "maximum of 3 sessions"});
  const std::string bob = NewSessionOf("bob-token");  // bob is not affected
  ASSERT_GRPC_OK(Close(stub(), alice[2], nullptr, "alice-token"));
  alice[2] = NewSessionOf("alice-token");

  // Bytes: alice may hold 8 pages; 5 tokens x 2 layers take 4.
  for (int i = 0; i < 3; ++i) {
    StepSpec s;
    s.positions = {0, 1, 2, 3, 4};
    for (int32_t layer = 0; layer < 2; ++layer) {
      s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, false));
      s.values.push_back(KvBytes(f32_, layer, s.positions, 1, false));
    }
    v1::StepResult result;
    const grpc::Status status =
        Append(stub(), AppendToProto(s, alice[i]), &result, "alice-token");
    if (i < 2) {
      EXPECT_GRPC_OK(status);
    } else {
      ExpectStatus(status, grpc::StatusCode::RESOURCE_EXHAUSTED,
                   {alice[i], "tenant 'alice'", "quota", "4096"});
    }
    // Bob's bytes are his own.
    s.positions.clear();
    for (int64_t p = 10 * i; p < 10 * i + 5; ++p) s.positions.push_back(p);
    for (int32_t layer = 0; layer < 2; ++layer) {
      s.keys[layer] = KvBytes(f32_, layer, s.positions, 0, false);
      s.values[layer] = KvBytes(f32_, layer, s.positions, 1, false);
    }
    if (i < 2) {
      EXPECT_GRPC_OK(
          Append(stub(), AppendToProto(s, bob), &result, "bob-token"));
    }
  }
  v1::SessionStats stats;
  ASSERT_GRPC_OK(Stats(stub(), alice[2], &stats, "alice-token"));
  EXPECT_EQ(stats.pages(), 0);
  // Freed bytes are available again.
  ASSERT_GRPC_OK(Close(stub(), alice[0], nullptr, "alice-token"));
  StepSpec s;
  s.positions = {0, 1, 2, 3, 4};
  for (int32_t layer = 0; layer < 2; ++layer) {
    s.keys.push_back(KvBytes(f32_, layer, s.positions, 0, false));
    s.values.push_back(KvBytes(f32_, layer, s.positions, 1, false));
  }
  v1::StepResult result;
  EXPECT_GRPC_OK(
      Append(stub(), AppendToProto(s, alice[2]), &result, "alice-token"));
}

}  // namespace
}  // namespace kvkeep
