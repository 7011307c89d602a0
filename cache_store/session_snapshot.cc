#include "cache_store/session_snapshot.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache_store/append_quantizer.h"

namespace kvkeep {
namespace {

// What is wrong with layer `s`'s keys, values and staging for `layout`
// (empty: nothing).
std::string BytesProblem(const LayerSnapshot& s, const ModelLayout& layout,
                         bool bytes_follow) {
  const PageLayout page = layout.page_layout();
  const bool kivi = IsKivi(layout.dtype);
  const int64_t n = s.resident();
  const int64_t blocks = (n + page.page_tokens - 1) / page.page_tokens;
  const int64_t value_bytes = bytes_follow ? 0 : n * page.token_bytes();
  const int64_t key_bytes = bytes_follow ? 0
                            : kivi       ? blocks * page.key_block_bytes()
                                         : value_bytes;
  if (static_cast<int64_t>(s.keys.size()) != key_bytes ||
      static_cast<int64_t>(s.values.size()) != value_bytes) {
    if (bytes_follow) return "keys and values must come later";
    if (!kivi) {
      return absl::StrCat("keys and values must hold ", n, " tokens of ",
                          page.token_bytes(), " bytes");
    }
    return absl::StrCat("keys must hold ", blocks, " kivi_int4 key blocks of ",
                        page.key_block_bytes(), " bytes and values ", n,
                        " tokens of ", page.token_bytes(), " bytes; they hold ",
                        s.keys.size(), " and ", s.values.size());
  }
  const int64_t staged =
      kivi ? n % page.page_tokens * page.token_elements() : 0;
  if (static_cast<int64_t>(s.kivi_staging.size()) != staged) {
    return kivi ? absl::StrCat(
                      "the kivi_int4 staging must hold the open "
                      "page's ",
                      n % page.page_tokens, " tokens' keys (", staged,
                      " floats); it holds ", s.kivi_staging.size())
                : std::string(
                      "a kivi_int4 staging for a layout that is not "
                      "kivi_int4");
  }
  for (size_t i = 0; i < s.kivi_staging.size(); ++i) {
    if (!(std::fabs(s.kivi_staging[i]) <= AppendQuantizer::kKiviKeyMax)) {
      return absl::StrCat(
          "kivi_int4 staging element ", i, " is ", s.kivi_staging[i],
          " (keys are finite, |x| <= ", AppendQuantizer::kKiviKeyMax, ")");
    }
  }
  return "";
}

}  // namespace

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
  if (snapshot.kivi != IsKivi(layout.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session snapshot ", SessionName(snapshot.id), " holds ",
        snapshot.kivi ? "kivi_int4 key blocks" : "token records", "; layout '",
        layout.name, "' stores ", std::string(DTypeName(layout.dtype))));
  }
  const SessionWork& w = snapshot.work;
  if (w.evicted_tokens < 0 || w.score_updates < 0 || w.evictions < 0 ||
      !std::isfinite(w.evicted_score) || w.evicted_score < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session snapshot ", SessionName(snapshot.id),
        ": its work so far is not valid (counts are not negative; the ",
        "evicted score, ", w.evicted_score, ", is finite and not negative)"));
  }
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const LayerSnapshot& s = snapshot.layers[l];
    const size_t n = s.position.size();
    if (s.arrival.size() != n || s.score.size() != n) {
      return bad(l, "positions, arrivals and scores differ in length");
    }
    if (!s.history.empty() && s.history.size() != n) {
      return bad(l, "history is neither empty nor one entry per slot");
    }
    if (std::string problem = BytesProblem(s, layout, bytes_follow);
        !problem.empty()) {
      return bad(l, problem);
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
