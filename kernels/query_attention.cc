// QueryAttention (kernels/attention.h): the CPU twin of the query-scoring
// kernel, blocked for the cache and written in GCC vector extensions, with
// its key loads and dot products in AVX-512 intrinsics on CPUs that have
// them (kernels/query_avx512.h, chosen at run time).
//
// Per row, over tiles of resident slots (32 at head_dim 128; the next
// tile's token records are prefetched while one is scored), and inside a
// tile per kv head g:
//   1. the tile's keys of head g are widened (f16/bf16 converted,
//      int8/int4/fp8/kivi_int4 dequantised with their scales; AVX-512:
//      query_avx512.cc, otherwise WidenKey / WidenHead) into a float tile
//      [keys][dp] on the stack, dp = head_dim rounded up to 16 with zeros:
//      each key is dequantised once and stays in L1 while every query head
//      of its GQA group reads it; f32 and bf16 keys are read in place, and
//      with AVX-512 so are f16, int8, int4, fp8 and kivi_int4 keys (widened in
//      registers as the dot products read them, the same floats: a key's
//      GQA group is one register block, so it is still widened once);
//   2. logits for blocks of (query heads x keys) in registers (AVX-512 and
//      head_dim % 16 == 0: 4 x 4 blocks, 16 accumulators, the next block's
//      keys prefetched; otherwise 4 x 2, 2 x 4 or 1 x 8), folded into the
//      dot products by kernels/fold_lanes.h's shuffle tree (no horizontal
//      sum per dot product), into scratch [query_heads][n];
// then per query head the max, exp (fast_exp.h's polynomial, vectorised)
// and the denominator in one pass, and the probabilities added into out,
// heads in order. Stack: 48 KiB (key tile and padded query rows), and
// under 11 KiB more in the AVX-512 dots (quantised keys' scale tables).
//
// Arithmetic order: a dot product sums 16 lane-partials (element i goes to
// lane i % 16), then folds them pairwise (lanes l and l + 8, then + 4, + 2,
// + 1) and multiplies by 1 / sqrt(head_dim); exp is ExpNonPositive. The
// keys are bit-identical to kernels/quantize.h's WidenHead (and so to the
// CUDA kernel's). Results are deterministic on one machine; across machines
// the path chosen (AVX-512 intrinsics, or GCC's function multi-versioning
// clones for AVX-512, AVX2+FMA or baseline x86-64, as in
// services/lm/model_ops.cc) may contract a multiply and an add into an FMA
// and change last bits, well inside the tolerances attention_kernels_test
// and the GPU test state.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/attention.h"
#include "kernels/fast_exp.h"
#include "kernels/fold_lanes.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"
#include "kernels/query_avx512.h"

