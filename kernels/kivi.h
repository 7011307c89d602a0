// CPU twins of kivi_int4's key block (KIVI: keys quantised per channel over
// a page's tokens; its values are int4 token records, kernels/quantize.h).
// The block's bytes are written down in kernels/page_layout.h and
// docs/quantization.md. Thread-safe (no shared state).
//
// Each channel c < E = kv_heads * head_dim of a page is one asymmetric int4
// group: the keys x(t, c) of the page's n tokens present, quantised with
// kernels/quant_format.h's GroupScale and CodeOf (range holding 0, binary16
// scale rounded up, codes rounded to nearest even), so every key is within
// half its channel's scale of its value. A page that is still filling is
// quantised again from its tokens' exact inputs on every append
// (KiviOpenPage), so its block is always what quantising those tokens at
// once writes.
#ifndef KVKEEP_KERNELS_KIVI_H_
#define KVKEEP_KERNELS_KIVI_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/page_layout.h"

namespace kvkeep {

// Where a block could not be quantised (a NaN, an infinity, or a range too
// wide for a binary16 scale): its first token in the page and its channel.
struct KiviResult {
  QuantError error = QuantError::kOk;
  int32_t token = 0;
  int64_t channel = 0;
  bool ok() const { return error == QuantError::kOk; }
};

// Quantises the keys of a page's first n tokens (1 <= n <= page_tokens),
//   keys:  [n][kv_heads][head_dim] float32
//   block: layout.key_block_bytes() bytes (rows n.. of the codes are 0)
// Writes nothing unless it returns ok.
KiviResult QuantizeKiviKeys(const PageLayout& layout, const float* keys,
                            int32_t n, std::byte* block);

// Keys of slots [first, first + n) of a block as [n][kv_heads][head_dim] of
// out_type (f32, f16 or bf16; f16 and bf16 rounded to nearest even).
void DequantizeKiviKeys(const PageLayout& layout, const std::byte* block,
                        int32_t first, int32_t n, DType out_type, void* out);

// Head `head` of slot `slot`'s keys as head_dim float32 values (query
// scoring's key load).
void WidenKiviKeyHead(const PageLayout& layout, const std::byte* block,
                      int32_t slot, int32_t head, float* dst);

// The open (last, partly filled) page of a layer: the exact float32 keys of
// its tokens, from which its block is quantised again as it fills. Owned by
// one session's layer; not thread-safe.
//
// An append re-codes only what it changes: the page keeps its block as last
// written and each channel's range, so a channel whose range the new
// tokens leave as it was keeps its scale, zero point and codes, and only
// the new rows are coded; a channel whose range grows is re-coded whole.
// The block is byte for byte what quantising the page's tokens at once
// writes (a code depends only on its key and its channel's range).
class KiviOpenPage {
 public:
  explicit KiviOpenPage(const PageLayout& layout) : layout_(layout) {}

  // Tokens held (0 <= tokens() < page_tokens between appends).
  int32_t tokens() const {
    return static_cast<int32_t>(keys_.size() / layout_.token_elements());
  }
  // Bytes held, for the session's resident-bytes accounting: OpenBytes
  // while a page is open, 0 otherwise.
  int64_t bytes() const {
    return keys_.capacity() == 0 ? 0 : OpenBytes(layout_);
  }
  // What an open page holds: a whole page's float32 keys, its block, and
  // each channel's range and scale.
  static int64_t OpenBytes(const PageLayout& layout) {
    return layout.page_tokens * layout.token_elements() *
               int64_t{sizeof(float)} +
           layout.key_block_bytes() +
           layout.token_elements() * int64_t{sizeof(Channel)};
  }
  const float* keys() const { return keys_.data(); }

  // Replaces the held tokens by n tokens of keys ([n][E] float32).
  void Reset(const float* keys, int32_t n);
  // Adds n keys ([n][E] float32; tokens() + n <= page_tokens) and quantises
  // the page's block from all its tokens into `block`. On an error nothing
  // is kept or written. A page that becomes full is dropped (tokens() = 0).
  KiviResult Append(const float* keys, int32_t n, std::byte* block);

 private:
  // A channel's range over the tokens held (it holds 0) and its scale.
  struct Channel {
    float lo = 0.0f;
    float hi = 0.0f;
    float scale = 0.0f;
  };
  // Codes the rows from `old` on into block_, first re-coding whole every
  // channel whose range they widen (its scale, zero point and first `old`
  // rows). False, with block_ and channels_ perhaps half written, if a new
  // key is not finite or a range does not fit a binary16 scale.
  bool CodeIncrementally(int32_t old);
  // Quantises every held token into block_ and sets channels_ from it.
  KiviResult QuantizeAll();
  // Room for a new page, nothing held or coded yet.
  void Open();
  // Drops every token and what was kept of them.
  void Clear();

  PageLayout layout_;
  std::vector<float> keys_;  // [tokens()][E]
  // While a page is open: its block as last written and, when `coded_`,
  // each channel's range and scale in it (after Reset or a refused append
  // they are made again at the next append).
  std::vector<std::byte> block_;
  std::vector<Channel> channels_;
  bool coded_ = false;
};

}  // namespace kvkeep

#endif  // KVKEEP_KERNELS_KIVI_H_
