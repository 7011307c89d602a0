// The plain matrix product a query-scored step is measured against in
// grpc_e2e_bench: q [query_heads x head_dim] x K^T [head_dim x resident] in
// float, hand-written (`omp simd` dot products, as the kernels vectorise
// theirs) or as one OpenBLAS cblas_sgemm.
#ifndef KVKEEP_BENCH_MATMUL_RATE_H_
#define KVKEEP_BENCH_MATMUL_RATE_H_

#include <cstdint>

namespace kvkeep::bench {

enum class MatmulKernel { kOmpSimd, kOpenBlas };

struct MatmulRate {
  double gflop_per_cpu_s = 0;  // thread 0, per second of its CPU time
  double gflop_per_s = 0;      // all threads together, per wall second
};

// Runs the product for `seconds` on `threads` threads, each with its own q
// and K; 2 * rows * depth * resident flops per product. OpenBLAS runs
// single-threaded inside each thread, so a thread's CPU time is its own.
MatmulRate Matmul(MatmulKernel kernel, int32_t rows, int32_t depth,
                  int64_t resident, int threads, double seconds);

// The same flops on the store's own shapes (what query scoring computes
// under GQA): per layer and kv head, one OpenBLAS cblas_sgemm of
// q [group x depth] x K^T [depth x resident] over that head's f32 keys, laid
// out as sgemm reads them best ([layers][kv_heads][resident][depth], every
// layer its own keys, as a decode step reads every layer's). One thread;
// GFLOP (2 * layers * kv_heads * group * depth * resident per step) per
// second of its CPU time, over `seconds`.
double SgemmGqaGflopPerCpuS(int32_t layers, int32_t kv_heads, int32_t group,
                            int32_t depth, int64_t resident, double seconds);

// The kernel set OpenBLAS chose for this CPU (openblas_get_corename). On a
// CPU it does not know it falls back to old ones (Debian's 0.3.21 picks
// "Prescott", SSE3, on the Xeon these numbers were measured on; setting
// OPENBLAS_CORETYPE=SkylakeX gives its AVX-512 kernels): print it with
// every rate.
const char* OpenBlasCore();

}  // namespace kvkeep::bench

#endif  // KVKEEP_BENCH_MATMUL_RATE_H_
