// What the CacheStore and Session tests share: a store over given layouts
// (Harness) with appends and attention by position, whole-store snapshots to
// show a refused call changed nothing, and NOT_FOUND checks. Header-only: each
// test binary links its own .cc alone.
#ifndef KVKEEP_TESTS_CACHE_STORE_HARNESS_H_
#define KVKEEP_TESTS_CACHE_STORE_HARNESS_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cache_store/cache_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/token_data.h"

namespace kvkeep::store_testing {

using ::kvkeep::testing::ExpectError;
using ::kvkeep::testing::StatusOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ListSessions() is in ascending id order, whatever order they were made in.
inline std::vector<SessionId> Sorted(std::vector<SessionId> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}

// NOT_FOUND, naming the session (its id in decimal or as 16 hex digits).
template <typename S>
inline void ExpectNotFound(const S& s, SessionId id) {
  const absl::Status status = StatusOf(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  const std::string message(status.message());
  EXPECT_THAT(message, HasSubstr("not found"));
  EXPECT_TRUE(message.find(std::to_string(id)) != std::string::npos ||
              message.find(absl::StrFormat("%016x", id)) != std::string::npos)
      << "the message does not name session " << id << ": " << message;
}

inline ModelLayout MakeLayout(std::string name, int32_t layers,
                              int32_t page_tokens, int32_t kv_heads = 1,
                              int32_t query_heads = 1, int32_t head_dim = 4,
                              DType dtype = DType::kF32) {
  ModelLayout l;
  l.name = std::move(name);
  l.num_layers = layers;
  l.kv_heads = kv_heads;
  l.query_heads = query_heads;
  l.head_dim = head_dim;
  l.dtype = dtype;
  l.page_tokens = page_tokens;
  return l;
}

using ::kvkeep::test_data::Noise;
using ::kvkeep::test_data::TokenBytes;

using ::kvkeep::test_data::AppendBuffers;

// Positions [first, end).
inline std::vector<int64_t> Range(int64_t first, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = first; i < end; ++i) v.push_back(i);
  return v;
}
inline std::vector<int64_t> Concat(std::vector<int64_t> a,
                                   const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class Harness {
 public:
  explicit Harness(std::vector<ModelLayout> layouts,
                   int64_t capacity_pages = 1024,
                   int64_t max_sessions = 1 << 16) {
    StoreOptions options;
    options.device = test_support::TestDevice();
    options.max_sessions = max_sessions;
    for (const ModelLayout& l : layouts) {
      options.pools.push_back(PoolSpec{l, capacity_pages});
      layouts_[l.name] = l;
    }
    absl::StatusOr<std::unique_ptr<CacheStore>> store =
        CacheStore::Create(options);
    if (!store.ok()) {
      ADD_FAILURE() << store.status();
      std::abort();
    }
    store_ = *std::move(store);
  }

  CacheStore& store() { return *store_; }
  const ModelLayout& layout(const std::string& name) const {
    return layouts_.at(name);
  }

  absl::StatusOr<SessionId> Open(const std::string& layout,
                                 const std::string& policy,
                                 std::map<std::string, std::string> params,
                                 int64_t budget) {
    SessionSpec spec;
    spec.layout = layout;
    spec.policy = PolicySpec{policy, std::move(params)};
    spec.budget.tokens = budget;
    return store_->CreateSession(spec);
  }

  // Appends `positions` to a session of `layout`.
  absl::StatusOr<StepResult> Append(SessionId id, const std::string& layout,
                                    std::vector<int64_t> positions) {
    AppendBuffers b(layouts_.at(layout), std::move(positions));
    return store_->Append(id, b.request());
  }

  // Appends `positions` to a session, whatever its layout.
  absl::StatusOr<StepResult> Append(SessionId id,
                                    std::vector<int64_t> positions) {
    absl::StatusOr<SessionStats> stats = store_->GetStats(id);
    if (!stats.ok()) return stats.status();
    return Append(id, stats->layout, std::move(positions));
  }

  // Appends positions [first, first + n) in one call.
  absl::StatusOr<StepResult> AppendRange(SessionId id, int64_t first,
                                         int64_t n) {
    return Append(id, Range(first, first + n));
  }

  // Head-reduced attention rows for one layer, given by position (0 for
  // every other resident token), laid out in the layer's current slot order
  // and sent at its current version.
  absl::StatusOr<StepResult> AttendRows(
      SessionId id, int32_t layer,
      const std::vector<std::map<int64_t, float>>& rows) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
    if (!table.ok()) return table.status();
    std::vector<float> data;
    for (const auto& by_position : rows) {
      for (const auto& [pos, p] : by_position) {
        if (std::find(table->positions.begin(), table->positions.end(), pos) ==
            table->positions.end()) {
          ADD_FAILURE() << "test bug: position " << pos << " is not resident";
        }
      }
      for (int64_t pos : table->positions) {
        auto it = by_position.find(pos);
        data.push_back(it == by_position.end() ? 0.0f : it->second);
      }
    }
    LayerScores s{layer, table->version, ScoreSource::kReduced,
                  static_cast<int32_t>(rows.size()), data};
    return store_->UpdateScores(id, std::span<const LayerScores>(&s, 1));
  }
  absl::StatusOr<StepResult> Attend(
      SessionId id, int32_t layer,
      const std::map<int64_t, float>& by_position) {
    return AttendRows(id, layer, {by_position});
  }

  // One row of head-reduced attention for every layer: given by position
  // (0 for the others), in slot order, at the current versions.
  absl::StatusOr<StepResult> AttendAll(
      SessionId id, int32_t layers,
      const std::vector<std::map<int64_t, float>>& by_layer) {
    std::vector<std::vector<float>> rows(layers);
    std::vector<LayerScores> scores;
    for (int32_t layer = 0; layer < layers; ++layer) {
      absl::StatusOr<BlockTable> t = store_->GetBlockTable(id, layer);
      if (!t.ok()) return t.status();
      for (int64_t pos : t->positions) {
        auto it = by_layer[layer].find(pos);
        rows[layer].push_back(it == by_layer[layer].end() ? 0.0f : it->second);
      }
      scores.push_back(LayerScores{layer, t->version, ScoreSource::kReduced, 1,
                                   rows[layer]});
    }
    return store_->UpdateScores(id, scores);
  }

  std::vector<int64_t> Resident(SessionId id, int32_t layer) {
    absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
    EXPECT_TRUE(table.ok()) << table.status();
    if (!table.ok()) return {};
    std::vector<int64_t> p = table->positions;
    std::sort(p.begin(), p.end());
    return p;
  }

  PoolStats Pool(const std::string& layout) const {
    for (const LayoutStats& s : store_->Layouts()) {
      if (s.layout.name == layout) return s.pool;
    }
    ADD_FAILURE() << "no layout " << layout;
    return {};
  }

 private:
  std::map<std::string, ModelLayout> layouts_;
  std::unique_ptr<CacheStore> store_;
};

// Everything observable about a session and its pool.
struct Snapshot {
  SessionStats stats;
  std::vector<BlockTable> tables;
  std::vector<LayerKvCopy> data;
  PoolStats pool;
  std::vector<SessionId> sessions;
};

inline Snapshot Take(Harness& h, SessionId id) {
  Snapshot s;
  absl::StatusOr<SessionStats> stats = h.store().GetStats(id);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return s;
  s.stats = *stats;
  for (int32_t layer = 0; layer < h.layout(s.stats.layout).num_layers;
       ++layer) {
    absl::StatusOr<BlockTable> t = h.store().GetBlockTable(id, layer);
    absl::StatusOr<LayerKvCopy> kv = h.store().ReadLayer(id, layer);
    EXPECT_TRUE(t.ok() && kv.ok());
    if (!t.ok() || !kv.ok()) return s;
    s.tables.push_back(*t);
    s.data.push_back(*kv);
  }
  s.pool = h.Pool(s.stats.layout);
  s.sessions = h.store().ListSessions();
  return s;
}

inline void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.stats.resident_tokens, b.stats.resident_tokens);
  EXPECT_EQ(a.stats.pages, b.stats.pages);
  EXPECT_EQ(a.stats.bytes, b.stats.bytes);
  EXPECT_EQ(a.stats.evicted_tokens, b.stats.evicted_tokens);
  EXPECT_EQ(a.stats.evicted_score, b.stats.evicted_score);
  EXPECT_EQ(a.stats.score_updates, b.stats.score_updates);
  EXPECT_EQ(a.stats.compressed, b.stats.compressed);
  EXPECT_EQ(a.stats.layer_resident, b.stats.layer_resident);
  EXPECT_EQ(a.stats.layer_version, b.stats.layer_version);
  ASSERT_EQ(a.tables.size(), b.tables.size());
  for (size_t l = 0; l < a.tables.size(); ++l) {
    EXPECT_EQ(a.tables[l].version, b.tables[l].version) << "layer " << l;
    EXPECT_EQ(a.tables[l].pages, b.tables[l].pages) << "layer " << l;
    EXPECT_EQ(a.tables[l].positions, b.tables[l].positions) << "layer " << l;
    EXPECT_EQ(a.tables[l].cache_positions, b.tables[l].cache_positions);
    EXPECT_EQ(a.data[l].keys, b.data[l].keys) << "layer " << l;
    EXPECT_EQ(a.data[l].values, b.data[l].values) << "layer " << l;
  }
  EXPECT_EQ(a.pool.used_pages, b.pool.used_pages);
  EXPECT_EQ(a.pool.owners, b.pool.owners);
  EXPECT_EQ(a.sessions, b.sessions);
}

}  // namespace kvkeep::store_testing

#endif  // KVKEEP_TESTS_CACHE_STORE_HARNESS_H_
