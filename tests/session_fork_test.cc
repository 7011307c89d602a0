// ForkSession and copy-on-write pages, at the store: random streams of
// creates, forks (some with another policy or budget), appends, score
// updates, decode steps and closes, in any order, each session checked byte
// for byte against an unshared twin in another store (a deep copy made at
// fork time and driven by the same inputs), the pool's reference counts
// against the block tables after every operation, and everything back to
// zero once all are closed. Then the quota rule and the refusals.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cache_store/budget.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

constexpr char kLayout[] = "fork";

ModelLayout ForkLayout(int32_t page_tokens) {
  ModelLayout l;
  l.name = std::string(kLayout);
  l.num_layers = 2;
  l.kv_heads = 1;
  l.query_heads = 2;
  l.head_dim = 4;
  l.dtype = DType::kF32;
  l.page_tokens = page_tokens;
  return l;
}

std::unique_ptr<CacheStore> MakeStore(const ModelLayout& layout,
                                      int64_t capacity_pages,
                                      int64_t max_bytes_per_tenant = 0) {
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools.push_back(PoolSpec{layout, capacity_pages});
  options.max_bytes_per_tenant = max_bytes_per_tenant;
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// The policies streams use, each with parameters every budget below fits.
const std::vector<PolicySpec>& StreamPolicies() {
  static const std::vector<PolicySpec> kPolicies = {
      {"h2o", {{"sinks", "1"}, {"recent", "2"}, {"slack", "1"}}},
      {"tova", {{"recent", "1"}}},
      {"scissorhands", {{"sinks", "1"}, {"recent", "1"}, {"history", "3"}}},
      {"h2o_page", {{"sinks", "1"}, {"recent", "1"}}},
      {"window", {{"slack", "2"}}},
      {"streaming_llm", {{"sinks", "2"}, {"recent", "2"}}},
      {"full", {}},
      {"snapkv", {{"window", "2"}, {"kernel", "1"}}},
  };
  return kPolicies;
}

bool Scored(const PolicySpec& p) {
  const PolicyInfo* info = FindPolicy(p.name);
  return info != nullptr && info->input == PolicyInput::kPerStep;
}

// One append's request and the buffers it borrows: random bytes, so a token
// written into the wrong session's page never passes for the right one.
struct Tokens {
  std::vector<int64_t> positions;
  std::vector<std::vector<float>> keys, values;  // per layer
  std::vector<LayerKv> layers;

  Tokens(const ModelLayout& l, int64_t first, int64_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> value(-1, 1);
    const int64_t per_token = int64_t{l.kv_heads} * l.head_dim;
    for (int64_t i = 0; i < n; ++i) positions.push_back(first + i);
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      keys.emplace_back(n * per_token);
      values.emplace_back(n * per_token);
      for (float& f : keys.back()) f = value(rng);
      for (float& f : values.back()) f = value(rng);
    }
    for (int32_t layer = 0; layer < l.num_layers; ++layer) {
      layers.push_back(LayerKv{std::as_bytes(std::span(keys[layer])),
                               std::as_bytes(std::span(values[layer]))});
    }
  }
  AppendRequest request() const { return AppendRequest{positions, layers}; }
};

// Head-reduced attention rows (one row, summing to 1) for some layers.
struct Attention {
  std::vector<std::vector<float>> rows;
  std::vector<LayerScores> scores;
};

// What a call reported, without page ids (the twins' pages differ).
void ExpectSameChange(const StepResult& got, const StepResult& want,
                      const std::string& where) {
  ASSERT_EQ(got.layers.size(), want.layers.size()) << where;
  for (size_t l = 0; l < got.layers.size(); ++l) {
    const LayerChange& a = got.layers[l];
    const LayerChange& b = want.layers[l];
    EXPECT_EQ(a.version, b.version) << where << " layer " << l;
    EXPECT_EQ(a.resident, b.resident) << where << " layer " << l;
    EXPECT_EQ(a.evicted_positions, b.evicted_positions) << where;
    EXPECT_EQ(a.moves, b.moves) << where << " layer " << l;
    EXPECT_EQ(a.pages_freed.size(), b.pages_freed.size()) << where;
    EXPECT_EQ(a.pages_added.size(), b.pages_added.size()) << where;
    EXPECT_TRUE(b.pages_copied.empty()) << where << ": the twin shares nothing";
  }
}

