// PagePool hands out the fixed-size pages of one arena, and accounts for them
// per owner (a session). Allocation and release are O(1) per page; a request
// for n pages is all or nothing. The pool never over-commits: when pages run
// out, Allocate returns RESOURCE_EXHAUSTED and changes nothing.
//
// A page may have several holders (forked sessions share their parent's
// pages copy-on-write: Share). Each page keeps the list of its holders, so
// its reference count is exact and a free by an owner that does not hold it
// is refused; the page returns to the free list when its last holder frees
// it. A page with more than one holder is read-only by contract: a holder
// that wants to write it copies it to a page of its own first (Session does;
// the pool only counts). Nothing but Share adds a holder, and only a holder
// may share, so a page with one holder stays unshared until that holder
// shares it.
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
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/page_memory.h"
#include "kernels/page_layout.h"

namespace kvkeep {

using OwnerId = uint64_t;

struct PoolStats {
  int64_t capacity_pages = 0;
  int64_t used_pages = 0;  // physical pages in use, each counted once
  int64_t page_bytes = 0;
  int64_t owners = 0;  // owners holding at least one page
  // Pages with more than one holder, and holdings summed over every page
  // (used_pages when nothing is shared): page_references - used_pages pages
  // are what sharing saves.
  int64_t shared_pages = 0;
  int64_t page_references = 0;
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

  // Makes `holder` a holder of each of `pages`, all of which `from` holds:
  // all or nothing. INVALID_ARGUMENT when holder == from, a page is out of
  // range, not held by `from`, already held by `holder`, or named twice.
  [[nodiscard]] absl::Status Share(OwnerId from, OwnerId holder,
                                   std::span<const PageId> pages);

  // Lets go of pages held by owner; a page goes back to the free list when
  // its last holder lets go. Returns how many did (the pages the pool got
  // back). A page the owner does not hold (a bug in the caller) is left
  // alone, so it can never be handed out twice; the count of such pages is
  // PoolStats::rejected_frees.
  int64_t Free(OwnerId owner, std::span<const PageId> pages);

  // Holders of page p: 0 when free, more than 1 when shared. Stable while
  // the caller is p's only holder (nobody else can share it).
  int32_t Holders(PageId p) const;
  // How many of `pages` have more than one holder (one lock for all).
  int64_t CountShared(std::span<const PageId> pages) const;

  // Pages owner holds, shared ones included.
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
  // Per page: its holders (empty when free), in the order they came.
  std::vector<absl::InlinedVector<OwnerId, 1>> holders_ ABSL_GUARDED_BY(mu_);
  int64_t shared_pages_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t page_references_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocation_failures_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rejected_frees_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_PAGE_POOL_H_
