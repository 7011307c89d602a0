#include "cache_store/step_batch.h"

#include <cstring>
#include <vector>

#include "kernels/attention.h"
#include "kernels/slot_copy.h"

namespace kvkeep {

StepBatch::Range StepBatch::CopyPages(std::span<const PageId> pages) {
  const Range r{page_ids_.size(), pages.size()};
  page_ids_.insert(page_ids_.end(), pages.begin(), pages.end());
  return r;
}

void StepBatch::AddPageCopy(PageId from, PageId to) {
  copies_.push_back(PageCopy{stage_, from, to});
}

void StepBatch::AddMoves(std::span<const PageId> pages,
                         std::span<const SlotMove> moves) {
  if (moves.empty()) return;
  Moves m;
  m.stage = stage_;
  m.pages = CopyPages(pages);
  m.moves = Range{slot_moves_.size(), moves.size()};
  slot_moves_.insert(slot_moves_.end(), moves.begin(), moves.end());
  moves_.push_back(m);
}

void StepBatch::AddWrite(std::span<const PageId> pages, int64_t first,
                         int64_t n, const std::byte* keys,
                         const std::byte* values) {
  if (n <= 0) return;
  const int64_t p = layout_.page_tokens;
  const int64_t first_page = first / p;
  const int64_t last_page = (first + n - 1) / p;
  Write w;
  w.stage = stage_;
  w.pages = CopyPages(pages.subspan(first_page, last_page - first_page + 1));
  w.first = first - first_page * p;
  w.n = n;
  w.keys = keys;
  w.values = values;
  writes_.push_back(w);
}

void StepBatch::AddScoring(std::span<const PageId> pages,
                           std::span<const int64_t> order, int64_t slots,
                           const float* queries,
                           std::span<const int64_t> row_order,
                           int32_t query_heads, float* out) {
  if (row_order.empty() || slots <= 0) return;
  const int64_t p = layout_.page_tokens;
  Scoring s;
  s.stage = stage_;
  s.pages = CopyPages(pages.first((slots + p - 1) / p));
  s.order = order.empty() ? nullptr : order.data();
  s.slots = slots;
  s.queries = queries;
  s.row_order = Range{row_orders_.size(), row_order.size()};
  row_orders_.insert(row_orders_.end(), row_order.begin(), row_order.end());
  s.rows = static_cast<int32_t>(row_order.size());
  s.query_heads = query_heads;
  s.out = out;
  scorings_.push_back(s);
}

void StepBatch::Clear() {
  stage_ = 0;
  copies_.clear();
  moves_.clear();
  writes_.clear();
  key_blocks_.clear();
  scorings_.clear();
  page_ids_.clear();
  slot_moves_.clear();
  row_orders_.clear();
}

void RunStepOnHost(std::byte* arena, const StepBatch& batch) {
  const PageLayout& layout = batch.layout();
  // Reused per thread: the logits of one row, every query head.
  thread_local std::vector<float> scratch;
  size_t c = 0, m = 0, w = 0, k = 0, s = 0;
  for (int32_t stage = 0; stage < batch.stages(); ++stage) {
    for (; c < batch.copies().size() && batch.copies()[c].stage == stage; ++c) {
      CopyPageBytes(arena, layout, batch.copies()[c].from,
                    batch.copies()[c].to);
    }
    for (; m < batch.moves().size() && batch.moves()[m].stage == stage; ++m) {
      const StepBatch::Moves& e = batch.moves()[m];
      MoveSlotBytes(arena, layout, batch.pages(e.pages),
                    batch.slot_moves(e.moves));
    }
    for (; w < batch.writes().size() && batch.writes()[w].stage == stage; ++w) {
      const StepBatch::Write& e = batch.writes()[w];
      WriteSlotBytes(arena, layout, batch.pages(e.pages).data(), e.first, e.n,
                     e.keys, e.values);
    }
    for (;
         k < batch.key_blocks().size() && batch.key_blocks()[k].stage == stage;
         ++k) {
      const StepBatch::KeyBlock& e = batch.key_blocks()[k];
      WriteKeyBlockBytes(arena, layout, &e.page, 1, e.block);
    }
    for (; s < batch.scorings().size() && batch.scorings()[s].stage == stage;
         ++s) {
      const StepBatch::Scoring& e = batch.scorings()[s];
      scratch.resize(static_cast<size_t>(int64_t{e.query_heads} * e.slots +
                                         layout.head_dim));
      const std::span<const int64_t> order(
          e.order, e.order == nullptr ? 0 : static_cast<size_t>(e.slots));
      const PagedKeys keys{arena, layout, batch.pages(e.pages), order, e.slots};
      QueryAttention(keys, e.queries, batch.row_order(e.row_order).data(),
                     e.rows, e.query_heads, e.out, scratch.data());
    }
  }
}

}  // namespace kvkeep
