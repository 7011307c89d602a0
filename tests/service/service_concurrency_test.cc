// 64 sessions decoding at once through one server: 8 client threads, each
// driving 8 sessions on their own Decode streams, 1,000 steps per session
// with eviction under six policies. Every reply is checked against a local
// replica (the domain store, no gRPC) fed exactly the same steps, and a
// worker's block table, kept only from the replies as kvkeep.proto says, must
// equal the server's at the end. Then pool accounting must be exact, and zero
// once every session is closed.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "tests/testing/noise.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::testing::ElementsAreArray;

constexpr int kThreads = 8;
constexpr int kSessionsPerThread = 8;
constexpr int kSteps = 1000;
constexpr int64_t kBudget = 32;
constexpr int64_t kPoolPages = 2048;
// Bounds a hung call (a bug) so the test fails instead of blocking.
constexpr std::chrono::seconds kCallDeadline(600);

// Tiny, so 64,000 steps stay quick under sanitizers: the test is about the
// service under concurrency, not the kernels.
ModelLayout TinyLayout() {
  ModelLayout l;
  l.name = "tiny";
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 4;
  l.head_dim = 8;
  l.dtype = DType::kBF16;
  l.page_tokens = 4;
  return l;
}

struct PolicyCase {
  const char* name;
  std::map<std::string, std::string> params;
  bool takes_scores;  // attention-driven; else it evicts on append
};

const std::vector<PolicyCase>& Policies() {
  static const auto* const policies = new std::vector<PolicyCase>{
      {"h2o", {{"sinks", "2"}, {"recent", "4"}}, true},
      {"tova", {{"slack", "2"}}, true},
      {"window", {{"slack", "3"}}, false},
      {"scissorhands",
       {{"history", "8"}, {"recent", "4"}, {"sinks", "1"}, {"slack", "1"}},
       true},
      {"h2o_page", {{"recent", "4"}, {"slack", "4"}}, true},
      {"streaming_llm", {{"sinks", "4"}}, false},
  };
  return *policies;
}

// ---------------------------------------------------------------------------
// Deterministic steps, as a proto for the wire and domain values for the
// replica.

using ::kvkeep::testing::NoiseF;

struct ScoreSpec {
  int32_t layer = 0;
  uint64_t version = 0;
  ScoreSource source = ScoreSource::kReduced;
  std::vector<float> data;  // one row
};

struct StepSpec {
  std::vector<int64_t> positions;         // empty: no append
  std::vector<std::string> keys, values;  // per layer
  std::vector<ScoreSpec> scores;
};

std::string KvBytes(const ModelLayout& l, uint64_t session, int32_t layer,
                    int64_t position, int which) {
  const int64_t elems = int64_t{l.kv_heads} * l.head_dim;
  std::string out(elems * DTypeBytes(l.dtype), '\0');
  for (int64_t e = 0; e < elems; ++e) {
    StoreFromFloat(l.dtype, out.data(), e,
                   NoiseF(session, layer * 2 + which, position, e));
  }
  return out;
}

std::vector<float> Weights(int64_t n, float total, uint64_t a, uint64_t b) {
  std::vector<float> w(n);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    // Skewed, so some tokens are clearly heavier than others.
    const float x = std::abs(NoiseF(a, b, j, 3));
    w[j] = 0.01f + x * x * x;
    sum += w[j];
  }
  for (float& x : w) x = static_cast<float>(x / sum * total);
  return w;
}

ScoreSpec MakeScores(const ModelLayout& l, int32_t layer, uint64_t version,
                     ScoreSource source, int64_t n, uint64_t a, uint64_t b) {
  ScoreSpec s{layer, version, source, {}};
  switch (source) {
    case ScoreSource::kReduced:
      s.data = Weights(n, 0.97f * l.query_heads, a, b * 8 + layer);
      break;
    case ScoreSource::kPerHead:
      for (int32_t h = 0; h < l.query_heads; ++h) {
        const std::vector<float> row =
            Weights(n, 0.97f, a, (b * 8 + layer) * 8 + h);
        s.data.insert(s.data.end(), row.begin(), row.end());
      }
      break;
    case ScoreSource::kQueries:
      for (int64_t i = 0; i < int64_t{l.query_heads} * l.head_dim; ++i) {
        s.data.push_back(3.0f * NoiseF(a, b, layer, i));
      }
      break;
  }
  return s;
}

