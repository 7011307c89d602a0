// The fused path for head-reduced attention (Session::FusedScores): h2o and
// h2o_page check a step's rows and add them to the scores in one pass, into
// scratch that is swapped in only once the step can no longer fail. A step
// whose last layer is refused after the earlier layers were added must leave
// the session exactly as it was: a twin session that never saw the refused
// steps keeps making the same evictions, with the same evicted score (which
// sums the victims' float scores, so any change in a score shows).
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 3;
constexpr int32_t kQueryHeads = 4;
constexpr int64_t kBudget = 24;

ModelLayout Layout() {
  ModelLayout l;
  l.name = std::string("fused");
  l.num_layers = kLayers;
  l.kv_heads = 2;
  l.query_heads = kQueryHeads;
  l.head_dim = 4;
  l.dtype = DType::kBF16;
  l.page_tokens = 4;
  return l;
}

using test_data::AppendBuffers;

// A store with one session of `policy` prefilled with kBudget - 4 tokens.
struct Twin {
  std::unique_ptr<CacheStore> store;
  SessionId id = 0;
  std::vector<uint64_t> versions = std::vector<uint64_t>(kLayers);
  std::vector<int64_t> resident = std::vector<int64_t>(kLayers);

  void Follow(const StepResult& r) {
    for (const LayerChange& c : r.layers) {
      versions[c.layer] = c.version;
      resident[c.layer] = c.resident;
    }
  }
};

Twin MakeTwin(const std::string& policy) {
  Twin t;
  StoreOptions options;
  options.pools.push_back(PoolSpec{Layout(), 128});
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return t;
  t.store = *std::move(store);
  SessionSpec spec;
  spec.layout = "fused";
  spec.policy =
      PolicySpec{policy, {{"sinks", "1"}, {"recent", "2"}, {"slack", "4"}}};
  spec.budget.tokens = kBudget;
  absl::StatusOr<SessionId> id = t.store->CreateSession(spec);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return t;
  t.id = *id;
  std::vector<int64_t> prompt;
  for (int64_t p = 0; p < kBudget - 4; ++p) prompt.push_back(p);
  absl::StatusOr<StepResult> r =
      t.store->Append(t.id, AppendBuffers(Layout(), prompt).request());
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) t.Follow(*r);
  return t;
}

// How the last layer's row is made bad; the earlier layers' rows are valid.
enum class Bad { kRowSum, kNaNInTheAppendedSlot, kNegativeInTheMiddle };

class FusedScoresTest
    : public ::testing::TestWithParam<std::tuple<std::string, Bad>> {};

TEST_P(FusedScoresTest, ARefusedStepLeavesTheScoresBitForBit) {
  const auto& [policy, bad] = GetParam();
  Twin a = MakeTwin(policy);
  Twin b = MakeTwin(policy);
  ASSERT_NE(a.store, nullptr);
  ASSERT_NE(b.store, nullptr);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> w(0.01f, 1.0f);
  int64_t evicted = 0;
  for (int64_t step = 0; step < 40; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const AppendBuffers token(Layout(), {kBudget - 4 + step});
    // Valid rows over the slots after the append: up to 4 heads' worth.
    std::vector<std::vector<float>> rows(kLayers);
    std::vector<LayerScores> good;
    for (int32_t l = 0; l < kLayers; ++l) {
      const int64_t slots = a.resident[l] + 1;
      for (int64_t s = 0; s < slots; ++s) rows[l].push_back(w(rng));
      float sum = 0;
      for (float v : rows[l]) sum += v;
      for (float& v : rows[l]) v *= kQueryHeads / sum * 0.99f;
      good.push_back(
          LayerScores{l, a.versions[l], ScoreSource::kReduced, 1, rows[l]});
    }
    std::vector<float> last = rows[kLayers - 1];
    switch (bad) {
      case Bad::kRowSum:  // seen only once the whole row is summed
        last.front() += kQueryHeads;
        break;
      case Bad::kNaNInTheAppendedSlot:
        last.back() = std::numeric_limits<float>::quiet_NaN();
        break;
      case Bad::kNegativeInTheMiddle:
        last[last.size() / 2] = -0.5f;
        break;
    }
    std::vector<LayerScores> refused = good;
    refused.back().data = last;
    const absl::StatusOr<SessionStats> before = a.store->GetStats(a.id);
    KV_ASSERT_OK(before.status());
    absl::StatusOr<StepOutcome> r =
        a.store->Step(a.id, token.request(), refused);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << r.status();
    EXPECT_NE(r.status().message().find("layer 2"), absl::string_view::npos)
        << r.status();
    const absl::StatusOr<SessionStats> after = a.store->GetStats(a.id);
    KV_ASSERT_OK(after.status());
    EXPECT_EQ(after->layer_resident, before->layer_resident);
    EXPECT_EQ(after->layer_version, before->layer_version);
    EXPECT_EQ(after->score_updates, before->score_updates);

    // The same good step on both: the same evictions and evicted score.
    KV_ASSIGN_OR_FAIL(StepOutcome oa,
                      a.store->Step(a.id, token.request(), good));
    KV_ASSIGN_OR_FAIL(StepOutcome ob,
                      b.store->Step(b.id, token.request(), good));
    for (int32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(oa.scores.layers[l].evicted_positions,
                ob.scores.layers[l].evicted_positions)
          << "layer " << l;
      evicted +=
          static_cast<int64_t>(oa.scores.layers[l].evicted_positions.size());
    }
    a.Follow(oa.append);
    a.Follow(oa.scores);
    b.Follow(ob.append);
    b.Follow(ob.scores);
    KV_ASSIGN_OR_FAIL(SessionStats sa, a.store->GetStats(a.id));
    KV_ASSIGN_OR_FAIL(SessionStats sb, b.store->GetStats(b.id));
    EXPECT_EQ(sa.evicted_score, sb.evicted_score);
    EXPECT_EQ(sa.evicted_tokens, sb.evicted_tokens);
  }
  // 40 steps from budget - 4 evict several times on every layer.
  EXPECT_GE(evicted, kLayers * 20);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, FusedScoresTest,
    ::testing::Combine(::testing::Values("h2o", "h2o_page"),
                       ::testing::Values(Bad::kRowSum,
                                         Bad::kNaNInTheAppendedSlot,
                                         Bad::kNegativeInTheMiddle)));

}  // namespace
}  // namespace kvkeep
