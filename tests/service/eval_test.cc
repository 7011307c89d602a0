// The evaluation harness end to end, small enough for CI: the reference
// workers drive a real kvkeepd gRPC server (in-process, loopback) on
// synthetic workloads, and the measured quality shows the orderings the
// papers report:
//  - on a workload with attention sinks, window (which drops them) loses far
//    more attention than streaming_llm (which keeps them);
//  - at a 20% budget, h2o keeps a needle that is attended again and again,
//    which window and streaming_llm lose;
//  - a needle never attended until its question comes late is lost by the
//    score-based policies at small budgets, while the oracle keeps it;
//  - full loses nothing; every policy keeps its budget.
// Also: prefill and decode in every score mode agree with the store's
// tables, and a prefill -> decode handoff between two workers works.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "services/kvkeepd/kvkeep_server.h"
#include "services/workers/evaluation.h"
#include "services/workers/session_driver.h"
#include "services/workers/workload.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using workers::DecodeReport;
using workers::EvalRow;
using workers::Workload;
using workers::WorkloadFamily;
using workers::WorkloadSpec;

// 2 layers of f32, 2 kv / 8 query heads, head_dim 32, 16-token pages.
ModelLayout EvalLayout() {
  ModelLayout l;
  l.name = "eval";
  l.num_layers = 2;
  l.kv_heads = 2;
  l.query_heads = 8;
  l.head_dim = 32;
  l.dtype = DType::kF32;
  l.page_tokens = 16;
  return l;
}

class EvalTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<KvKeepServer>> server = KvKeepServer::Start(
        testing::TestServerConfig({PoolSpec{EvalLayout(), 4096}}));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    client::ClientOptions options;
    options.address = server_->address();
    client_ = std::make_unique<client::KvKeepClient>(
        *client::KvKeepClient::Connect(options));
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    layout_ = info->layouts(0);
  }

  Workload MakeWorkload(WorkloadFamily family, int64_t prompt = 256,
                        int64_t decode = 64) {
    WorkloadSpec spec = workers::DefaultSpec(family);
    spec.prompt_tokens = prompt;
    spec.decode_steps = decode;
    absl::StatusOr<Workload> w =
        Workload::Create(workers::FitToLayout(spec, layout_));
    EXPECT_TRUE(w.ok()) << w.status();
    return *std::move(w);
  }

  EvalRow Run(const Workload& w, const std::string& policy, double fraction) {
    const int64_t budget =
        static_cast<int64_t>(fraction * static_cast<double>(w.total_tokens()));
    absl::StatusOr<EvalRow> row =
        workers::RunCase(*client_, "eval", w, policy, budget,
                         workers::ScoreMode::kReduced, /*evaluate=*/true);
    EXPECT_TRUE(row.ok()) << policy << ": " << row.status();
    return row.value_or(EvalRow{});
  }

  static KvKeepServer* server_;
  std::unique_ptr<client::KvKeepClient> client_;
  v1::Layout layout_;
};

KvKeepServer* EvalTest::server_ = nullptr;

TEST_F(EvalTest, FullLosesNothingAndPoliciesKeepTheirBudget) {
  const Workload w = MakeWorkload(WorkloadFamily::kMixed);
  const EvalRow full = Run(w, "full", 1.0);
  EXPECT_EQ(full.attention_loss.max, 0.0);
  EXPECT_EQ(full.output_error.max, 0.0);
  EXPECT_EQ(full.top_recall.mean, 1.0);
  for (const std::string policy :
       {"window", "streaming_llm", "h2o", "tova", "scissorhands", "h2o_page"}) {
    const EvalRow row = Run(w, policy, 0.25);
    SCOPED_TRACE(policy);
    // What each step's attention read: the budget, plus the new token for
    // the policies that evict after scoring it.
    EXPECT_LE(row.mean_resident_tokens, row.budget_tokens + 1);
    EXPECT_GT(row.attention_loss.mean, 0.0);
  }
  EXPECT_EQ(server_->store().ListSessions().size(), 0u)
      << "every session closed";
}

TEST_F(EvalTest, SinksSeparateWindowFromStreamingLlm) {
  const Workload w = MakeWorkload(WorkloadFamily::kSinks);
  const EvalRow window = Run(w, "window", 0.2);
  const EvalRow streaming = Run(w, "streaming_llm", 0.2);
  // The sinks hold sink_share of every query's attention: window loses it.
  EXPECT_GT(window.attention_loss.mean,
            streaming.attention_loss.mean + 0.5 * w.spec().sink_share)
      << window.attention_loss.mean << " vs " << streaming.attention_loss.mean;
}

