// Replays the golden traces of the official reference implementations (H2O,
// TOVA, StreamingLLM, SnapKV; format in tests/golden/README.md) through a real
// CacheStore and requires the kept set to be identical after every step.
//
// KVKEEP_GOLDEN_DIRS is a ':'-separated list of directories; every *.json in
// them is one test case (named after the file). A file name found in several
// directories is taken from the first one, so a newer shared copy wins over
// the one checked in beside the tests. A trace whose policy (or parameter)
// this test does not know fails: a new reference must not pass silently.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_device.h"

namespace kvkeep {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::ElementsAreArray;

// One golden file; printed by its name only, so ctest lists each trace
// without the directory.
struct GoldenFile {
  fs::path path;
  friend void PrintTo(const GoldenFile& f, std::ostream* os) {
    *os << f.path.filename().string();
  }
};

// The golden files: *.json of every existing directory of KVKEEP_GOLDEN_DIRS,
// de-duplicated by file name (the first directory wins), sorted by name.
std::vector<GoldenFile> GoldenFiles() {
  std::vector<GoldenFile> files;
  std::set<std::string> names;
  for (absl::string_view dir :
       absl::StrSplit(KVKEEP_GOLDEN_DIRS, ':', absl::SkipEmpty())) {
    std::error_code ec;
    if (!fs::is_directory(fs::path(std::string(dir)), ec)) continue;
    std::vector<fs::path> here;
    for (const fs::directory_entry& e :
         fs::directory_iterator(fs::path(std::string(dir)), ec)) {
      if (e.is_regular_file() && e.path().extension() == ".json") {
        here.push_back(e.path());
      }
    }
    std::sort(here.begin(), here.end());
    for (const fs::path& p : here) {
      if (names.insert(p.filename().string()).second) files.push_back({p});
    }
  }
  std::sort(files.begin(), files.end(),
            [](const GoldenFile& a, const GoldenFile& b) {
              return a.path.filename() < b.path.filename();
            });
  return files;
}

// A gtest-safe test name: the file's stem with anything but [A-Za-z0-9_]
// replaced by '_'.
std::string CaseName(const fs::path& file) {
  std::string name = file.stem().string();
  for (char& c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_';
    if (!ok) c = '_';
  }
  return name;
}

// Fails the test unless every key of `params` is in `known`: a parameter the
// replay ignores could change what the reference kept.
void ExpectOnlyParams(const json& params, const std::set<std::string>& known) {
  for (const auto& [key, value] : params.items()) {
    EXPECT_TRUE(known.count(key) > 0)
        << "golden trace has parameter '" << key
        << "' that this test does not know how to apply";
  }
}

std::vector<std::byte> Floats(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// One layer of `dtype` (a quantised one appended as f32, in groups of the
// whole head_dim); the store's pool is far larger than any trace needs.
ModelLayout OneLayer(int32_t kv_heads, int32_t query_heads, int32_t head_dim,
                     int32_t page_tokens, DType dtype = DType::kF32) {
  ModelLayout layout;
  layout.name = "golden";
  layout.num_layers = 1;
  layout.kv_heads = kv_heads;
  layout.query_heads = query_heads;
  layout.head_dim = head_dim;
  layout.dtype = dtype;
  if (IsQuantized(dtype)) {
    layout.group_size = head_dim;
    layout.append_dtype = DType::kF32;
  }
  layout.page_tokens = page_tokens;
  return layout;
}

// Eviction decides on scores alone: with probabilities as input, a layout
// that stores int8, fp8_e4m3 or int4 records keeps the reference set too.
constexpr DType kEveryDType[] = {DType::kF32, DType::kInt8, DType::kFp8E4M3,
                                 DType::kInt4};

std::unique_ptr<CacheStore> NewStore(const ModelLayout& layout) {
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(StoreOptions{.pools = {PoolSpec{layout, 4096}},
                                      .device = test_support::TestDevice()});
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

BudgetSpec Budget(int64_t tokens) {
  BudgetSpec budget;
  budget.tokens = tokens;
  return budget;
}

std::vector<int64_t> SortedResident(CacheStore& store, SessionId id) {
  absl::StatusOr<BlockTable> table = store.GetBlockTable(id, 0);
  EXPECT_TRUE(table.ok()) << table.status();
  if (!table.ok()) return {};
  std::vector<int64_t> positions = table->positions;
  std::sort(positions.begin(), positions.end());
  return positions;
}

// ---------------------------------------------------------------------------
// Streams: h2o, tova, streaming_llm.

struct StreamCase {
  std::string policy;
  PolicySpec spec;
  int64_t budget = 0;
  bool needs_scores = true;
  int32_t heads = 1;
  int64_t steps = 0;
  // logits[h][t][j], j <= t (empty for streaming_llm).
  std::vector<std::vector<std::vector<double>>> logits;
  std::vector<std::vector<int64_t>> resident;  // [t]: sorted positions
};

std::string Str(const json& v) { return std::to_string(v.get<int64_t>()); }

// Reads the policy-specific part of a stream trace. False (with a test
// failure) for a policy or parameter this replay does not know.
bool ParseStream(const json& g, StreamCase& c) {
  c.policy = g.at("policy").get<std::string>();
  const json& params = g.at("params");
  c.spec.name = c.policy;
  c.spec.params["slack"] = "0";
  if (c.policy == "h2o") {
    ExpectOnlyParams(params, {"sinks", "heavy", "recent"});
    c.spec.params["sinks"] = Str(params.at("sinks"));
    c.spec.params["recent"] = Str(params.at("recent"));
    c.budget = params.at("sinks").get<int64_t>() +
               params.at("heavy").get<int64_t>() +
               params.at("recent").get<int64_t>();
  } else if (c.policy == "tova") {
    ExpectOnlyParams(params, {"cache_size"});
    c.budget = params.at("cache_size").get<int64_t>();
  } else if (c.policy == "streaming_llm") {
    ExpectOnlyParams(params, {"sinks", "recent"});
    c.spec.params["sinks"] = Str(params.at("sinks"));
    c.spec.params["recent"] = Str(params.at("recent"));
    c.budget =
        params.at("sinks").get<int64_t>() + params.at("recent").get<int64_t>();
    c.needs_scores = false;
  } else {
    ADD_FAILURE() << "unknown policy '" << c.policy << "' in golden trace";
    return false;
  }
  c.heads = g.at("heads").get<int32_t>();
  c.steps = g.at("steps").get<int64_t>();
  c.resident = g.at("resident").get<std::vector<std::vector<int64_t>>>();
  EXPECT_EQ(static_cast<int64_t>(c.resident.size()), c.steps);
  if (c.needs_scores) {
    c.logits =
        g.at("logits").get<std::vector<std::vector<std::vector<double>>>>();
    EXPECT_EQ(static_cast<int32_t>(c.logits.size()), c.heads);
    for (const auto& head : c.logits) {
      EXPECT_EQ(static_cast<int64_t>(head.size()), c.steps);
      for (size_t t = 0; t < head.size(); ++t) {
        EXPECT_EQ(head[t].size(), t + 1) << "logits row " << t;
      }
    }
  }
  return !::testing::Test::HasFailure();
}

// Per-head probabilities of query t over the resident slots in slot order:
// softmax in double over the resident positions (the new token included),
// rounded to float32. [heads][1][slots].
std::vector<float> StepProbabilities(const StreamCase& c, int64_t t,
                                     const std::vector<int64_t>& slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<float> probs(c.heads * n);
  for (int32_t h = 0; h < c.heads; ++h) {
    const std::vector<double>& row = c.logits[h][t];
    double mx = -INFINITY;
    for (int64_t p : slots) mx = std::max(mx, row.at(p));
    double denom = 0;
    for (int64_t p : slots) denom += std::exp(row.at(p) - mx);
    for (int64_t s = 0; s < n; ++s) {
      probs[h * n + s] =
          static_cast<float>(std::exp(row.at(slots[s]) - mx) / denom);
    }
  }
  return probs;
}

// Replays the stream with the given page size and stored dtype; `shared_kv`
// makes every query head read one kv head (GQA), which must not change the
// probabilities' use.
void ReplayStream(const StreamCase& c, int32_t page_tokens, bool shared_kv,
                  DType dtype) {
  SCOPED_TRACE(absl::StrCat("page_tokens=", page_tokens,
                            " kv_heads=", shared_kv ? 1 : c.heads,
                            " dtype=", std::string(DTypeName(dtype))));
  constexpr int32_t kHeadDim = 2;
  const int32_t kv_heads = shared_kv ? 1 : c.heads;
  const ModelLayout layout =
      OneLayer(kv_heads, c.heads, kHeadDim, page_tokens, dtype);
  std::unique_ptr<CacheStore> store = NewStore(layout);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<SessionId> id =
      store->CreateSession(SessionSpec{layout.name, c.spec, Budget(c.budget)});
  ASSERT_TRUE(id.ok()) << id.status();

  for (int64_t t = 0; t < c.steps; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    // K/V bytes: the position, so a mix-up would be visible in a dump.
    const std::vector<std::byte> kv =
        Floats(std::vector<float>(kv_heads * kHeadDim, static_cast<float>(t)));
    const int64_t position = t;
    const LayerKv layer_kv{kv, kv};
    absl::StatusOr<StepResult> appended = store->Append(
        *id, AppendRequest{std::span<const int64_t>(&position, 1),
                           std::span<const LayerKv>(&layer_kv, 1)});
    ASSERT_TRUE(appended.ok()) << appended.status();
    if (c.needs_scores) {
      absl::StatusOr<BlockTable> table = store->GetBlockTable(*id, 0);
      ASSERT_TRUE(table.ok()) << table.status();
      ASSERT_EQ(table->version, appended->layers[0].version);
      const std::vector<float> probs =
          StepProbabilities(c, t, table->positions);
      const LayerScores scores{0, appended->layers[0].version,
                               ScoreSource::kPerHead, 1, probs};
      absl::StatusOr<StepResult> updated =
          store->UpdateScores(*id, std::span<const LayerScores>(&scores, 1));
      ASSERT_TRUE(updated.ok()) << updated.status();
    }
    ASSERT_THAT(SortedResident(*store, *id), ElementsAreArray(c.resident[t]));
  }
}

// ---------------------------------------------------------------------------
// Prompt compression: snapkv.

struct SnapCase {
  PolicySpec spec;
  int64_t window = 0;
  int64_t capacity = 0;
  std::vector<std::vector<float>> q, k;  // [n][d]
  std::vector<int64_t> kept;
};

bool ParseSnap(const json& g, SnapCase& c) {
  const json& params = g.at("params");
  ExpectOnlyParams(params, {"window", "capacity", "kernel", "pooling"});
  c.window = params.at("window").get<int64_t>();
  c.capacity = params.at("capacity").get<int64_t>();
  c.spec.name = "snapkv";
  c.spec.params["window"] = Str(params.at("window"));
  c.spec.params["kernel"] = Str(params.at("kernel"));
  c.spec.params["pooling"] = params.at("pooling").get<std::string>();
  c.q = g.at("q").get<std::vector<std::vector<float>>>();
  c.k = g.at("k").get<std::vector<std::vector<float>>>();
  c.kept = g.at("kept").get<std::vector<int64_t>>();
  EXPECT_FALSE(c.q.empty());
  EXPECT_EQ(c.q.size(), c.k.size());
  for (size_t i = 0; i < c.q.size(); ++i) {
    EXPECT_EQ(c.q[i].size(), c.q[0].size()) << "q row " << i;
    EXPECT_EQ(c.k[i].size(), c.q[0].size()) << "k row " << i;
  }
  EXPECT_LT(c.window, static_cast<int64_t>(c.q.size()));
  EXPECT_EQ(static_cast<int64_t>(c.kept.size()), c.capacity);
  return !::testing::Test::HasFailure();
}

// The window's attention as the reference computes it, in double: query i of
// the window (position n - window + i) sees keys 0..n - window + i, scaled by
// 1/sqrt(d). [1 head][window][slots], in slot order.
std::vector<float> WindowProbabilities(const SnapCase& c,
                                       const std::vector<int64_t>& slots) {
  const int64_t n = static_cast<int64_t>(c.q.size());
  const size_t d = c.q[0].size();
  const int64_t num_slots = static_cast<int64_t>(slots.size());
  std::vector<float> probs(c.window * num_slots, 0.0f);
  for (int64_t i = 0; i < c.window; ++i) {
    const int64_t qpos = n - c.window + i;
    std::vector<double> logits(num_slots, -INFINITY);
    double mx = -INFINITY;
    for (int64_t s = 0; s < num_slots; ++s) {
      if (slots[s] > qpos) continue;  // causal inside the window
      double dot = 0;
      for (size_t e = 0; e < d; ++e) {
        dot += static_cast<double>(c.q[qpos][e]) * c.k[slots[s]][e];
      }
      logits[s] = dot / std::sqrt(static_cast<double>(d));
      mx = std::max(mx, logits[s]);
    }
    double denom = 0;
    for (double l : logits) denom += std::exp(l - mx);
    for (int64_t s = 0; s < num_slots; ++s) {
      probs[i * num_slots + s] =
          static_cast<float>(std::exp(logits[s] - mx) / denom);
    }
  }
  return probs;
}

// Appends the prompt and compresses it: with the window's query vectors
// (kQueries: the store computes the attention) or with the attention the test
// computed (kPerHead).
void ReplaySnap(const SnapCase& c, int32_t page_tokens, ScoreSource source,
                DType dtype = DType::kF32) {
  SCOPED_TRACE(absl::StrCat(
      "page_tokens=", page_tokens,
      " source=", source == ScoreSource::kQueries ? "queries" : "per-head",
      " dtype=", std::string(DTypeName(dtype))));
  const int64_t n = static_cast<int64_t>(c.q.size());
  const int32_t d = static_cast<int32_t>(c.q[0].size());
  const ModelLayout layout = OneLayer(1, 1, d, page_tokens, dtype);
  std::unique_ptr<CacheStore> store = NewStore(layout);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<SessionId> id = store->CreateSession(
      SessionSpec{layout.name, c.spec, Budget(c.capacity)});
  ASSERT_TRUE(id.ok()) << id.status();

  std::vector<int64_t> positions(n);
  std::vector<float> keys, values;
  for (int64_t i = 0; i < n; ++i) {
    positions[i] = i;
    keys.insert(keys.end(), c.k[i].begin(), c.k[i].end());
    values.insert(values.end(), d, static_cast<float>(i));
  }
  const std::vector<std::byte> key_bytes = Floats(keys);
  const std::vector<std::byte> value_bytes = Floats(values);
  const LayerKv layer_kv{key_bytes, value_bytes};
  absl::StatusOr<StepResult> appended = store->Append(
      *id, AppendRequest{positions, std::span<const LayerKv>(&layer_kv, 1)});
  ASSERT_TRUE(appended.ok()) << appended.status();
  ASSERT_EQ(appended->layers[0].resident, n);

  std::vector<float> data;
  if (source == ScoreSource::kQueries) {
    for (int64_t i = n - c.window; i < n; ++i) {
      data.insert(data.end(), c.q[i].begin(), c.q[i].end());
    }
  } else {
    absl::StatusOr<BlockTable> table = store->GetBlockTable(*id, 0);
    ASSERT_TRUE(table.ok()) << table.status();
    data = WindowProbabilities(c, table->positions);
  }
  const LayerScores window{0, appended->layers[0].version, source,
                           static_cast<int32_t>(c.window), data};
  absl::StatusOr<StepResult> compressed =
      store->CompressPrompt(*id, std::span<const LayerScores>(&window, 1));
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_EQ(compressed->layers[0].resident, c.capacity);
  EXPECT_EQ(
      static_cast<int64_t>(compressed->layers[0].evicted_positions.size()),
      n - c.capacity);
  EXPECT_THAT(SortedResident(*store, *id), ElementsAreArray(c.kept));
}

// ---------------------------------------------------------------------------

class GoldenTest : public ::testing::TestWithParam<GoldenFile> {};

TEST_P(GoldenTest, KeepsTheReferenceSet) {
  const fs::path& file = GetParam().path;
  SCOPED_TRACE(file.string());
  std::ifstream in(file);
  ASSERT_TRUE(in.good()) << "cannot open " << file;
  json golden;
  try {
    golden = json::parse(in);
  } catch (const json::exception& e) {
    FAIL() << "bad JSON in " << file << ": " << e.what();
  }
  ASSERT_TRUE(golden.contains("policy")) << "no policy field";
  const std::string policy = golden.at("policy").get<std::string>();
  try {
    if (policy == "snapkv") {
      SnapCase c;
      ASSERT_TRUE(ParseSnap(golden, c));
      for (int32_t page_tokens : {4, 1, 7}) {
        for (ScoreSource source :
             {ScoreSource::kQueries, ScoreSource::kPerHead}) {
          ReplaySnap(c, page_tokens, source);
        }
        // Queries score the stored keys, which quantising changes: the
        // probabilities only.
        for (DType dtype : kEveryDType) {
          if (dtype != DType::kF32) {
            ReplaySnap(c, page_tokens, ScoreSource::kPerHead, dtype);
          }
        }
      }
      return;
    }
    StreamCase c;
    ASSERT_TRUE(ParseStream(golden, c));  // fails on an unknown policy
    for (int32_t page_tokens : {4, 1, 7}) {
      for (bool shared_kv : {false, true}) {
        for (DType dtype : kEveryDType) {
          ReplayStream(c, page_tokens, shared_kv, dtype);
          if (HasFatalFailure()) return;
        }
      }
    }
  } catch (const json::exception& e) {
    FAIL() << "malformed golden trace " << file << ": " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Traces, GoldenTest, ::testing::ValuesIn(GoldenFiles()),
                         [](const ::testing::TestParamInfo<GoldenFile>& info) {
                           return CaseName(info.param.path);
                         });

// Without this, an empty or misconfigured KVKEEP_GOLDEN_DIRS would make the
// suite above vanish instead of failing.
TEST(GoldenFilesTest, AtLeastOneTraceIsFound) {
  EXPECT_FALSE(GoldenFiles().empty())
      << "no *.json in KVKEEP_GOLDEN_DIRS = " << KVKEEP_GOLDEN_DIRS;
}

TEST(GoldenFilesTest, EveryReferencePolicyHasATrace) {
  std::set<std::string> policies;
  for (const GoldenFile& file : GoldenFiles()) {
    std::ifstream in(file.path);
    const json golden = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (golden.is_object() && golden.contains("policy")) {
      policies.insert(golden["policy"].get<std::string>());
    }
  }
  for (const char* name : {"h2o", "tova", "streaming_llm", "snapkv"}) {
    EXPECT_TRUE(policies.count(name) > 0) << "no golden trace for " << name;
  }
}

}  // namespace
}  // namespace kvkeep
