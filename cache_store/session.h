// Session: one sequence's KV cache. It owns, per layer, the pages holding the
// resident tokens' keys and values (dense in slots [0, resident)), each slot's
// original position, arrival order and policy state, and a version that every
// change to the layer's slots bumps. It asks its policy what to evict and
// compacts the survivors so no page has holes; emptied pages go back to the
// pool before the call returns. A call's page work for every layer (moves,
// writes, query scoring) runs as one batch on the pool's memory (one wait on
// a CUDA device; two when store-scored queries evict). Every call either
// succeeds and reports what it changed, or fails with a status and changes
// nothing.
//
// Fork makes a child that shares every page with its parent, copy-on-write:
// neither ever writes a page another session also holds. Whatever would
// write into one (an append into a partly filled page, a compaction move, an
// eviction settling an over-budget layer) first copies the whole page to a
// page of its own, in the same batch, and reports it (LayerChange::
// pages_copied). The pages those copies may need are reserved before the
// call changes anything (a bound from the call's shape), so a full pool
// still fails the call cleanly. A session that never forked and was never
// forked from skips all of this.
//
// Not thread-safe: the store serialises the calls on one session.
#ifndef KVKEEP_CACHE_STORE_SESSION_H_
#define KVKEEP_CACHE_STORE_SESSION_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_store/append_quantizer.h"
#include "cache_store/kivi_keys.h"
#include "cache_store/model_layout.h"
#include "cache_store/page_pool.h"
#include "cache_store/page_quota.h"
#include "cache_store/policy_registry.h"
#include "cache_store/score_input.h"
#include "cache_store/session_snapshot.h"
#include "cache_store/session_types.h"
#include "cache_store/step_batch.h"
#include "cache_store/store_observer.h"

namespace kvkeep {

// kivi_int4 layouts take the policies full and h2o_page only
// (INVALID_ARGUMENT naming why otherwise); OK for every other layout.
absl::Status CheckKiviPolicy(const ModelLayout& layout,
                             absl::string_view policy);

class Session {
 public:
  // Validates the policy against every layer budget. `pool` must outlive the
  // session and serve `layout`. Pages are also charged to `quota` when set.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      SessionId id, const ModelLayout& layout, PagePool* pool, PolicyPtr policy,
      std::vector<int64_t> layer_budgets,
      std::shared_ptr<PageQuota> quota = nullptr);
  // A session in the state `snapshot` describes (see session_snapshot.h),
  // with pages from `pool`, all or nothing: INVALID_ARGUMENT for a snapshot
  // that is inconsistent or does not fit the layout or the policy;
  // RESOURCE_EXHAUSTED (nothing held) when the pool or quota cannot give its
  // pages. The snapshot's id, layout name, policy spec and tenant are the
  // caller's business.
  // With `bytes_follow` the snapshot carries no keys and values: the pages
  // are taken but hold nothing meaningful until WriteSlots fills them.
  static absl::StatusOr<std::unique_ptr<Session>> Restore(
      SessionId id, const ModelLayout& layout, PagePool* pool, PolicyPtr policy,
      const SessionSnapshot& snapshot,
      std::shared_ptr<PageQuota> quota = nullptr, bool bytes_follow = false);
  // Writes the keys and values of slots [first, first + n) of `layer`
  // ([n][kv_heads][head_dim] each, the layout's dtype). INVALID_ARGUMENT for
  // a layer or slot range outside the resident tokens or mismatched sizes.
  // kivi_int4: `first` is a page's first slot and keys are the key blocks
  // of the ceil(n / page_tokens) pages written (session_snapshot.h).
  absl::Status WriteSlots(int32_t layer, int64_t first,
                          std::span<const std::byte> keys,
                          std::span<const std::byte> values);
  // kivi_int4, once a restored session's bytes are written: INVALID_ARGUMENT
  // unless every key block's scales are finite binary16, not negative, and
  // its zero points int4 (0-15), and every open page's key block is what
  // its staging quantises to (a snapshot's blocks and staging belong
  // together). OK for other layouts.
  absl::Status CheckKiviPages() const;
  ~Session();  // lets go of every page (shared ones stay with the others)

