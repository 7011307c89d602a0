// The dot-product register block of query scoring's CPU kernels
// (kernels/query_attention.cc, kernels/query_avx512.cc): 16-lane float
// vectors (GCC vector extensions) and the shuffle tree that folds 8
// accumulators of 16 lane-partials each into 8 dot products. Header-only and
// always inlined, so each caller compiles it for its own instruction set;
// both callers fold in this one order, so a key read through either gives
// the same dot products. Thread-safe (pure functions).
#ifndef KVKEEP_KERNELS_FOLD_LANES_H_
#define KVKEEP_KERNELS_FOLD_LANES_H_

namespace kvkeep::query_dots {

constexpr int kLanes = 16;
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
// Accumulators per register block: (heads x keys) = (4 x 2), (2 x 4) or
// (1 x 8); 8 independent FMA chains hide the FMA latency.
constexpr int kBlock = 8;

// By pointer: a 64-byte vector passed or returned by value would change the
// ABI of the baseline clone (-Wpsabi).
[[gnu::always_inline]] inline void LoadVec(Vec* v, const float* p) {
  __builtin_memcpy(v, p, sizeof(*v));
}

// out[m] = sum of the lanes of a[m], m < 8, folded pairwise: lanes l and
// l + 8, then + 4, + 2, + 1.
[[gnu::always_inline]] inline void FoldLanes(const Vec a[kBlock],
                                             float out[kBlock]) {
  Vec c[4], e[2];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {  // lanes 0-7: a[2p] halves, 8-15: a[2p+1]
    c[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6,
                                   7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13,
                                   14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {  // 4 lanes each of a[4p] .. a[4p+3]
    e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 2, 3, 8, 9, 10,
                                   11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * p], c[2 * p + 1], 4, 5, 6, 7, 12, 13,
                                   14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  // 2 lanes each of a[0] .. a[7].
  const Vec f = __builtin_shufflevector(e[0], e[1], 0, 1, 4, 5, 8, 9, 12, 13,
                                        16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(e[0], e[1], 2, 3, 6, 7, 10, 11, 14, 15,
                                        18, 19, 22, 23, 26, 27, 30, 31);
  const Vec g = __builtin_shufflevector(f, f, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
                                        5, 7, 9, 11, 13, 15) +
                __builtin_shufflevector(f, f, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                        4, 6, 8, 10, 12, 14);
  for (int m = 0; m < kBlock; ++m) out[m] = g[m];
}

}  // namespace kvkeep::query_dots

#endif  // KVKEEP_KERNELS_FOLD_LANES_H_