namespace kvkeep {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVKEEP_QA_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVKEEP_QA_CLONES
#endif

using query_dots::kBlock;
using query_dots::kLanes;
using query_dots::LoadVec;
using query_dots::Vec;
// The stack tile: up to 64 keys, at least kBlock keys at head_dim 1024.
constexpr int kTileFloats = 8192;
constexpr int kMaxTileKeys = 64;
// Query rows of the heads being scored, padded: 4 heads at head_dim 1024.
constexpr int kQueryFloats = 4096;
// What padding keys read in place of a record: head_dim <= 1024 f32.
alignas(64) constexpr float kZeroKey[1024] = {};

// Where a register block reads its keys, 16 elements at a time: the widened
// tile...
struct TileKeys {
  const float* tile;  // [keys][dp]
  int32_t dp;
  [[gnu::always_inline]] void Load(int32_t t, int32_t i, Vec* v) const {
    LoadVec(v, tile + int64_t{t} * dp + i);
  }
};

// ...or, for f32 and bf16 keys with head_dim % 16 == 0, the records in the
// pages (widened in registers: with a GQA group of up to 4 heads a key is
// read by one block, so a tile would only add a store and a reload).
// key[t]: kv head g's first element of key t, or a zero buffer.
template <DType kType>
struct RecordKeys {
  const std::byte* const* key;
  [[gnu::always_inline]] void Load(int32_t t, int32_t i, Vec* v) const {
    if constexpr (kType == DType::kF32) {
      LoadVec(v, reinterpret_cast<const float*>(key[t]) + i);
    } else {  // bf16: the 16 bits become the high half of each 32-bit lane
      using Halves16 = uint16_t __attribute__((vector_size(32)));
      using Halves32 = uint16_t __attribute__((vector_size(64)));
      Halves16 h;
      __builtin_memcpy(&h, reinterpret_cast<const uint16_t*>(key[t]) + i,
                       sizeof(h));
      const Halves16 z = {};
      const Halves32 wide = __builtin_shufflevector(
          z, h, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23, 0, 24,
          0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31);
      *v = (Vec)wide;  // a bit cast (GCC vector conversion)
    }
  }
};

// dots[j][t] = q[j] . key(t0 + t) for kHeads rows of q and kBlock / kHeads
// keys, all dp long (dp % 16 == 0).
template <int kHeads, class Keys>
[[gnu::always_inline]] inline void DotBlock(const float* q, const Keys& keys,
                                            int32_t t0, int32_t dp,
                                            float dots[kBlock]) {
  constexpr int kKeys = kBlock / kHeads;
  // Fully unrolled, so that the accumulators live in registers (otherwise
  // GCC keeps the array on the stack and the loop is load/store-bound).
  Vec acc[kBlock];
#pragma GCC unroll 8
  for (int m = 0; m < kBlock; ++m) acc[m] = Vec{};
  for (int32_t i = 0; i < dp; i += kLanes) {
    Vec k[kKeys];
#pragma GCC unroll 8
    for (int t = 0; t < kKeys; ++t) keys.Load(t0 + t, i, &k[t]);
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j) {
      Vec qj;
      LoadVec(&qj, q + j * dp + i);
#pragma GCC unroll 8
      for (int t = 0; t < kKeys; ++t) acc[j * kKeys + t] += qj * k[t];
    }
  }
  query_dots::FoldLanes(acc, dots);
}

// Unscaled logits (dot products; AddSoftmax scales them, -inf for slots the
// row does not see) logits[j][s0 + t] for the heads [0, kHeads) of `q` and
// the tile's keys
// (count of them; the keys up to the next block boundary must read as 0).
template <int kHeads, class Keys>
[[gnu::always_inline]] inline void ScoreTile(const float* q, const Keys& keys,
                                             const bool* visible, int32_t count,
                                             int32_t dp, float* logits,
                                             int64_t n, int64_t s0) {
  constexpr int kKeys = kBlock / kHeads;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int32_t t0 = 0; t0 < count; t0 += kKeys) {
    float dots[kBlock];
    DotBlock<kHeads>(q, keys, t0, dp, dots);
    const int32_t live = std::min(kKeys, count - t0);
    bool all_visible = live == kKeys;
    for (int32_t t = 0; t < live; ++t) all_visible &= visible[t0 + t];
    for (int j = 0; j < kHeads; ++j) {
      float* row = logits + j * n + s0 + t0;
      if (all_visible) {  // the common case: one short vector store
        __builtin_memcpy(row, dots + j * kKeys, sizeof(float) * kKeys);
        continue;
      }
      for (int32_t t = 0; t < live; ++t) {
        row[t] = visible[t0 + t] ? dots[j * kKeys + t] : kNegInf;
      }
    }
  }
}

// code -> float(code - zero) * scale for 16 codes (kernels/quantize.cc's
// DequantGroup, the same float operations). A fixed-length loop: GCC turns
// it into byte-to-int widening (__builtin_convertvector becomes lane
// inserts).
[[gnu::always_inline]] inline void Dequant16(const uint8_t* codes, int32_t zero,
                                             float scale, float* out) {
#pragma omp simd
  for (int k = 0; k < 16; ++k) {
    out[k] = static_cast<float>(int32_t{codes[k]} - zero) * scale;
  }
}

