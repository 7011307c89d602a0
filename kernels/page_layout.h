// PageLayout: where a token's key and value bytes live in a page arena.
// Written once, used by the host backend, the kernels and their CPU twins.
// A plain value type; thread-safe to share.
//
// One page holds one layer's keys and values for `page_tokens` tokens of all
// kv heads:
//   page: [2 (K, V)][page_tokens][kv_heads][head_dim] elements of `dtype`
// Offsets are 64-bit: page id x page bytes overflows int32 on a real GPU.
#ifndef KVKEEP_KERNELS_PAGE_LAYOUT_H_
#define KVKEEP_KERNELS_PAGE_LAYOUT_H_

#include <cstdint>

#include "kernels/dtype.h"

#if defined(__CUDACC__)
#define KVKEEP_HOST_DEVICE __host__ __device__
#else
#define KVKEEP_HOST_DEVICE
#endif

namespace kvkeep {

using PageId = int32_t;

struct PageLayout {
  int32_t page_tokens = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kF32;

  // Bytes of one token's keys (or values) for all kv heads.
  KVKEEP_HOST_DEVICE int64_t token_bytes() const {
    return static_cast<int64_t>(kv_heads) * head_dim * DTypeBytes(dtype);
  }
  KVKEEP_HOST_DEVICE int64_t page_bytes() const {
    return 2 * static_cast<int64_t>(page_tokens) * token_bytes();
  }
  // Byte offset in the arena of the keys of token `slot_in_page` of `page`.
  KVKEEP_HOST_DEVICE int64_t key_offset(PageId page,
                                        int32_t slot_in_page) const {
    return static_cast<int64_t>(page) * page_bytes() +
           static_cast<int64_t>(slot_in_page) * token_bytes();
  }
  KVKEEP_HOST_DEVICE int64_t value_offset(PageId page,
                                          int32_t slot_in_page) const {
    return key_offset(page, slot_in_page) +
           static_cast<int64_t>(page_tokens) * token_bytes();
  }
};

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_PAGE_LAYOUT_H_