v1::DecodeStep StepToProto(const StepSpec& s, const std::string& session_id) {
  v1::DecodeStep out;
  out.set_session_id(session_id);
  if (!s.positions.empty()) {
    v1::AppendRequest* append = out.mutable_append();
    append->mutable_positions()->Add(s.positions.begin(), s.positions.end());
    for (size_t l = 0; l < s.keys.size(); ++l) {
      v1::LayerKv* kv = append->add_layers();
      kv->set_keys(s.keys[l]);
      kv->set_values(s.values[l]);
    }
  }
  for (const ScoreSpec& x : s.scores) {
    v1::LayerScores* score = out.add_scores();
    score->set_layer(x.layer);
    score->set_version(x.version);
    switch (x.source) {
      case ScoreSource::kPerHead:
        score->mutable_per_head()->set_rows(1);
        score->mutable_per_head()->mutable_values()->Add(x.data.begin(),
                                                         x.data.end());
        break;
      case ScoreSource::kReduced:
        score->mutable_reduced()->set_rows(1);
        score->mutable_reduced()->mutable_values()->Add(x.data.begin(),
                                                        x.data.end());
        break;
      case ScoreSource::kQueries:
        score->mutable_queries()->set_rows(1);
        score->mutable_queries()->mutable_values()->Add(x.data.begin(),
                                                        x.data.end());
        break;
    }
  }
  return out;
}

// The same step as domain values, pointing into `s`.
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
      scores.push_back(LayerScores{x.layer, x.version, x.source, 1,
                                   std::span<const float>(x.data)});
    }
  }
};

// ---------------------------------------------------------------------------
// A worker's block table, kept only from the replies.

struct LayerView {
  uint64_t version = 0;
  std::vector<int32_t> pages;
  std::vector<int64_t> positions;  // per slot
};

// Applies one LayerChange in the order kvkeep.proto gives (moves; keep
// [0, resident - k) and drop pages_freed from the end; append pages_added and
// the k kept new tokens), checking it is consistent as it goes. Returns what
// was wrong, or "".
std::string Follow(LayerView& v, const v1::LayerChange& c,
                   std::span<const int64_t> new_positions,
                   int32_t page_tokens) {
  std::vector<int64_t> before = v.positions;
  for (const v1::SlotMove& m : c.moves()) {
    if (m.from_slot() < 0 || m.from_slot() >= std::ssize(v.positions) ||
        m.to_slot() < 0 || m.to_slot() >= std::ssize(v.positions)) {
      return absl::StrCat("move ", m.from_slot(), " -> ", m.to_slot(),
                          " outside ", v.positions.size(), " slots");
    }
    v.positions[m.to_slot()] = v.positions[m.from_slot()];
  }
  const std::vector<int64_t> evicted(c.evicted_positions().begin(),
                                     c.evicted_positions().end());
  std::vector<int64_t> kept_new;
  for (int64_t p : new_positions) {
    if (!std::binary_search(evicted.begin(), evicted.end(), p)) {
      kept_new.push_back(p);
    }
  }
  const int64_t keep = c.resident() - std::ssize(kept_new);
  if (keep < 0 || keep > std::ssize(v.positions)) {
    return absl::StrCat("resident ", c.resident(), " with ", kept_new.size(),
                        " new tokens, but ", v.positions.size(), " slots");
  }
  v.positions.resize(keep);
  // The tokens that left are exactly the old ones in evicted_positions.
  std::vector<int64_t> now = v.positions;
  std::sort(before.begin(), before.end());
  std::sort(now.begin(), now.end());
  std::vector<int64_t> gone;
  std::set_difference(before.begin(), before.end(), now.begin(), now.end(),
                      std::back_inserter(gone));
  std::vector<int64_t> evicted_old;
  std::set_intersection(evicted.begin(), evicted.end(), before.begin(),
                        before.end(), std::back_inserter(evicted_old));
  if (gone != evicted_old || std::ssize(now) != keep ||
      std::adjacent_find(now.begin(), now.end()) != now.end()) {
    return absl::StrCat("evicted {", absl::StrJoin(evicted, ","),
                        "} but the slots lost {", absl::StrJoin(gone, ","),
                        "}");
  }
  if (c.pages_freed_size() > std::ssize(v.pages)) {
    return "more pages freed than held";
  }
  std::vector<int32_t> tail(v.pages.end() - c.pages_freed_size(),
                            v.pages.end());
  std::vector<int32_t> freed(c.pages_freed().begin(), c.pages_freed().end());
  std::sort(tail.begin(), tail.end());
  std::sort(freed.begin(), freed.end());
  if (tail != freed) {
    return absl::StrCat("pages freed {", absl::StrJoin(freed, ","),
                        "} are not the last pages {", absl::StrJoin(tail, ","),
                        "}");
  }
  v.pages.resize(v.pages.size() - c.pages_freed_size());
  v.pages.insert(v.pages.end(), c.pages_added().begin(), c.pages_added().end());
  v.positions.insert(v.positions.end(), kept_new.begin(), kept_new.end());
  v.version = c.version();
  const int64_t pages_needed =
      (std::ssize(v.positions) + page_tokens - 1) / page_tokens;
  if (std::ssize(v.pages) != pages_needed) {
    return absl::StrCat(v.pages.size(), " pages for ", v.positions.size(),
                        " tokens");
  }
  return "";
}