// int8 / int4 elements [first, first + head_dim) of one token record.
[[gnu::always_inline]] inline void WidenIntHead(const PageLayout& lay,
                                                const uint8_t* record,
                                                int64_t first,
                                                float* __restrict dst) {
  const int32_t d = lay.head_dim;
  const int32_t gs = lay.group_size;
  const bool int8 = lay.dtype == DType::kInt8;
  for (int32_t j0 = 0; j0 < d; j0 += gs) {
    const int64_t g = (first + j0) / gs;
    const uint8_t* scale_at = record + lay.scales_offset() + 2 * g;
    const float scale = HalfToFloat(static_cast<uint16_t>(
        scale_at[0] | static_cast<uint16_t>(scale_at[1]) << 8));
    const int32_t zero = record[lay.zeros_offset() + g];
    float* out = dst + j0;
    int32_t i = 0;
    if (int8) {
      const uint8_t* codes = record + first + j0;
      for (; i + 16 <= gs; i += 16) Dequant16(codes + i, zero, scale, out + i);
      for (; i < gs; ++i) {
        out[i] = static_cast<float>(int32_t{codes[i]} - zero) * scale;
      }
    } else {
      const uint8_t* codes = record + (first + j0) / 2;
      for (; i + 16 <= gs; i += 16) {
        // Lane k holds byte k / 2 (a byte shuffle into 32-bit lanes), then
        // the low nibble for even k and the high one for odd k. All in
        // registers: nibbles stored as bytes and read back as a vector
        // stall store forwarding.
        using Bytes16 = uint8_t __attribute__((vector_size(16)));
        using Bytes64 = uint8_t __attribute__((vector_size(64)));
        using Ints16 = int32_t __attribute__((vector_size(64)));
        using Words2 = uint64_t __attribute__((vector_size(16)));
        uint64_t word;
        __builtin_memcpy(&word, codes + i / 2, sizeof(word));
        const Words2 w = {word, 0};
        const Bytes16 b = (Bytes16)w;
        const Bytes16 z = {};
        const Bytes64 spread = __builtin_shufflevector(
            b, z, 0, 16, 16, 16, 0, 16, 16, 16, 1, 16, 16, 16, 1, 16, 16, 16, 2,
            16, 16, 16, 2, 16, 16, 16, 3, 16, 16, 16, 3, 16, 16, 16, 4, 16, 16,
            16, 4, 16, 16, 16, 5, 16, 16, 16, 5, 16, 16, 16, 6, 16, 16, 16, 6,
            16, 16, 16, 7, 16, 16, 16, 7, 16, 16, 16);
        Ints16 c = (Ints16)spread;
        const Ints16 shift = {0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};
        c = ((c >> shift) & 0xf) - zero;
        const Vec v = __builtin_convertvector(c, Vec) * scale;
        __builtin_memcpy(out + i, &v, sizeof(v));
      }
      for (; i < gs; i += 2) {
        const uint8_t b = codes[i / 2];
        out[i] = static_cast<float>((b & 0xf) - zero) * scale;
        out[i + 1] = static_cast<float>((b >> 4) - zero) * scale;
      }
    }
  }
}