  // A new session `child` at this session's current state (tokens, slots,
  // scores, versions, positions), holding the same pages, shared
  // copy-on-write. It evicts on its own from then on, with `policy` (null:
  // this session's) and `layer_budgets` (empty: this session's; a budget
  // below the resident tokens is evicted down to on the child's next call
  // that evicts). Its work counters start at zero. Pages are charged to
  // `quota` only when a write copies them (the pool counts a shared page
  // once). INVALID_ARGUMENT for a policy or budgets that do not fit the
  // layout; this session's device error if it has one. This session is
  // unchanged except that its pages are now shared.
  absl::StatusOr<std::unique_ptr<Session>> Fork(
      SessionId child, PolicyPtr policy, std::vector<int64_t> layer_budgets,
      std::shared_ptr<PageQuota> quota) const;

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Appends tokens to every layer (see AppendRequest). Any eviction this
  // causes happens before the new tokens are placed: content-blind policies
  // (window, streaming_llm) make room by evicting the oldest unprotected
  // tokens (and, for a chunk longer than the budget, its own oldest
  // unprotected tokens are evicted on arrival, never written); an
  // attention-driven policy whose layer is still over budget (no scores came
  // since the last append) first evicts it down to budget with the scores it
  // has.
  absl::StatusOr<StepResult> Append(const AppendRequest& request);

  // Folds one step's attention into the listed layers' scores and evicts any
  // layer over budget. All inputs are checked before any is applied.
  absl::StatusOr<StepResult> UpdateScores(std::span<const LayerScores> scores);

  // One decode step in one call: appends `append` (its tokens, if any), then
  // applies `scores`, whose versions are the layers' versions BEFORE the
  // append and whose attention covers the slots after it (the new tokens in
  // the next slots). Everything is checked before the append, so a refused
  // step changes nothing. A layer that is over budget (its last scores never
  // came) cannot take scores in a step with an append: FAILED_PRECONDITION.
  absl::StatusOr<StepOutcome> Step(const AppendRequest& append,
                                   std::span<const LayerScores> scores);
  // The same into `out`, whose buffers are reused (a decode stream keeps one
  // StepOutcome, so steady-state steps allocate nothing for their results).
  // On failure `out` holds nothing of use.
  absl::Status Step(const AppendRequest& append,
                    std::span<const LayerScores> scores, StepOutcome& out);

  // snapkv only, once: compresses the prompt with the observation window's
  // attention (rows = the window: the last `window` tokens appended).
  absl::StatusOr<StepResult> CompressPrompt(
      std::span<const LayerScores> window);

  absl::StatusOr<BlockTable> GetBlockTable(int32_t layer) const;
  // The stored bytes; INVALID_ARGUMENT for kivi_int4 (its keys are
  // per-page blocks: ReadKiviLayerAs).
  absl::StatusOr<LayerKvCopy> ReadLayer(int32_t layer) const;
  // kivi_int4 only: keys and values dequantised to dtype (f32, f16, bf16).
  absl::StatusOr<LayerKvCopy> ReadKiviLayerAs(int32_t layer, DType dtype) const;
  SessionStats stats() const;
  // The session's state (its layers, last position, work; the caller adds
  // id, layout, policy spec and tenant). With `with_bytes`, copies every
  // resident byte; without, the keys and values are left empty.
  SessionSnapshot Snapshot(bool with_bytes = true) const;
  // Copies the keys and values of slots [first, first + n) of `layer` into
  // `keys` and `values` ([n][kv_heads][head_dim] each). INVALID_ARGUMENT
  // for a range outside the layer or buffers of the wrong size. A kivi_int4
  // session reads as ReadKiviSlots (n is then values.size() / token bytes).
  absl::Status ReadSlots(int32_t layer, int64_t first, int64_t n,
                         std::span<std::byte> keys,
                         std::span<std::byte> values) const;
  // kivi_int4's ReadSlots, as WriteSlots takes its bytes: `first` starts a
  // page, the run ends on a page's end or the layer's, `keys` are the key
  // blocks of its ceil(n / page_tokens) pages and `values` its n records
  // (n = values.size() / token bytes). INVALID_ARGUMENT otherwise.
  absl::Status ReadKiviSlots(int32_t layer, int64_t first,
                             std::span<std::byte> keys,
                             std::span<std::byte> values) const;
  // OK unless a device error left the session's pages in an unknown state;
  // then every call that reads or changes them returns this DATA_LOSS
  // status, and the session should be closed.
  const absl::Status& device_error() const { return device_error_; }
  // What the session has done since it was created (for monitoring).
  const SessionWork& work() const { return work_; }