// Random streams over one store whose sessions share pages, and a twin
// store where every session has pages of its own.
class ForkStream {
 public:
  ForkStream(uint32_t seed, int32_t page_tokens, int64_t capacity_pages)
      : layout_(ForkLayout(page_tokens)),
        rng_(seed),
        store_(MakeStore(layout_, capacity_pages)),
        twins_(MakeStore(layout_, 8192)) {}

  // `ops` random operations, every invariant checked after each.
  void Run(int ops) {
    for (int i = 0; i < ops && !::testing::Test::HasFatalFailure(); ++i) {
      const int pick = Uniform(0, 99);
      if (live_.empty() || pick < 8) {
        Create();
      } else if (pick < 22) {
        Fork();
      } else if (pick < 55) {
        Append();
      } else if (pick < 75) {
        Scores(/*with_append=*/false);
      } else if (pick < 90) {
        Scores(/*with_append=*/true);
      } else {
        Close();
      }
      CheckPool();
      CheckEverySession();
    }
    while (!live_.empty()) {
      CloseAt(live_.size() - 1);
      CheckPool();
    }
    const LayoutStats stats = store_->Layouts()[0];
    EXPECT_EQ(stats.pool.used_pages, 0);
    EXPECT_EQ(stats.pool.page_references, 0);
    EXPECT_EQ(stats.pool.shared_pages, 0);
    EXPECT_EQ(stats.pool.owners, 0);
    EXPECT_EQ(stats.pool.rejected_frees, 0);
    EXPECT_EQ(TenantBytes(), 0);
  }

  int64_t forks() const { return forks_; }
  int64_t refusals() const { return refusals_; }

 private:
  struct Live {
    SessionId id = 0;    // in store_
    SessionId twin = 0;  // in twins_
    PolicySpec policy;
    int64_t last_position = -1;
  };

  int Uniform(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  const PolicySpec& RandomPolicy() {
    const int n = static_cast<int>(StreamPolicies().size());
    return StreamPolicies()[Uniform(0, n - 1)];
  }
  size_t AnyLive() { return Uniform(0, static_cast<int>(live_.size()) - 1); }
  std::string Where(const Live& s) const {
    return absl::StrCat("session ", SessionName(s.id), " (", s.policy.name,
                        ")");
  }

  void Create() {
    SessionSpec spec;
    spec.layout = std::string(kLayout);
    spec.policy = RandomPolicy();
    spec.budget.tokens = Uniform(8, 20);
    absl::StatusOr<SessionId> id = store_->CreateSession(spec);
    absl::StatusOr<SessionId> twin = twins_->CreateSession(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(twin.ok()) << twin.status();
    live_.push_back(Live{*id, *twin, spec.policy});
  }

  // The child, and its twin: the parent's twin exported, changed as the fork
  // spec says, and imported under the child's id.
  void Fork() {
    const Live parent = live_[AnyLive()];
    ForkSpec spec;
    if (Uniform(0, 3) == 0) {
      spec.policy = RandomPolicy();
    }
    if (Uniform(0, 3) == 0) {
      spec.budget = BudgetSpec{};
      spec.budget->tokens = Uniform(6, 22);
    }
    absl::StatusOr<SessionId> child = store_->ForkSession(parent.id, spec);
    ASSERT_TRUE(child.ok()) << child.status();
    ++forks_;
    absl::StatusOr<SessionSnapshot> snapshot =
        twins_->ExportSession(parent.twin);
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    snapshot->id = *child;
    snapshot->work = SessionWork{};
    if (spec.policy.has_value()) snapshot->policy = *spec.policy;
    absl::StatusOr<PolicyPtr> policy = NewPolicy(snapshot->policy);
    ASSERT_TRUE(policy.ok()) << policy.status();
    if (spec.budget.has_value()) {
      absl::StatusOr<std::vector<int64_t>> budgets = LayerBudgets(
          *spec.budget, layout_.num_layers, (*policy)->protected_tokens());
      ASSERT_TRUE(budgets.ok()) << budgets.status();
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        snapshot->layers[l].budget = (*budgets)[l];
      }
    }
    const bool had_history =
        !spec.policy.has_value() || (*NewPolicy(parent.policy))->uses_history();
    for (LayerSnapshot& l : snapshot->layers) {
      if (!(*policy)->uses_history()) {
        l.history.clear();
      } else if (!had_history) {
        l.history.assign(l.position.size(), 0);
      }
    }
    absl::StatusOr<SessionId> twin = twins_->ImportSession(*snapshot);
    ASSERT_TRUE(twin.ok()) << twin.status();
    live_.push_back(
        Live{*child, *twin, snapshot->policy, parent.last_position});
  }

  void Append() {
    Live& s = live_[AnyLive()];
    const Tokens tokens(layout_, s.last_position + 1, Uniform(1, 7), rng_);
    absl::StatusOr<StepResult> got = store_->Append(s.id, tokens.request());
    if (!got.ok()) {
      // Only a full pool may refuse; the twin then takes nothing either.
      ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted)
          << got.status();
      ++refusals_;
      return;
    }
    absl::StatusOr<StepResult> want = twins_->Append(s.twin, tokens.request());
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameChange(*got, *want, Where(s));
    s.last_position = tokens.positions.back();
  }

