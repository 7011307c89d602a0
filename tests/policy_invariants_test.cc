// Invariants of every evicting policy over seeded random streams (all of
// PolicyNames() but full, and snapkv apart): no layer over budget,
// protected tokens never evicted, the StepResults let a worker reproduce the
// block table exactly, ReadLayer returns the bytes appended for each
// resident token (for a quantised layout the twin's record of them), and the
// pool's pages in use are exactly the sessions' pages (none once they
// close). The streams and their seeds come from conformance_support.h; a
// failure names the seed and step that reproduce it, and
// KVKEEP_CONFORMANCE_SCALE=N runs N times as many rounds.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/quantize.h"
#include "tests/conformance_support.h"
#include "tests/test_device.h"

namespace kvkeep::conformance_testing {
namespace {

// ---------------------------------------------------------------------------
// Invariants of every evicting policy.

// A worker's copy of one layer's block table, kept only from StepResults.
struct WorkerLayer {
  std::vector<PageId> pages;
  std::vector<int64_t> positions;  // per slot
};

// Follows one call's change the way session_types.h (LayerChange) tells a
// worker to. `new_positions` are the call's appended positions (none for a
// score update). Returns false (with a failure) if the change cannot apply.
bool Follow(const LayerChange& c, const std::vector<int64_t>& new_positions,
            WorkerLayer& w) {
  const int64_t old_size = static_cast<int64_t>(w.positions.size());
  for (const SlotMove& m : c.moves) {
    if (m.from_slot < 0 || m.from_slot >= old_size || m.to_slot < 0 ||
        m.to_slot >= old_size) {
      ADD_FAILURE() << "move " << m.from_slot << "->" << m.to_slot
                    << " outside the " << old_size << " slots";
      return false;
    }
    w.positions[m.to_slot] = w.positions[m.from_slot];
  }
  std::vector<int64_t> kept_new;
  for (int64_t p : new_positions) {
    if (!std::binary_search(c.evicted_positions.begin(),
                            c.evicted_positions.end(), p)) {
      kept_new.push_back(p);
    }
  }
  const int64_t keep = c.resident - static_cast<int64_t>(kept_new.size());
  if (keep < 0 || keep > old_size) {
    ADD_FAILURE() << "resident " << c.resident << " with " << kept_new.size()
                  << " new tokens kept, from " << old_size << " slots";
    return false;
  }
  w.positions.resize(keep);
  if (c.pages_freed.size() > w.pages.size() ||
      !std::equal(c.pages_freed.begin(), c.pages_freed.end(),
                  w.pages.end() - c.pages_freed.size())) {
    ADD_FAILURE() << "pages_freed [" << absl::StrJoin(c.pages_freed, ",")
                  << "] are not the end of the worker's pages ["
                  << absl::StrJoin(w.pages, ",") << "]";
    return false;
  }
  w.pages.resize(w.pages.size() - c.pages_freed.size());
  w.pages.insert(w.pages.end(), c.pages_added.begin(), c.pages_added.end());
  w.positions.insert(w.positions.end(), kept_new.begin(), kept_new.end());
  return true;
}

// Random parameters for a policy; the caller learns of a policy this test
// does not know through a test failure (its invariants must be covered).
bool RandomPolicy(absl::string_view name, Rng& rng, PolicySpec& spec) {
  spec.name = std::string(name);
  spec.params.clear();
  const int64_t slack = rng.Chance(0.6) ? 0 : rng.Int(1, 6);
  spec.params["slack"] = absl::StrCat(slack);
  if (name == "window") return true;
  if (name == "streaming_llm" || name == "h2o" || name == "tova" ||
      name == "scissorhands" || name == "h2o_page") {
    spec.params["sinks"] = absl::StrCat(rng.Chance(0.3) ? 0 : rng.Int(1, 4));
    spec.params["recent"] = absl::StrCat(rng.Chance(0.3) ? 0 : rng.Int(1, 8));
    if (name == "scissorhands") {
      spec.params["history"] = absl::StrCat(rng.Int(1, 64));
      spec.params["threshold"] = rng.Pick<const char*>({"0.5", "1", "2"});
    }
    return true;
  }
  ADD_FAILURE() << "policy '" << name
                << "' is new: give it parameters in RandomPolicy";
  return false;
}

// One session under test and the test's own view of it.
struct Tracked {
  SessionId id = 0;
  PolicySpec spec;
  PolicyPtr policy;  // for its trigger and protected counts
  std::vector<int64_t> budgets;
  std::vector<int64_t> appended;  // every position appended, in order
  std::vector<WorkerLayer> worker;
  int64_t next_position = 0;
};

int64_t ArrivalOf(const Tracked& t, int64_t position) {
  auto it = std::lower_bound(t.appended.begin(), t.appended.end(), position);
  return it != t.appended.end() && *it == position ? it - t.appended.begin()
                                                   : -1;
}

// Checks one layer change against the session's protection rules:
// `appended_view` is the arrival count the eviction was judged at.
void CheckEvictions(const Tracked& t, const LayerChange& c,
                    const std::vector<int64_t>& held_before,
                    const std::vector<int64_t>& new_positions,
                    int64_t appended_view) {
  EXPECT_TRUE(
      std::is_sorted(c.evicted_positions.begin(), c.evicted_positions.end()) &&
      std::adjacent_find(c.evicted_positions.begin(),
                         c.evicted_positions.end()) ==
          c.evicted_positions.end())
      << "evicted_positions not strictly ascending: ["
      << absl::StrJoin(c.evicted_positions, ",") << "]";
  const CommonParams& common = t.policy->common();
  for (int64_t p : c.evicted_positions) {
    const bool was_held = std::find(held_before.begin(), held_before.end(),
                                    p) != held_before.end() ||
                          std::find(new_positions.begin(), new_positions.end(),
                                    p) != new_positions.end();
    EXPECT_TRUE(was_held) << "evicted position " << p << " was not held";
    const int64_t arrival = ArrivalOf(t, p);
    EXPECT_GE(arrival, common.sinks) << "evicted sink " << p;
    EXPECT_LT(arrival, appended_view - common.recent)
        << "evicted position " << p << " of the recent window";
  }
}

// Everything the test can compare after a call on `t`: the worker's table
// against the store's, the bytes, budgets and protected tokens. `over_budget`
// is how far a layer may be over budget at this point (the tokens appended
// since the last scores of an attention-driven policy).
void CheckSession(CacheStore& store, const Tracked& t,
                  const ModelLayout& layout, int64_t over_budget) {
  absl::StatusOr<SessionStats> stats = store.GetStats(t.id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->layer_budget, t.budgets);
  int64_t pages = 0;
  const int64_t total = static_cast<int64_t>(t.appended.size());
  const CommonParams& common = t.policy->common();
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    absl::StatusOr<BlockTable> table = store.GetBlockTable(t.id, l);
    ASSERT_TRUE(table.ok()) << table.status();
    const int64_t resident = static_cast<int64_t>(table->positions.size());
    ASSERT_EQ(table->pages, t.worker[l].pages);
    ASSERT_EQ(table->positions, t.worker[l].positions);
    EXPECT_EQ(static_cast<int64_t>(table->pages.size()),
              (resident + layout.page_tokens - 1) / layout.page_tokens);
    EXPECT_EQ(stats->layer_resident[l], resident);
    EXPECT_LE(resident, t.budgets[l] + over_budget);
    pages += static_cast<int64_t>(table->pages.size());

    // The protected tokens are all held.
    const std::vector<int64_t> held = Sorted(table->positions);
    for (int64_t a = 0; a < total; ++a) {
      if (a < common.sinks || a >= total - common.recent) {
        EXPECT_TRUE(std::binary_search(held.begin(), held.end(), t.appended[a]))
            << "protected position " << t.appended[a] << " (arrival " << a
            << ") is gone";
      }
    }

    absl::StatusOr<LayerKvCopy> copy = store.ReadLayer(t.id, l);
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->version, table->version);
    ASSERT_EQ(copy->positions, table->positions);
    const int64_t token_bytes = layout.page_layout().token_bytes();
    ASSERT_EQ(static_cast<int64_t>(copy->keys.size()), resident * token_bytes);
    ASSERT_EQ(static_cast<int64_t>(copy->values.size()),
              resident * token_bytes);
    for (int64_t s = 0; s < resident; ++s) {
      const std::vector<std::byte> k =
          StoredTokenBytes(layout, l, table->positions[s], true);
      const std::vector<std::byte> v =
          StoredTokenBytes(layout, l, table->positions[s], false);
      ASSERT_EQ(0, std::memcmp(copy->keys.data() + s * token_bytes, k.data(),
                               token_bytes))
          << "keys of slot " << s << " (position " << table->positions[s]
          << ")";
      ASSERT_EQ(0, std::memcmp(copy->values.data() + s * token_bytes, v.data(),
                               token_bytes))
          << "values of slot " << s << " (position " << table->positions[s]
          << ")";
    }
  }
  EXPECT_EQ(stats->pages, pages);
}