  SessionId id() const { return id_; }
  // Tokens ever appended to the session (every layer gets the same appends;
  // the largest layer count).
  int64_t appended_tokens() const;
  // The pages of `layer` (slot s in pages[s / page_tokens]), and the memory
  // they live in: for moving a frozen or reserved session's bytes device to
  // device. `layer` must be valid.
  std::span<const PageId> layer_pages(int32_t layer) const {
    return layers_[layer].pages;
  }
  PageMemory& memory() const { return pool_->memory(); }
  const ModelLayout& layout() const { return layout_; }
  const EvictionPolicy& policy() const { return *policy_; }

 private:
  struct Layer {
    std::vector<PageId> pages;
    std::vector<int64_t> position;  // per slot
    std::vector<int64_t> arrival;   // per slot
    std::vector<float> score;       // per slot
    // The step's new scores on the fused path (FusedScores), swapped in for
    // `score` once the step can no longer fail; scratch between steps.
    std::vector<float> next_score;
    std::vector<uint64_t>
        history;  // per slot (empty unless the policy uses it)
    int64_t appended = 0;
    uint64_t version = 1;
    int64_t budget = 0;
    int64_t size() const { return static_cast<int64_t>(position.size()); }
  };

  Session(SessionId id, const ModelLayout& layout, PagePool* pool,
          PolicyPtr policy, std::vector<int64_t> layer_budgets,
          std::shared_ptr<PageQuota> quota);
  // Pages from the pool, charged to the quota: all or nothing.
  absl::Status AllocatePages(int64_t n, std::vector<PageId>* pages);
  // Lets go of pages; the quota is credited for those the pool got back.
  void FreePages(std::span<const PageId> pages);

  // Copy-on-write (see the class comment). The spare pages a layer's
  // eviction of `evict` tokens followed by writes of `incoming` tokens may
  // need: at most one per shared page written, and an eviction writes into
  // at most one page per victim (count + page_tokens - 1 for page-level
  // policies); writes touch at most the partly filled page, or, after an
  // eviction, the pages the incoming tokens span.
  int64_t CopyBound(const Layer& layer, int64_t evict, int64_t incoming) const;
  // The same for the evictions `scores` may cause after `growth` more tokens.
  int64_t AttentionCopyBound(std::span<const LayerScores> scores,
                             int64_t growth, bool compress) const;
  // Adds n pages to spare_, all or nothing.
  absl::Status ReserveCopies(int64_t n);
  // Makes the page at `index` of `layer` one only this session holds,
  // copying it (in batch_) to a spare page if it is shared.
  void MakeWritable(Layer& layer, int64_t index, LayerChange& change);
  // MakeWritable for the pages the layer already has that hold slots
  // [first, end) (the slots an append is about to write).
  void MakeSlotsWritable(Layer& layer, int64_t first, int64_t end,
                         LayerChange& change);
  // Returns the spare pages a call did not use (at its end).
  void ReleaseSpare();