// Head `head` of one stored token as dp floats (zeros past head_dim).
// `token` is its record in `arena`, or for kivi_int4 its codes' row in its
// page's key block.
[[gnu::always_inline]] inline void WidenKey(const PageLayout& lay,
                                            const std::byte* arena,
                                            const std::byte* token,
                                            int32_t head, int32_t dp,
                                            float* __restrict dst) {
  const int32_t d = lay.head_dim;
  const int64_t first = int64_t{head} * d;
  switch (lay.dtype) {
    case DType::kF32:
      std::memcpy(dst, reinterpret_cast<const float*>(token) + first,
                  sizeof(float) * d);
      break;
    case DType::kBF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(token) + first;
#pragma omp simd
      for (int32_t i = 0; i < d; ++i) {
        dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
      }
      break;
    }
    case DType::kF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(token) + first;
#pragma omp simd
      for (int32_t i = 0; i < d; ++i) dst[i] = HalfToFloat(src[i]);  // dtype.h
      break;
    }
    case DType::kInt8:
    case DType::kInt4:
      WidenIntHead(lay, reinterpret_cast<const uint8_t*>(token), first, dst);
      break;
    case DType::kKiviInt4: {  // the key block's per-channel codes
      const int64_t at = token - arena;
      const int64_t page = at / lay.page_bytes();
      WidenKiviKeyHead(lay, arena + page * lay.page_bytes(),
                       static_cast<int32_t>((at - page * lay.page_bytes()) /
                                            lay.code_bytes()),
                       head, dst);
      break;
    }
    default:  // fp8_e4m3: a table lookup per code, no vector form to gain
      WidenHead(lay, token, head, dst);
      break;
  }
  for (int32_t i = d; i < dp; ++i) dst[i] = 0.0f;
}

struct RowArgs {
  const PagedKeys* keys;
  const float* q_row;  // [query_heads][head_dim]
  int64_t row_order;
  int32_t group;
  float scale;
};

// The token records (keys, all kv heads) of slots [s0, s0 + count), nullptr
// for slots the row does not see; one division per tile, not per slot.
[[gnu::always_inline]] inline void TileRecords(const RowArgs& a, int64_t s0,
                                               int32_t count,
                                               const std::byte** records) {
  const PagedKeys& keys = *a.keys;
  const PageLayout& lay = keys.layout;
  int64_t page = s0 / lay.page_tokens;
  int32_t in_page = static_cast<int32_t>(s0 % lay.page_tokens);
  for (int32_t t = 0; t < count; ++t) {
    const bool visible =
        keys.order.empty() || keys.order[s0 + t] <= a.row_order;
    records[t] = visible
                     ? keys.arena + lay.key_offset(keys.pages[page], in_page)
                     : nullptr;
    if (++in_page == lay.page_tokens) in_page = 0, ++page;
  }
}

// Asks for the cache lines of the next tile's records while this one is
// scored: the kv heads' parts of a record are read one head at a time,
// which the hardware prefetcher does not follow across records.
[[gnu::always_inline]] inline void PrefetchRecords(
    const std::byte* const* records, int32_t count, int64_t bytes) {
  for (int32_t t = 0; t < count; ++t) {
    if (records[t] == nullptr) continue;
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(records[t] + b);
    }
  }
}

// Fills tile [count][dp] with kv head g of the records (zeros for a null
// record, and for the keys after count up to the next register block, which
// the last block reads).
[[gnu::always_inline]] inline void LoadTile(const PageLayout& lay,
                                            const std::byte* arena,
                                            const std::byte* const* records,
                                            int32_t count, int32_t g,
                                            int32_t dp, bool avx512,
                                            float* tile) {
  if (avx512) {
    WidenTileAvx512(lay, arena, records, count, g, dp, tile);
  } else {
    for (int32_t t = 0; t < count; ++t) {
      float* dst = tile + int64_t{t} * dp;
      if (records[t] == nullptr) {
        std::fill(dst, dst + dp, 0.0f);
      } else {
        WidenKey(lay, arena, records[t], g, dp, dst);
      }
    }
  }
  const int32_t padded = (count + kBlock - 1) / kBlock * kBlock;
  std::fill(tile + int64_t{count} * dp, tile + int64_t{padded} * dp, 0.0f);
}

