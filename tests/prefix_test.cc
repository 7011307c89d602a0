// Named prefixes at the store (docs/prefixes.md): children read the prefix's
// bytes exactly; with protection (the default) every policy leaves the
// prefix's pages shared however much the children evict; without, children
// evict from the prefix and copy; an unpublished prefix lives until its last
// child is freed; the publisher is charged for the prefix's pages; and the
// refusals.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"

namespace kvkeep {
namespace {

constexpr char kLayout[] = "prefix";
constexpr int32_t kPageTokens = 4;
constexpr int32_t kLayers = 2;
constexpr int64_t kPrefixTokens = 40;  // 10 full pages per layer

ModelLayout Layout(const std::string& name = kLayout) {
  ModelLayout l;
  l.name = name;
  l.num_layers = kLayers;
  l.kv_heads = 1;
  l.query_heads = 2;
  l.head_dim = 4;
  l.dtype = DType::kF32;
  l.page_tokens = kPageTokens;
  return l;
}

std::unique_ptr<CacheStore> MakeStore(bool allow_public = false,
                                      int64_t capacity_pages = 4096) {
  StoreOptions options;
  options.device = test_support::TestDevice();
  options.pools.push_back(PoolSpec{Layout(), capacity_pages});
  options.pools.push_back(PoolSpec{Layout("other"), 64});
  options.allow_public_prefixes = allow_public;
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// n tokens at positions first.. of random bytes (every layer).
struct Tokens {
  std::vector<int64_t> positions;
  std::vector<std::vector<float>> keys, values;
  std::vector<LayerKv> layers;
  Tokens(int64_t first, int64_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> value(-1, 1);
    for (int64_t i = 0; i < n; ++i) positions.push_back(first + i);
    for (int32_t l = 0; l < kLayers; ++l) {
      keys.emplace_back(n * 4);
      values.emplace_back(n * 4);
      for (float& f : keys.back()) f = value(rng);
      for (float& f : values.back()) f = value(rng);
    }
    for (int32_t l = 0; l < kLayers; ++l) {
      layers.push_back(LayerKv{std::as_bytes(std::span(keys[l])),
                               std::as_bytes(std::span(values[l]))});
    }
  }
  AppendRequest request() const { return AppendRequest{positions, layers}; }
};

// A full-policy session of `tenant` holding kPrefixTokens tokens.
SessionId Source(CacheStore& store, std::mt19937& rng,
                 const std::string& tenant = "") {
  SessionSpec spec;
  spec.layout = kLayout;
  spec.policy = PolicySpec{"full", {}};
  spec.budget.tokens = 1024;
  spec.tenant = tenant;
  absl::StatusOr<SessionId> id = store.CreateSession(spec);
  EXPECT_TRUE(id.ok()) << id.status();
  const Tokens t(0, kPrefixTokens, rng);
  EXPECT_TRUE(store.Append(*id, t.request()).ok());
  return *id;
}

SessionSpec FromPrefix(const std::string& prefix, PolicySpec policy,
                       int64_t budget, bool evictable = false,
                       const std::string& tenant = "") {
  SessionSpec spec;
  spec.prefix = prefix;
  spec.policy = std::move(policy);
  spec.budget.tokens = budget;
  spec.prefix_evictable = evictable;
  spec.tenant = tenant;
  return spec;
}

// One layer's resident tokens by position: (position, key bytes, value
// bytes), so sessions that hold them in other slots compare equal.
struct Token {
  int64_t position;
  std::vector<std::byte> key, value;
  bool operator==(const Token&) const = default;
  bool operator<(const Token& o) const { return position < o.position; }
};
std::vector<Token> ByPosition(CacheStore& store, SessionId id, int32_t layer) {
  absl::StatusOr<LayerKvCopy> kv = store.ReadLayer(id, layer);
  EXPECT_TRUE(kv.ok()) << kv.status();
  std::vector<Token> out;
  if (!kv.ok()) return out;
  const size_t bytes =
      kv->keys.size() / std::max<size_t>(1, kv->positions.size());
  for (size_t i = 0; i < kv->positions.size(); ++i) {
    auto at = [&](const std::vector<std::byte>& v) {
      return std::vector<std::byte>(v.begin() + i * bytes,
                                    v.begin() + (i + 1) * bytes);
    };
    out.push_back(Token{kv->positions[i], at(kv->keys), at(kv->values)});
  }
  std::sort(out.begin(), out.end());
  return out;
}
// The tokens of `all` before position `end`.
std::vector<Token> Before(const std::vector<Token>& all, int64_t end) {
  std::vector<Token> out;
  for (const Token& t : all) {
    if (t.position < end) out.push_back(t);
  }
  return out;
}

// One step's attention for every layer: random rows summing to 1.
struct Attention {
  std::vector<std::vector<float>> rows;
  std::vector<LayerScores> scores;
  Attention(CacheStore& store, SessionId id, int32_t rows_per_layer,
            std::mt19937& rng) {
    absl::StatusOr<SessionStats> stats = store.GetStats(id);
    EXPECT_TRUE(stats.ok()) << stats.status();
    std::uniform_real_distribution<float> weight(0.01f, 1);
    for (int32_t l = 0; l < kLayers; ++l) {
      const int64_t slots = stats->layer_resident[l];
      std::vector<float> r(rows_per_layer * slots);
      for (int32_t row = 0; row < rows_per_layer; ++row) {
        float sum = 0;
        for (int64_t j = 0; j < slots; ++j) {
          sum += (r[row * slots + j] = weight(rng));
        }
        for (int64_t j = 0; j < slots; ++j) r[row * slots + j] /= sum;
      }
      rows.push_back(std::move(r));
      scores.push_back(LayerScores{l,
                                   stats->layer_version[l],
                                   ScoreSource::kReduced,
                                   rows_per_layer,
                                   {}});
    }
    for (size_t i = 0; i < scores.size(); ++i) scores[i].data = rows[i];
  }
};

// Appends `steps` single tokens after the prefix, with the attention each
// policy takes (scores per step; snapkv compresses once, first).
void Decode(CacheStore& store, SessionId id, const std::string& policy,
            int steps, std::mt19937& rng) {
  const PolicyInfo* info = FindPolicy(policy);
  ASSERT_NE(info, nullptr);
  int64_t position = kPrefixTokens;
  if (info->input == PolicyInput::kCompress) {
    // A prompt past the budget: compression evicts from it (never from the
    // prefix); decode then only grows.
    const Tokens prompt(position, 20, rng);
    position += 20;
    KV_ASSERT_OK(store.Append(id, prompt.request()).status());
    const Attention window(store, id, 2, rng);
    KV_ASSERT_OK(store.CompressPrompt(id, window.scores).status());
  }
  for (int i = 0; i < steps; ++i) {
    const Tokens one(position++, 1, rng);
    KV_ASSERT_OK(store.Append(id, one.request()).status());
    if (info->input == PolicyInput::kPerStep) {
      const Attention a(store, id, 1, rng);
      KV_ASSERT_OK(store.UpdateScores(id, a.scores).status());
    }
  }
}

PoolStats Pool(const CacheStore& store) { return store.Layouts()[0].pool; }

int64_t TenantBytes(const CacheStore& store, const std::string& tenant) {
  for (const TenantStats& t : store.Tenants()) {
    if (t.tenant == tenant) return t.bytes;
  }
  return 0;
}

void ExpectEmpty(const CacheStore& store) {
  const PoolStats pool = Pool(store);
  EXPECT_EQ(pool.used_pages, 0);
  EXPECT_EQ(pool.page_references, 0);
  EXPECT_EQ(pool.owners, 0);
  EXPECT_EQ(pool.rejected_frees, 0);
  for (const TenantStats& t : store.Tenants()) {
    EXPECT_EQ(t.bytes, 0) << t.tenant;
  }
  EXPECT_TRUE(store.Prefixes(std::nullopt).empty());
}

TEST(PrefixTest, ChildrenReadThePrefixBytesExactly) {
  std::unique_ptr<CacheStore> store = MakeStore();
  std::mt19937 rng(1);
  const SessionId source = Source(*store, rng);
  KV_ASSIGN_OR_FAIL(const PrefixInfo info,
                    store->PublishPrefix(source, {"system/v1", "", false}));
  EXPECT_EQ(info.tokens, kPrefixTokens);
  EXPECT_EQ(info.pages, 2 * kPrefixTokens / kPageTokens);
  EXPECT_EQ(info.layout, kLayout);
  std::vector<SessionId> children;
  for (int i = 0; i < 3; ++i) {
    KV_ASSIGN_OR_FAIL(const SessionId child,
                      store->CreateSession(
                          FromPrefix("system/v1", PolicySpec{"h2o", {}}, 64)));
    children.push_back(child);
  }
  // The source lives on, unchanged, and changes without touching them.
  const Tokens more(kPrefixTokens, 5, rng);
  KV_ASSERT_OK(store->Append(source, more.request()).status());
  for (int32_t l = 0; l < kLayers; ++l) {
    const std::vector<Token> prefix =
        Before(ByPosition(*store, source, l), kPrefixTokens);
    ASSERT_EQ(prefix.size(), static_cast<size_t>(kPrefixTokens));
    for (SessionId child : children) {
      EXPECT_EQ(ByPosition(*store, child, l), prefix) << "layer " << l;
    }
  }
  // No page was copied: the pool holds the source's pages once.
  EXPECT_EQ(Pool(*store).used_pages, 2 * (kPrefixTokens / kPageTokens + 2));
  for (SessionId child : children) KV_ASSERT_OK(store->CloseSession(child));
  KV_ASSERT_OK(store->CloseSession(source));
  KV_ASSERT_OK(store->UnpublishPrefix("", "system/v1", false).status());
  ExpectEmpty(*store);
}

// Every policy, with the prefix protected: children decode far past their
// budgets, and the prefix's 20 pages stay shared by all of them.
TEST(PrefixTest, ProtectedPrefixStaysSharedUnderEveryPolicy) {
  const std::vector<PolicySpec> policies = {
      {"h2o", {{"recent", "2"}, {"slack", "1"}}},
      {"tova", {{"recent", "1"}}},
      {"scissorhands", {{"recent", "1"}, {"history", "3"}}},
      {"h2o_page", {{"recent", "1"}}},
      {"window", {{"slack", "2"}}},
      {"streaming_llm", {{"sinks", "2"}, {"recent", "2"}}},
      {"snapkv", {{"window", "2"}, {"kernel", "1"}}},
      {"full", {}},
  };
  std::unique_ptr<CacheStore> store = MakeStore();
  std::mt19937 rng(2);
  const SessionId source = Source(*store, rng);
  KV_ASSERT_OK(store->PublishPrefix(source, {"tools", "", false}).status());
  KV_ASSERT_OK(store->CloseSession(source));  // the prefix holds its pages
  const int64_t prefix_pages = 2 * kPrefixTokens / kPageTokens;
  std::vector<std::vector<Token>> prefix;
  for (const PolicySpec& policy : policies) {
    SCOPED_TRACE(policy.name);
    KV_ASSIGN_OR_FAIL(
        const SessionId child,
        store->CreateSession(FromPrefix("tools", policy, kPrefixTokens + 8)));
    if (prefix.empty()) {
      for (int32_t l = 0; l < kLayers; ++l) {
        prefix.push_back(ByPosition(*store, child, l));
      }
    }
    KV_ASSIGN_OR_FAIL(const BlockTable before, store->GetBlockTable(child, 0));
    Decode(*store, child, policy.name, 60, rng);
    KV_ASSIGN_OR_FAIL(const SessionStats stats, store->GetStats(child));
    if (policy.name != "full") {
      EXPECT_GT(stats.evicted_tokens, 0);
    }
    if (policy.name != "full" && policy.name != "snapkv") {
      EXPECT_LE(stats.layer_resident[0], kPrefixTokens + 8);
    }
    EXPECT_EQ(stats.shared_pages, prefix_pages);
    KV_ASSIGN_OR_FAIL(const BlockTable after, store->GetBlockTable(child, 0));
    EXPECT_TRUE(std::equal(before.pages.begin(),
                           before.pages.begin() + kPrefixTokens / kPageTokens,
                           after.pages.begin()));
    for (int32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(Before(ByPosition(*store, child, l), kPrefixTokens), prefix[l]);
    }
    EXPECT_EQ(Pool(*store).shared_pages, prefix_pages);
  }
  KV_ASSERT_OK(store->UnpublishPrefix("", "tools", false).status());
  for (SessionId id : store->ListSessions())
    KV_ASSERT_OK(store->CloseSession(id));
  ExpectEmpty(*store);
}

TEST(PrefixTest, EvictableChildrenEvictFromThePrefixAndCopy) {
  std::unique_ptr<CacheStore> store = MakeStore();
  std::mt19937 rng(3);
  const SessionId source = Source(*store, rng);
  KV_ASSERT_OK(store->PublishPrefix(source, {"p", "", false}).status());
  KV_ASSIGN_OR_FAIL(
      const SessionId loose,
      store->CreateSession(FromPrefix("p", PolicySpec{"h2o", {}}, 16, true)));
  KV_ASSIGN_OR_FAIL(const SessionId kept, store->CreateSession(FromPrefix(
                                              "p", PolicySpec{"h2o", {}}, 48)));
  int64_t copies = 0;
  for (int i = 0; i < 10; ++i) {
    const Tokens one(kPrefixTokens + i, 1, rng);
    KV_ASSIGN_OR_FAIL(const StepResult appended,
                      store->Append(loose, one.request()));
    const Attention a(*store, loose, 1, rng);
    KV_ASSIGN_OR_FAIL(const StepResult scored,
                      store->UpdateScores(loose, a.scores));
    for (const StepResult* r : {&appended, &scored}) {
      for (const LayerChange& c : r->layers) copies += c.pages_copied.size();
    }
  }
  EXPECT_GT(copies, 0);
  KV_ASSIGN_OR_FAIL(const SessionStats stats, store->GetStats(loose));
  EXPECT_LE(stats.layer_resident[0], 16);
  EXPECT_LT(Before(ByPosition(*store, loose, 0), kPrefixTokens).size(),
            static_cast<size_t>(kPrefixTokens));
  // The prefix, the source and the protected child are untouched.
  for (int32_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(ByPosition(*store, kept, l), ByPosition(*store, source, l));
  }
  EXPECT_EQ(store->Prefixes(std::nullopt)[0].pages, 2 * 10);
  // A fork of the protected child, under another policy, keeps the
  // protection: it evicts only its own tokens.
  ForkSpec other;
  other.policy = PolicySpec{"tova", {}};
  KV_ASSIGN_OR_FAIL(const SessionId fork, store->ForkSession(kept, other));
  Decode(*store, fork, "tova", 30, rng);
  KV_ASSIGN_OR_FAIL(const SessionStats forked, store->GetStats(fork));
  EXPECT_GT(forked.evicted_tokens, 0);
  EXPECT_EQ(Before(ByPosition(*store, fork, 0), kPrefixTokens),
            Before(ByPosition(*store, kept, 0), kPrefixTokens));
}

TEST(PrefixTest, UnpublishedPrefixLivesUntilItsLastChildCloses) {
  std::unique_ptr<CacheStore> store = MakeStore();
  std::mt19937 rng(4);
  const SessionId source = Source(*store, rng);
  KV_ASSERT_OK(store->PublishPrefix(source, {"p", "", false}).status());
  KV_ASSERT_OK(store->CloseSession(source));
  KV_ASSIGN_OR_FAIL(const SessionId a, store->CreateSession(FromPrefix(
                                           "p", PolicySpec{"full", {}}, 64)));
  KV_ASSIGN_OR_FAIL(const SessionId b, store->CreateSession(FromPrefix(
                                           "p", PolicySpec{"full", {}}, 64)));
  // A fork of a child holds the prefix too.
  KV_ASSIGN_OR_FAIL(const SessionId c, store->ForkSession(b, {}));
  const std::vector<Token> want = ByPosition(*store, a, 0);
  KV_ASSERT_OK(store->UnpublishPrefix("", "p", false).status());
  // The name is free at once; a new session cannot start from it.
  testing::ExpectError(
      store->CreateSession(FromPrefix("p", PolicySpec{"full", {}}, 64)),
      absl::StatusCode::kNotFound, {});
  std::vector<PrefixInfo> listed = store->Prefixes("");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_FALSE(listed[0].published);
  EXPECT_EQ(listed[0].holders, 3);
  EXPECT_EQ(listed[0].pages, 20);
  for (SessionId id : {a, b}) {
    KV_ASSERT_OK(store->CloseSession(id));
    EXPECT_EQ(Pool(*store).used_pages, 20);
    EXPECT_EQ(ByPosition(*store, c, 0), want);
  }
  EXPECT_EQ(store->Prefixes("")[0].holders, 1);
  KV_ASSERT_OK(store->CloseSession(c));
  ExpectEmpty(*store);
}

// The publisher pays for the prefix's pages while the prefix exists; a
// child of another tenant pays only for the pages it writes.
TEST(PrefixTest, ThePublisherIsChargedForAPublicPrefix) {
  std::unique_ptr<CacheStore> store = MakeStore(/*allow_public=*/true);
  const int64_t page = Layout().page_layout().page_bytes();
  std::mt19937 rng(5);
  const SessionId source = Source(*store, rng, "alice");
  KV_ASSERT_OK(
      store->PublishPrefix(source, {"common", "alice", true}).status());
  KV_ASSERT_OK(store->CloseSession(source));
  EXPECT_EQ(TenantBytes(*store, "alice"), 20 * page);
  KV_ASSIGN_OR_FAIL(const SessionId child,
                    store->CreateSession(FromPrefix(
                        "common", PolicySpec{"full", {}}, 64, false, "bob")));
  EXPECT_EQ(TenantBytes(*store, "bob"), 0);
  const Tokens more(kPrefixTokens, 5, rng);  // 2 new pages per layer
  KV_ASSERT_OK(store->Append(child, more.request()).status());
  EXPECT_EQ(TenantBytes(*store, "bob"), 4 * page);
  EXPECT_EQ(TenantBytes(*store, "alice"), 20 * page);
  // Only alice may unpublish it; bob sees it until then.
  testing::ExpectError(store->UnpublishPrefix("bob", "common", true),
                       absl::StatusCode::kPermissionDenied, {});
  EXPECT_EQ(store->Prefixes("bob").size(), 1u);
  KV_ASSERT_OK(store->UnpublishPrefix("alice", "common", true).status());
  EXPECT_TRUE(store->Prefixes("bob").empty());
  EXPECT_EQ(TenantBytes(*store, "alice"), 20 * page);  // bob's child holds it
  KV_ASSERT_OK(store->CloseSession(child));
  ExpectEmpty(*store);
}

TEST(PrefixTest, RefusalsSayWhatIsWrongAndHoldNothing) {
  std::unique_ptr<CacheStore> store = MakeStore();
  std::mt19937 rng(6);
  const SessionId source = Source(*store, rng, "alice");
  for (const std::string& bad : {std::string(), std::string("-x"),
                                 std::string("a b"), std::string(129, 'a')}) {
    testing::ExpectError(store->PublishPrefix(source, {bad, "alice", false}),
                         absl::StatusCode::kInvalidArgument, {"prefix name"});
  }
  testing::ExpectError(store->PublishPrefix(source, {"pub", "alice", true}),
                       absl::StatusCode::kFailedPrecondition,
                       {"allow_public_prefixes"});
  // Another tenant's session: as for any call, not found.
  testing::ExpectError(store->PublishPrefix(source, {"x", "bob", false}),
                       absl::StatusCode::kNotFound, {});
  KV_ASSERT_OK(store->PublishPrefix(source, {"p", "alice", false}).status());
  testing::ExpectError(store->PublishPrefix(source, {"p", "alice", false}),
                       absl::StatusCode::kAlreadyExists, {"'p'"});
  // Another tenant's private prefix reads as a missing one, word for word.
  const absl::Status theirs =
      store
          ->CreateSession(
              FromPrefix("p", PolicySpec{"full", {}}, 64, false, "bob"))
          .status();
  const absl::Status missing =
      store
          ->CreateSession(
              FromPrefix("q", PolicySpec{"full", {}}, 64, false, "bob"))
          .status();
  EXPECT_EQ(theirs.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(theirs.message(), "prefix 'p' not found");
  EXPECT_EQ(missing.message(), "prefix 'q' not found");
  testing::ExpectError(store->UnpublishPrefix("bob", "p", false),
                       absl::StatusCode::kNotFound, {"'p'"});
  SessionSpec other_layout =
      FromPrefix("p", PolicySpec{"full", {}}, 64, false, "alice");
  other_layout.layout = "other";
  testing::ExpectError(store->CreateSession(other_layout),
                       absl::StatusCode::kFailedPrecondition,
                       {"layout 'prefix', not of layout 'other'"});
  // A budget that cannot keep the protected prefix.
  testing::ExpectError(store->CreateSession(FromPrefix(
                           "p", PolicySpec{"h2o", {}}, 30, false, "alice")),
                       absl::StatusCode::kInvalidArgument,
                       {"40 tokens are protected"});
  testing::ExpectError(store->CreateSession(FromPrefix(
                           "p", PolicySpec{"nope", {}}, 64, false, "alice")),
                       absl::StatusCode::kInvalidArgument, {});
  // Evictable, the same budget is fine.
  KV_ASSERT_OK(store
                   ->CreateSession(FromPrefix("p", PolicySpec{"h2o", {}}, 30,
                                              true, "alice"))
                   .status());
  EXPECT_EQ(store->ListSessions().size(), 2u);
  EXPECT_THAT(store->Prefixes("bob"), ::testing::IsEmpty());
  EXPECT_EQ(store->Prefixes("alice").size(), 1u);
}

}  // namespace
}  // namespace kvkeep