// A call that evicted cut the layer to budget - slack, no further: token
// policies evict exactly the excess, h2o_page rounds up to whole pages.
void CheckNotOverEvicted(const Tracked& t, const ModelLayout& layout,
                         int32_t layer, const LayerChange& c) {
  if (c.evicted_positions.empty()) return;
  const int64_t rounding =
      t.spec.name == "h2o_page" ? layout.page_tokens - 1 : 0;
  EXPECT_GE(c.resident, t.budgets[layer] - t.policy->common().slack - rounding)
      << "layer " << layer << " evicted too much: ["
      << absl::StrJoin(c.evicted_positions, ",") << "]";
}

void CheckPool(CacheStore& store, const std::vector<Tracked>& sessions) {
  int64_t pages = 0;
  for (const Tracked& t : sessions) {
    absl::StatusOr<SessionStats> stats = store.GetStats(t.id);
    ASSERT_TRUE(stats.ok()) << stats.status();
    pages += stats->pages;
  }
  const std::vector<LayoutStats> layouts = store.Layouts();
  ASSERT_EQ(layouts.size(), 1u);
  EXPECT_EQ(layouts[0].pool.used_pages, pages);
}

// Attention for `rows` query rows over the layer's slots, in the given form:
// random positive weights over the causally visible slots, normalised per
// head (per-head and reduced), or random query vectors.
std::vector<float> RandomScores(Rng& rng, const ModelLayout& layout,
                                const Tracked& t, int32_t layer, int32_t rows,
                                ScoreSource source) {
  const std::vector<int64_t>& slots = t.worker[layer].positions;
  const int64_t n = static_cast<int64_t>(slots.size());
  const int32_t heads = layout.query_heads;
  if (source == ScoreSource::kQueries) {
    std::vector<float> q(int64_t{rows} * heads * layout.head_dim);
    for (float& x : q) x = static_cast<float>(rng.Real(-2.0, 2.0));
    return q;
  }
  std::vector<float> per_head(int64_t{heads} * rows * n, 0.0f);
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t r = 0; r < rows; ++r) {
      const int64_t query = t.appended[t.appended.size() - rows + r];
      std::vector<double> w(n, 0.0);
      double sum = 0;
      for (int64_t s = 0; s < n; ++s) {
        if (slots[s] <= query) w[s] = std::exp(rng.Real(-3.0, 3.0));
        sum += w[s];
      }
      for (int64_t s = 0; s < n; ++s) {
        per_head[(int64_t{h} * rows + r) * n + s] =
            static_cast<float>(w[s] / sum);
      }
    }
  }
  if (source == ScoreSource::kPerHead) return per_head;
  std::vector<float> reduced(int64_t{rows} * n, 0.0f);
  for (int32_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < int64_t{rows} * n; ++i) {
      reduced[i] += per_head[int64_t{h} * rows * n + i];
    }
  }
  return reduced;
}

// One round: a random layout, one session per evicting policy, steps
// interleaved at random across the sessions (appends of one or several
// tokens, attention in every form or none at all), checks after every call,
// then every session closed.
void RunInvariantRound(uint64_t seed) {
  Rng rng(Hash({seed, 0x1a7a}));
  const ModelLayout layout = RandomLayout(rng, {1, 3, 4, 8});
  SCOPED_TRACE(absl::StrCat("round seed ", seed, " layers ", layout.num_layers,
                            " heads ", layout.query_heads, "/", layout.kv_heads,
                            " dim ", layout.head_dim, " ",
                            std::string(DTypeName(layout.dtype)), " group ",
                            layout.group_size, " page ", layout.page_tokens));
  std::unique_ptr<CacheStore> store = MakeStore(layout, 4096);
  ASSERT_NE(store, nullptr);

  std::vector<Tracked> sessions;
  for (absl::string_view name : PolicyNames()) {
    if (name == "full" || name == "snapkv") continue;
    Tracked t;
    ASSERT_TRUE(RandomPolicy(name, rng, t.spec));
    absl::StatusOr<PolicyPtr> policy = NewPolicy(t.spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    t.policy = *policy;
    // The least budget the policy accepts: budget - slack keeps a token
    // and the protected ones.
    const int64_t floor = std::max<int64_t>(1, t.policy->protected_tokens()) +
                          t.policy->common().slack;
    BudgetSpec budget;
    switch (rng.Int(0, 2)) {
      case 0:
        budget.tokens = floor + rng.Int(0, 24);
        break;
      case 1:
        for (int32_t l = 0; l < layout.num_layers; ++l) {
          budget.per_layer.push_back(floor + rng.Int(0, 24));
        }
        break;
      default:
        // Pyramid with beta 2: the top layer keeps protected + free / 2,
        // which covers the slack.
        budget.schedule = "pyramid";
        budget.pyramid_beta = 2.0;
        budget.tokens = floor + t.policy->common().slack + 20 + rng.Int(0, 24);
        break;
    }
    absl::StatusOr<SessionId> id =
        store->CreateSession(SessionSpec{layout.name, t.spec, budget});
    ASSERT_TRUE(id.ok()) << id.status() << " for " << name;
    t.id = *id;
    absl::StatusOr<SessionStats> stats = store->GetStats(t.id);
    ASSERT_TRUE(stats.ok());
    t.budgets = stats->layer_budget;
    if (!budget.per_layer.empty()) {
      ASSERT_EQ(t.budgets, budget.per_layer);
    }
    t.worker.resize(layout.num_layers);
    t.next_position = rng.Int(0, 3);
    sessions.push_back(std::move(t));
  }

  const int steps =
      static_cast<int>(rng.Int(40, 70)) * static_cast<int>(sessions.size());
  std::vector<int64_t> pending(sessions.size(), 0);  // tokens awaiting scores
  for (int step = 0; step < steps; ++step) {
    const size_t which = static_cast<size_t>(
        rng.Int(0, static_cast<int64_t>(sessions.size()) - 1));
    Tracked& t = sessions[which];
    SCOPED_TRACE(absl::StrCat("step ", step, " policy ", t.spec.name));
    const bool on_attention =
        t.policy->trigger() == EvictionTrigger::kOnAttention;

    // Append one token, or a chunk.
    const int64_t n = rng.Chance(0.8) ? 1 : rng.Int(2, 20);
    std::vector<int64_t> chunk;
    for (int64_t i = 0; i < n; ++i) {
      chunk.push_back(t.next_position);
      t.next_position += rng.Int(1, 2);
    }
    std::vector<std::vector<int64_t>> held_before(layout.num_layers);
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      held_before[l] = t.worker[l].positions;
    }
    const int64_t appended_before = static_cast<int64_t>(t.appended.size());
    absl::StatusOr<StepResult> appended =
        store->Append(t.id, AppendBuffers(layout, chunk).request());
    ASSERT_TRUE(appended.ok()) << appended.status();
    t.appended.insert(t.appended.end(), chunk.begin(), chunk.end());
    ASSERT_EQ(appended->layers.size(), static_cast<size_t>(layout.num_layers));
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const LayerChange& c = appended->layers[l];
      EXPECT_EQ(c.layer, l);
      // An attention-driven policy settles an earlier append before placing
      // the new tokens; a content-blind one judges as if they had arrived.
      CheckEvictions(t, c, held_before[l], chunk,
                     on_attention ? appended_before
                                  : static_cast<int64_t>(t.appended.size()));
      ASSERT_TRUE(Follow(c, chunk, t.worker[l])) << Render(*appended);
      EXPECT_EQ(c.resident, static_cast<int64_t>(t.worker[l].positions.size()));
      CheckNotOverEvicted(t, layout, l, c);
    }
    pending[which] = on_attention ? n : 0;
    CheckSession(*store, t, layout, pending[which]);
    if (::testing::Test::HasFailure()) return;

    // This step's attention, usually.
    if (on_attention && rng.Chance(0.85)) {
      const ScoreSource source =
          rng.Pick<ScoreSource>({ScoreSource::kPerHead, ScoreSource::kReduced,
                                 ScoreSource::kQueries});
      const int32_t rows = static_cast<int32_t>(rng.Int(1, n));
      std::vector<std::vector<float>> data(layout.num_layers);
      std::vector<LayerScores> scores;
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        held_before[l] = t.worker[l].positions;
        data[l] = RandomScores(rng, layout, t, l, rows, source);
        scores.push_back(
            LayerScores{l, appended->layers[l].version, source, rows, data[l]});
      }
      absl::StatusOr<StepResult> updated = store->UpdateScores(t.id, scores);
      ASSERT_TRUE(updated.ok()) << updated.status();
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        const LayerChange& c = updated->layers[l];
        CheckEvictions(t, c, held_before[l], {},
                       static_cast<int64_t>(t.appended.size()));
        ASSERT_TRUE(Follow(c, {}, t.worker[l])) << Render(*updated);
        CheckNotOverEvicted(t, layout, l, c);
      }
      pending[which] = 0;
      CheckSession(*store, t, layout, 0);
      if (::testing::Test::HasFailure()) return;
    }
    CheckPool(*store, sessions);
    if (::testing::Test::HasFailure()) return;
  }

  // Close them one by one; the pool gets every page back.
  while (!sessions.empty()) {
    ASSERT_TRUE(store->CloseSession(sessions.back().id).ok());
    sessions.pop_back();
    CheckPool(*store, sessions);
  }
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
}