  // Attention for a random subset of layers over the slots they will have
  // after `growth` more tokens; versions as they are now.
  Attention MakeAttention(const Live& s, int64_t growth) {
    Attention a;
    absl::StatusOr<SessionStats> stats = store_->GetStats(s.id);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) return a;
    std::uniform_real_distribution<float> weight(0.01f, 1);
    for (int32_t l = 0; l < layout_.num_layers; ++l) {
      const int64_t slots = stats->layer_resident[l] + growth;
      if (slots == 0 || Uniform(0, 3) == 0) continue;
      std::vector<float> row(slots);
      float sum = 0;
      for (float& f : row) sum += (f = weight(rng_));
      for (float& f : row) f /= sum;
      a.rows.push_back(std::move(row));
      a.scores.push_back(LayerScores{
          l, stats->layer_version[l], ScoreSource::kReduced, 1, {}});
    }
    for (size_t i = 0; i < a.scores.size(); ++i) a.scores[i].data = a.rows[i];
    return a;
  }

  // snapkv, once: the last two tokens' attention compresses every layer.
  void Compress(Live& s) {
    absl::StatusOr<SessionStats> stats = store_->GetStats(s.id);
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (stats->compressed || stats->layer_resident[0] < 2) return;
    Attention a;
    std::uniform_real_distribution<float> weight(0.01f, 1);
    for (int32_t l = 0; l < layout_.num_layers; ++l) {
      const int64_t slots = stats->layer_resident[l];
      std::vector<float> rows(2 * slots);
      for (int r = 0; r < 2; ++r) {
        float sum = 0;
        for (int64_t j = 0; j < slots; ++j)
          sum += (rows[r * slots + j] = weight(rng_));
        for (int64_t j = 0; j < slots; ++j) rows[r * slots + j] /= sum;
      }
      a.rows.push_back(std::move(rows));
      a.scores.push_back(LayerScores{
          l, stats->layer_version[l], ScoreSource::kReduced, 2, {}});
    }
    for (size_t i = 0; i < a.scores.size(); ++i) a.scores[i].data = a.rows[i];
    absl::StatusOr<StepResult> got = store_->CompressPrompt(s.id, a.scores);
    if (!got.ok()) {
      ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted)
          << got.status();
      ++refusals_;
      return;
    }
    absl::StatusOr<StepResult> want = twins_->CompressPrompt(s.twin, a.scores);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameChange(*got, *want, Where(s) + " compress");
  }

  void Scores(bool with_append) {
    Live& s = live_[AnyLive()];
    if (s.policy.name == "snapkv" && !with_append) {
      Compress(s);
      return;
    }
    if (!Scored(s.policy)) {
      Append();
      return;
    }
    const int64_t growth = with_append ? Uniform(1, 2) : 0;
    const Tokens tokens(layout_, s.last_position + 1, growth, rng_);
    const Attention a = MakeAttention(s, growth);
    absl::StatusOr<StepOutcome> got =
        store_->Step(s.id, tokens.request(), a.scores);
    if (!got.ok()) {
      // A layer still over budget refuses an append with scores (its last
      // scores never came), and a full pool refuses; both change nothing.
      ASSERT_THAT(got.status().code(),
                  ::testing::AnyOf(absl::StatusCode::kResourceExhausted,
                                   absl::StatusCode::kFailedPrecondition))
          << got.status();
      if (got.status().code() == absl::StatusCode::kFailedPrecondition) {
        absl::StatusOr<StepOutcome> twin =
            twins_->Step(s.twin, tokens.request(), a.scores);
        EXPECT_EQ(twin.status().code(), got.status().code());
      } else {
        ++refusals_;
      }
      return;
    }
    absl::StatusOr<StepOutcome> want =
        twins_->Step(s.twin, tokens.request(), a.scores);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameChange(got->append, want->append, Where(s) + " append");
    ExpectSameChange(got->scores, want->scores, Where(s) + " scores");
    if (growth > 0) s.last_position = tokens.positions.back();
  }

  void Close() { CloseAt(AnyLive()); }
  void CloseAt(size_t i) {
    ASSERT_TRUE(store_->CloseSession(live_[i].id).ok());
    ASSERT_TRUE(twins_->CloseSession(live_[i].twin).ok());
    live_.erase(live_.begin() + i);
  }

  int64_t TenantBytes() const {
    int64_t bytes = 0;
    for (const TenantStats& t : store_->Tenants()) bytes += t.bytes;
    return bytes;
  }

  // The pool's counts are the block tables': each page in use once, its
  // holders as many as the tables naming it, and the tenant charged once
  // per page. A page freed while a table still names it shows here (and as
  // wrong bytes once it is handed out again).
  void CheckPool() {
    absl::flat_hash_map<PageId, int64_t> named;
    int64_t references = 0;
    for (const Live& s : live_) {
      absl::flat_hash_set<PageId> own;  // a session names a page once
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        absl::StatusOr<BlockTable> t = store_->GetBlockTable(s.id, l);
        ASSERT_TRUE(t.ok()) << t.status();
        for (PageId p : t->pages) {
          ASSERT_TRUE(own.insert(p).second) << Where(s) << " page " << p;
          ++named[p];
          ++references;
        }
      }
    }
    int64_t shared = 0;
    for (const auto& [page, count] : named) shared += count > 1 ? 1 : 0;
    const PoolStats pool = store_->Layouts()[0].pool;
    ASSERT_EQ(pool.used_pages, static_cast<int64_t>(named.size()));
    ASSERT_EQ(pool.page_references, references);
    ASSERT_EQ(pool.shared_pages, shared);
    ASSERT_EQ(pool.rejected_frees, 0);
    ASSERT_EQ(TenantBytes(), pool.used_pages * pool.page_bytes);
  }

  // Every session reads exactly as its twin: slots, positions, versions,
  // keys and values; and, on a host pool, so do the pages its block table
  // names when read in place, as a worker that maps the pool reads them.
  void CheckEverySession() {
    std::byte* arena = (*store_->MemoryOf(kLayout))->host_data();
    for (const Live& s : live_) {
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        absl::StatusOr<LayerKvCopy> got = store_->ReadLayer(s.id, l);
        absl::StatusOr<LayerKvCopy> want = twins_->ReadLayer(s.twin, l);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_TRUE(want.ok()) << want.status();
        ASSERT_EQ(got->version, want->version) << Where(s) << " layer " << l;
        ASSERT_EQ(got->positions, want->positions) << Where(s);
        ASSERT_TRUE(got->keys == want->keys) << Where(s) << " layer " << l;
        ASSERT_TRUE(got->values == want->values) << Where(s) << " layer " << l;
        if (arena == nullptr) continue;
        absl::StatusOr<BlockTable> table = store_->GetBlockTable(s.id, l);
        ASSERT_TRUE(table.ok()) << table.status();
        SlotSpans spans;
        HostSlotSpans(arena, layout_.page_layout(), table->pages, 0,
                      static_cast<int64_t>(table->positions.size()), &spans);
        std::vector<std::byte> keys, values;
        for (std::span<std::byte> k : spans.keys) {
          keys.insert(keys.end(), k.begin(), k.end());
        }
        for (std::span<std::byte> v : spans.values) {
          values.insert(values.end(), v.begin(), v.end());
        }
        ASSERT_TRUE(keys == want->keys) << Where(s) << " in place, layer " << l;
        ASSERT_TRUE(values == want->values) << Where(s) << " in place";
      }
    }
  }

  const ModelLayout layout_;
  std::mt19937 rng_;
  std::unique_ptr<CacheStore> store_;
  std::unique_ptr<CacheStore> twins_;
  std::vector<Live> live_;
  int64_t forks_ = 0;
  int64_t refusals_ = 0;
};

