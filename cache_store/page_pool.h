// PagePool hands out the fixed-size pages of one arena, and accounts for them
// per owner (a session). Allocation and release are O(1) per page; a request
// for n pages is all or nothing. The pool never over-commits: when pages run
// out, Allocate returns RESOURCE_EXHAUSTED and changes nothing.
//
// The arena's bytes are owned by the pool, in its PageMemory (host memory or
// a GPU); a page's bytes belong to whoever holds the page, who reads and
// writes them through memory(). Thread-safe.
#ifndef KVKEEP_CACHE_STORE_PAGE_POOL_H_
#define KVKEEP_CACHE_STORE_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/page_memory.h"
#include "kernels/page_layout.h"

namespace kvkeep {

using OwnerId = uint64_t;

struct PoolStats {
  int64_t capacity_pages = 0;
  int64_t used_pages = 0;
  int64_t page_bytes = 0;
  int64_t owners = 0;               // owners holding at least one page
  int64_t allocation_failures = 0;  // RESOURCE_EXHAUSTED answers so far
  int64_t rejected_frees = 0;       // pages freed by an owner not holding them
};

class PagePool {
 public:
  // Reserves capacity_pages * layout.page_bytes() bytes on `device` (host
  // memory by default); see NewPageMemory for `shareable` and the errors.
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(
      const PageLayout& layout, int64_t capacity_pages, Device device = {},
      bool shareable = false);

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Appends n pages to *pages and charges them to owner, or returns
  // RESOURCE_EXHAUSTED (naming the shortfall) and changes nothing. n < 0 is
  // INVALID_ARGUMENT.
  [[nodiscard]] absl::Status Allocate(OwnerId owner, int64_t n,
                                      std::vector<PageId>* pages);

  // Returns pages held by owner. A page the owner does not hold (a bug in
  // the caller) is left alone, so it can never be handed out twice; the
  // count of such pages is PoolStats::rejected_frees.
  void Free(OwnerId owner, std::span<const PageId> pages);

  int64_t PagesHeldBy(OwnerId owner) const;
  PoolStats stats() const;

  const PageLayout& layout() const { return layout_; }
  int64_t capacity_pages() const { return capacity_pages_; }
  // The arena. Bytes of page p: [p * page_bytes, (p + 1) * page_bytes).
  PageMemory& memory() const { return *memory_; }
  // The arena when it is in host memory (null for a GPU pool).
  std::byte* data() { return memory_->host_data(); }
  const std::byte* data() const { return memory_->host_data(); }

 private:
  PagePool(const PageLayout& layout, int64_t capacity_pages,
           std::unique_ptr<PageMemory> memory);

  const PageLayout layout_;
  const int64_t capacity_pages_;
  const std::unique_ptr<PageMemory> memory_;

  mutable absl::Mutex mu_;
  std::vector<PageId> free_ ABSL_GUARDED_BY(mu_);  // a stack of free pages
  absl::flat_hash_map<OwnerId, int64_t> held_ ABSL_GUARDED_BY(mu_);
  std::vector<OwnerId> owner_of_ ABSL_GUARDED_BY(mu_);  // per page
  int64_t allocation_failures_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rejected_frees_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_PAGE_POOL_H_