TEST(PolicyInvariantsTest, HoldOverRandomInterleavedSessions) {
  for (uint64_t round = 0; round < 80u * Scale(); ++round) {
    RunInvariantRound(round);
    if (HasFailure()) return;
  }
}

// A session at its budget holds its pages and needs no more: a content-blind
// policy makes room before placing new tokens (docs/policies.md), so it keeps
// appending in a pool sized exactly for its budget; an attention-driven one
// holds at most budget + one append between an append and its scores, so
// that much pool suffices for it.
void AppendAtBudgetInASizedPool(absl::string_view name, EvictionTrigger trigger,
                                int32_t page_tokens) {
  SCOPED_TRACE(absl::StrCat(name, " page_tokens ", page_tokens));
  constexpr int64_t kBudget = 8;
  constexpr int32_t kLayers = 2;
  const ModelLayout layout =
      MakeLayout(kLayers, 1, 1, 2, DType::kF32, page_tokens);
  const int64_t held = trigger == EvictionTrigger::kOnAppend
                           ? kBudget
                           : kBudget + 1;  // one decode append over
  const int64_t capacity = kLayers * ((held + page_tokens - 1) / page_tokens);
  std::unique_ptr<CacheStore> store = MakeStore(layout, capacity);
  ASSERT_NE(store, nullptr);
  BudgetSpec budget;
  budget.tokens = kBudget;
  absl::StatusOr<SessionId> id = store->CreateSession(
      SessionSpec{layout.name, PolicySpec{std::string(name), {}}, budget});
  ASSERT_TRUE(id.ok()) << id.status();
  for (int64_t position = 0; position < 4 * kBudget; ++position) {
    absl::StatusOr<StepResult> appended =
        store->Append(*id, AppendBuffers(layout, {position}).request());
    ASSERT_TRUE(appended.ok())
        << "position " << position << ": " << appended.status();
    if (trigger != EvictionTrigger::kOnAttention) continue;
    std::vector<std::vector<float>> rows(kLayers);
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < kLayers; ++l) {
      const int64_t n = appended->layers[l].resident;
      rows[l].assign(n, 1.0f / static_cast<float>(n));
      scores.push_back(LayerScores{l, appended->layers[l].version,
                                   ScoreSource::kPerHead, 1, rows[l]});
    }
    ASSERT_TRUE(store->UpdateScores(*id, scores).ok());
  }
  absl::StatusOr<SessionStats> stats = store->GetStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_THAT(stats->layer_resident, ::testing::Each(kBudget));
}