TEST(SessionForkTest, RandomStreamsMatchUnsharedTwins) {
  int64_t forks = 0;
  for (uint32_t seed = 0; seed < 1200; ++seed) {
    const int32_t page_tokens = std::vector<int32_t>{1, 3, 4, 7}[seed % 4];
    ForkStream stream(seed, page_tokens, /*capacity_pages=*/4096);
    stream.Run(/*ops=*/40);
    forks += stream.forks();
    if (HasFatalFailure()) FAIL() << "seed " << seed;
  }
  EXPECT_GT(forks, 1200);
}

// A pool too small for every stream: refused calls (RESOURCE_EXHAUSTED,
// copies included) change nothing and leak nothing.
TEST(SessionForkTest, RandomStreamsInATightPool) {
  int64_t refusals = 0;
  for (uint32_t seed = 0; seed < 600; ++seed) {
    const int32_t page_tokens = std::vector<int32_t>{1, 3, 4}[seed % 3];
    ForkStream stream(10'000 + seed, page_tokens,
                      /*capacity_pages=*/48 / page_tokens + 6);
    stream.Run(/*ops=*/40);
    refusals += stream.refusals();
    if (HasFatalFailure()) FAIL() << "seed " << seed;
  }
  EXPECT_GT(refusals, 0) << "the pool never ran out: the test tests nothing";
}

