// PageLayout: where a token's key and value bytes live in a page arena.
// Written once, used by the host backend, the kernels and their CPU twins.
// A plain value type; thread-safe to share.
//
// One page holds one layer's keys and values for `page_tokens` tokens of all
// kv heads:
//   page: [2 (K, V)][page_tokens][token_bytes()]
// A token's keys (or values) are [kv_heads][head_dim] elements of `dtype`
// for f32, f16 and bf16, and for int8, fp8_e4m3 and int4 one quantised token
// record (codes, then the per-group scales and zero points; the format is in
// kernels/quant_format.h). Either way a token is token_bytes() contiguous
// bytes, so copies, compaction and transfers move records whole.
//
// kivi_int4 is the exception: its values are int4 token records as above,
// but a page's keys are one block quantised per channel over the page's
// tokens (KIVI), so a key is not a record of its own:
//   page: [key block: key_block_bytes()][page_tokens][token_bytes()] (values)
//   key block: codes [page_tokens][kv_heads * head_dim / 2] (int4, element
//              2i of a token in the low nibble of its row's byte i), then
//              per channel c < kv_heads * head_dim a binary16 scale
//              (little-endian) and then per channel a uint8 zero point
// Key c of slot t reads (code(t, c) - zero(c)) * scale(c) (kernels/kivi.h).
// Offsets are 64-bit: page id x page bytes overflows int32 on a real GPU.
#ifndef KVKEEP_KERNELS_PAGE_LAYOUT_H_
#define KVKEEP_KERNELS_PAGE_LAYOUT_H_

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/quant_format.h"

namespace kvkeep {

using PageId = int32_t;

struct PageLayout {
  int32_t page_tokens = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kF32;
  // Elements per quantisation group (quantised dtypes; divides head_dim).
  int32_t group_size = 0;

  // Elements of one token's keys (or values): kv_heads * head_dim.
  KVKEEP_HOST_DEVICE int64_t token_elements() const {
    return static_cast<int64_t>(kv_heads) * head_dim;
  }
  // Quantised records: bytes of the codes, then where the scales and the
  // zero points start, and the number of groups.
  KVKEEP_HOST_DEVICE int64_t code_bytes() const {
    return dtype == DType::kInt4 || dtype == DType::kKiviInt4
               ? token_elements() / 2
               : token_elements();
  }
  KVKEEP_HOST_DEVICE int64_t groups() const {
    return group_size > 0 ? token_elements() / group_size : 0;
  }
  KVKEEP_HOST_DEVICE int64_t scales_offset() const { return code_bytes(); }
  KVKEEP_HOST_DEVICE int64_t zeros_offset() const {
    return code_bytes() + 2 * groups();
  }
  // Bytes of one token's keys (or values) for all kv heads; for kivi_int4,
  // of one token's values (its keys are in the page's key block).
  KVKEEP_HOST_DEVICE int64_t token_bytes() const {
    if (IsQuantized(dtype)) {
      return code_bytes() + groups() * SpecOf(dtype).meta_bytes();
    }
    return token_elements() * DTypeBytes(dtype);
  }
  // Bytes of a page's keys: page_tokens records, or kivi_int4's key block
  // (codes, then a scale and a zero point per channel).
  KVKEEP_HOST_DEVICE int64_t key_block_bytes() const {
    if (IsKivi(dtype)) {
      return static_cast<int64_t>(page_tokens) * code_bytes() +
             3 * token_elements();
    }
    return static_cast<int64_t>(page_tokens) * token_bytes();
  }
  // Bytes of the keys of slots [first, first + n) in a dense buffer: n
  // token records, or for kivi_int4 the whole key blocks of the pages those
  // slots touch (kernels/slot_copy.h).
  KVKEEP_HOST_DEVICE int64_t key_run_bytes(int64_t first, int64_t n) const {
    if (!IsKivi(dtype)) return n * token_bytes();
    const int64_t touched =
        n > 0 ? (first % page_tokens + n + page_tokens - 1) / page_tokens : 0;
    return touched * key_block_bytes();
  }
  // kivi_int4's key block: where the per-channel scales and zeros start.
  KVKEEP_HOST_DEVICE int64_t key_scales_offset() const {
    return static_cast<int64_t>(page_tokens) * code_bytes();
  }
  KVKEEP_HOST_DEVICE int64_t key_zeros_offset() const {
    return key_scales_offset() + 2 * token_elements();
  }
  KVKEEP_HOST_DEVICE int64_t page_bytes() const {
    return key_block_bytes() +
           static_cast<int64_t>(page_tokens) * token_bytes();
  }
  // Byte offset in the arena of the keys of token `slot_in_page` of `page`
  // (kivi_int4: of its codes' row in the key block).
  KVKEEP_HOST_DEVICE int64_t key_offset(PageId page,
                                        int32_t slot_in_page) const {
    const int64_t row = IsKivi(dtype) ? code_bytes() : token_bytes();
    return static_cast<int64_t>(page) * page_bytes() +
           static_cast<int64_t>(slot_in_page) * row;
  }
  KVKEEP_HOST_DEVICE int64_t value_offset(PageId page,
                                          int32_t slot_in_page) const {
    return static_cast<int64_t>(page) * page_bytes() + key_block_bytes() +
           static_cast<int64_t>(slot_in_page) * token_bytes();
  }
};

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_PAGE_LAYOUT_H_
