// Session's forks and copy-on-write (see session.h): Fork, the bound on the
// pages a call may copy, their reservation, and the copy of a shared page
// before the session writes into it.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_store/session.h"

namespace kvkeep {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Fork(
    SessionId child_id, PolicyPtr policy, std::vector<int64_t> layer_budgets,
    std::shared_ptr<PageQuota> quota) const {
  if (!device_error_.ok()) return device_error_;
  if (layer_budgets.empty()) {
    for (const Layer& layer : layers_) layer_budgets.push_back(layer.budget);
  }
  absl::StatusOr<std::unique_ptr<Session>> made =
      Create(child_id, layout_, pool_, policy != nullptr ? policy : policy_,
             std::move(layer_budgets), std::move(quota));
  if (!made.ok()) return made.status();
  Session& child = **made;
  std::vector<PageId> pages;
  for (const Layer& layer : layers_) {
    pages.insert(pages.end(), layer.pages.begin(), layer.pages.end());
  }
  if (absl::Status s = pool_->Share(id_, child_id, pages); !s.ok()) {
    return InSession(id_, s);
  }
  const bool history = child.policy_->uses_history();
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& from = layers_[l];
    Layer& to = child.layers_[l];
    to.pages = from.pages;
    to.position = from.position;
    to.arrival = from.arrival;
    to.score = from.score;
    // Another policy's history bits mean nothing to this one: they start
    // clear (a policy without history keeps none).
    if (history && policy_->uses_history()) {
      to.history = from.history;
    } else if (history) {
      to.history.assign(from.position.size(), 0);
    }
    to.appended = from.appended;
    to.version = from.version;
  }
  // kivi_int4: the open pages' staging goes with the shared pages, whose
  // key blocks it quantised (the child's quota was charged its bound).
  if (kivi_ != nullptr) child.kivi_->CopyStaging(*kivi_);
  child.last_position_ = last_position_;
  child.compressed_ = compressed_;
  child.may_share_ = true;
  may_share_ = true;
  return made;
}

int64_t Session::appended_tokens() const {
  int64_t appended = 0;
  for (const Layer& layer : layers_) {
    appended = std::max(appended, layer.appended);
  }
  return appended;
}

int64_t Session::CopyBound(const Layer& layer, int64_t evict,
                           int64_t incoming) const {
  if (!may_share_ || (evict <= 0 && incoming <= 0)) return 0;
  const int64_t p = layout_.page_tokens;
  const int64_t victims = evict > 0 ? evict + p - 1 : 0;
  int64_t written = 0;
  if (incoming > 0) {
    written =
        evict > 0 ? CeilDiv(incoming, p) + 1 : (layer.size() % p != 0 ? 1 : 0);
  }
  return std::min(pool_->CountShared(layer.pages), victims + written);
}

int64_t Session::AttentionCopyBound(std::span<const LayerScores> scores,
                                    int64_t growth, bool compress) const {
  if (!may_share_) return 0;
  int64_t bound = 0;
  for (const LayerScores& in : scores) {
    const Layer& layer = layers_[in.layer];
    const int64_t size = layer.size() + growth;
    int64_t excess = 0;
    if (compress) {
      excess = std::max<int64_t>(0, size - layer.budget);
    } else if (size > layer.budget) {
      excess = size - (layer.budget - policy_->common().slack);
    }
    bound += CopyBound(layer, excess, 0);
  }
  return bound;
}

absl::Status Session::ReserveCopies(int64_t n) {
  if (n <= 0) return absl::OkStatus();
  if (absl::Status s = AllocatePages(n, &spare_); !s.ok()) {
    return absl::Status(
        s.code(), SessionMessage(id_, "reserving ", n,
                                 " pages to copy shared pages before writing "
                                 "into them: ",
                                 s.message()));
  }
  return absl::OkStatus();
}

void Session::MakeWritable(Layer& layer, int64_t index, LayerChange& change) {
  const PageId shared = layer.pages[index];
  if (pool_->Holders(shared) <= 1) return;
  if (spare_.empty()) {
    // CopyBound reserved too few: a bug (the random streams of
    // tests/session_fork_test.cc would show it). Nothing of this call may
    // run (it would write a page others read), so the session stops here.
    batch_.Clear();
    device_error_ = absl::InternalError(SessionMessage(
        id_, "no page to copy shared page ", shared,
        " to before writing it; the session's state is unknown, close it"));
    return;
  }
  const PageId own = spare_.back();
  spare_.pop_back();
  batch_.AddPageCopy(shared, own);
  if (kivi_ != nullptr) {
    kivi_->PageCopied(shared, own);
  }
  layer.pages[index] = own;
  // The copy reads it: let go once the batch has run.
  pending_free_.push_back(shared);
  change.pages_copied.push_back(
      PageCopy{static_cast<int32_t>(index), shared, own});
  ++work_.pages_copied;
}

void Session::ReleaseSpare() {
  if (spare_.empty()) return;
  FreePages(spare_);
  spare_.clear();
}

void Session::MakeSlotsWritable(Layer& layer, int64_t first, int64_t end,
                                LayerChange& change) {
  if (!may_share_ || end <= first) return;
  // The new tokens go into pages the layer already has (its partly filled
  // page, pages kept from an eviction) and new ones (its own).
  const int64_t held = std::min(static_cast<int64_t>(layer.pages.size()),
                                CeilDiv(end, layout_.page_tokens));
  for (int64_t i = first / layout_.page_tokens; i < held; ++i) {
    MakeWritable(layer, i, change);
  }
}

}  // namespace kvkeep