// A session of `policy` with `tokens` appended (positions 0, 1, ...).
SessionId Filled(CacheStore& store, const std::string& policy, int64_t budget,
                 int64_t tokens, std::mt19937& rng,
                 const std::string& tenant = "") {
  SessionSpec spec;
  spec.layout = std::string(kLayout);
  spec.policy = PolicySpec{policy, {}};
  spec.budget.tokens = budget;
  spec.tenant = tenant;
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok() || tokens == 0) return id.value_or(0);
  const Tokens t(ForkLayout(4), 0, tokens, rng);
  EXPECT_TRUE(store.Append(*id, t.request()).ok());
  return *id;
}

int64_t TenantBytes(const CacheStore& store, const std::string& tenant) {
  for (const TenantStats& t : store.Tenants()) {
    if (t.tenant == tenant) return t.bytes;
  }
  return 0;
}

std::vector<LayerKvCopy> ReadAll(CacheStore& store, SessionId id) {
  std::vector<LayerKvCopy> out;
  for (int32_t l = 0; l < 2; ++l) {
    absl::StatusOr<LayerKvCopy> kv = store.ReadLayer(id, l);
    EXPECT_TRUE(kv.ok()) << kv.status();
    if (kv.ok()) out.push_back(*std::move(kv));
  }
  return out;
}

bool SameKv(const std::vector<LayerKvCopy>& a,
            const std::vector<LayerKvCopy>& b) {
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l) {
    if (a[l].version != b[l].version || a[l].positions != b[l].positions ||
        a[l].keys != b[l].keys || a[l].values != b[l].values) {
      return false;
    }
  }
  return true;
}

