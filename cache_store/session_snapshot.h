// SessionSnapshot: everything a session is, as a plain value: per layer the
// resident tokens' keys and values (in slot order), their positions, arrival
// order, policy scores and history bits, the append count, the version and the
// budget; the session's policy (by its registry spec), tenant and work so far.
// A session restored from a snapshot, in any store serving the same layout,
// answers every later call exactly as the original would have: the same
// evictions, the same slot moves, the same versions (only page ids differ:
// they belong to the new pool). It is the unit of a session transfer between
// stores.
//
// kivi_int4 layouts (kernels/page_layout.h): a layer's keys are its pages'
// key blocks as stored (quantised per channel over each page's tokens; no
// re-rounding on the way), and its open page's exact float32 keys travel
// with them (the staging, cache_store/kivi_keys.h), so the restored session
// re-quantises that page as the original would.
//
// Plain value; not thread-safe to share while being filled.
#ifndef KVKEEP_CACHE_STORE_SESSION_SNAPSHOT_H_
#define KVKEEP_CACHE_STORE_SESSION_SNAPSHOT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cache_store/model_layout.h"
#include "cache_store/policy_params.h"
#include "cache_store/session_types.h"
#include "cache_store/store_observer.h"

namespace kvkeep {

struct LayerSnapshot {
  // Per slot, in slot order (dense: slots [0, resident)).
  std::vector<int64_t> position;
  std::vector<int64_t> arrival;
  std::vector<float> score;
  std::vector<uint64_t> history;  // empty unless the policy keeps history
  int64_t appended = 0;           // tokens ever appended (arrival counter)
  uint64_t version = 0;
  int64_t budget = 0;
  // [resident][kv_heads][head_dim] each, in the layout's dtype; kivi_int4:
  // keys are ceil(resident / page_tokens) key blocks of key_block_bytes()
  // (the layer's pages in order), values its int4 token records.
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
  // kivi_int4 only: the open page's float32 keys, [resident % page_tokens]
  // [kv_heads][head_dim] (empty when every page is full).
  std::vector<float> kivi_staging;

  int64_t resident() const { return static_cast<int64_t>(position.size()); }
};

struct SessionSnapshot {
  SessionId id = 0;
  std::string layout;  // the layout's name; its shape must match on restore
  PolicySpec policy;
  std::string tenant;
  int64_t last_position = -1;  // the last position appended (-1: none)
  bool compressed = false;     // snapkv: the prompt was compressed
  SessionWork work;            // evictions and updates so far (times: zero)
  std::vector<LayerSnapshot> layers;
  // The layers' keys are kivi_int4 key blocks with a staging (above): set by
  // Session::Snapshot for a kivi_int4 session, and what a tier file or a
  // transfer header says its format is, so a reader never takes one form for
  // the other (ValidateSnapshot checks it against the layout).
  bool kivi = false;
  // The lease's length (ZeroDuration: it never expires); nullopt where the
  // snapshot does not say (an older source).
  std::optional<absl::Duration> idle_timeout;
};

// INVALID_ARGUMENT, naming the layer and field, unless `snapshot` is
// internally consistent for `layout`: one layer each; per layer equal slot
// counts, history either empty or per slot, keys and values exactly resident
// tokens of the layout; distinct positions no greater than last_position;
// distinct arrivals below `appended`; a version of at least 1; scores finite
// and not negative; the work so far (counts and evicted score) likewise;
// kivi_int4 (and `kivi` set, only then): keys as key blocks, and a staging of
// exactly the open page's tokens, finite and within
// AppendQuantizer::kKiviKeyMax (other layouts: none). With `bytes_follow`,
// every layer's keys and values must be empty instead (the bytes are written
// later: CacheStore::PrepareImport).
absl::Status ValidateSnapshot(const SessionSnapshot& snapshot,
                              const ModelLayout& layout,
                              bool bytes_follow = false);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SESSION_SNAPSHOT_H_
