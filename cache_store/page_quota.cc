#include "cache_store/page_quota.h"

#include "absl/strings/str_cat.h"

namespace kvkeep {

absl::Status PageQuota::Reserve(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (limit_bytes_ > 0 && used_bytes_ + bytes > limit_bytes_) {
    ++rejections_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", name_, "' is over its quota: ", used_bytes_, " of ",
        limit_bytes_, " bytes held, ", bytes, " more needed"));
  }
  used_bytes_ += bytes;
  return absl::OkStatus();
}

void PageQuota::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_bytes_ -= bytes;
}

int64_t PageQuota::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

int64_t PageQuota::rejections() const {
  absl::MutexLock lock(&mu_);
  return rejections_;
}

void PageQuota::CountRejection() {
  absl::MutexLock lock(&mu_);
  ++rejections_;
}

}  // namespace kvkeep