// Logits of `heads` query rows q [heads][dp] against the tile's keys, into
// logits[j][s0 + t].
template <class Keys>
[[gnu::always_inline]] inline void ScoreHeads(
    const float* q, int32_t heads, const Keys& keys, const bool* visible,
    int32_t count, int32_t dp, float* logits, int64_t n, int64_t s0) {
  int32_t j = 0;
  for (; j + 4 <= heads; j += 4) {
    ScoreTile<4>(q + j * dp, keys, visible, count, dp, logits + j * n, n, s0);
  }
  for (; j + 2 <= heads; j += 2) {
    ScoreTile<2>(q + j * dp, keys, visible, count, dp, logits + j * n, n, s0);
  }
  for (; j < heads; ++j) {
    ScoreTile<1>(q + j * dp, keys, visible, count, dp, logits + j * n, n, s0);
  }
}

// Logits of kv head g's query heads against the tile's keys, for slots
// [s0, s0 + count), into logits [query_heads][n].
template <class Keys>
[[gnu::always_inline]] inline void ScoreGroup(
    const RowArgs& a, int32_t g, const Keys& keys, const bool* visible,
    int32_t count, int32_t dp, float* q_pad, float* logits, int64_t s0) {
  const int32_t d = a.keys->layout.head_dim;
  const int64_t n = a.keys->slots;
  const int32_t heads_per_pass = std::min(a.group, kQueryFloats / dp);
  for (int32_t h0 = 0; h0 < a.group; h0 += heads_per_pass) {
    const int32_t heads = std::min(heads_per_pass, a.group - h0);
    const int64_t h = int64_t{g} * a.group + h0;
    const float* q = a.q_row + h * d;
    if (dp != d) {  // rows padded with zeros to whole 16-lane chunks
      for (int32_t j = 0; j < heads; ++j) {
        std::copy_n(a.q_row + (h + j) * d, d, q_pad + j * dp);
        std::fill(q_pad + j * dp + d, q_pad + (j + 1) * dp, 0.0f);
      }
      q = q_pad;
    }
    ScoreHeads(q, heads, keys, visible, count, dp, logits + h * n, n, s0);
  }
}

// key[t] = the kv head's part (at `offset` bytes) of records[t] for t <
// count, kZeroKey for a null record and for the padding up to the next
// register block.
[[gnu::always_inline]] inline void HeadKeys(const std::byte* const* records,
                                            int32_t count, int64_t offset,
                                            const std::byte** key) {
  const int32_t padded = (count + kBlock - 1) / kBlock * kBlock;
  for (int32_t t = 0; t < padded; ++t) {
    key[t] = t < count && records[t] != nullptr
                 ? records[t] + offset
                 : reinterpret_cast<const std::byte*>(kZeroKey);
  }
}

// ScoreGroup through kernels/query_avx512.h's register blocks (head_dim a
// multiple of 16, so the query rows need no padding); visible == nullptr:
// the tile's slots are all visible.
[[gnu::always_inline]] inline void ScoreGroupAvx512(const RowArgs& a, int32_t g,
                                                    const KeyRows& keys,
                                                    const bool* visible,
                                                    int32_t count,
                                                    float* logits, int64_t s0) {
  const int32_t d = a.keys->layout.head_dim;
  const int64_t n = a.keys->slots;
  const int64_t h = int64_t{g} * a.group;
  float* dots = logits + h * n + s0;
  DotsAvx512(a.q_row + h * d, a.group, d, keys, count, dots, n);
  if (visible == nullptr) return;
  for (int32_t t = 0; t < count; ++t) {
    if (visible[t]) continue;
    for (int32_t j = 0; j < a.group; ++j) {
      dots[j * n + t] = -std::numeric_limits<float>::infinity();
    }
  }
}

