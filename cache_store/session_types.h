// The values that go in and out of a session: what to create, what to append,
// the attention of a step, and what each call changed. Plain values; a request
// only borrows the caller's buffers for the duration of the call.
#ifndef KVKEEP_CACHE_STORE_SESSION_TYPES_H_
#define KVKEEP_CACHE_STORE_SESSION_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache_store/budget.h"
#include "cache_store/policy_params.h"
#include "kernels/compaction.h"
#include "kernels/page_layout.h"

namespace kvkeep {

using SessionId = uint64_t;

// A session id as users see it: 16 lowercase hex digits.
std::string SessionName(SessionId id);
// The inverse; nullopt unless `name` is exactly 16 hex digits.
std::optional<SessionId> ParseSessionName(std::string_view name);

// Every message about one session names it first, the same way, so a log can
// be searched by id:
//   SessionMessage(id, "layer ", l, " is outside ...")
//       -> "session 00000000000000ab: layer 3 is outside ..."
//   absl::StrCat(SessionLabel(id), " not found")
//       -> "session 00000000000000ab not found"
std::string SessionLabel(SessionId id);  // "session <SessionName(id)>"
template <typename... Parts>
std::string SessionMessage(SessionId id, const Parts&... parts) {
  return absl::StrCat(SessionLabel(id), ": ", parts...);
}
// `status` with its message in SessionMessage form and its code kept (OK
// stays OK): for an error from below that does not know the session.
absl::Status InSession(SessionId id, const absl::Status& status);

struct SessionSpec {
  std::string layout;  // name of a layout the store serves
  PolicySpec policy;
  BudgetSpec budget;
  std::string tenant;           // who owns the session ("" without auth)
  std::string idempotency_key;  // optional: a retried create returns the same
  // The session's lease (lease.h): ZeroDuration asks for the store's default.
  absl::Duration idle_timeout;
  // A named prefix to start from (CacheStore::PublishPrefix): the session
  // begins at the prefix's state, sharing its pages copy-on-write; `layout`
  // may be empty (the prefix's). Empty: an empty session.
  std::string prefix;
  // With a prefix: false (the default) protects the prefix's tokens from
  // eviction in this session (as sinks), so its pages stay shared; true
  // lets the policy evict them (a page is copied when it is written).
  bool prefix_evictable = false;
};

// What PublishPrefix publishes (docs/prefixes.md).
struct PrefixSpec {
  std::string name;        // ValidatePrefixName's rules
  std::string tenant;      // the publisher, charged for the prefix's pages
  bool is_public = false;  // every tenant may start from it (if allowed)
};

// A named prefix as listings show it.
struct PrefixInfo {
  std::string name;
  std::string tenant;  // who published it
  bool is_public = false;
  bool published = true;  // false: unpublished, still held by sessions
  std::string layout;
  SessionId source = 0;         // the session it was published from
  int64_t tokens = 0;           // tokens per layer (protected in its sessions)
  int64_t resident_tokens = 0;  // summed over layers
  int64_t pages = 0;            // pages it holds
  int64_t shared_pages = 0;     // of those, pages another session holds too
  int64_t holders = 0;  // open sessions started from it (and their forks)
};

// INVALID_ARGUMENT unless `name` is 1 to 128 characters of [A-Za-z0-9._:/-]
// starting with a letter or digit.
absl::Status ValidatePrefixName(std::string_view name);

// What a fork's child changes from its parent (CacheStore::ForkSession);
// anything unset is the parent's.
struct ForkSpec {
  std::optional<PolicySpec> policy;  // another policy, parameters and all
  std::optional<BudgetSpec> budget;  // another budget
  std::string idempotency_key;  // optional: a retried fork returns the same
  // The child's lease (lease.h); ZeroDuration: the parent's idle timeout.
  absl::Duration idle_timeout;
};

// One layer's keys and values for the n tokens of an append, in the layout's
// dtype: [n][kv_heads][head_dim] each.
struct LayerKv {
  std::span<const std::byte> keys;
  std::span<const std::byte> values;
};

// n tokens for every layer: a prefill chunk, or one decode token (n = 1).
struct AppendRequest {
  // Original positions, strictly increasing and greater than any appended
  // before (the same for every layer).
  std::span<const int64_t> positions;
  std::span<const LayerKv> layers;  // one per layer, in layer order
};

// Where a layer's attention for one step comes from.
enum class ScoreSource {
  // Probabilities per query head: [query_heads][rows][resident], each row
  // over the layer's resident slots in slot order.
  kPerHead,
  // The same, already summed over query heads by the worker: [rows][resident].
  kReduced,
  // Query vectors: [rows][query_heads][head_dim] float32. The store computes
  // softmax(q K^T / sqrt(head_dim)) over the resident keys itself.
  kQueries,
};

// One layer's attention for one step (or a prefill chunk: one row per query,
// oldest first; the rows belong to the most recently appended tokens).
struct LayerScores {
  int32_t layer = 0;
  uint64_t version = 0;  // the layer version the attention was computed at
  ScoreSource source = ScoreSource::kReduced;
  int32_t rows = 1;
  std::span<const float> data;
};

// A block-table entry a call replaced: the layer's page at `index` was
// shared with a forked session, so before writing into it the session copied
// it whole to a page of its own, `to`, which holds the same tokens.
struct PageCopy {
  int32_t index = 0;  // in the block table
  PageId from = 0;
  PageId to = 0;
  friend bool operator==(const PageCopy&, const PageCopy&) = default;
};

// What one call changed in one layer. A worker holding the block table
// (the page list, and the position in each slot) follows it in this order:
//   0. replace pages[index] by `to` for each of `pages_copied` (only a
//      session that shares pages with a fork copies any);
//   1. apply `moves` in order: the token at from_slot is now at to_slot;
//   2. keep slots [0, resident - k), where k is the number of this call's new
//      tokens that are not in `evicted_positions`, and drop `pages_freed`
//      from the end of the page list;
//   3. append `pages_added` to the page list; the k kept new tokens take
//      slots [resident - k, resident) in position order.
// Only Append adds tokens (k = 0 for every other call).
struct LayerChange {
  int32_t layer = 0;
  uint64_t version = 0;  // after the call
  int64_t resident = 0;  // tokens resident after the call
  // Ascending. For an append, may include new tokens evicted on arrival.
  std::vector<int64_t> evicted_positions;
  std::vector<SlotMove> moves;
  std::vector<PageId> pages_freed;     // were the last pages of the block table
  std::vector<PageId> pages_added;     // now the last pages of the block table
  std::vector<PageCopy> pages_copied;  // copy-on-write, see above
};

struct StepResult {
  std::vector<LayerChange> layers;  // every layer, in layer order
};

// What a decode step (Session::Step) changed: first its append, then the
// evictions its scores caused.
struct StepOutcome {
  StepResult append;
  StepResult scores;
};

// A layer's block table: its pages and, per slot, where the token came from.
struct BlockTable {
  int32_t layer = 0;
  uint64_t version = 0;
  int32_t page_tokens = 0;
  std::vector<PageId> pages;       // slot s is in pages[s / page_tokens]
  std::vector<int64_t> positions;  // per slot: original position
  // Per slot: the token's index among the resident tokens ordered by
  // position (0 for the oldest). This is the position a pre-RoPE key is
  // rotated with under StreamingLLM-style re-indexing.
  std::vector<int64_t> cache_positions;
};

// A layer's resident keys and values, copied out in slot order.
struct LayerKvCopy {
  uint64_t version = 0;
  std::vector<int64_t> positions;  // per slot
  // What keys and values hold: [resident][kv_heads][head_dim] of a float
  // dtype, or [resident] token records of the layout's quantised dtype.
  DType dtype = DType::kF32;
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
};

struct SessionStats {
  SessionId id = 0;
  std::string layout;
  std::string policy;
  std::string tenant;
  int64_t resident_tokens = 0;  // summed over layers
  int64_t pages = 0;
  int64_t bytes = 0;  // pages * page bytes
  // Of `pages`, those another session holds too (a fork's parent, child or
  // sibling): counted in full here, once in the pool and the tenant's bytes.
  int64_t shared_pages = 0;
  int64_t evicted_tokens = 0;  // summed over layers, since creation
  double evicted_score = 0;    // the policy scores of evicted tokens, summed
  int64_t score_updates = 0;   // layer score updates applied
  bool compressed = false;     // snapkv: the prompt was compressed
  std::vector<int64_t> layer_resident;
  std::vector<int64_t> layer_budget;
  std::vector<uint64_t> layer_version;
  // The lease (lease.h's LeaseStatus): ZeroDuration idle_timeout: it never
  // expires; lease_left: until it expires if nothing calls it (idle_timeout
  // while held by a stream or a transfer).
  absl::Duration idle_timeout;
  absl::Duration lease_left;
  bool lease_held = false;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SESSION_TYPES_H_
