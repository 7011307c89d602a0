#include "cache_store/page_pool.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvkeep {
namespace {

bool Holds(const absl::InlinedVector<OwnerId, 1>& holders, OwnerId owner) {
  return std::find(holders.begin(), holders.end(), owner) != holders.end();
}

absl::StatusOr<std::unique_ptr<PageMemory>> CheckedFor(
    const PageLayout& layout, std::unique_ptr<PageMemory> memory) {
  if (absl::Status s = memory->CheckLayout(layout); !s.ok()) return s;
  return memory;
}
}  // namespace

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(
    const PageLayout& layout, int64_t capacity_pages, Device device,
    bool shareable) {
  if (capacity_pages <= 0 ||
      capacity_pages > std::numeric_limits<PageId>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool capacity must be in [1, 2^31) pages, got ", capacity_pages));
  }
  if (layout.page_bytes() <= 0) {
    return absl::InvalidArgumentError("page layout has no bytes");
  }
  const int64_t bytes = capacity_pages * layout.page_bytes();
  absl::StatusOr<std::unique_ptr<PageMemory>> memory =
      NewPageMemory(device, bytes, shareable);
  if (memory.ok()) memory = CheckedFor(layout, *std::move(memory));
  if (!memory.ok()) {
    return absl::Status(memory.status().code(),
                        absl::StrCat("a pool of ", capacity_pages, " pages (",
                                     bytes, " bytes) on ", device.name(), ": ",
                                     memory.status().message()));
  }
  return std::unique_ptr<PagePool>(
      new PagePool(layout, capacity_pages, *std::move(memory)));
}

PagePool::PagePool(const PageLayout& layout, int64_t capacity_pages,
                   std::unique_ptr<PageMemory> memory)
    : layout_(layout),
      capacity_pages_(capacity_pages),
      memory_(std::move(memory)) {
  absl::MutexLock lock(&mu_);
  free_.reserve(capacity_pages);
  // Lowest ids on top, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t p = capacity_pages - 1; p >= 0; --p) {
    free_.push_back(static_cast<PageId>(p));
  }
  holders_.resize(capacity_pages);
}

absl::Status PagePool::Allocate(OwnerId owner, int64_t n,
                                std::vector<PageId>* pages) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate a negative number of pages (", n, ")"));
  }
  if (n == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  const int64_t available = static_cast<int64_t>(free_.size());
  if (n > available) {
    ++allocation_failures_;
    return absl::ResourceExhaustedError(
        absl::StrCat("page pool exhausted: need ", n, " pages, ", available,
                     " of ", capacity_pages_, " free"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const PageId p = free_.back();
    free_.pop_back();
    holders_[p].push_back(owner);
    pages->push_back(p);
  }
  held_[owner] += n;
  page_references_ += n;
  return absl::OkStatus();
}

absl::Status PagePool::Share(OwnerId from, OwnerId holder,
                             std::span<const PageId> pages) {
  if (from == holder) {
    return absl::InvalidArgumentError(
        "an owner cannot share pages with itself");
  }
  if (pages.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<PageId> seen;
  seen.reserve(pages.size());
  for (PageId p : pages) {
    if (p < 0 || p >= capacity_pages_ || !Holds(holders_[p], from) ||
        Holds(holders_[p], holder) || !seen.insert(p).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page ", p,
          " cannot be shared: it is not held by the owner sharing "
          "it, is already held by the new holder, or is named twice"));
    }
  }
  for (PageId p : pages) {
    if (holders_[p].size() == 1) ++shared_pages_;
    holders_[p].push_back(holder);
  }
  held_[holder] += static_cast<int64_t>(pages.size());
  page_references_ += static_cast<int64_t>(pages.size());
  return absl::OkStatus();
}

int64_t PagePool::Free(OwnerId owner, std::span<const PageId> pages) {
  if (pages.empty()) return 0;
  absl::MutexLock lock(&mu_);
  int64_t let_go = 0;
  int64_t returned = 0;
  for (PageId p : pages) {
    auto* holders = p >= 0 && p < capacity_pages_ ? &holders_[p] : nullptr;
    auto it = holders == nullptr
                  ? nullptr
                  : std::find(holders->begin(), holders->end(), owner);
    if (holders == nullptr || it == holders->end()) {
      ++rejected_frees_;
      continue;
    }
    holders->erase(it);
    ++let_go;
    if (holders->size() == 1) --shared_pages_;
    if (holders->empty()) {
      free_.push_back(p);
      ++returned;
    }
  }
  page_references_ -= let_go;
  if (let_go == 0) return 0;
  auto held = held_.find(owner);
  held->second -= let_go;
  if (held->second == 0) held_.erase(held);
  return returned;
}

int32_t PagePool::Holders(PageId p) const {
  if (p < 0 || p >= capacity_pages_) return 0;
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(holders_[p].size());
}

int64_t PagePool::CountShared(std::span<const PageId> pages) const {
  absl::MutexLock lock(&mu_);
  int64_t shared = 0;
  for (PageId p : pages) {
    if (p >= 0 && p < capacity_pages_ && holders_[p].size() > 1) ++shared;
  }
  return shared;
}

int64_t PagePool::PagesHeldBy(OwnerId owner) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(owner);
  return it == held_.end() ? 0 : it->second;
}

PoolStats PagePool::stats() const {
  absl::MutexLock lock(&mu_);
  return PoolStats{capacity_pages_,
                   capacity_pages_ - static_cast<int64_t>(free_.size()),
                   layout_.page_bytes(),
                   static_cast<int64_t>(held_.size()),
                   shared_pages_,
                   page_references_,
                   allocation_failures_,
                   rejected_frees_};
}

}  // namespace kvkeep