// logits [query_heads][n] for one row. Tiles of slots outside, kv heads
// inside: a tile's token records (all heads) are read from memory once, in
// slot order, and stay in cache while each kv head's part is widened.
[[gnu::always_inline]] inline void RowLogits(const RowArgs& a, float* logits) {
  const PagedKeys& keys = *a.keys;
  const PageLayout& lay = keys.layout;
  const int32_t d = lay.head_dim;
  const int32_t dp = (d + kLanes - 1) / kLanes * kLanes;
  const int64_t n = keys.slots;
  const int32_t tile_keys =
      std::clamp(kTileFloats / 2 / dp / kBlock * kBlock, kBlock, kMaxTileKeys);
  alignas(64) float key_tile[kTileFloats];
  alignas(64) float q_pad[kQueryFloats];
  // Records of this tile and the next (prefetched while this one is scored).
  const std::byte* records[2][kMaxTileKeys];
  // f32 and bf16 keys are read in place when no padding is needed.
  const bool direct =
      (lay.dtype == DType::kF32 || lay.dtype == DType::kBF16) && d == dp;
  const std::byte* head_key[kMaxTileKeys];
  // Keys that stay in a core's L2 between steps (under 1 MiB) come back
  // faster without the prefetch instructions (7% of the time at 256 bf16
  // tokens); larger sets come from memory, where they pay.
  const bool prefetch = n * lay.token_bytes() > (int64_t{1} << 20);
  // int8 / int4 / fp8 / f16 keys widened with AVX-512 intrinsics where the
  // CPU has them (kernels/query_avx512.h: the same floats).
  const bool avx512 = Avx512Widens(lay);
  // Dot products in AVX-512 register blocks (4 query heads x 4 keys) for
  // every dtype when the rows need no padding.
  const bool avx512_dots = d == dp && CpuHasAvx512();
  // ...reading f16, int8, int4 and fp8 keys in place too, widened in
  // registers (kernels/query_avx512.h): no tile written and read back. A
  // record padding key reads kZeroKey from its start, so it must cover one.
  const bool fused =
      avx512_dots && FusedWidens(lay) &&
      (lay.dtype == DType::kF16 ||
       lay.token_bytes() <= static_cast<int64_t>(sizeof(kZeroKey)));
  // Where kv head g's part starts in a record (0: the loader finds it).
  const int64_t head_bytes =
      IsQuantized(lay.dtype) ? 0 : int64_t{d} * DTypeBytes(lay.dtype);
  bool visible[kMaxTileKeys];
  TileRecords(a, 0, static_cast<int32_t>(std::min<int64_t>(tile_keys, n)),
              records[0]);
  for (int64_t s0 = 0, tile = 0; s0 < n; s0 += tile_keys, ++tile) {
    const int32_t count =
        static_cast<int32_t>(std::min<int64_t>(tile_keys, n - s0));
    const std::byte* const* now = records[tile % 2];
    if (s0 + tile_keys < n) {
      const int32_t next = static_cast<int32_t>(
          std::min<int64_t>(tile_keys, n - s0 - tile_keys));
      TileRecords(a, s0 + tile_keys, next, records[(tile + 1) % 2]);
      if (prefetch) {
        PrefetchRecords(records[(tile + 1) % 2], next, lay.token_bytes());
      }
    }
    bool all_visible = true;
    for (int32_t t = 0; t < count; ++t) {
      visible[t] = now[t] != nullptr;
      all_visible &= visible[t];
    }
    for (int32_t g = 0; g < lay.kv_heads; ++g) {
      if (avx512_dots) {
        KeyRows rows{lay.dtype,
                     head_key,
                     nullptr,
                     &lay,
                     g,
                     a.keys->arena,
                     reinterpret_cast<const std::byte*>(kZeroKey)};
        if (direct || fused) {
          // Whole records (head_bytes 0) are the same for every kv head.
          if (g == 0 || head_bytes != 0) {
            HeadKeys(now, count, g * head_bytes, head_key);
          }
        } else {
          LoadTile(lay, a.keys->arena, now, count, g, dp, avx512, key_tile);
          rows.tile = key_tile;
        }
        ScoreGroupAvx512(a, g, rows, all_visible ? nullptr : visible, count,
                         logits, s0);
      } else if (direct) {
        HeadKeys(now, count, int64_t{g} * d * DTypeBytes(lay.dtype), head_key);
        if (lay.dtype == DType::kF32) {
          ScoreGroup(a, g, RecordKeys<DType::kF32>{head_key}, visible, count,
                     dp, q_pad, logits, s0);
        } else {
          ScoreGroup(a, g, RecordKeys<DType::kBF16>{head_key}, visible, count,
                     dp, q_pad, logits, s0);
        }
      } else {
        LoadTile(lay, a.keys->arena, now, count, g, dp, avx512, key_tile);
        ScoreGroup(a, g, TileKeys{key_tile, dp}, visible, count, dp, q_pad,
                   logits, s0);
      }
    }
  }
}