// What the wire reported for one call against what the replica did; page
// ids belong to each store's own pool, so pages compare by count.
std::string Compare(const v1::StepResult& wire, const StepResult& local) {
  if (wire.layers_size() != std::ssize(local.layers)) {
    return absl::StrCat(wire.layers_size(), " layers, the replica has ",
                        local.layers.size());
  }
  for (size_t l = 0; l < local.layers.size(); ++l) {
    const v1::LayerChange& w = wire.layers(static_cast<int>(l));
    const LayerChange& d = local.layers[l];
    bool same =
        w.layer() == d.layer && w.version() == d.version &&
        w.resident() == d.resident &&
        std::equal(w.evicted_positions().begin(), w.evicted_positions().end(),
                   d.evicted_positions.begin(), d.evicted_positions.end()) &&
        w.moves_size() == std::ssize(d.moves) &&
        w.pages_freed_size() == std::ssize(d.pages_freed) &&
        w.pages_added_size() == std::ssize(d.pages_added);
    for (int m = 0; same && m < w.moves_size(); ++m) {
      same = w.moves(m).from_slot() == d.moves[m].from_slot &&
             w.moves(m).to_slot() == d.moves[m].to_slot;
    }
    if (!same) {
      return absl::StrCat("layer ", l, ": wire {", w.ShortDebugString(),
                          "} vs replica version ", d.version, " resident ",
                          d.resident, " evicted {",
                          absl::StrJoin(d.evicted_positions, ","), "} moves ",
                          d.moves.size(), " freed ", d.pages_freed.size(),
                          " added ", d.pages_added.size());
    }
  }
  return "";
}

// ---------------------------------------------------------------------------

// One session as its client thread drives it.
struct DrivenSession {
  int index = 0;
  const PolicyCase* policy = nullptr;
  std::string id;          // on the server
  SessionId replica_id{};  // in the replica
  std::vector<LayerView> layers;
  int64_t next_position = 0;
  int64_t evicted = 0;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::DecodeStep, v1::DecodeStepResult>>
      stream;
  StepSpec step;      // the step in flight
  std::string error;  // the first thing that went wrong
};

class ConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::vector<PoolSpec> pools = {PoolSpec{TinyLayout(), kPoolPages}};
    ServerConfig config = testing::TestServerConfig(pools);
    config.max_message_bytes = 1 << 20;
    absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
        testing::TestServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    StoreOptions options;
    options.pools = pools;
    absl::StatusOr<std::unique_ptr<CacheStore>> replica =
        CacheStore::Create(options);
    ASSERT_TRUE(replica.ok()) << replica.status();
    replica_ = *std::move(replica);
  }

  void TearDown() override { server_.reset(); }

  static void Prepare(grpc::ClientContext& ctx) {
    ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  }

  // Creates the session on the server and in the replica, and opens its
  // stream. Returns what went wrong, or "".
  std::string Open(DrivenSession& s) {
    const ModelLayout layout = TinyLayout();
    v1::CreateSessionRequest req;
    req.set_layout(layout.name);
    req.set_policy(s.policy->name);
    for (const auto& [k, v] : s.policy->params) {
      (*req.mutable_policy_params())[k] = v;
    }
    req.mutable_budget()->set_tokens(kBudget);
    v1::CreateSessionResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx);
    const grpc::Status status = server_->stub().CreateSession(&ctx, req, &resp);
    if (!status.ok()) return "CreateSession: " + status.error_message();
    s.id = resp.session_id();
    SessionSpec spec;
    spec.layout = layout.name;
    spec.policy = PolicySpec{s.policy->name, s.policy->params};
    spec.budget.tokens = kBudget;
    absl::StatusOr<SessionId> local = replica_->CreateSession(spec);
    if (!local.ok()) return std::string(local.status().message());
    s.replica_id = *local;
    s.layers.resize(layout.num_layers);
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      s.layers[l].version = resp.layer_versions(l);
    }
    s.ctx = std::make_unique<grpc::ClientContext>();
    Prepare(*s.ctx);
    s.stream = server_->stub().Decode(s.ctx.get());
    return "";
  }

  // Step `i` of a session: attention-driven policies mostly append and
  // score in one step, with every tenth step an append alone and the next
  // scores alone; the others only append. Sources rotate.
  static StepSpec MakeStep(DrivenSession& s, int i) {
    const ModelLayout layout = TinyLayout();
    const bool append = !s.policy->takes_scores || i % 10 != 6;
    const bool scores = s.policy->takes_scores && i % 10 != 5;
    StepSpec step;
    if (append) {
      const int64_t p = s.next_position;
      s.next_position += i % 4 == 3 ? 2 : 1;  // positions may skip
      step.positions = {p};
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        step.keys.push_back(KvBytes(layout, s.index, l, p, 0));
        step.values.push_back(KvBytes(layout, s.index, l, p, 1));
      }
    }
    if (scores) {
      const auto source = static_cast<ScoreSource>((i + s.index) % 3);
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        const LayerView& v = s.layers[l];
        const int64_t n = std::ssize(v.positions) + (append ? 1 : 0);
        step.scores.push_back(
            MakeScores(layout, l, v.version, source, n, s.index, i));
      }
    }
    return step;
  }

  // Follows and checks one reply. Returns what went wrong, or "".
  std::string Check(DrivenSession& s, int i, const v1::DecodeStepResult& wire,
                    const StepOutcome& expected) {
    const bool append = !s.step.positions.empty();
    if (wire.has_append() != append) return "append result presence";
    if (append) {
      if (std::string e = Compare(wire.append(), expected.append); !e.empty()) {
        return "append: " + e;
      }
    }
    if (std::string e = Compare(wire.scores(), expected.scores); !e.empty()) {
      return "scores: " + e;
    }
    const ModelLayout layout = TinyLayout();
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      if (append) {
        if (std::string e = Follow(s.layers[l], wire.append().layers(l),
                                   s.step.positions, layout.page_tokens);
            !e.empty()) {
          return absl::StrCat("following the append of layer ", l, ": ", e);
        }
      }
      if (std::string e = Follow(s.layers[l], wire.scores().layers(l), {},
                                 layout.page_tokens);
          !e.empty()) {
        return absl::StrCat("following the scores of layer ", l, ": ", e);
      }
      const int64_t resident = std::ssize(s.layers[l].positions);
      // Within budget after every scored step; one append over at most.
      if (resident > kBudget + (s.step.scores.empty() ? 1 : 0)) {
        return absl::StrCat("layer ", l, " holds ", resident, " tokens");
      }
      s.evicted += wire.append().layers_size() > 0
                       ? wire.append().layers(l).evicted_positions_size()
                       : 0;
      s.evicted += wire.scores().layers(l).evicted_positions_size();
    }
    (void)i;
    return "";
  }

  // Drives kSessionsPerThread sessions for kSteps steps: each step is
  // written to every session's stream before any reply is read, so the
  // server has several sessions of this thread in flight at once.
  void Drive(std::vector<DrivenSession>& sessions) {
    for (DrivenSession& s : sessions) {
      s.error = Open(s);
    }
    for (int i = 0; i < kSteps; ++i) {
      for (DrivenSession& s : sessions) {
        if (!s.error.empty()) continue;
        s.step = MakeStep(s, i);
        // The first message names the session; later ones may repeat it.
        const v1::DecodeStep msg =
            StepToProto(s.step, i == 0 || i % 100 == 50 ? s.id : "");
        if (!s.stream->Write(msg)) {
          s.error = absl::StrCat("step ", i, ": the stream broke");
        }
      }
      for (DrivenSession& s : sessions) {
        if (!s.error.empty()) continue;
        const DomainStep domain(s.step);
        absl::StatusOr<StepOutcome> expected =
            replica_->Step(s.replica_id, domain.append, domain.scores);
        v1::DecodeStepResult wire;
        if (!s.stream->Read(&wire)) {
          s.error = absl::StrCat("step ", i, ": no reply");
          continue;
        }
        if (!expected.ok()) {
          s.error = absl::StrCat("step ", i, ": the replica refused it: ",
                                 expected.status().message());
          continue;
        }
        if (std::string e = Check(s, i, wire, *expected); !e.empty()) {
          s.error = absl::StrCat("step ", i, ": ", e);
        }
      }
    }
    for (DrivenSession& s : sessions) {
      if (s.stream == nullptr) continue;
      s.stream->WritesDone();
      const grpc::Status status = s.stream->Finish();
      if (s.error.empty() && !status.ok()) {
        s.error = "the stream ended with " + status.error_message();
      }
    }
  }

  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<CacheStore> replica_;
};

