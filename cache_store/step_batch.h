// StepBatch: the page-memory work of one session call (a decode step, an
// append, a score update) for every layer, recorded by the session and run by
// PageMemory::RunStep as one batch. The CUDA memory stages a batch with one
// upload, launches it (compaction moves of every layer in one launch) and
// waits for its stream once; the host memory runs the CPU twins in the same
// order. Either way a batch is done, outputs written and bytes moved, when
// RunStep returns.
//
// A batch is a sequence of stages (NextStage starts one). Within a stage,
// every whole-page copy runs first (copy-on-write of a page a forked session
// shares, before anything writes into the copy), then every compaction move,
// then every write of new tokens, then every query scoring, which sees the
// bytes the copies, moves and writes left. The entries of one kind in one
// stage must touch disjoint slots (in practice: one entry per layer, and
// layers never write a page another holder can see).
//
// Ownership: block tables, moves and row orders are copied when recorded
// (the session changes its tables while it records a step); every other
// pointer (keys, values, queries, slot orders, outputs) is borrowed and must
// stay valid and unchanged until RunStep returns.
//
// Not thread-safe: one session records and runs it. Clear keeps the capacity,
// so a session reusing its batch allocates nothing in steady state.
#ifndef KVKEEP_CACHE_STORE_STEP_BATCH_H_
#define KVKEEP_CACHE_STORE_STEP_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/compaction.h"
#include "kernels/page_layout.h"

namespace kvkeep {

class StepBatch {
 public:
  // [offset, offset + size) of one of the batch's own arrays.
  struct Range {
    size_t offset = 0;
    size_t size = 0;
  };
  // MoveSlotBytes (kernels/compaction.h) of one layer: moves as
  // PlanCompaction gives them (sources at or above the new end, targets
  // below it), so they are independent and may run in parallel.
  // A whole page's bytes (keys, values and any scales) from `from` to `to`.
  struct PageCopy {
    int32_t stage = 0;
    PageId from = 0;
    PageId to = 0;
  };
  struct Moves {
    int32_t stage = 0;
    Range pages;  // the layer's block table when the moves were planned
    Range moves;
  };
  // WriteSlotBytes (kernels/slot_copy.h): tokens [0, n) of keys and values
  // ([n][kv_heads][head_dim] of the layout's dtype) into slots
  // [first, first + n) of `pages`. Only the pages the slots need are kept,
  // so `first` counts from the first of them.
  struct Write {
    int32_t stage = 0;
    Range pages;
    int64_t first = 0;
    int64_t n = 0;
    const std::byte* keys = nullptr;
    const std::byte* values = nullptr;
  };
  // A kivi_int4 page's whole key block (layout.key_block_bytes() at `block`,
  // borrowed) written over page `page`'s, after the stage's writes.
  struct KeyBlock {
    int32_t stage = 0;
    PageId page = 0;
    const std::byte* block = nullptr;
  };
  // QueryAttention (kernels/attention.h) over `slots` slots of `pages`:
  // queries [rows][query_heads][head_dim] f32 in, out [rows][slots] f32 out.
  // `order` is null when every slot is visible to every row.
  struct Scoring {
    int32_t stage = 0;
    Range pages;
    const int64_t* order = nullptr;  // [slots], or null
    int64_t slots = 0;
    const float* queries = nullptr;
    Range row_order;  // [rows]
    int32_t rows = 0;
    int32_t query_heads = 0;
    float* out = nullptr;
  };

  explicit StepBatch(const PageLayout& layout) : layout_(layout) {}

  const PageLayout& layout() const { return layout_; }

  // Ends the current stage: entries recorded from now on run after every
  // entry recorded before.
  void NextStage() {
    if (!empty()) ++stage_;
  }
  // Records a copy of page `from` over page `to` (two distinct pages).
  void AddPageCopy(PageId from, PageId to);
  // Records a layer's compaction moves (nothing when `moves` is empty).
  // `pages` is the block table the moves' slots refer to.
  void AddMoves(std::span<const PageId> pages, std::span<const SlotMove> moves);
  // Records a write of n tokens into slots [first, first + n) of the layer
  // whose block table is `pages` (nothing when n <= 0).
  void AddWrite(std::span<const PageId> pages, int64_t first, int64_t n,
                const std::byte* keys, const std::byte* values);
  // Records a key block write (kivi_int4).
  void AddKeyBlock(PageId page, const std::byte* block) {
    key_blocks_.push_back(KeyBlock{stage_, page, block});
  }
  // Records query scoring of `rows` queries against the first `slots` slots
  // of `pages`; row_order [rows] is each query's causal order, `order` the
  // slots' (empty: every slot visible to every row). Nothing when rows or
  // slots is 0.
  void AddScoring(std::span<const PageId> pages, std::span<const int64_t> order,
                  int64_t slots, const float* queries,
                  std::span<const int64_t> row_order, int32_t query_heads,
                  float* out);

  // Forgets every entry; keeps the capacity.
  void Clear();
  bool empty() const {
    return copies_.empty() && moves_.empty() && writes_.empty() &&
           key_blocks_.empty() && scorings_.empty();
  }
  // Stages recorded so far: entries have stage in [0, stages()).
  int32_t stages() const { return empty() ? 0 : stage_ + 1; }

  // The entries, each in the order recorded (so by stage).
  std::span<const PageCopy> copies() const { return copies_; }
  std::span<const Moves> moves() const { return moves_; }
  std::span<const Write> writes() const { return writes_; }
  std::span<const KeyBlock> key_blocks() const { return key_blocks_; }
  std::span<const Scoring> scorings() const { return scorings_; }
  std::span<const PageId> pages(Range r) const {
    return std::span<const PageId>(page_ids_).subspan(r.offset, r.size);
  }
  std::span<const SlotMove> slot_moves(Range r) const {
    return std::span<const SlotMove>(slot_moves_).subspan(r.offset, r.size);
  }
  std::span<const int64_t> row_order(Range r) const {
    return std::span<const int64_t>(row_orders_).subspan(r.offset, r.size);
  }

 private:
  Range CopyPages(std::span<const PageId> pages);

  const PageLayout layout_;
  int32_t stage_ = 0;
  std::vector<PageCopy> copies_;
  std::vector<Moves> moves_;
  std::vector<Write> writes_;
  std::vector<KeyBlock> key_blocks_;
  std::vector<Scoring> scorings_;
  std::vector<PageId> page_ids_;
  std::vector<SlotMove> slot_moves_;
  std::vector<int64_t> row_orders_;
};

// Runs `batch` over a host arena with the CPU twins: stage by stage, page
// copies (CopyPageBytes), moves (MoveSlotBytes), then writes
// (WriteSlotBytes), then key blocks, then scorings (QueryAttention). The host
// PageMemory's RunStep, and the reference the CUDA memory's is tested against.
void RunStepOnHost(std::byte* arena, const StepBatch& batch);

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_STEP_BATCH_H_
