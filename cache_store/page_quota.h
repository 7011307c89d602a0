// PageQuota: a byte limit shared by several sessions (a tenant's), charged
// as sessions take pages from a pool and credited as they return them.
// Thread-safe.
#ifndef KVKEEP_CACHE_STORE_PAGE_QUOTA_H_
#define KVKEEP_CACHE_STORE_PAGE_QUOTA_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvkeep {

class PageQuota {
 public:
  // limit_bytes <= 0: unlimited (bytes are still counted).
  PageQuota(std::string name, int64_t limit_bytes)
      : name_(std::move(name)), limit_bytes_(limit_bytes) {}

  // Charges `bytes`, or returns RESOURCE_EXHAUSTED and charges nothing.
  [[nodiscard]] absl::Status Reserve(int64_t bytes);
  void Release(int64_t bytes);

  int64_t used_bytes() const;
  // Reserve calls refused so far (and other refusals counted against the
  // tenant, such as its session limit).
  int64_t rejections() const;
  void CountRejection();
  int64_t limit_bytes() const { return limit_bytes_; }
  const std::string& name() const { return name_; }

 private:
  const std::string name_;
  const int64_t limit_bytes_;
  mutable absl::Mutex mu_;
  int64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rejections_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_PAGE_QUOTA_H_