TEST(PolicyInvariantsTest, SessionAtBudgetAppendsIntoAPoolSizedForIt) {
  for (absl::string_view name : PolicyNames()) {
    absl::StatusOr<PolicyPtr> policy =
        NewPolicy(PolicySpec{std::string(name), {}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    const EvictionTrigger trigger = (*policy)->trigger();
    if (trigger != EvictionTrigger::kOnAppend &&
        trigger != EvictionTrigger::kOnAttention) {
      continue;  // full and snapkv grow without bound during decode
    }
    for (int32_t page_tokens : {1, 3, 4}) {
      AppendAtBudgetInASizedPool(name, trigger, page_tokens);
    }
  }
}

// evicted_positions is documented as ascending; a policy that picks victims
// by score must still report them in position order.
TEST(PolicyInvariantsTest, EvictedPositionsAreAscending) {
  const ModelLayout layout = MakeLayout(1, 1, 1, 2, DType::kF32, 4);
  for (absl::string_view name : {"h2o", "tova", "h2o_page", "scissorhands"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<CacheStore> store = MakeStore(layout, 64);
    ASSERT_NE(store, nullptr);
    BudgetSpec budget;
    budget.tokens = 8;
    absl::StatusOr<SessionId> id = store->CreateSession(
        SessionSpec{layout.name, PolicySpec{std::string(name), {}}, budget});
    ASSERT_TRUE(id.ok()) << id.status();
    std::vector<int64_t> positions(20);
    for (int64_t i = 0; i < 20; ++i) positions[i] = i;
    absl::StatusOr<StepResult> appended =
        store->Append(*id, AppendBuffers(layout, positions).request());
    ASSERT_TRUE(appended.ok());
    // Attention falling with position: the newest tokens score least, so a
    // score-ordered victim list would be descending.
    std::vector<float> row(20);
    double sum = 0;
    for (int i = 0; i < 20; ++i) sum += 20 - i;
    for (int i = 0; i < 20; ++i) row[i] = static_cast<float>((20 - i) / sum);
    const LayerScores scores{0, appended->layers[0].version,
                             ScoreSource::kPerHead, 1, row};
    absl::StatusOr<StepResult> updated =
        store->UpdateScores(*id, std::span<const LayerScores>(&scores, 1));
    ASSERT_TRUE(updated.ok()) << updated.status();
    const std::vector<int64_t>& evicted = updated->layers[0].evicted_positions;
    EXPECT_GE(evicted.size(), 12u);
    EXPECT_TRUE(std::is_sorted(evicted.begin(), evicted.end()))
        << absl::StrJoin(evicted, ",");
  }
}

// snapkv: after compression every layer holds exactly its budget, the window
// included; decode afterwards never evicts; score updates and a second
// compression are refused.
TEST(PolicyInvariantsTest, SnapKvKeepsTheBudgetThenNeverEvicts) {
  for (uint64_t round = 0; round < 120u * Scale(); ++round) {
    Rng rng(Hash({round, 0x5a9}));
    const ModelLayout layout = RandomLayout(rng, {2, 4, 8});
    const int64_t window = rng.Int(1, 12);
    const int64_t kernel = rng.Pick<int64_t>({1, 3, 5, 7});
    Tracked t;
    t.spec = PolicySpec{
        "snapkv",
        {{"window", absl::StrCat(window)},
         {"kernel", absl::StrCat(kernel)},
         {"pooling", rng.Pick<const char*>({"avgpool", "maxpool"})}}};
    SCOPED_TRACE(absl::StrCat("round ", round, " window ", window, " kernel ",
                              kernel, " layers ", layout.num_layers));
    absl::StatusOr<PolicyPtr> policy = NewPolicy(t.spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    t.policy = *policy;
    BudgetSpec budget;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      budget.per_layer.push_back(window + rng.Int(0, 30));
    }
    std::unique_ptr<CacheStore> store = MakeStore(layout, 4096);
    ASSERT_NE(store, nullptr);
    absl::StatusOr<SessionId> id =
        store->CreateSession(SessionSpec{layout.name, t.spec, budget});
    ASSERT_TRUE(id.ok()) << id.status();
    t.id = *id;
    t.budgets = budget.per_layer;
    t.worker.resize(layout.num_layers);

    // The prompt, in one or a few chunks, longer than every budget.
    const int64_t prompt =
        *std::max_element(t.budgets.begin(), t.budgets.end()) + rng.Int(1, 40);
    StepResult last;
    int64_t position = 0;
    while (static_cast<int64_t>(t.appended.size()) < prompt) {
      const int64_t n = std::min<int64_t>(
          prompt - static_cast<int64_t>(t.appended.size()), rng.Int(1, prompt));
      std::vector<int64_t> chunk;
      for (int64_t i = 0; i < n; ++i) chunk.push_back(position++);
      absl::StatusOr<StepResult> appended =
          store->Append(t.id, AppendBuffers(layout, chunk).request());
      ASSERT_TRUE(appended.ok()) << appended.status();
      t.appended.insert(t.appended.end(), chunk.begin(), chunk.end());
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        EXPECT_TRUE(appended->layers[l].evicted_positions.empty());
        ASSERT_TRUE(Follow(appended->layers[l], chunk, t.worker[l]));
      }
      last = *std::move(appended);
    }
    const ScoreSource source = rng.Pick<ScoreSource>(
        {ScoreSource::kPerHead, ScoreSource::kReduced, ScoreSource::kQueries});
    std::vector<std::vector<float>> data(layout.num_layers);
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      data[l] =
          RandomScores(rng, layout, t, l, static_cast<int32_t>(window), source);
      scores.push_back(LayerScores{l, last.layers[l].version, source,
                                   static_cast<int32_t>(window), data[l]});
    }
    absl::StatusOr<StepResult> compressed = store->CompressPrompt(t.id, scores);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const LayerChange& c = compressed->layers[l];
      EXPECT_EQ(c.resident, t.budgets[l]);
      EXPECT_EQ(static_cast<int64_t>(c.evicted_positions.size()),
                prompt - t.budgets[l]);
      CheckEvictions(t, c, t.worker[l].positions, {},
                     static_cast<int64_t>(t.appended.size()));
      ASSERT_TRUE(Follow(c, {}, t.worker[l]));
    }
    CheckSession(*store, t, layout, 0);  // the window (recent) is held
    if (::testing::Test::HasFatalFailure()) return;

    // Decode: the cache grows, nothing is evicted.
    for (int64_t step = 0; step < 20; ++step) {
      const std::vector<int64_t> chunk = {position++};
      absl::StatusOr<StepResult> appended =
          store->Append(t.id, AppendBuffers(layout, chunk).request());
      ASSERT_TRUE(appended.ok()) << appended.status();
      t.appended.push_back(chunk[0]);
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        const LayerChange& c = appended->layers[l];
        EXPECT_TRUE(c.evicted_positions.empty());
        EXPECT_TRUE(c.moves.empty());
        EXPECT_TRUE(c.pages_freed.empty());
        EXPECT_EQ(c.resident, t.budgets[l] + step + 1);
        ASSERT_TRUE(Follow(c, chunk, t.worker[l]));
      }
      CheckSession(*store, t, layout, step + 1);
      if (::testing::Test::HasFatalFailure()) return;
      std::vector<float> one(layout.query_heads * t.worker[0].positions.size(),
                             0.0f);
      const LayerScores update{0, appended->layers[0].version,
                               ScoreSource::kPerHead, 1, one};
      EXPECT_EQ(
          store->UpdateScores(t.id, std::span<const LayerScores>(&update, 1))
              .status()
              .code(),
          absl::StatusCode::kFailedPrecondition);
    }
    EXPECT_EQ(store->CompressPrompt(t.id, scores).status().code(),
              absl::StatusCode::kFailedPrecondition);
    CheckPool(*store, {t});
    ASSERT_TRUE(store->CloseSession(t.id).ok());
    EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  }
}

}  // namespace
}  // namespace kvkeep::conformance_testing