// The rule: a tenant is charged once for each physical page its sessions
// hold. A fork costs nothing until a write copies a page; the pages a
// parent shares stay charged while any child holds them.
TEST(SessionForkTest, QuotaChargesEachPhysicalPageOnce) {
  const ModelLayout layout = ForkLayout(4);
  std::unique_ptr<CacheStore> store = MakeStore(layout, 64);
  const int64_t page = layout.page_layout().page_bytes();
  std::mt19937 rng(7);
  const SessionId parent = Filled(*store, "full", 64, 6, rng);  // 2 pages/layer
  EXPECT_EQ(TenantBytes(*store, ""), 4 * page);

  KV_ASSIGN_OR_FAIL(const SessionId child, store->ForkSession(parent, {}));
  PoolStats pool = store->Layouts()[0].pool;
  EXPECT_EQ(pool.used_pages, 4);
  EXPECT_EQ(pool.page_references, 8);
  EXPECT_EQ(pool.shared_pages, 4);
  EXPECT_EQ(TenantBytes(*store, ""), 4 * page);
  KV_ASSIGN_OR_FAIL(const SessionStats child_stats, store->GetStats(child));
  EXPECT_EQ(child_stats.pages, 4);
  EXPECT_EQ(child_stats.shared_pages, 4);
  EXPECT_EQ(child_stats.resident_tokens, 12);

  // The child's token goes into the partly filled page: copied first.
  KV_ASSIGN_OR_FAIL(const BlockTable before, store->GetBlockTable(child, 0));
  const Tokens one(layout, 6, 1, rng);
  KV_ASSIGN_OR_FAIL(const StepResult appended,
                    store->Append(child, one.request()));
  ASSERT_EQ(appended.layers[0].pages_copied.size(), 1u);
  const PageCopy copy = appended.layers[0].pages_copied[0];
  EXPECT_EQ(copy.index, 1);
  EXPECT_EQ(copy.from, before.pages[1]);
  KV_ASSIGN_OR_FAIL(const BlockTable after, store->GetBlockTable(child, 0));
  EXPECT_EQ(after.pages[0], before.pages[0]);  // still shared
  EXPECT_EQ(after.pages[1], copy.to);
  pool = store->Layouts()[0].pool;
  EXPECT_EQ(pool.used_pages, 6);
  EXPECT_EQ(pool.shared_pages, 2);
  EXPECT_EQ(TenantBytes(*store, ""), 6 * page);

  // The parent's page 1 is its own again: its append copies nothing.
  const Tokens three(layout, 6, 3, rng);
  KV_ASSIGN_OR_FAIL(const StepResult parent_append,
                    store->Append(parent, three.request()));
  EXPECT_TRUE(parent_append.layers[0].pages_copied.empty());
  EXPECT_EQ(parent_append.layers[0].pages_added.size(), 1u);
  EXPECT_EQ(TenantBytes(*store, ""), 8 * page);

  // Closing the parent returns only what the child does not hold.
  KV_ASSERT_OK(store->CloseSession(parent));
  pool = store->Layouts()[0].pool;
  EXPECT_EQ(pool.used_pages, 4);
  EXPECT_EQ(pool.shared_pages, 0);
  EXPECT_EQ(TenantBytes(*store, ""), 4 * page);
  KV_ASSERT_OK(store->CloseSession(child));
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  EXPECT_EQ(TenantBytes(*store, ""), 0);
}

// A tenant at its quota can fork; the child's first write needs a copy the
// quota refuses, and changes nothing; once the parent is gone the child's
// pages are its own and the same write needs no copy.
TEST(SessionForkTest, QuotaRefusesACopyAndChangesNothing) {
  const ModelLayout layout = ForkLayout(4);
  const int64_t page = layout.page_layout().page_bytes();
  std::unique_ptr<CacheStore> store = MakeStore(layout, 64, 4 * page);
  std::mt19937 rng(8);
  const SessionId parent = Filled(*store, "full", 64, 6, rng, "t");
  KV_ASSIGN_OR_FAIL(const SessionId child, store->ForkSession(parent, {}));
  const std::vector<LayerKvCopy> kept = ReadAll(*store, child);

  const Tokens one(layout, 6, 1, rng);
  testing::ExpectError(store->Append(child, one.request()),
                       absl::StatusCode::kResourceExhausted,
                       {"shared pages", "quota"});
  EXPECT_TRUE(SameKv(ReadAll(*store, child), kept));
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 4);
  EXPECT_EQ(TenantBytes(*store, "t"), 4 * page);

  KV_ASSERT_OK(store->CloseSession(parent));
  KV_ASSIGN_OR_FAIL(const StepResult appended,
                    store->Append(child, one.request()));
  EXPECT_TRUE(appended.layers[0].pages_copied.empty());
  EXPECT_EQ(TenantBytes(*store, "t"), 4 * page);
  KV_ASSERT_OK(store->CloseSession(child));
  EXPECT_EQ(TenantBytes(*store, "t"), 0);
}