TEST_F(ConcurrencyTest, SixtyFourSessionsMatchTheirReplicas) {
  std::vector<std::vector<DrivenSession>> groups(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    groups[t].resize(kSessionsPerThread);
    for (int j = 0; j < kSessionsPerThread; ++j) {
      DrivenSession& s = groups[t][j];
      s.index = t * kSessionsPerThread + j;
      s.policy = &Policies()[s.index % Policies().size()];
    }
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, &groups, t] { Drive(groups[t]); });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf("%d sessions x %d decode steps through gRPC in %.2f s\n",
              kThreads * kSessionsPerThread, kSteps, seconds);

  int64_t pages = 0;
  std::map<std::string, int64_t> evicted_by_policy;
  for (const std::vector<DrivenSession>& group : groups) {
    for (const DrivenSession& s : group) {
      SCOPED_TRACE(
          absl::StrCat("session ", s.index, " (", s.policy->name, ") ", s.id));
      ASSERT_EQ(s.error, "");
      evicted_by_policy[s.policy->name] += s.evicted;

      // The block tables the replies built are the server's.
      v1::GetBlockTablesRequest req;
      req.set_session_id(s.id);
      v1::GetBlockTablesResponse tables;
      grpc::ClientContext ctx;
      Prepare(ctx);
      ASSERT_TRUE(server_->stub().GetBlockTables(&ctx, req, &tables).ok());
      ASSERT_EQ(tables.tables_size(), std::ssize(s.layers));
      for (int l = 0; l < tables.tables_size(); ++l) {
        const v1::BlockTable& t = tables.tables(l);
        EXPECT_EQ(t.version(), s.layers[l].version);
        EXPECT_THAT(t.pages(), ElementsAreArray(s.layers[l].pages));
        EXPECT_THAT(t.positions(), ElementsAreArray(s.layers[l].positions));
        absl::StatusOr<BlockTable> local =
            replica_->GetBlockTable(s.replica_id, l);
        ASSERT_TRUE(local.ok());
        EXPECT_THAT(t.positions(), ElementsAreArray(local->positions));
        EXPECT_THAT(t.cache_positions(),
                    ElementsAreArray(local->cache_positions));
      }

      // Its stats are the replica's.
      v1::GetSessionStatsRequest stats_req;
      stats_req.set_session_id(s.id);
      v1::SessionStats stats;
      grpc::ClientContext stats_ctx;
      Prepare(stats_ctx);
      ASSERT_TRUE(
          server_->stub().GetSessionStats(&stats_ctx, stats_req, &stats).ok());
      absl::StatusOr<SessionStats> want = replica_->GetStats(s.replica_id);
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(stats.policy(), s.policy->name);
      EXPECT_EQ(stats.resident_tokens(), want->resident_tokens);
      EXPECT_EQ(stats.pages(), want->pages);
      EXPECT_EQ(stats.evicted_tokens(), want->evicted_tokens);
      EXPECT_EQ(stats.evicted_tokens(), s.evicted);
      EXPECT_EQ(stats.evicted_score(), want->evicted_score);
      EXPECT_EQ(stats.score_updates(), want->score_updates);
      EXPECT_THAT(stats.layer_version(), ElementsAreArray(want->layer_version));
      EXPECT_THAT(stats.layer_resident(),
                  ElementsAreArray(want->layer_resident));
      int64_t follower_pages = 0;
      for (const LayerView& v : s.layers) follower_pages += std::ssize(v.pages);
      EXPECT_EQ(stats.pages(), follower_pages);
      // About 1,000 tokens per layer went through a 32-token budget.
      EXPECT_GT(stats.evicted_tokens(), 2 * (kSteps - kBudget) * 8 / 10);
      pages += stats.pages();
    }
  }
  for (const PolicyCase& p : Policies()) {
    EXPECT_GT(evicted_by_policy[p.name], 0) << p.name;
  }

  // Pool accounting is exact: the pool's pages are the sessions' pages.
  v1::ServerInfo info;
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    ASSERT_TRUE(server_->stub()
                    .GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info)
                    .ok());
  }
  ASSERT_EQ(info.pools_size(), 1);
  EXPECT_EQ(info.pools(0).used_pages(), pages);
  EXPECT_EQ(info.pools(0).sessions(), kThreads * kSessionsPerThread);
  EXPECT_EQ(info.pools(0).allocation_failures(), 0);
  EXPECT_EQ(replica_->Layouts()[0].pool.used_pages, pages);

  // Closing every session returns every page.
  int64_t freed = 0;
  for (const std::vector<DrivenSession>& group : groups) {
    for (const DrivenSession& s : group) {
      v1::CloseSessionRequest req;
      req.set_session_id(s.id);
      v1::CloseSessionResponse resp;
      grpc::ClientContext ctx;
      Prepare(ctx);
      ASSERT_TRUE(server_->stub().CloseSession(&ctx, req, &resp).ok());
      freed += resp.freed_pages();
    }
  }
  EXPECT_EQ(freed, pages);
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    ASSERT_TRUE(server_->stub()
                    .GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info)
                    .ok());
  }
  EXPECT_EQ(info.pools(0).used_pages(), 0);
  EXPECT_EQ(info.pools(0).sessions(), 0);
  v1::ListSessionsResponse list;
  grpc::ClientContext ctx;
  Prepare(ctx);
  ASSERT_TRUE(server_->stub()
                  .ListSessions(&ctx, v1::ListSessionsRequest(), &list)
                  .ok());
  EXPECT_EQ(list.sessions_size(), 0);
  EXPECT_EQ(server_->store().Layouts()[0].pool.used_pages, 0);
}

}  // namespace
}  // namespace kvkeep
