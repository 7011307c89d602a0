#include "cache_store/session_snapshot.h"

#include <algorithm>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvkeep {

absl::Status ValidateSnapshot(const SessionSnapshot& snapshot,
                              const ModelLayout& layout, bool bytes_follow) {
  auto bad = [&](size_t layer, absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("session snapshot ", SessionName(snapshot.id), ": layer ",
                     layer, ": ", what));
  };
  if (static_cast<int32_t>(snapshot.layers.size()) != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("session snapshot ", SessionName(snapshot.id), " has ",
                     snapshot.layers.size(), " layers; layout '", layout.name,
                     "' has ", layout.num_layers));
  }
  const SessionWork& w = snapshot.work;
  if (w.evicted_tokens < 0 || w.score_updates < 0 || w.evictions < 0 ||
      !std::isfinite(w.evicted_score) || w.evicted_score < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session snapshot ", SessionName(snapshot.id),
        ": its work so far is not valid (counts are not negative; the ",
        "evicted score, ", w.evicted_score, ", is finite and not negative)"));
  }
  const int64_t token_bytes = layout.page_layout().token_bytes();
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const LayerSnapshot& s = snapshot.layers[l];
    const size_t n = s.position.size();
    if (s.arrival.size() != n || s.score.size() != n) {
      return bad(l, "positions, arrivals and scores differ in length");
    }
    if (!s.history.empty() && s.history.size() != n) {
      return bad(l, "history is neither empty nor one entry per slot");
    }
    const int64_t bytes =
        bytes_follow ? 0 : static_cast<int64_t>(n) * token_bytes;
    if (static_cast<int64_t>(s.keys.size()) != bytes ||
        s.values.size() != s.keys.size()) {
      return bad(l, bytes_follow
                        ? std::string("keys and values must come later")
                        : absl::StrCat("keys and values must hold ", n,
                                       " tokens of ", token_bytes, " bytes"));
    }
    if (s.version < 1) return bad(l, "version must be at least 1");
    if (s.budget < 0) return bad(l, "negative budget");
    if (static_cast<int64_t>(n) > s.appended) {
      return bad(l, "more resident tokens than were ever appended");
    }
    absl::flat_hash_set<int64_t> positions;
    absl::flat_hash_set<int64_t> arrivals;
    for (size_t i = 0; i < n; ++i) {
      if (s.position[i] < 0 || s.position[i] > snapshot.last_position ||
          !positions.insert(s.position[i]).second) {
        return bad(l, absl::StrCat("position ", s.position[i],
                                   " is repeated or out of range"));
      }
      if (s.arrival[i] < 0 || s.arrival[i] >= s.appended ||
          !arrivals.insert(s.arrival[i]).second) {
        return bad(l, absl::StrCat("arrival ", s.arrival[i],
                                   " is repeated or out of range"));
      }
      // Scores are sums of attention: what live input may give (finite,
      // not negative) is all an import may hold, or a later eviction would
      // sort NaN (the selection kernels' contract forbids it).
      if (!std::isfinite(s.score[i]) || s.score[i] < 0.0f) {
        return bad(l, absl::StrCat("slot ", i, " has score ", s.score[i],
                                   " (scores are finite and not negative)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvkeep
