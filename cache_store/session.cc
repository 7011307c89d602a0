#include "cache_store/session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_store/score_input.h"
#include "kernels/accumulate.h"

namespace kvkeep {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What an append stores: the request itself, or for a quantised layout its
// records (INVALID_ARGUMENT naming the session for a value they cannot hold).
absl::StatusOr<AppendRequest> StoredForm(AppendQuantizer& quantizer,
                                         const ModelLayout& layout,
                                         SessionId id,
                                         const AppendRequest& request) {
  if (!IsQuantized(layout.dtype)) return request;
  absl::StatusOr<AppendRequest> records = quantizer.Quantize(layout, request);
  if (!records.ok()) return InSession(id, records.status());
  return records;
}

// Attention the store computed itself, from the keys it holds. A key a client
// appended may hold NaN or infinity (the store keeps bytes as sent), and a
// logit may overflow float; either makes its whole softmax row NaN. Such a
// row attends nowhere: it is zeroed, so no score, eviction or counter ever
// sees a NaN (input rows are refused instead: score_input.h).
void ZeroNonFiniteRows(float* rows, int32_t count, int64_t slots) {
  for (int32_t r = 0; r < count; ++r) {
    float* row = rows + int64_t{r} * slots;
    float sum = 0;
    for (int64_t j = 0; j < slots; ++j) sum += row[j] * 0.0f;  // NaN if any is
    if (!(sum == 0)) std::fill(row, row + slots, 0.0f);
  }
}

// Per-thread buffers for a step's attention rows, so memory scales with
// threads, not sessions, and the hot path does not allocate.
struct AttentionScratch {
  std::vector<float> rows;
  std::vector<int64_t> offsets;
  std::vector<int64_t> row_order;      // one scoring's query rows' order
  std::vector<const float*> row_ptrs;  // per layer update: its rows
  std::vector<uint8_t> seen;           // per layer: named in this call
};
// Adds the time of its scope to *total (a monotonic clock).
class ScopedTimer {
 public:
  explicit ScopedTimer(absl::Duration* total)
      : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    *total_ += absl::FromChrono(std::chrono::steady_clock::now() - start_);
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  absl::Duration* const total_;
  const std::chrono::steady_clock::time_point start_;
};

AttentionScratch& ThreadScratch() {
  thread_local AttentionScratch scratch;
  return scratch;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Create(
    SessionId id, const ModelLayout& layout, PagePool* pool, PolicyPtr policy,
    std::vector<int64_t> layer_budgets, std::shared_ptr<PageQuota> quota) {
  if (static_cast<int32_t>(layer_budgets.size()) != layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("got ", layer_budgets.size(), " layer budgets for ",
                     layout.num_layers, " layers"));
  }
  if (absl::Status s = CheckKiviPolicy(layout, policy->name()); !s.ok()) {
    return s;
  }
  for (size_t l = 0; l < layer_budgets.size(); ++l) {
    if (absl::Status s =
            policy->ValidateBudget(layer_budgets[l], layout.page_tokens);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("layer ", l, ": ", s.message()));
    }
  }
  // A kivi_int4 session's staging (the open pages' float32 keys, host
  // memory outside the pool) is charged to its tenant at its bound.
  if (IsKivi(layout.dtype) && quota != nullptr) {
    if (absl::Status s = quota->Reserve(
            KiviKeys::MaxStagingBytes(layout.page_layout(), layout.num_layers));
        !s.ok()) {
      return s;
    }
  }
  return std::unique_ptr<Session>(
      new Session(id, layout, pool, std::move(policy), std::move(layer_budgets),
                  std::move(quota)));
}

Session::Session(SessionId id, const ModelLayout& layout, PagePool* pool,
                 PolicyPtr policy, std::vector<int64_t> layer_budgets,
                 std::shared_ptr<PageQuota> quota)
    : id_(id),
      layout_(layout),
      page_layout_(layout.page_layout()),
      pool_(pool),
      policy_(std::move(policy)),
      quota_(std::move(quota)),
      layers_(layout.num_layers),
      batch_(page_layout_) {
  if (IsKivi(layout.dtype)) {
    kivi_ = std::make_unique<KiviKeys>(page_layout_, layout.num_layers);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l].budget = layer_budgets[l];
  }
}

Session::~Session() {
  for (Layer& layer : layers_) FreePages(layer.pages);
  FreePages(spare_);
  if (kivi_ != nullptr && quota_ != nullptr) {
    quota_->Release(kivi_->max_staging_bytes());
  }
}

absl::Status Session::AllocatePages(int64_t n, std::vector<PageId>* pages) {
  const int64_t bytes = n * page_layout_.page_bytes();
  if (quota_ != nullptr) {
    if (absl::Status s = quota_->Reserve(bytes); !s.ok()) return s;
  }
  absl::Status s = pool_->Allocate(id_, n, pages);
  if (!s.ok() && quota_ != nullptr) quota_->Release(bytes);
  return s;
}

void Session::FreePages(std::span<const PageId> pages) {
  const int64_t returned = pool_->Free(id_, pages);
  if (quota_ != nullptr && returned > 0) {
    quota_->Release(returned * page_layout_.page_bytes());
  }
}

LayerTokens Session::Tokens(Layer& layer) {
  return LayerTokens{layer.arrival, layer.score, layer.history, layer.appended,
                     layout_.page_tokens};
}

int64_t Session::Excess(const Layer& layer) const {
  if (layer.size() <= layer.budget) return 0;
  return layer.size() - (layer.budget - policy_->common().slack);
}

void Session::ResetResult(StepResult& result) const {
  result.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerChange& change = result.layers[l];
    change.layer = static_cast<int32_t>(l);
    change.version = 0;
    change.resident = 0;
    change.evicted_positions.clear();
    change.moves.clear();
    change.pages_freed.clear();
    change.pages_added.clear();
    change.pages_copied.clear();
  }
}

absl::Status Session::DeviceCheck(absl::Status status) const {
  if (status.ok() || !device_error_.ok()) return device_error_;
  device_error_ = absl::DataLossError(
      SessionMessage(id_, "its pages on ", pool_->memory().device().name(),
                     " are in an unknown state after a device error (",
                     status.ToString(), "); close the session"));
  return device_error_;
}

void Session::RunBatch() {
  // After an error nothing more runs: the batch may write a shared page.
  if (device_error_.ok()) {
    DeviceCheck(pool_->memory().RunStep(batch_))
        .IgnoreError();  // recorded in device_error_, reported by the caller
  }
  batch_.Clear();
  if (kivi_ != nullptr) kivi_->BatchDone();
  if (!pending_free_.empty()) {
    FreePages(pending_free_);
    pending_free_.clear();
  }
}

void Session::Evict(Layer& layer, int64_t count, int64_t appended_view,
                    int64_t incoming, LayerChange& change) {
  if (count <= 0) return;
  const ScopedTimer timer(&work_.eviction_time);
  victims_.clear();
  LayerTokens tokens = Tokens(layer);
  tokens.appended = appended_view;
  policy_->SelectVictims(tokens, count, select_scratch_, &victims_);
  if (victims_.empty()) return;
  const int64_t old_size = layer.size();
  const int64_t new_size = old_size - static_cast<int64_t>(victims_.size());

  for (int32_t v : victims_) {
    change.evicted_positions.push_back(layer.position[v]);
    work_.evicted_score += layer.score[v];
  }
  work_.evicted_tokens += static_cast<int64_t>(victims_.size());
  ++work_.evictions;

  std::vector<SlotMove>& moves = moves_;
  PlanCompaction(victims_, old_size, evicted_flags_, moves);
  if (may_share_) {
    // The moves write their targets' pages: make those the layer's own.
    int64_t last = -1;
    for (const SlotMove& m : moves) {
      const int64_t index = m.to_slot / layout_.page_tokens;
      if (index != last) MakeWritable(layer, index, change);
      last = index;
    }
    // kivi_int4 also writes the new open page's key block (CopyBound's
    // evict + page_tokens - 1 pages cover it).
    if (kivi_ != nullptr && new_size % layout_.page_tokens != 0) {
      MakeWritable(layer, new_size / layout_.page_tokens, change);
    }
  }
  batch_.AddMoves(layer.pages, moves);
  if (kivi_ != nullptr) {
    // A device error reading the blocks is recorded; the batch then runs
    // nothing and the caller reports it.
    DeviceCheck(kivi_->Compact(static_cast<int32_t>(&layer - layers_.data()),
                               layer.pages, moves, old_size, new_size,
                               pool_->memory(), batch_))
        .IgnoreError();
  }
  MoveSlotValues(layer.position, moves, new_size);
  MoveSlotValues(layer.arrival, moves, new_size);
  MoveSlotValues(layer.score, moves, new_size);
  if (!layer.history.empty()) MoveSlotValues(layer.history, moves, new_size);
  change.moves.insert(change.moves.end(), moves.begin(), moves.end());

  // Pages that `incoming` tokens will fill stay with the layer.
  const int64_t keep_pages =
      std::min<int64_t>(static_cast<int64_t>(layer.pages.size()),
                        CeilDiv(new_size + incoming, layout_.page_tokens));
  const std::span<const PageId> freed(layer.pages.begin() + keep_pages,
                                      layer.pages.end());
  // The moves still read them: back to the pool once the batch has run.
  pending_free_.insert(pending_free_.end(), freed.begin(), freed.end());
  change.pages_freed.insert(change.pages_freed.end(), freed.begin(),
                            freed.end());
  layer.pages.resize(keep_pages);
  ++layer.version;
}

absl::Status Session::ValidateAppend(const AppendRequest& request) const {
  const int64_t n = static_cast<int64_t>(request.positions.size());
  if (n == 0) {
    return absl::InvalidArgumentError(
        SessionMessage(id_, "append of zero tokens"));
  }
  if (static_cast<int32_t>(request.layers.size()) != layout_.num_layers) {
    return absl::InvalidArgumentError(SessionMessage(
        id_, "append has ", request.layers.size(), " layers, layout '",
        layout_.name, "' has ", layout_.num_layers));
  }
  int64_t previous = last_position_;
  for (int64_t i = 0; i < n; ++i) {
    if (request.positions[i] <= previous) {
      return absl::InvalidArgumentError(SessionMessage(
          id_, "positions must strictly increase; token ", i, " has position ",
          request.positions[i], " after ", previous));
    }
    previous = request.positions[i];
  }
  // Workers send the input dtype; a quantised layout stores records.
  const int64_t token_bytes = layout_.input_token_bytes();
  for (size_t l = 0; l < request.layers.size(); ++l) {
    const LayerKv& kv = request.layers[l];
    if (static_cast<int64_t>(kv.keys.size()) != n * token_bytes ||
        static_cast<int64_t>(kv.values.size()) != n * token_bytes) {
      return absl::InvalidArgumentError(SessionMessage(
          id_, "layer ", l, " keys/values have ", kv.keys.size(), "/",
          kv.values.size(), " bytes, expected ", n * token_bytes, " each (", n,
          " tokens x ", layout_.kv_heads, " kv heads x ", layout_.head_dim,
          " x ", std::string(DTypeName(layout_.input_dtype())), ")"));
    }
  }

  return absl::OkStatus();
}

absl::StatusOr<StepResult> Session::Append(const AppendRequest& request) {
  if (!device_error_.ok()) return device_error_;
  if (absl::Status s = ValidateAppend(request); !s.ok()) return s;
  // All of it before any page moves: a refused value leaves no trace.
  absl::StatusOr<AppendRequest> stored =
      StoredForm(quantizer_, layout_, id_, request);
  if (!stored.ok()) return stored.status();
  StepResult result;
  const absl::Status s = ApplyAppend(*stored, result);
  RunBatch();
  ReleaseSpare();
  if (!device_error_.ok()) return device_error_;
  if (!s.ok()) return s;
  return result;
}

absl::Status Session::ApplyAppend(const AppendRequest& request,
                                  StepResult& result) {
  const int64_t n = static_cast<int64_t>(request.positions.size());
  const int64_t token_bytes = page_layout_.token_bytes();
  // Plan each layer's evictions. Every eviction of an append happens before
  // the new tokens are placed, so a worker can follow one order: moves, then
  // freed pages, then added pages and the surviving new tokens.
  std::vector<AppendPlan>& plans = append_plans_;
  plans.assign(layers_.size(), AppendPlan{});
  const CommonParams& common = policy_->common();
  int64_t pages_needed = 0;
  int64_t copies = 0;  // spare pages for copy-on-write
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    AppendPlan& plan = plans[l];
    plan.appended_view = layer.appended;
    switch (policy_->trigger()) {
      case EvictionTrigger::kOnAttention:
        // Scores never came for the last append: settle it first.
        plan.evict = Excess(layer);
        break;
      case EvictionTrigger::kOnAppend: {
        // Content-blind policies evict the oldest unprotected tokens, so
        // the room for the new ones is made before they arrive, seen as if
        // they had (the recent window moves by n).
        plan.appended_view = layer.appended + n;
        const int64_t after = layer.size() + n;
        if (after <= layer.budget) break;
        const int64_t excess = after - (layer.budget - common.slack);
        const int64_t recent_from = plan.appended_view - common.recent;
        int64_t evictable = 0;
        for (int64_t a : layer.arrival) {
          evictable += (a >= common.sinks && a < recent_from) ? 1 : 0;
        }
        plan.evict = std::min(excess, evictable);
        // A prompt longer than the budget: its oldest unprotected tokens
        // are evicted on arrival.
        plan.drop = excess - plan.evict;
        plan.drop_begin = std::max<int64_t>(0, common.sinks - layer.appended);
        break;
      }
      case EvictionTrigger::kNever:
      case EvictionTrigger::kOnCompress:
        break;
    }
    // A layer keeps the pages its own eviction empties for the incoming
    // tokens; only growth comes from the pool. (A page-level policy that
    // evicts more than asked only needs fewer.)
    const int64_t kept = layer.size() - plan.evict;
    pages_needed += std::max<int64_t>(
        0, CeilDiv(kept + n - plan.drop, layout_.page_tokens) -
               static_cast<int64_t>(layer.pages.size()));
    copies += CopyBound(layer, plan.evict, n - plan.drop);
  }
  // Pages first, all or nothing, so a full pool changes nothing.
  std::vector<PageId>& new_pages = new_pages_;
  new_pages.clear();
  absl::Status s = ReserveCopies(copies);
  if (s.ok()) s = AllocatePages(pages_needed, &new_pages);
  if (!s.ok()) {
    ReleaseSpare();
    return absl::Status(s.code(), SessionMessage(id_, "append of ", n,
                                                 " tokens: ", s.message()));
  }

  ResetResult(result);
  size_t next_page = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    const AppendPlan& plan = plans[l];
    LayerChange& change = result.layers[l];
    Evict(layer, plan.evict, plan.appended_view, n - plan.drop, change);

    const int64_t first = layer.size();
    const int64_t size = first + n - plan.drop;
    const int64_t pages_wanted = CeilDiv(size, layout_.page_tokens);
    MakeSlotsWritable(layer, first, size, change);
    while (static_cast<int64_t>(layer.pages.size()) < pages_wanted) {
      layer.pages.push_back(new_pages[next_page]);
      change.pages_added.push_back(new_pages[next_page]);
      ++next_page;
    }
    // The kept tokens are two runs around the ones dropped on arrival:
    // [0, drop_begin) and [drop_begin + drop, n).
    const LayerKv& kv = request.layers[l];
    const int64_t tail = plan.drop_begin + plan.drop;
    // kivi_int4 writes values only here: its keys go into the pages' key
    // blocks (AppendKiviKeys).
    const std::byte* keys = kivi_ != nullptr ? nullptr : kv.keys.data();
    batch_.AddWrite(layer.pages, first, plan.drop_begin, keys,
                    kv.values.data());
    batch_.AddWrite(layer.pages, first + plan.drop_begin, n - tail,
                    keys == nullptr ? nullptr : keys + tail * token_bytes,
                    kv.values.data() + tail * token_bytes);
    if (kivi_ != nullptr) AppendKiviKeys(l, plan, kv, n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t arrival = layer.appended++;
      if (i >= plan.drop_begin && i < tail) {
        change.evicted_positions.push_back(request.positions[i]);
        continue;
      }
      layer.position.push_back(request.positions[i]);
      layer.arrival.push_back(arrival);
    }
    work_.evicted_tokens += plan.drop;
    layer.score.resize(size);
    if (policy_->uses_history()) layer.history.resize(size);
    policy_->OnAppend(Tokens(layer), first);
    ++layer.version;
    std::sort(change.evicted_positions.begin(), change.evicted_positions.end());
    change.version = layer.version;
    change.resident = layer.size();
  }
  // Pages were reserved for the worst case; return any the layers did not
  // take (a page-level eviction can free more than planned).
  if (next_page < new_pages.size()) {
    FreePages(std::span<const PageId>(new_pages).subspan(next_page));
  }
  last_position_ = request.positions[n - 1];
  return absl::OkStatus();
}

absl::Status Session::CheckLayerIndex(int32_t layer) const {
  if (layer < 0 || layer >= layout_.num_layers) {
    return absl::InvalidArgumentError(SessionMessage(
        id_, "layer ", layer, " is outside [0, ", layout_.num_layers, ")"));
  }
  return absl::OkStatus();
}

ScoreInputShape Session::InputShape(int64_t resident) const {
  return ScoreInputShape{layout_.query_heads, layout_.head_dim, resident};
}

absl::Status Session::PrepareAttention(std::span<const LayerScores> scores,
                                       int64_t growth,
                                       std::vector<float>& rows_out,
                                       std::vector<const float*>& rows) {
  const ScopedTimer timer(&work_.scoring_time);
  // Shapes, versions and duplicates first: they are cheap and fail fast.
  std::vector<uint8_t>& seen = ThreadScratch().seen;
  seen.assign(layers_.size(), 0);
  std::vector<int64_t>& offsets = ThreadScratch().offsets;
  int64_t total = 0;
  offsets.clear();
  for (const LayerScores& in : scores) {
    if (absl::Status s = CheckLayerIndex(in.layer); !s.ok()) return s;
    if (std::exchange(seen[in.layer], 1) != 0) {
      return absl::InvalidArgumentError(SessionMessage(
          id_, "layer ", in.layer, " appears twice in one step"));
    }
    const Layer& layer = layers_[in.layer];
    if (in.version != layer.version) {
      return absl::FailedPreconditionError(SessionMessage(
          id_, "stale version for layer ", in.layer,
          ": attention was computed at version ", in.version,
          ", the layer is at version ", layer.version,
          " (its slots changed since; recompute over the current block "
          "table)"));
    }
    if (growth > 0 && Excess(layer) > 0) {
      return absl::FailedPreconditionError(SessionMessage(
          id_, "layer ", in.layer, " is over budget (its last ",
          "scores never came), so appending would evict first and the step's "
          "attention would not match the slots; send scores without an "
          "append"));
    }
    const int64_t n = layer.size() + growth;
    if (in.source == ScoreSource::kQueries && layout_.keys_pre_rope) {
      return absl::FailedPreconditionError(SessionMessage(
          id_, "layout '", layout_.name,
          "' stores keys before RoPE, so the store cannot score queries "
          "against them; send attention probabilities"));
    }
    if (absl::Status s = CheckScoreShape(in, InputShape(n)); !s.ok()) {
      return InSession(id_, s);
    }
    // Head-reduced rows are used where they lie; the rest need scratch.
    offsets.push_back(total);
    if (in.source != ScoreSource::kReduced) total += int64_t{in.rows} * n;
  }

  rows_out.resize(total);
  rows.clear();
  for (size_t i = 0; i < scores.size(); ++i) {
    const LayerScores& in = scores[i];
    Layer& layer = layers_[in.layer];
    const int64_t n = layer.size() + growth;
    float* out = rows_out.data() + offsets[i];
    rows.push_back(in.source == ScoreSource::kReduced ? in.data.data() : out);
    absl::Status s;
    if (FusedScores(in)) {
      // Checked and added in one read of the rows, into scratch: a later
      // layer's failure leaves every layer's scores as they were.
      layer.next_score.resize(n);
      s = CheckProbabilityRows(
          in, InputShape(n),
          AccumulateCheckedRows(in.data.data(), in.rows, n, layer.score.data(),
                                layer.size(), layer.next_score.data()));
    } else {
      // Per-head rows are summed into `out` as they are checked.
      const std::span<float> head_sums(
          out, in.source == ScoreSource::kPerHead ? int64_t{in.rows} * n : 0);
      s = CheckScoreValues(in, InputShape(n), head_sums);
    }
    if (!s.ok()) return InSession(id_, s);
    if (in.source == ScoreSource::kQueries) {
      // Query row r belongs to the token that arrived (rows - 1 - r) before
      // the newest; those tokens must be resident (an append's new tokens
      // will be: the layer is not over budget).
      const int64_t oldest = layer.appended + growth - in.rows;
      int64_t found = std::min<int64_t>(growth, in.rows);
      for (int64_t a : layer.arrival) found += a >= oldest ? 1 : 0;
      if (found != in.rows) {
        return absl::FailedPreconditionError(
            SessionMessage(id_, "layer ", in.layer, ": ", in.rows,
                           " query rows need the last ", in.rows,
                           " appended tokens resident; ", found, " are"));
      }
    }
  }
  return absl::OkStatus();
}

void Session::FinishAttention(std::span<const LayerScores> scores,
                              std::vector<const float*>& rows) {
  const ScopedTimer timer(&work_.scoring_time);
  std::vector<int64_t>& row_order = ThreadScratch().row_order;
  bool scoring = false;
  for (size_t i = 0; i < scores.size(); ++i) {
    const LayerScores& in = scores[i];
    if (in.source != ScoreSource::kQueries) continue;
    const Layer& layer = layers_[in.layer];
    row_order.resize(in.rows);
    for (int32_t r = 0; r < in.rows; ++r) {
      row_order[r] = layer.appended - in.rows + r;
    }
    // One row is the newest token's, which sees every resident slot: no
    // causal order to stage.
    const std::span<const int64_t> order =
        in.rows == 1 ? std::span<const int64_t>() : layer.arrival;
    batch_.AddScoring(layer.pages, order, layer.size(), in.data.data(),
                      row_order, layout_.query_heads,
                      const_cast<float*>(rows[i]));
    scoring = true;
  }
  // The policies need the rows now: run the step's device work so far (an
  // append's moves and writes, then the scoring) as one batch.
  if (!scoring) return;
  RunBatch();
  for (size_t i = 0; i < scores.size(); ++i) {
    if (scores[i].source != ScoreSource::kQueries) continue;
    ZeroNonFiniteRows(const_cast<float*>(rows[i]), scores[i].rows,
                      layers_[scores[i].layer].size());
  }
}

void Session::ApplyAttention(std::span<const LayerScores> scores,
                             std::span<const float* const> rows, bool compress,
                             StepResult& result) {
  // Its evictions' moves run after the append's writes of this call.
  batch_.NextStage();
  ResetResult(result);
  for (size_t i = 0; i < scores.size(); ++i) {
    Layer& layer = layers_[scores[i].layer];
    const StepAttention step{rows[i], scores[i].rows, layer.size(),
                             layout_.query_heads};
    if (FusedScores(scores[i])) {
      // PrepareAttention wrote the new scores (for the slots after this
      // step's append, which put its tokens at the end).
      layer.score.swap(layer.next_score);
    } else {
      const ScopedTimer timer(&work_.scoring_time);
      policy_->Observe(Tokens(layer), step);
    }
    ++work_.score_updates;
    const int64_t excess =
        compress ? std::max<int64_t>(0, layer.size() - layer.budget)
                 : Excess(layer);
    LayerChange& change = result.layers[scores[i].layer];
    Evict(layer, excess, layer.appended, /*incoming=*/0, change);
    std::sort(change.evicted_positions.begin(), change.evicted_positions.end());
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    result.layers[l].version = layers_[l].version;
    result.layers[l].resident = layers_[l].size();
  }
  if (compress) compressed_ = true;
  RunBatch();
}

absl::StatusOr<StepOutcome> Session::Step(const AppendRequest& append,
                                          std::span<const LayerScores> scores) {
  StepOutcome outcome;
  if (absl::Status s = Step(append, scores, outcome); !s.ok()) return s;
  return outcome;
}

absl::Status Session::Step(const AppendRequest& append,
                           std::span<const LayerScores> scores,
                           StepOutcome& out) {
  if (append.positions.empty()) {
    ResetResult(out.append);
    return ScoresInto(scores, out.scores);
  }
  if (!scores.empty() && policy_->trigger() != EvictionTrigger::kOnAttention) {
    return absl::FailedPreconditionError(
        SessionMessage(id_, "policy '", policy_->name(),
                       "' does not use per-step attention scores"));
  }
  // Everything that can fail is checked before the append, so a refused step
  // changes nothing.
  if (!device_error_.ok()) return device_error_;
  if (absl::Status s = ValidateAppend(append); !s.ok()) return s;
  absl::StatusOr<AppendRequest> stored =  // as Append
      StoredForm(quantizer_, layout_, id_, append);
  if (!stored.ok()) return stored.status();
  AttentionScratch& scratch = ThreadScratch();
  const int64_t growth = static_cast<int64_t>(append.positions.size());
  if (absl::Status s =
          PrepareAttention(scores, growth, scratch.rows, scratch.row_ptrs);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReserveCopies(AttentionCopyBound(scores, growth, /*compress=*/false));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ApplyAppend(*stored, out.append); !s.ok()) return s;
  FinishAttention(scores, scratch.row_ptrs);
  ApplyAttention(scores, scratch.row_ptrs, /*compress=*/false, out.scores);
  ReleaseSpare();
  return device_error_;
}

absl::StatusOr<StepResult> Session::UpdateScores(
    std::span<const LayerScores> scores) {
  StepResult result;
  if (absl::Status s = ScoresInto(scores, result); !s.ok()) return s;
  return result;
}

absl::Status Session::ScoresInto(std::span<const LayerScores> scores,
                                 StepResult& result) {
  if (policy_->trigger() != EvictionTrigger::kOnAttention) {
    return absl::FailedPreconditionError(
        SessionMessage(id_, "policy '", policy_->name(),
                       "' does not use per-step attention scores"));
  }
  if (!device_error_.ok()) return device_error_;
  AttentionScratch& scratch = ThreadScratch();
  if (absl::Status s = PrepareAttention(scores, /*growth=*/0, scratch.rows,
                                        scratch.row_ptrs);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReserveCopies(
          AttentionCopyBound(scores, /*growth=*/0, /*compress=*/false));
      !s.ok()) {
    return s;
  }
  FinishAttention(scores, scratch.row_ptrs);
  ApplyAttention(scores, scratch.row_ptrs, /*compress=*/false, result);
  ReleaseSpare();
  return device_error_;
}