  LayerTokens Tokens(Layer& layer);
  // Tokens to evict so the layer drops to budget - slack, if over budget.
  int64_t Excess(const Layer& layer) const;
  // Evicts `count` tokens chosen by the policy, records the compaction moves
  // in batch_, and frees (after the batch) the tail pages that neither the
  // survivors nor `incoming` tokens about to be appended need. The policy sees
  // `appended_view` tokens appended (for its recent window).
  void Evict(Layer& layer, int64_t count, int64_t appended_view,
             int64_t incoming, LayerChange& change);
  absl::Status CheckLayerIndex(int32_t layer) const;
  absl::Status ValidateAppend(const AppendRequest& request) const;
  // Appends a validated request; fails (changing nothing) only when the pool
  // cannot give the pages.
  absl::Status ApplyAppend(const AppendRequest& request, StepResult& result);
  // UpdateScores into `result`.
  absl::Status ScoresInto(std::span<const LayerScores> scores,
                          StepResult& result);
  // True when `in` takes the fused path: head-reduced rows for a policy
  // whose Observe only adds them (EvictionPolicy::observe_adds_rows).
  // PrepareAttention then checks them and writes the layer's new scores into
  // its next_score in one pass, and ApplyAttention swaps those in.
  bool FusedScores(const LayerScores& in) const {
    return in.source == ScoreSource::kReduced && policy_->observe_adds_rows();
  }
  // What a layer's score input is checked against (score_input.h) when its
  // rows run over `resident` slots.
  ScoreInputShape InputShape(int64_t resident) const;
  // Validates `scores` as they will apply after `growth` more tokens are
  // appended, and points rows[i] at entry i's head-summed rows: the caller's
  // own buffer for head-reduced input, else space in rows_out, filled now for
  // probabilities and by FinishAttention for queries (which read the keys).
  absl::Status PrepareAttention(std::span<const LayerScores> scores,
                                int64_t growth, std::vector<float>& rows_out,
                                std::vector<const float*>& rows);
  // Scores the queries against the stored keys into their rows; a row that
  // comes out not finite (non-finite keys, overflowing logits) is zeroed.
  void FinishAttention(std::span<const LayerScores> scores,
                       std::vector<const float*>& rows);
  // Folds prepared rows into the policy's scores and evicts what is over
  // budget (down to budget - slack; to budget exactly when compressing).
  void ApplyAttention(std::span<const LayerScores> scores,
                      std::span<const float* const> rows, bool compress,
                      StepResult& result);
  // Makes `result` one empty change per layer, keeping its buffers.
  void ResetResult(StepResult& result) const;
  // Runs batch_ (the call's page work recorded so far) on the pool's memory,
  // then returns pending_free_ to the pool. A device error is recorded in
  // device_error_, which the caller reports.
  void RunBatch();
  // Records the first failed page-memory call as device_error_ (a host pool
  // never fails) and returns device_error_.
  absl::Status DeviceCheck(absl::Status status) const;
  template <typename T>
  absl::StatusOr<T> AfterDevice(absl::StatusOr<T> result) const {
    if (!device_error_.ok()) return device_error_;
    return result;
  }

  const SessionId id_;
  const ModelLayout layout_;
  const PageLayout page_layout_;
  PagePool* const pool_;
  const PolicyPtr policy_;
  const std::shared_ptr<PageQuota> quota_;  // may be null
  std::vector<Layer> layers_;
  int64_t last_position_ = -1;
  SessionWork work_;
  bool compressed_ = false;
  // Set on both sides of a fork: pages may be shared, so writes check.
  mutable bool may_share_ = false;
  // Pages reserved for the current call's copies (empty between calls).
  std::vector<PageId> spare_;
  mutable absl::Status device_error_;
  // The page work of the current call, every layer (moves, writes, query
  // scoring), run as one batch by RunBatch; and the pages its evictions
  // emptied, freed once it has run (the moves read them until then).
  StepBatch batch_;
  std::vector<PageId> pending_free_;
  // Reused per call to avoid allocating on the hot path.
  std::vector<RankedItem> select_scratch_;
  std::vector<int32_t> victims_;
  std::vector<uint8_t> evicted_flags_;
  std::vector<SlotMove> moves_;
  // One layer's plan in ApplyAppend.
  struct AppendPlan {
    int64_t evict = 0;       // resident tokens to evict first
    int64_t drop_begin = 0;  // new tokens [drop_begin, drop_begin + drop)
    int64_t drop = 0;        // are evicted on arrival, never written
    int64_t appended_view = 0;
  };
  std::vector<AppendPlan> append_plans_;
  // kivi_int4 (session_kivi.cc): the keys of layer l's appended tokens
  // that `plan` keeps, quantised with their pages into batch_.
  void AppendKiviKeys(size_t l, const AppendPlan& plan, const LayerKv& kv,
                      int64_t n);
  // Layer `index`'s key blocks and values into `out` (Snapshot).
  void SnapshotKivi(int32_t index, LayerSnapshot& out) const;
  // The slot count of a kivi_int4 run of `key_bytes` and `value_bytes` at
  // `first` of layer `index` (ReadKiviSlots' rules), or INVALID_ARGUMENT.
  absl::StatusOr<int64_t> KiviRun(int32_t index, int64_t first,
                                  size_t key_bytes, size_t value_bytes) const;
  // WriteSlots of a kivi_int4 layer.
  absl::Status WriteKiviSlots(int32_t index, int64_t first,
                              std::span<const std::byte> keys,
                              std::span<const std::byte> values);
  std::vector<PageId> new_pages_;
  AppendQuantizer quantizer_;  // quantised layouts: records of each append
  // kivi_int4 layouts: the keys, per channel by page (null otherwise).
  std::unique_ptr<KiviKeys> kivi_;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_SESSION_H_