// out_row[s] += softmax over s of logits[j], for each of `group` heads in
// order; a head with no visible slot adds nothing. Overwrites the logits
// with exp(logit - max). Whole chunks of 16 slots with 16 running maxima and
// sums, then the tail: loops over the whole row made GCC peel scalar
// iterations until a row (not 64-byte aligned) was, which cost more than the
// vector part at 256 slots. The denominator sums lane k's slots (s % 16 ==
// k) in slot order, then lanes 0..15 and the tail in order.
[[gnu::always_inline]] inline void AddSoftmax(float* logits, int32_t group,
                                              int64_t n, float scale,
                                              float* out_row) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t whole = n / kLanes * kLanes;
  for (int32_t j = 0; j < group; ++j) {
    float* l = logits + j * n;
    float lane[kLanes];
    std::fill_n(lane, kLanes, kNegInf);
    for (int64_t s = 0; s < whole; s += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) {
        lane[k] = l[s + k] > lane[k] ? l[s + k] : lane[k];
      }
    }
    float mx = kNegInf;
    for (int k = 0; k < kLanes; ++k) mx = lane[k] > mx ? lane[k] : mx;
    for (int64_t s = whole; s < n; ++s) mx = l[s] > mx ? l[s] : mx;
    if (mx == kNegInf) continue;
    // The logits are unscaled dot products: scale > 0 keeps the max.
    std::fill_n(lane, kLanes, 0.0f);
    for (int64_t s = 0; s < whole; s += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) {
        const float e = ExpNonPositive((l[s + k] - mx) * scale);  // masked: 0
        l[s + k] = e;
        lane[k] += e;
      }
    }
    float denom = 0.0f;
    for (int k = 0; k < kLanes; ++k) denom += lane[k];
    for (int64_t s = whole; s < n; ++s) {
      l[s] = ExpNonPositive((l[s] - mx) * scale);
      denom += l[s];
    }
    const float inv = 1.0f / denom;
    for (int64_t s = 0; s < whole; s += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) out_row[s + k] += l[s + k] * inv;
    }
    for (int64_t s = whole; s < n; ++s) out_row[s] += l[s] * inv;
  }
}

}  // namespace

KVKEEP_QA_CLONES
void QueryAttention(const PagedKeys& keys, const float* queries,
                    const int64_t* row_order, int32_t rows, int32_t query_heads,
                    float* out, float* scratch) {
  const PageLayout& lay = keys.layout;
  const int32_t d = lay.head_dim;
  const int32_t group = query_heads / lay.kv_heads;
  const int64_t n = keys.slots;
  for (int32_t r = 0; r < rows; ++r) {
    const RowArgs args{&keys, queries + int64_t{r} * query_heads * d,
                       row_order[r], group,
                       1.0f / std::sqrt(static_cast<float>(d))};
    float* out_row = out + int64_t{r} * n;
    std::fill(out_row, out_row + n, 0.0f);
    RowLogits(args, scratch);
    AddSoftmax(scratch, query_heads, n, args.scale, out_row);
  }
}

}  // namespace kvkeep
