// Session's snapshots: a session restored from one (its bytes written with
// it, or following through WriteSlots), its slots read and written whole, and
// the snapshot of its state (session_snapshot.h).
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/session.h"

namespace kvkeep {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Restore(
    SessionId id, const ModelLayout& layout, PagePool* pool, PolicyPtr policy,
    const SessionSnapshot& snapshot, std::shared_ptr<PageQuota> quota,
    bool bytes_follow) {
  if (absl::Status s = ValidateSnapshot(snapshot, layout, bytes_follow);
      !s.ok()) {
    return s;
  }
  std::vector<int64_t> budgets;
  for (const LayerSnapshot& l : snapshot.layers) {
    budgets.push_back(l.budget);
    if (l.resident() > 0 && l.history.empty() == policy->uses_history()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session snapshot ", SessionName(snapshot.id), ": policy '",
          policy->name(), "' ", policy->uses_history() ? "needs" : "keeps no",
          " history bits"));
    }
  }
  absl::StatusOr<std::unique_ptr<Session>> session =
      Create(id, layout, pool, std::move(policy), std::move(budgets),
             std::move(quota));
  if (!session.ok()) return session.status();
  Session& s = **session;
  int64_t pages = 0;
  for (const LayerSnapshot& l : snapshot.layers) {
    pages += CeilDiv(l.resident(), layout.page_tokens);
  }
  std::vector<PageId> fresh;
  if (absl::Status st = s.AllocatePages(pages, &fresh); !st.ok()) return st;
  size_t next = 0;
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const LayerSnapshot& from = snapshot.layers[l];
    Layer& to = s.layers_[l];
    to.position = from.position;
    to.arrival = from.arrival;
    to.score = from.score;
    to.history = from.history;
    to.appended = from.appended;
    to.version = from.version;
    const int64_t pages_needed = CeilDiv(from.resident(), layout.page_tokens);
    for (int64_t p = 0; p < pages_needed; ++p) {
      to.pages.push_back(fresh[next++]);
    }
    if (s.kivi_ != nullptr) {
      s.kivi_->RestoreStaging(static_cast<int32_t>(l), from.kivi_staging);
    }
  }
  if (!bytes_follow) {
    for (size_t l = 0; l < snapshot.layers.size(); ++l) {
      const LayerSnapshot& from = snapshot.layers[l];
      if (absl::Status st =
              s.WriteSlots(static_cast<int32_t>(l), 0, from.keys, from.values);
          !st.ok()) {
        return st;
      }
    }
    if (absl::Status st = s.CheckKiviPages(); !st.ok()) return st;
  }
  s.last_position_ = snapshot.last_position;
  s.compressed_ = snapshot.compressed;
  s.work_ = snapshot.work;
  s.work_.scoring_time = absl::ZeroDuration();
  s.work_.eviction_time = absl::ZeroDuration();
  return session;
}

absl::Status Session::WriteSlots(int32_t index, int64_t first,
                                 std::span<const std::byte> keys,
                                 std::span<const std::byte> values) {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  if (kivi_ != nullptr) return WriteKiviSlots(index, first, keys, values);
  Layer& layer = layers_[index];
  const int64_t token_bytes = page_layout_.token_bytes();
  const int64_t n = static_cast<int64_t>(keys.size()) / token_bytes;
  if (static_cast<int64_t>(keys.size()) != n * token_bytes ||
      values.size() != keys.size() || first < 0 || first + n > layer.size()) {
    return absl::InvalidArgumentError(SessionMessage(
        id_, "layer ", index, ": ", keys.size(), " key and ", values.size(),
        " value bytes at slot ", first, " do not fit its ", layer.size(),
        " slots of ", token_bytes, " bytes"));
  }
  return DeviceCheck(pool_->memory().WriteSlots(
      page_layout_, layer.pages, first, n, keys.data(), values.data()));
}

absl::Status Session::ReadSlots(int32_t index, int64_t first, int64_t n,
                                std::span<std::byte> keys,
                                std::span<std::byte> values) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  if (kivi_ != nullptr) return ReadKiviSlots(index, first, keys, values);
  const Layer& layer = layers_[index];
  const int64_t token_bytes = page_layout_.token_bytes();
  if (first < 0 || n < 0 || first + n > layer.size() ||
      static_cast<int64_t>(keys.size()) != n * token_bytes ||
      values.size() != keys.size()) {
    return absl::InvalidArgumentError(SessionMessage(
        id_, "layer ", index, ": slots [", first, ", ", first + n, ") into ",
        keys.size(), " bytes: outside its ", layer.size(),
        " slots or the wrong size"));
  }
  return DeviceCheck(pool_->memory().ReadSlots(page_layout_, layer.pages, first,
                                               n, keys.data(), values.data()));
}

SessionSnapshot Session::Snapshot(bool with_bytes) const {
  SessionSnapshot out;
  out.id = id_;
  out.layout = layout_.name;
  out.last_position = last_position_;
  out.compressed = compressed_;
  out.kivi = kivi_ != nullptr;
  out.work = work_;
  out.work.scoring_time = absl::ZeroDuration();
  out.work.eviction_time = absl::ZeroDuration();
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    LayerSnapshot s;
    s.position = layer.position;
    s.arrival = layer.arrival;
    s.score = layer.score;
    s.history = layer.history;
    s.appended = layer.appended;
    s.version = layer.version;
    s.budget = layer.budget;
    if (kivi_ != nullptr) {
      const std::span<const float> staging =
          kivi_->staging(static_cast<int32_t>(l));
      s.kivi_staging.assign(staging.begin(), staging.end());
    }
    if (with_bytes && kivi_ != nullptr) {
      SnapshotKivi(static_cast<int32_t>(l), s);
    } else if (with_bytes) {
      // A device error leaves the bytes out; the caller sees device_error().
      absl::StatusOr<LayerKvCopy> kv = ReadLayer(static_cast<int32_t>(l));
      if (kv.ok()) {
        s.keys = std::move(kv->keys);
        s.values = std::move(kv->values);
      }
    }
    out.layers.push_back(std::move(s));
  }
  return out;
}

}  // namespace kvkeep
