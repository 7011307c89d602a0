#include "cache_store/page_pool.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace kvkeep {
namespace {
constexpr OwnerId kFree = std::numeric_limits<OwnerId>::max();

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
  owner_of_.assign(capacity_pages, kFree);
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
    owner_of_[p] = owner;
    pages->push_back(p);
  }
  held_[owner] += n;
  return absl::OkStatus();
}

void PagePool::Free(OwnerId owner, std::span<const PageId> pages) {
  if (pages.empty()) return;
  absl::MutexLock lock(&mu_);
  int64_t freed = 0;
  for (PageId p : pages) {
    if (p < 0 || p >= capacity_pages_ || owner_of_[p] != owner) {
      ++rejected_frees_;
      continue;
    }
    owner_of_[p] = kFree;
    free_.push_back(p);
    ++freed;
  }
  if (freed == 0) return;
  auto it = held_.find(owner);
  it->second -= freed;
  if (it->second == 0) held_.erase(it);
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
                   allocation_failures_,
                   rejected_frees_};
}

}  // namespace kvkeep