TEST_F(EvalTest, H2OKeepsANeedleAttendedAgainAndAgain) {
  const Workload w = MakeWorkload(WorkloadFamily::kNeedleRepeated);
  ASSERT_FALSE(w.needles().empty());
  const EvalRow h2o = Run(w, "h2o", 0.2);
  const EvalRow window = Run(w, "window", 0.2);
  const EvalRow streaming = Run(w, "streaming_llm", 0.2);
  EXPECT_EQ(h2o.needle_survival, 1.0);
  EXPECT_EQ(window.needle_survival, 0.0);
  EXPECT_EQ(streaming.needle_survival, 0.0);
}

TEST_F(EvalTest, ANeedleAskedOnceIsLostByScoresButKeptByTheOracle) {
  const Workload w = MakeWorkload(WorkloadFamily::kNeedleOnce);
  ASSERT_FALSE(w.needles().empty());
  for (const std::string policy : {"h2o", "tova", "h2o_page"}) {
    EXPECT_EQ(Run(w, policy, 0.125).needle_survival, 0.0) << policy;
  }
  EXPECT_EQ(Run(w, workers::kOracle, 0.125).needle_survival, 1.0);
}

// No policy loses less attention than the per-step bound (no set of budget
// + 1 tokens does), and the oracle is within it too.
TEST_F(EvalTest, NoPolicyBeatsTheBound) {
  for (WorkloadFamily family : {WorkloadFamily::kSinks, WorkloadFamily::kMixed,
                                WorkloadFamily::kNeedleOnce}) {
    const Workload w = MakeWorkload(family);
    SCOPED_TRACE(workers::FamilyName(family));
    const int64_t budget = w.total_tokens() / 4;
    EvalRow bound;
    absl::StatusOr<EvalRow> oracle =
        workers::RunCase(*client_, "eval", w, workers::kOracle, budget,
                         workers::ScoreMode::kReduced, true, &bound);
    ASSERT_TRUE(oracle.ok()) << oracle.status();
    ASSERT_EQ(bound.policy, workers::kBound);
    ASSERT_GT(bound.attention_loss.count, 0);
    EXPECT_LE(bound.attention_loss.mean, oracle->attention_loss.mean);
    for (const std::string policy : {"window", "streaming_llm", "h2o", "tova",
                                     "scissorhands", "h2o_page"}) {
      const EvalRow row = Run(w, policy, 0.25);
      ASSERT_LE(row.mean_resident_tokens, budget + 1) << policy;
      EXPECT_LE(bound.attention_loss.mean, row.attention_loss.mean) << policy;
    }
  }
}

// Every score mode drives the same policy to a consistent state, and a
// second worker can take over a prefilled session (the prefill -> decode
// handoff of kvkeep-prefill and kvkeep-decode).
TEST_F(EvalTest, ScoreModesAndHandoff) {
  const Workload w = MakeWorkload(WorkloadFamily::kMixed, 128, 32);
  for (workers::ScoreMode mode :
       {workers::ScoreMode::kPerHead, workers::ScoreMode::kReduced,
        workers::ScoreMode::kQueries}) {
    SCOPED_TRACE(workers::ScoreModeName(mode));
    workers::SessionPlan plan;
    plan.layout = "eval";
    plan.policy = "h2o";
    plan.params = workers::EvalParams("h2o", 48);
    plan.budget_tokens = 48;
    plan.prefill_chunk = 40;
    plan.scores = mode;
    absl::StatusOr<workers::PrefilledSession> prefilled =
        workers::Prefill(*client_, w, plan);
    ASSERT_TRUE(prefilled.ok()) << prefilled.status();
    // The decode worker starts from the store's tables, not the prefill's.
    absl::StatusOr<client::Session> session =
        client_->OpenSession(prefilled->session.id());
    ASSERT_TRUE(session.ok()) << session.status();
    absl::StatusOr<client::BlockTableMirror> mirror = session->Mirror();
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    for (int32_t l = 0; l < mirror->num_layers(); ++l) {
      EXPECT_EQ(mirror->positions(l), prefilled->mirror.positions(l));
    }
    workers::DecodeOptions options;
    options.scores = mode;
    options.evaluate = true;
    absl::StatusOr<DecodeReport> r =
        workers::Decode(*session, *mirror, w, options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->steps, 32);
    EXPECT_EQ(r->quality.count(), 32 * 2 * 8);  // steps x layers x heads
    absl::StatusOr<client::BlockTableMirror> after = session->Mirror();
    ASSERT_TRUE(after.ok());
    for (int32_t l = 0; l < mirror->num_layers(); ++l) {
      EXPECT_EQ(mirror->positions(l), after->positions(l));
      EXPECT_LE(mirror->resident(l), 48);
    }
    ASSERT_TRUE(session->Close().ok());
  }
}

}  // namespace
}  // namespace kvkeep