TEST(SessionForkTest, RefusalsSayWhyAndHoldNothing) {
  const ModelLayout layout = ForkLayout(4);
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools.push_back(PoolSpec{layout, 64});
  options.max_sessions_per_tenant = 2;
  KV_ASSIGN_OR_FAIL(std::unique_ptr<CacheStore> store,
                    CacheStore::Create(options));
  std::mt19937 rng(9);
  const SessionId parent = Filled(*store, "h2o", 16, 6, rng);
  const PoolStats start = store->Layouts()[0].pool;
  const auto unchanged = [&] {
    const PoolStats now = store->Layouts()[0].pool;
    EXPECT_EQ(now.used_pages, start.used_pages);
    EXPECT_EQ(now.page_references, start.page_references);
    EXPECT_EQ(store->ListSessions().size(), 1u);
  };

  testing::ExpectError(store->ForkSession(parent + 1, {}),
                       absl::StatusCode::kNotFound, {"not found"});
  ForkSpec bad_budget;
  bad_budget.budget = BudgetSpec{};
  bad_budget.budget->tokens = 0;
  testing::ExpectError(store->ForkSession(parent, bad_budget),
                       absl::StatusCode::kInvalidArgument, {"budget"});
  ForkSpec bad_policy;
  bad_policy.policy = PolicySpec{"nope", {}};
  testing::ExpectError(store->ForkSession(parent, bad_policy),
                       absl::StatusCode::kInvalidArgument, {"nope"});
  unchanged();

  // A session being transferred: not now, and it works once it thaws.
  KV_ASSERT_OK(store->FreezeForTransfer(parent).status());
  testing::ExpectError(store->ForkSession(parent, {}),
                       absl::StatusCode::kUnavailable,
                       {SessionName(parent).c_str(), "being transferred"});
  unchanged();
  KV_ASSERT_OK(store->FinishTransfer(parent, /*committed=*/false));

  // A retried fork with the same key gets the same child.
  ForkSpec keyed;
  keyed.idempotency_key = std::string("branch-1");
  KV_ASSIGN_OR_FAIL(const SessionId child, store->ForkSession(parent, keyed));
  KV_ASSIGN_OR_FAIL(const SessionId again, store->ForkSession(parent, keyed));
  EXPECT_EQ(again, child);
  // The tenant's session limit (2) counts children.
  testing::ExpectError(store->ForkSession(parent, {}),
                       absl::StatusCode::kResourceExhausted, {"maximum of 2"});
  EXPECT_EQ(store->Layouts()[0].pool.page_references,
            2 * start.page_references);
  KV_ASSERT_OK(store->CloseSession(child));
  unchanged();
}

// Siblings stepping at once on threads, each copying pages the others
// still read, end exactly where the same steps leave unshared twins.
TEST(SessionForkTest, SiblingsSteppingConcurrentlyMatchTwins) {
  const ModelLayout layout = ForkLayout(3);
  std::unique_ptr<CacheStore> store = MakeStore(layout, 4096);
  std::unique_ptr<CacheStore> twins = MakeStore(layout, 4096);
  std::mt19937 rng(10);
  const SessionId root = Filled(*store, "h2o", 12, 10, rng);
  KV_ASSIGN_OR_FAIL(SessionSnapshot snapshot, store->ExportSession(root));
  std::vector<SessionId> ids = {root};
  for (int i = 0; i < 4; ++i) {
    KV_ASSIGN_OR_FAIL(const SessionId child, store->ForkSession(root, {}));
    ids.push_back(child);
  }
  constexpr int kSteps = 150;
  // Session i's steps, made from seed i: the same for it and its twin.
  const auto drive = [&](CacheStore& on, SessionId id, uint32_t seed) {
    std::mt19937 gen(seed);
    for (int step = 0; step < kSteps; ++step) {
      const Tokens t(layout, 10 + step, 1, gen);
      absl::StatusOr<SessionStats> stats = on.GetStats(id);
      ASSERT_TRUE(stats.ok()) << stats.status();
      std::vector<std::vector<float>> rows;
      std::vector<LayerScores> scores;
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        std::vector<float> row(stats->layer_resident[l] + 1);
        std::uniform_real_distribution<float> w(0.01f, 1);
        float sum = 0;
        for (float& f : row) sum += (f = w(gen));
        for (float& f : row) f /= sum;
        rows.push_back(std::move(row));
        scores.push_back(LayerScores{
            l, stats->layer_version[l], ScoreSource::kReduced, 1, {}});
      }
      for (size_t l = 0; l < scores.size(); ++l) scores[l].data = rows[l];
      ASSERT_TRUE(on.Step(id, t.request(), scores).ok());
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ids.size(); ++i) {
    threads.emplace_back([&, i] { drive(*store, ids[i], 100 + i); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < ids.size(); ++i) {
    snapshot.id = ids[i];
    KV_ASSIGN_OR_FAIL(const SessionId twin, twins->ImportSession(snapshot));
    drive(*twins, twin, 100 + i);
    EXPECT_TRUE(SameKv(ReadAll(*store, ids[i]), ReadAll(*twins, twin)))
        << "session " << i;
  }
  for (SessionId id : ids) KV_ASSERT_OK(store->CloseSession(id));
  EXPECT_EQ(store->Layouts()[0].pool.used_pages, 0);
  EXPECT_EQ(store->Layouts()[0].pool.rejected_frees, 0);
}

}  // namespace
}  // namespace kvkeep