absl::StatusOr<StepResult> Session::CompressPrompt(
    std::span<const LayerScores> window) {
  if (policy_->trigger() != EvictionTrigger::kOnCompress) {
    return absl::FailedPreconditionError(
        SessionMessage(id_, "policy '", policy_->name(),
                       "' does not compress prompts (use snapkv)"));
  }
  if (compressed_) {
    return absl::FailedPreconditionError(
        SessionMessage(id_, "the prompt was already compressed"));
  }
  if (window.size() != layers_.size()) {
    return absl::InvalidArgumentError(
        SessionMessage(id_,
                       "compression is one-shot and needs the "
                       "window of every layer once: got ",
                       window.size(), " of ", layers_.size(), " layers"));
  }
  const int64_t window_rows = policy_->common().recent;
  for (const LayerScores& in : window) {
    if (in.rows != window_rows) {
      return absl::InvalidArgumentError(SessionMessage(
          id_, "layer ", in.layer, ": compression needs the ", window_rows,
          " rows of the observation window, got ", in.rows));
    }
  }
  if (!device_error_.ok()) return device_error_;
  AttentionScratch& scratch = ThreadScratch();
  if (absl::Status s = PrepareAttention(window, /*growth=*/0, scratch.rows,
                                        scratch.row_ptrs);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReserveCopies(
          AttentionCopyBound(window, /*growth=*/0, /*compress=*/true));
      !s.ok()) {
    return s;
  }
  FinishAttention(window, scratch.row_ptrs);
  StepResult result;
  ApplyAttention(window, scratch.row_ptrs, /*compress=*/true, result);
  ReleaseSpare();
  return AfterDevice(absl::StatusOr<StepResult>(std::move(result)));
}

absl::StatusOr<BlockTable> Session::GetBlockTable(int32_t index) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  const Layer& layer = layers_[index];
  BlockTable table;
  table.layer = index;
  table.version = layer.version;
  table.page_tokens = layout_.page_tokens;
  table.pages = layer.pages;
  table.positions = layer.position;
  std::vector<int32_t> order(layer.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return layer.position[a] < layer.position[b];
  });
  table.cache_positions.resize(layer.size());
  for (size_t rank = 0; rank < order.size(); ++rank) {
    table.cache_positions[order[rank]] = static_cast<int64_t>(rank);
  }
  return table;
}

absl::StatusOr<LayerKvCopy> Session::ReadLayer(int32_t index) const {
  if (absl::Status s = CheckLayerIndex(index); !s.ok()) return s;
  if (kivi_ != nullptr) {
    return absl::InvalidArgumentError(SessionMessage(
        id_,
        "kivi_int4 keys are per-page blocks, not token records: read "
        "them as f32, f16 or bf16"));
  }
  const Layer& layer = layers_[index];
  const int64_t token_bytes = page_layout_.token_bytes();
  LayerKvCopy copy;
  copy.version = layer.version;
  copy.positions = layer.position;
  copy.dtype = layout_.dtype;
  copy.keys.resize(layer.size() * token_bytes);
  copy.values.resize(layer.size() * token_bytes);
  if (absl::Status s =
          ReadSlots(index, 0, layer.size(), copy.keys, copy.values);
      !s.ok()) {
    return s;
  }
  return copy;
}

SessionStats Session::stats() const {
  SessionStats s;
  s.id = id_;
  s.layout = layout_.name;
  s.policy = std::string(policy_->name());
  for (const Layer& layer : layers_) {
    s.resident_tokens += layer.size();
    s.pages += static_cast<int64_t>(layer.pages.size());
    if (may_share_) s.shared_pages += pool_->CountShared(layer.pages);
    s.layer_resident.push_back(layer.size());
    s.layer_budget.push_back(layer.budget);
    s.layer_version.push_back(layer.version);
  }
  s.bytes = s.pages * page_layout_.page_bytes() +
            (kivi_ != nullptr ? kivi_->staging_bytes() : 0);
  s.evicted_tokens = work_.evicted_tokens;
  s.evicted_score = work_.evicted_score;
  s.score_updates = work_.score_updates;
  s.compressed = compressed_;
  return s;
}

}  // namespace kvkeep
